"""Poolers and heads: their configs (``poolers``, ``heads``: plain frozen dataclasses, the JSON on disk)
and the Linen modules built from them (``linen``); the NNX ones are in :mod:`flaxheads.nnx`."""

#: names reachable as ``fh.heads.<name>`` (imported on first use): module -> names
_NAMES = {"flaxheads.heads.heads": ("TokenLogits",), "flaxheads.heads.templates": ("PairTemplate", "TEMPLATES")}


def __getattr__(name: str):
    import importlib

    for module, names in _NAMES.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'flaxheads.heads' has no attribute {name!r}")
