"""PyTorch code of a flaxheads sequence classifier: any backbone transformers' ``AutoModel`` builds,
then any flaxheads pooler and head.

``flaxheads export --format transformers`` writes this file next to ``config.json`` and
``model.safetensors`` when the pooler + head is not a Hugging Face preset; ``config.json``'s
``auto_map`` points here, so::

    AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)
    pipeline("text-classification", model=folder, trust_remote_code=True)

load it. The file is self-contained (torch and transformers only): transformers copies it alone.
The config holds the backbone's own ``config.json`` (``backbone_hf_config``) and the flaxheads
pooler + head config (``sequence_head``, the JSON flaxheads checkpoints store). Weights:
``backbone.<the backbone's own PyTorch names>``, ``pooler.*`` and ``head.*`` (flaxheads'
module names; a Dense ``kernel [in, out]`` is a Linear ``weight [out, in]``).
flaxheads reads such a folder back from ``config.json`` and the weights, never from this file.
"""

from __future__ import annotations

import inspect
import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

_EPS = 1e-9  # token counts are clamped to this (sentence-transformers' rule, flaxheads' too)
POOL_MASKS = ("attention_mask", "non_pad_token", "eos_token")


class FlaxheadsConfig(PretrainedConfig):
    """A backbone's config (``backbone_hf_config``, its ``config.json`` as a dict) + a flaxheads head.

    ``pool_mask``: what the pooler reads as its mask (the attention mask, ``input_ids != pool_token_id``
    or ``input_ids == pool_token_id``); ``threshold``: the multi-label decision threshold."""

    model_type = "flaxheads"

    def __init__(
        self,
        backbone_hf_config: dict | None = None,
        sequence_head: dict | None = None,
        pool_mask: str = "attention_mask",
        pool_token_id: int | None = None,
        threshold: float = 0.5,
        **kwargs,
    ):
        self.backbone_hf_config = dict(backbone_hf_config or {})
        self.sequence_head = dict(sequence_head or {})
        self.pool_mask = pool_mask
        self.pool_token_id = pool_token_id
        self.threshold = float(threshold)
        super().__init__(**kwargs)


# ---- activations (Hugging Face names) ------------------------------------------------------------
def _quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    None: lambda x: x,
    "linear": lambda x: x,
    "identity": lambda x: x,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(k for k in ACTIVATIONS if k)}")
    return ACTIVATIONS[name]


# ---- pooling functions: hidden [B, T, H], mask [B, T] -> [B, H] -----------------------------------
def _gather(hidden, idx):
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]


def _positions(mask):
    return torch.arange(mask.shape[1], device=mask.device).unsqueeze(0).expand_as(mask)


def first_non_pad_index(mask):
    return torch.argmax(mask.to(torch.int32), dim=1)


def last_non_pad_index(mask):
    m = mask.bool()
    idx = torch.where(m, _positions(mask), torch.full_like(_positions(mask), -1))
    return torch.argmax(idx, dim=1) * m.any(dim=1).to(torch.long)


def _sum_count(hidden, weights):
    w = weights.to(hidden.dtype).unsqueeze(-1)
    return (hidden * w).sum(dim=1), w.sum(dim=1)


def _mean(hidden, mask):
    s, n = _sum_count(hidden, mask)
    return s / n.clamp(min=_EPS)


def _max(hidden, mask):
    m = mask.bool().unsqueeze(-1)
    out = torch.where(m, hidden, torch.full_like(hidden, torch.finfo(hidden.dtype).min)).amax(dim=1)
    return torch.where(m.any(dim=1), out, torch.zeros_like(out))


def _mean_sqrt_len(hidden, mask):
    s, n = _sum_count(hidden, mask)
    return s / torch.sqrt(n.clamp(min=_EPS))


def _weighted_mean(hidden, mask):
    first = first_non_pad_index(mask).to(hidden.dtype).unsqueeze(1)
    steps = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=hidden.dtype).unsqueeze(0)
    s, n = _sum_count(hidden, mask.to(hidden.dtype) * (steps - first))
    return s / n.clamp(min=_EPS)


POOL_FUNCTIONS = {
    "cls": lambda h, m: h[:, 0],
    "first_non_pad": lambda h, m: _gather(h, first_non_pad_index(m)),
    "last": lambda h, m: _gather(h, last_non_pad_index(m)),
    "mean": _mean,
    "max": _max,
    "mean_sqrt_len": _mean_sqrt_len,
    "weighted_mean": _weighted_mean,
}


# ---- poolers (flaxheads.heads.poolers, same parameter names) -----------------------------------------
class Pool(nn.Module):
    def __init__(self, spec, hidden_size):
        super().__init__()
        self.mode = spec.get("mode", "mean")
        self.out_features = hidden_size

    def forward(self, hidden, mask):
        return POOL_FUNCTIONS[self.mode](hidden, mask)


class AttentionPool(nn.Module):
    """softmax(h . query / sqrt(H)) over the masked tokens, weighted sum."""

    def __init__(self, spec, hidden_size):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.out_features = hidden_size

    def forward(self, hidden, mask):
        m = mask.bool()
        scores = torch.einsum("bth,h->bt", hidden, self.query.to(hidden.dtype)) / math.sqrt(hidden.shape[-1])
        scores = torch.where(m, scores, torch.full_like(scores, torch.finfo(scores.dtype).min))
        w = torch.softmax(scores, dim=-1) * m.to(scores.dtype)
        w = w / w.sum(dim=-1, keepdim=True).clamp(min=_EPS)
        return torch.einsum("bt,bth->bh", w, hidden)


class DensePooler(nn.Module):
    """A token (``source``) -> dropout -> dense -> activation (BERT's pooler, DeBERTa's ContextPooler)."""

    def __init__(self, spec, hidden_size):
        super().__init__()
        self.source = spec.get("source", "cls")
        self.out_features = spec.get("features") or hidden_size
        self.dropout = nn.Dropout(spec.get("dropout", 0.0))
        self.dense = nn.Linear(hidden_size, self.out_features)
        self.act = activation(spec.get("activation", "tanh"))

    def forward(self, hidden, mask):
        return self.act(self.dense(self.dropout(POOL_FUNCTIONS[self.source](hidden, mask))))


class LateDensePooler(nn.Module):
    """dense -> activation on every token, then pool (EuroBERT's late pooling)."""

    def __init__(self, spec, hidden_size):
        super().__init__()
        self.pool = spec.get("pool", "mean")
        self.out_features = spec.get("features") or hidden_size
        self.dense = nn.Linear(hidden_size, self.out_features)
        self.act = activation(spec.get("activation", "gelu"))

    def forward(self, hidden, mask):
        return POOL_FUNCTIONS[self.pool](self.act(self.dense(hidden)), mask)


class SequenceSummary(nn.Module):
    """XLNet's sequence summary (ignores the mask, as Hugging Face's)."""

    def __init__(self, spec, hidden_size):
        super().__init__()
        self.summary_type = spec.get("summary_type", "last")
        self.use_proj = spec.get("use_proj", True)
        n = spec.get("num_labels", 0)
        self.out_features = n if self.use_proj and spec.get("proj_to_labels") and n > 0 else hidden_size
        self.first_dropout = nn.Dropout(spec.get("first_dropout", 0.0))
        self.last_dropout = nn.Dropout(spec.get("last_dropout", 0.1))
        if self.use_proj:
            self.summary = nn.Linear(hidden_size, self.out_features)
        self.act = activation(spec.get("activation", "tanh"))

    def forward(self, hidden, mask):
        if self.summary_type == "first":
            x = hidden[:, 0]
        elif self.summary_type == "mean":
            x = hidden.mean(dim=1)
        else:  # "last", and "cls_index" without indices: position -1
            x = hidden[:, -1]
        x = self.first_dropout(x)
        if self.use_proj:
            x = self.summary(x)
        return self.last_dropout(self.act(x))


class Concat(nn.Module):
    def __init__(self, spec, hidden_size):
        super().__init__()
        self.n = len(spec["parts"])
        for i, part in enumerate(spec["parts"]):
            self.add_module(f"parts_{i}", make_pooler(part, hidden_size))
        self.out_features = sum(getattr(self, f"parts_{i}").out_features for i in range(self.n))

    def forward(self, hidden, mask):
        return torch.cat([getattr(self, f"parts_{i}")(hidden, mask) for i in range(self.n)], dim=-1)


POOLERS = {
    "pool": Pool,
    "attention": AttentionPool,
    "dense": DensePooler,
    "late_dense": LateDensePooler,
    "sequence_summary": SequenceSummary,
    "concat": Concat,
}


def make_pooler(spec, hidden_size):
    if spec.get("type") not in POOLERS:
        raise ValueError(f"unknown flaxheads pooler {spec.get('type')!r}; known: {sorted(POOLERS)}")
    return POOLERS[spec["type"]](spec, hidden_size)


# ---- heads (flaxheads.heads.heads, same parameter names) ---------------------------------------------
class LinearHead(nn.Module):
    def __init__(self, spec, in_features):
        super().__init__()
        self.dropout = nn.Dropout(spec.get("dropout", 0.1))
        self.classifier = nn.Linear(in_features, spec["num_labels"], bias=spec.get("use_bias", True))

    def forward(self, x):
        return self.classifier(self.dropout(x))


class MLPHead(nn.Module):
    """input dropout -> [dense -> act -> (LayerNorm) -> dropout] x depth -> out_proj."""

    def __init__(self, spec, in_features):
        super().__init__()
        self.input_dropout = nn.Dropout(spec.get("input_dropout", 0.0))
        self.dropout = nn.Dropout(spec.get("dropout", 0.1))
        self.act = activation(spec.get("activation", "gelu"))
        self.depth = len(spec.get("hidden_dims", [None]))
        self.layer_norm = bool(spec.get("layer_norm", False))
        w = in_features
        for i, d in enumerate(spec.get("hidden_dims", [None])):
            self.add_module(f"dense_{i}", nn.Linear(w, d or w, bias=spec.get("dense_bias", True)))
            w = d or w
            if self.layer_norm:
                self.add_module(
                    f"norm_{i}", nn.LayerNorm(w, eps=spec.get("norm_eps", 1e-5), bias=spec.get("norm_bias", True))
                )
        self.out_proj = nn.Linear(w, spec["num_labels"], bias=spec.get("out_bias", True))

    def forward(self, x):
        x = self.input_dropout(x)
        for i in range(self.depth):
            x = self.act(getattr(self, f"dense_{i}")(x))
            if self.layer_norm:
                x = getattr(self, f"norm_{i}")(x)
            x = self.dropout(x)
        return self.out_proj(x)


class ProjectionHead(nn.Module):
    """dropout -> [dense -> act] per width -> optional L2 normalisation (an embedding, not logits)."""

    def __init__(self, spec, in_features):
        super().__init__()
        widths = spec.get("features", 256)
        widths = [widths] if isinstance(widths, int) else list(widths)
        self.dropout = nn.Dropout(spec.get("dropout", 0.0))
        self.act = activation(spec.get("activation"))
        self.normalize = bool(spec.get("normalize", False))
        self.depth = len(widths)
        for i, d in enumerate(widths):
            self.add_module(f"dense_{i}", nn.Linear(in_features, d, bias=spec.get("use_bias", True)))
            in_features = d

    def forward(self, x):
        x = self.dropout(x)
        for i in range(self.depth):
            x = self.act(getattr(self, f"dense_{i}")(x))
        return F.normalize(x, dim=-1, eps=1e-12) if self.normalize else x


class IdentityHead(nn.Module):
    def __init__(self, spec, in_features):
        super().__init__()
        self.normalize = bool(spec.get("normalize", False))

    def forward(self, x):
        return F.normalize(x, dim=-1, eps=1e-12) if self.normalize else x


HEADS = {"linear": LinearHead, "mlp": MLPHead, "projection": ProjectionHead, "identity": IdentityHead}


def make_head(spec, in_features):
    if spec.get("type") not in HEADS:
        raise ValueError(f"unknown flaxheads head {spec.get('type')!r}; known: {sorted(HEADS)}")
    return HEADS[spec["type"]](spec, in_features)


# ---- the model --------------------------------------------------------------------------------------
def backbone_from_config(hf_config: dict) -> PreTrainedModel:
    """The bare backbone (``AutoModel``) of its own config, without a pretrained pooler it would not use."""
    values = dict(hf_config)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    options = {}
    # transformers annotates its lazy auto mappings with the tokenizer mapping's (slow, fast) pair;
    # MODEL_MAPPING's values are model classes (a cast, not an ignore: without transformers it is Any)
    cls = cast("type[PreTrainedModel]", MODEL_MAPPING[type(config)])
    if "add_pooling_layer" in inspect.signature(cls.__init__).parameters:
        options["add_pooling_layer"] = False  # flaxheads' pooler is its own module
    return AutoModel.from_config(config, **options)


class FlaxheadsForSequenceClassification(PreTrainedModel):
    """``backbone`` (any ``AutoModel``) -> ``pooler`` -> ``head``; logits are float32."""

    config_class = FlaxheadsConfig
    base_model_prefix = "backbone"

    def __init__(self, config: FlaxheadsConfig):
        super().__init__(config)
        if config.pool_mask not in POOL_MASKS:
            raise ValueError(f"pool_mask must be one of {POOL_MASKS}, got {config.pool_mask!r}")
        self.num_labels = config.num_labels
        self.backbone = backbone_from_config(config.backbone_hf_config)
        hidden = self.backbone.config.hidden_size
        self.pooler = make_pooler(config.sequence_head["pooler"], hidden)
        self.head = make_head(config.sequence_head["head"], self.pooler.out_features)
        params = inspect.signature(self.backbone.forward).parameters
        self._takes_token_types = "token_type_ids" in params
        self.post_init()

    def _init_weights(self, module):
        # only reached for weights a folder lacks: the backbone keeps its own initialisation
        if isinstance(module, nn.Linear) and not any(module is m for m in self.backbone.modules()):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def pooling_mask(self, input_ids, attention_mask):
        if self.config.pool_mask == "non_pad_token":
            return input_ids != self.config.pool_token_id
        if self.config.pool_mask == "eos_token":
            return input_ids == self.config.pool_token_id
        return attention_mask

    def forward(
        self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, return_dict=None, **kwargs
    ):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and self._takes_token_types:
            inputs["token_type_ids"] = token_type_ids
        hidden = self.backbone(**inputs).last_hidden_state.float()
        logits = self.head(self.pooler(hidden, self.pooling_mask(input_ids, attention_mask)))
        loss = None if labels is None else self._loss(logits, labels)
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def _loss(self, logits, labels):
        """Hugging Face's rule: regression -> MSE, integer labels -> cross-entropy, else BCE with logits."""
        problem = self.config.problem_type
        if problem is None:
            problem = (
                "regression"
                if self.num_labels == 1
                else "single_label_classification"
                if labels.dtype in (torch.long, torch.int)
                else "multi_label_classification"
            )
        if problem == "regression":
            out = logits.squeeze(-1) if self.num_labels == 1 else logits
            return F.mse_loss(out, labels.float().view_as(out))
        if problem == "single_label_classification":
            return F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits, labels.float())
