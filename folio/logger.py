"""The "folio" logger: start-up facts (KV capacity, load times) reach the user without any logging set-up."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(levelname)s %(asctime)s [folio] %(message)s"


def init_logger(level: int = logging.INFO) -> logging.Logger:
    """Gives the "folio" logger a stderr handler once (idempotent), as vLLM does for its own logger."""
    logger = logging.getLogger("folio")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    return logger
