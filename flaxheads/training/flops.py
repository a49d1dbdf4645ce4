"""Model FLOPs of a train step, counted from the backbone's config, and the accelerator's peak:
throughput and MFU (model FLOP utilisation) of a run. ``bench/`` counts with the same functions.

Model FLOPs (2 per multiply-add; embeddings, norms, softmax and the optimizer not counted; remat's
recomputation not counted, as MFU defines it), per training row of ``T`` token slots:

    T x (k x L x P_layer + a x 4 x L x T x A)  +  6 x P_head

``P_layer`` = the matmul weights of one layer (q, k, v, output; two FFN matrices, three when the FFN
is gated), ``A`` = the attention width (heads x head size; ``4 T A`` per token forward: ``QK^T`` and
``PV``), ``P_head`` = the matrices of the pooler and head. ``k`` is 6 when the backbone trains
(forward 2, gradients of inputs 2 and of weights 2), 4 with LoRA (the base's weights get no
gradients), 2 when frozen (forward only). The attention products have no weights: ``a`` is 3
(forward + the gradients of both operands) whenever gradients flow through the backbone, 1 when
frozen. For BERT this is ``6 N_matmul B T + 12 L T^2 H B + 6 (H^2 + H labels) B``, ``bench/mfu.py``'s
formula.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

#: Families whose FFN is gated (three matrices: gate, up, down; ``intermediate_size`` is one branch).
GATED_FFN = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "modernbert")

#: Dense matmul peak TFLOP/s per device, (bfloat16, float32 as JAX runs it: TF32 on NVIDIA tensor
#: cores, bf16 passes on TPU), from the vendors' data sheets; the longest matching name wins.
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H100 PCIe": (756.0, 378.0),
    "H100": (989.0, 494.7),
    "H200": (989.0, 494.7),
    "H800": (989.0, 494.7),
    "GH200": (989.0, 494.7),
    "B200": (2250.0, 1100.0),
    "A100": (312.0, 156.0),
    "A800": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "L4": (121.0, 60.0),
    "A10G": (70.0, 35.0),
    "A10": (125.0, 62.5),
    "V100": (125.0, 15.7),
    "TPU v2": (22.5, 22.5),
    "TPU v3": (61.5, 61.5),
    "TPU v4": (275.0, 275.0),
    "TPU v5 lite": (197.0, 197.0),
    "TPU v5e": (197.0, 197.0),
    "TPU v5p": (459.0, 459.0),
    "TPU v5": (459.0, 459.0),
    "TPU v6 lite": (918.0, 918.0),
    "TPU v6e": (918.0, 918.0),
}


def _first(cfg: Mapping[str, Any], *keys: str, default=None):
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return default


@dataclasses.dataclass(frozen=True)
class Dims:
    """The sizes a FLOP count needs (from an HF ``config.json``)."""

    hidden: int
    layers: int
    intermediate: int
    attention: int  # query heads x head size
    kv: int  # key/value heads x head size
    gated: bool = False

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Dims:
        """From an HF config (BERT-style keys, DistilBERT's ``dim``/``n_layers``, GPT-2's ``n_embd``,
        BART's ``d_model``; encoder-decoders count both stacks' self-attention and FFN)."""
        c = dict(config.items()) if not isinstance(config, dict) else config
        h = int(_first(c, "hidden_size", "d_model", "n_embd", "dim"))
        layers = _first(c, "num_hidden_layers", "n_layer", "n_layers")
        if layers is None:
            layers = int(c.get("encoder_layers", 0)) + int(c.get("decoder_layers", 0))
        heads = int(_first(c, "num_attention_heads", "n_head", "n_heads", "encoder_attention_heads"))
        head_dim = int(_first(c, "head_dim", default=h // heads))
        kv_heads = int(_first(c, "num_key_value_heads", default=heads))
        inter = int(_first(c, "intermediate_size", "encoder_ffn_dim", "n_inner", "hidden_dim", default=4 * h))
        return cls(h, int(layers), inter, heads * head_dim, kv_heads * head_dim, gated=c.get("model_type") in GATED_FFN)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matmuls: q, k, v, output and the FFN."""
        h = self.hidden
        ffn = (3 if self.gated else 2) * h * self.intermediate
        return h * self.attention + 2 * h * self.kv + self.attention * h + ffn


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one train step of a model (see the module docstring)."""

    dims: Dims
    head_params: int  # matrices of the pooler and head
    per_param: float = 6.0  # FLOPs per backbone weight per token: 6 trains, 4 LoRA, 2 frozen

    @classmethod
    def of(cls, model, *, frozen: bool = False) -> StepFlops:
        """The count for ``model`` (a ``SequenceModel``); ``frozen``: its backbone does not train."""
        head = sum(int(x.size) for x in _leaves(model.params.get("head", {})) if len(x.shape) >= 2)
        per = 2.0 if frozen else 4.0 if getattr(model, "lora", None) is not None else 6.0
        return cls(Dims.of(model.backbone.config), head, per)

    def __call__(self, rows: int, seq: int) -> float:
        """Model FLOPs of a step on ``rows`` rows of ``seq`` token slots."""
        d = self.dims
        matmuls = self.per_param * d.layers * d.layer_matmul_params
        attention = (3.0 if self.per_param > 2 else 1.0) * 4 * d.layers * seq * d.attention
        return rows * seq * (matmuls + attention) + 6.0 * rows * self.head_params

    def of_batch(self, batch: Mapping[str, Any]) -> float:
        """Model FLOPs of a step on ``batch`` (its ``input_ids``' slots, padding included: what runs)."""
        shape = batch["input_ids"].shape
        seq = int(shape[-1])
        return self(int(batch["input_ids"].size) // max(seq, 1), seq)


def forward_flops(dims: Dims, rows: int, seq: int, head_params: int = 0) -> float:
    """Model FLOPs of a forward pass on ``rows`` rows of ``seq`` token slots (``head_params``: the
    pooler and head matrices, applied once per row)."""
    per_token = 2 * dims.layers * dims.layer_matmul_params + 4 * dims.layers * seq * dims.attention
    return float(rows * seq * per_token + 2 * rows * head_params)


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def peak_flops(device_kind: str, precision: str = "bfloat16") -> float | None:
    """The dense peak FLOP/s of one device of ``device_kind`` (``jax.devices()[0].device_kind``) at
    ``precision``; None where the kind is not in :data:`PEAK_TFLOPS` (CPUs: MFU is left out)."""
    match = max((k for k in PEAK_TFLOPS if k.lower() in device_kind.lower()), key=len, default=None)
    if match is None:
        return None
    bf16, f32 = PEAK_TFLOPS[match]
    return 1e12 * (bf16 if precision == "bfloat16" else f32)
