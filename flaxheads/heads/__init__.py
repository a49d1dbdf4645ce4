"""Poolers and heads: their configs (``poolers``, ``heads``: plain frozen dataclasses, the JSON on disk)
and the Linen modules built from them (``linen``); the NNX ones are in :mod:`flaxheads.nnx`."""
