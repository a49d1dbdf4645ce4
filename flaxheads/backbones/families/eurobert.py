"""EuroBERT (``model_type`` ``eurobert``): transformers' ``EuroBertModel`` as a pure function.

EuroBERT is a Llama without the causal mask: the same module tree (``embed_tokens``,
``layers/<i>/self_attn/{q,k,v,o}_proj``, ``mlp/{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``norm``), RMSNorm ``w * x``, grouped-query attention with rotary
embeddings on positions ``0..T-1`` whatever the padding, ``attention_bias`` on all four projections
and ``mlp_bias`` on the MLP; every query sees every real token (``create_bidirectional_mask``).
So it is one more row of the decoder switches (:mod:`~flaxheads.backbones.families.decoder_config`,
``causal=False``) computed by :func:`flaxheads.backbones.families.decoder.encode`; this class only
names the family and what it supports.

Its classifier (``EuroBertForSequenceClassification``, preset ``eurobert``) is dense -> GELU ->
classifier over ``classifier_pooling``: ``bos`` (position 0), ``mean`` (masked mean) or ``late``
(dense -> GELU on every token, then the masked mean: :class:`~flaxheads.heads.poolers.LateDensePooler`).
"""

from __future__ import annotations

from flaxheads.backbones.families.decoder import DecoderBackbone


class EuroBertBackbone(DecoderBackbone):
    """EuroBERT: the decoder computation with bidirectional attention (see the module docstring)."""

    model_types = ("eurobert",)
    family = "EuroBERT"
    # no "causal": every token sees the whole text
    features = frozenset({"position_ids", "remat", "bf16", "only_at", "quantize"})
