"""Flax NNX forms of flaxheads: every pooler and head as an ``nnx.Module`` (:mod:`.layers`) and a
whole model (:class:`NNXSequenceModel`, from :meth:`flaxheads.SequenceModel.to_nnx`), on the same
params tree as the functional path."""
from .layers import (AttentionPool, Concat, DensePooler, IdentityHead, LinearHead, MLPHead, Pool, ProjectionHead,
                     SequenceHead, SequenceSummary, head, head_params, load_head_params, pooler)

__all__ = ["AttentionPool", "Concat", "DensePooler", "IdentityHead", "LinearHead", "MLPHead", "Pool",
           "ProjectionHead", "SequenceHead", "SequenceSummary", "head", "head_params", "load_head_params", "pooler"]
from .model import FrozenBase, LoraParam, NNXSequenceModel, shardings, to_nnx

__all__ += ["FrozenBase", "LoraParam", "NNXSequenceModel", "shardings", "to_nnx"]
