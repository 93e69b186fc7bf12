"""`folio proxy`'s flags (the proxy itself, with its web imports, loads only when the command runs)."""

from __future__ import annotations

import argparse
from typing import Any


def add_proxy_parser(sub: Any) -> None:
    proxy = sub.add_parser(
        "proxy",
        help="disaggregated prefill and decode: one OpenAI endpoint over a prefill and a decode `folio serve`",
        description="Send each completion's prefill to --prefill (a kv_producer) and its decode to --decode (a "
        "kv_consumer) after the prompt's KV blocks moved over (docs/scale_out.md).",
    )
    proxy.add_argument(
        "--prefill", required=True, metavar="URL", help="the prefill instance, e.g. http://127.0.0.1:8100"
    )
    proxy.add_argument("--decode", required=True, metavar="URL", help="the decode instance, e.g. http://127.0.0.1:8200")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    proxy.add_argument(
        "--decode-kv-port",
        type=int,
        default=None,
        help="the decode instance's kv_transfer_config kv_port, sent to the prefill instance with each request "
        "(default: none; the prefill instance's own kv_transfer_config kv_ip:kv_port names the consumer)",
    )
    proxy.add_argument(
        "--decode-kv-host",
        default=None,
        help="the decode instance's kv_ip, with --decode-kv-port (default: --decode's host)",
    )
    proxy.set_defaults(func=cmd_proxy)


def cmd_proxy(ns: argparse.Namespace) -> int:
    from folio.kv_transfer.proxy import run_proxy

    for name in ("port", "decode_kv_port"):
        value = getattr(ns, name)
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"{name} must be in [0, 65535], got {value}")
    for name in ("prefill", "decode"):
        if not getattr(ns, name).startswith(("http://", "https://")):
            raise ValueError(f"--{name} must be an http:// or https:// URL, got {getattr(ns, name)!r}")
    return run_proxy(ns.prefill, ns.decode, ns.host, ns.port, ns.decode_kv_host, ns.decode_kv_port)
