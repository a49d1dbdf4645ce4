"""Flax NNX forms of flaxheads: every pooler and head as an ``nnx.Module`` (:mod:`.layers`) and a
whole model (:class:`NNXSequenceModel`, from :meth:`flaxheads.SequenceModel.to_nnx`), on the same
params tree as the functional path. Tested with Flax 0.12; needs ``flax.nnx.data``."""

from flax import nnx as _nnx

if not hasattr(_nnx, "data"):
    raise ImportError("flaxheads.nnx needs a Flax whose nnx has `data` (tested with Flax 0.12): pip install -U flax")

from flaxheads.nnx.layers import (  # noqa: E402
    AttentionPool,
    Concat,
    DensePooler,
    IdentityHead,
    LinearHead,
    MLPHead,
    Pool,
    ProjectionHead,
    SequenceHead,
    SequenceSummary,
    head,
    head_params,
    load_head_params,
    pooler,
)
from flaxheads.nnx.model import FrozenBase, LoraParam, NNXSequenceModel, shardings, to_nnx  # noqa: E402

__all__ = [
    "AttentionPool",
    "Concat",
    "DensePooler",
    "FrozenBase",
    "IdentityHead",
    "LinearHead",
    "LoraParam",
    "MLPHead",
    "NNXSequenceModel",
    "Pool",
    "ProjectionHead",
    "SequenceHead",
    "SequenceSummary",
    "head",
    "head_params",
    "load_head_params",
    "pooler",
    "shardings",
    "to_nnx",
]
