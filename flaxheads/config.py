"""JSON round trip for the pooler and head configs.

A config is a plain frozen dataclass (``flaxheads.heads.poolers`` / ``flaxheads.heads.heads``); its
fields, in their order, are the JSON object's keys after ``"type"``, the ``kind`` string its class
registers here. Its Linen and NNX modules are built from it and are not serialised themselves.
A field declared with :data:`SINCE_FORMAT_1` metadata (added after the format was fixed) is written
only when it differs from its default, so the JSON of every config that leaves it alone is unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

_KINDS: dict[str, type] = {}
#: ``dataclasses.field(metadata=SINCE_FORMAT_1)``: omitted from the JSON while at its default
SINCE_FORMAT_1 = {"omit_default": True}


def register(kind: str):
    """Class decorator: make a config class loadable from ``{"type": kind, ...}``."""

    def wrap(cls):
        if kind in _KINDS and _KINDS[kind] is not cls:
            raise ValueError(f"config kind {kind!r} registered twice")
        cls.kind = kind
        _KINDS[kind] = cls
        return cls

    return wrap


def _fields(obj) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(obj) if f.name not in ("parent", "name") and f.init]


def to_dict(obj) -> dict[str, Any]:
    """Serialise a registered config (recursively) to plain JSON-able data."""
    out: dict[str, Any] = {"type": type(obj).kind}
    for f in _fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("omit_default") and value == f.default:
            continue
        out[f.name] = _encode(value)
    return out


def _encode(v):
    if hasattr(type(v), "kind") and dataclasses.is_dataclass(v):
        return to_dict(v)
    if isinstance(v, (tuple, list)):
        return [_encode(x) for x in v]
    return v


def from_dict(d: dict[str, Any]):
    """Inverse of :func:`to_dict`; unknown kinds or fields raise a ``ValueError``."""
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError(f"expected a config dict with a 'type' key, got {d!r}")
    kind = d["type"]
    if kind not in _KINDS:
        raise ValueError(f"unknown config type {kind!r}; known types: {sorted(_KINDS)}")
    cls = _KINDS[kind]
    names = {f.name: f for f in _fields(cls)}
    extra = set(d) - set(names) - {"type"}
    if extra:
        raise ValueError(f"config for {kind!r} has unknown fields {sorted(extra)}; valid fields: {sorted(names)}")
    kwargs = {k: _decode(v) for k, v in d.items() if k != "type"}
    return cls(**kwargs)


def _decode(v):
    if isinstance(v, dict) and "type" in v:
        return from_dict(v)
    if isinstance(v, list):
        return tuple(_decode(x) for x in v)
    return v


def to_json(obj, **kw) -> str:
    return json.dumps(to_dict(obj), **kw)


def from_json(s: str):
    return from_dict(json.loads(s))
