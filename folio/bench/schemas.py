"""JSON schemas of the structured-output benchmarks: a 20-property object (the compile-latency and mask-overhead
figures of docs/performance.md) and a valid instance of it."""

from __future__ import annotations

from typing import Any

TWENTY_PROPERTY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "height_m": {"type": "number", "minimum": 0.3, "maximum": 2.8},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "city": {"type": "string", "maxLength": 30},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "phone": {"type": "string", "pattern": "^\\+?[0-9 ]{7,15}$"},
        "created": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "plan": {"enum": ["free", "pro", "team"]},
        "credits": {"type": "integer", "minimum": 0},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "verified": {"type": "boolean"},
        "manager": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "level": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["name", "level"],
            "additionalProperties": False,
        },
        "notes": {"type": ["string", "null"], "maxLength": 80},
    },
    "required": ["id", "name", "email", "age", "active", "role", "country", "plan", "manager"],
    "additionalProperties": False,
}


def twenty_property_instance() -> dict[str, Any]:
    """A valid instance of TWENTY_PROPERTY_SCHEMA with every property set (properties in schema order)."""
    return {
        "id": 4217,
        "name": "Ada Lovelace",
        "email": "ada.lovelace@example.com",
        "age": 36,
        "height_m": 1.65,
        "active": True,
        "role": "editor",
        "tags": ["math", "engines"],
        "scores": [9.5, 8.25],
        "country": "GB",
        "city": "London",
        "zip": "12345",
        "phone": "+44 20 7946 0000",
        "created": "1843-07-10",
        "plan": "pro",
        "credits": 120,
        "ratio": 0.75,
        "verified": False,
        "manager": {"name": "Charles Babbage", "level": 3},
        "notes": None,
    }
