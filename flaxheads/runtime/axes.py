"""Logical axis names of parameters: what each dimension of a weight *means* (``embed``,
``heads``, ``kv``, ``mlp``, ``vocab``), decided from its place in the params tree.

One generic rule serves every family: the leaf name (``kernel``, ``embedding``, ``bias``,
``scale``) and the module names above it (``query``, ``q_proj``, ``intermediate/dense``,
``gate_proj``, ``down_proj``, ``wte``, ...). A family that stores ``[out, in]`` kernels (GPT-2)
sets :attr:`~flaxheads.backbones.base.Backbone.kernels_out_in` and the names are reversed there;
one whose tree breaks the Flax conventions further overrides
:meth:`flaxheads.backbones.base.Backbone.param_axes`.
A parameter the rule does not recognise gets ``None`` on every dimension (replicated).
:mod:`flaxheads.training.sharding` maps these names onto device-mesh axes.
"""

from __future__ import annotations

from collections.abc import Sequence

EMBED, HEADS, KV, MLP, VOCAB = "embed", "heads", "kv", "mlp", "vocab"
#: The logical names a parameter dimension can carry (None: no name, never sharded).
PARAM_AXES = (EMBED, HEADS, KV, MLP, VOCAB)

Axes = tuple[str | None, ...]

# Module-path suffixes ("/"-joined module names, the leaf excluded) -> the kernel's [in, out] names.
# The longest matching suffix wins, so "attention/output/dense" beats "output/dense".
_KERNELS: dict[str, tuple[str, str]] = {}
for _names, _axes in (
    # attention input projections (q, fused qkv) and key/value projections (fewer heads under GQA)
    (
        (
            "query",
            "q_proj",
            "q_lin",
            "query_proj",
            "pos_query_proj",
            "Wqkv",
            "qkv",
            "qkv_proj",
            "c_attn",
            "query_key_value",
        ),
        (EMBED, HEADS),
    ),
    (("key", "value", "k_proj", "v_proj", "k_lin", "v_lin", "key_proj", "value_proj", "pos_key_proj"), (EMBED, KV)),
    # attention output projections
    (
        (
            "o_proj",
            "out_lin",
            "attention/output/dense",
            "attention/dense",
            "attn/c_proj",
            "attn/Wo",
            "self_attn/out_proj",
            "encoder_attn/out_proj",
            "attn/out_proj",
            "attention/out_proj",
        ),
        (HEADS, EMBED),
    ),
    # feed-forward input (gated or not) and output projections
    (
        (
            "intermediate/dense",
            "gate_proj",
            "up_proj",
            "gate_up_proj",
            "fc1",
            "lin1",
            "c_fc",
            "ffn",
            "mlp/Wi",
            "w1",
            "w3",
            "dense_h_to_4h",
        ),
        (EMBED, MLP),
    ),
    (
        ("output/dense", "down_proj", "fc2", "lin2", "ffn_output", "mlp/c_proj", "mlp/Wo", "w2", "dense_4h_to_h"),
        (MLP, EMBED),
    ),
):
    for _n in _names:
        _KERNELS[_n] = _axes

#: Embedding tables whose rows are the vocabulary (other tables: positions, token types).
VOCAB_TABLES = frozenset({"word_embeddings", "wte", "shared", "embed_tokens", "tok_embeddings", "embed_in"})


def _kernel_axes(modules: Sequence[str]) -> tuple[str, str] | None:
    """The [in, out] names of the dense module at the end of ``modules`` (longest suffix rule)."""
    for k in range(max(len(modules) - 3, 0), len(modules)):
        hit = _KERNELS.get("/".join(modules[k:]))
        if hit is not None:
            return hit
    return None


def generic_param_axes(path: Sequence[str], shape: Sequence[int]) -> Axes:
    """Logical names of the dimensions of the param at ``path`` (module names then leaf name).

    * ``kernel [in, out]`` of a known projection: its names (e.g. ``query`` -> ``(embed, heads)``,
      ``down_proj`` -> ``(mlp, embed)``); of any other dense layer: ``(embed, None)``;
    * ``bias`` of a known projection: the kernel's output name; other biases and norm
      ``scale``/``bias``: ``(None,)``;
    * ``embedding [rows, dim]``: ``(vocab, embed)`` for word tables, ``(None, embed)`` otherwise;
    * anything else: ``None`` on every dimension (replicated)."""
    ndim = len(shape)
    none: Axes = (None,) * ndim
    if not path:
        return none
    *modules, leaf = (str(p) for p in path)
    if leaf == "embedding" and ndim == 2:
        return (VOCAB if modules and modules[-1] in VOCAB_TABLES else None, EMBED)
    known = _kernel_axes(modules)
    if leaf == "kernel" and ndim == 2:
        return known if known is not None else (EMBED, None)
    if leaf == "bias" and ndim == 1 and known is not None:
        return (known[1],)
    return none
