"""A dataclass config given as a JSON object (EngineArgs' dict form of a nested config, as the CLI's JSON gives it):
the checks every such field shares, so each error names the field and the keys it knows."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


def config_kwargs(field_name: str, value: object, config_class: type) -> dict[str, Any]:
    """``value`` as keyword arguments of ``config_class`` (a dataclass); ValueError naming ``field_name`` if it is
    not a JSON object or has keys that are not the class's fields."""
    if not isinstance(value, dict):
        raise ValueError(f"{field_name} must be a JSON object, got {value!r}")
    known = [f.name for f in fields(config_class)]
    unknown = set(value) - set(known)
    if unknown:
        raise ValueError(f"{field_name} has unknown fields {sorted(unknown)}; known: {known}")
    return value
