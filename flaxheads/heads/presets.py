"""Hugging Face's fixed pooler + head choices, one preset per ``config.model_type``.

Each preset reads the dropout/activation settings from the backbone's HF config exactly
where the PyTorch ``XForSequenceClassification`` reads them, and names the PyTorch
state-dict modules of its weights (``hf_names``: our params path -> HF module name;
Dense ``kernel`` [in, out] is HF ``weight`` [out, in]; LayerNorm ``scale`` is ``weight``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flaxheads import config as _config
from flaxheads.backbones.families.decoder_config import HF_CLASSES as DECODER_HF_CLASSES
from flaxheads.errors import ConfigError, FlaxheadsError
from flaxheads.heads.heads import Head, LinearHead, MLPHead
from flaxheads.heads.poolers import DensePooler, LateDensePooler, Pool, Pooler, SequenceSummary

# Which mask the pooler sees: the attention mask, or one derived from input_ids.
POOL_MASKS = ("attention_mask", "non_pad_token", "eos_token")
# Settings that change no weight's meaning: a head that differs from a preset only in these is that preset.
_NOT_STRUCTURE = frozenset({"dropout", "input_dropout", "init_std", "first_dropout", "last_dropout"})


class PoolMaskError(FlaxheadsError):
    """A pooling mask that is unknown, or that the backbone's config cannot provide."""


@dataclasses.dataclass(frozen=True)
class Preset:
    arch: str
    pooler: Pooler
    head: Head
    pool_mask: str = "attention_mask"
    hf_names: tuple[tuple[str, str], ...] = ()  # ("pooler/dense", "bert.pooler.dense"), ...
    hf_class: str = ""  # the PyTorch class this preset reproduces


def _get(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _std(cfg) -> float:
    return float(_get(cfg, "initializer_range", "init_std", default=0.02))


def _bert(cfg, n):
    p = _get(cfg, "classifier_dropout", "hidden_dropout_prob", default=0.1)
    return Preset(
        "bert",
        DensePooler(activation="tanh", init_std=_std(cfg)),
        LinearHead(n, dropout=p, init_std=_std(cfg)),
        hf_names=(("pooler/dense", "bert.pooler.dense"), ("head/classifier", "classifier")),
        hf_class="BertForSequenceClassification",
    )


def _bert_like(arch: str, prefix: str, hf_class: str):
    # BERT's classifier under another base prefix (nomic-bert, GTE): pooler dense + tanh -> dropout -> linear
    def make(cfg, n):
        p = _get(cfg, "classifier_dropout", "hidden_dropout_prob", default=0.1)
        return Preset(
            arch,
            DensePooler(activation="tanh", init_std=_std(cfg)),
            LinearHead(n, dropout=p, init_std=_std(cfg)),
            hf_names=(("pooler/dense", f"{prefix}.pooler.dense"), ("head/classifier", "classifier")),
            hf_class=hf_class,
        )

    return make


def _albert(cfg, n):
    p = _get(cfg, "classifier_dropout_prob", default=0.1)
    return Preset(
        "albert",
        DensePooler(activation="tanh", init_std=_std(cfg)),
        LinearHead(n, dropout=p, init_std=_std(cfg)),
        hf_names=(("pooler/dense", "albert.pooler"), ("head/classifier", "classifier")),
        hf_class="AlbertForSequenceClassification",
    )


def _dense_act_head(arch: str, act: str, prefix: str, hf_class: str):
    # RoBERTa/XLM-R/ELECTRA: first token -> dropout -> dense -> act -> dropout -> out_proj
    def make(cfg, n):
        p = _get(cfg, "classifier_dropout", "hidden_dropout_prob", default=0.1)
        return Preset(
            arch,
            Pool("cls"),
            MLPHead(n, activation=act, dropout=p, input_dropout=p, init_std=_std(cfg)),
            hf_names=(("head/dense_0", f"{prefix}.dense"), ("head/out_proj", f"{prefix}.out_proj")),
            hf_class=hf_class,
        )

    return make


def _bart(cfg, n):
    p = float(_get(cfg, "classifier_dropout", default=0.0))
    return Preset(
        "bart",
        Pool("last"),
        MLPHead(n, activation="tanh", dropout=p, input_dropout=p, init_std=_std(cfg)),
        pool_mask="eos_token",
        hf_names=(("head/dense_0", "classification_head.dense"), ("head/out_proj", "classification_head.out_proj")),
        hf_class="BartForSequenceClassification",
    )


def _distilbert(cfg, n):
    p = _get(cfg, "seq_classif_dropout", default=0.2)
    return Preset(
        "distilbert",
        Pool("cls"),
        MLPHead(n, activation="relu", dropout=p, init_std=_std(cfg)),
        hf_names=(("head/dense_0", "pre_classifier"), ("head/out_proj", "classifier")),
        hf_class="DistilBertForSequenceClassification",
    )


def _gpt2(cfg, n):
    return Preset(
        "gpt2",
        Pool("last"),
        LinearHead(n, dropout=0.0, use_bias=False, init_std=_std(cfg)),
        pool_mask="non_pad_token",
        hf_names=(("head/classifier", "score"),),
        hf_class="GPT2ForSequenceClassification",
    )


def _decoder(arch: str):
    # Llama, Mistral, Qwen2/3, Gemma 1/2/3: transformers' GenericForSequenceClassification, GPT-2's head
    # (last token != pad_token_id; with no pad_token_id PyTorch takes the last position for a batch of
    # one and raises for larger batches: flaxheads asks for pad_token_id when the model is loaded)
    def make(cfg, n):
        return Preset(
            arch,
            Pool("last"),
            LinearHead(n, dropout=0.0, use_bias=False, init_std=_std(cfg)),
            pool_mask="non_pad_token",
            hf_names=(("head/classifier", "score"),),
            hf_class=DECODER_HF_CLASSES[arch],
        )

    return make


def _xlnet(cfg, n):
    summary = SequenceSummary(
        summary_type=_get(cfg, "summary_type", default="last"),
        use_proj=bool(_get(cfg, "summary_use_proj", default=False)),
        proj_to_labels=bool(_get(cfg, "summary_proj_to_labels", default=False)),
        num_labels=n,
        activation=_get(cfg, "summary_activation"),
        first_dropout=float(_get(cfg, "summary_first_dropout", default=0.0)),
        last_dropout=float(_get(cfg, "summary_last_dropout", default=0.0)),
        init_std=_std(cfg),
    )
    return Preset(
        "xlnet",
        summary,
        LinearHead(n, dropout=0.0, init_std=_std(cfg)),
        hf_names=(("pooler/summary", "sequence_summary.summary"), ("head/classifier", "logits_proj")),
        hf_class="XLNetForSequenceClassification",
    )


def _deberta_v2(cfg, n):
    ctx = DensePooler(
        features=_get(cfg, "pooler_hidden_size", "hidden_size"),
        activation=_get(cfg, "pooler_hidden_act", default="gelu"),
        dropout=float(_get(cfg, "pooler_dropout", default=0.0)),
        init_std=_std(cfg),
    )
    p = _get(cfg, "cls_dropout", "hidden_dropout_prob", default=0.1)
    return Preset(
        "deberta-v2",
        ctx,
        LinearHead(n, dropout=p, init_std=_std(cfg)),
        hf_names=(("pooler/dense", "pooler.dense"), ("head/classifier", "classifier")),
        hf_class="DebertaV2ForSequenceClassification",
    )


def _modernbert(cfg, n):
    pooling = _get(cfg, "classifier_pooling", default="cls")
    if pooling not in ("cls", "mean"):
        raise ValueError(f"ModernBERT classifier_pooling must be 'cls' or 'mean', got {pooling!r}")
    head = MLPHead(
        n,
        activation=_get(cfg, "classifier_activation", default="gelu"),
        dropout=float(_get(cfg, "classifier_dropout", default=0.0)),
        layer_norm=True,
        norm_eps=float(_get(cfg, "norm_eps", default=1e-5)),
        norm_bias=bool(_get(cfg, "norm_bias", default=False)),
        dense_bias=bool(_get(cfg, "classifier_bias", default=False)),
        init_std=_std(cfg),
    )
    return Preset(
        "modernbert",
        Pool(pooling),
        head,
        hf_names=(("head/dense_0", "head.dense"), ("head/norm_0", "head.norm"), ("head/out_proj", "classifier")),
        hf_class="ModernBertForSequenceClassification",
    )


def _modernbert_decoder(cfg, n):
    # ModernBertDecoderForSequenceClassification: head (dense -> act -> LayerNorm) -> dropout -> classifier on
    # every token, the last non-pad token's logits (as GPT-2); dense and classifier biases: classifier_bias
    bias = bool(_get(cfg, "classifier_bias", default=False))
    head = MLPHead(
        n,
        activation=_get(cfg, "classifier_activation", default="gelu"),
        dropout=float(_get(cfg, "classifier_dropout", default=0.0)),
        layer_norm=True,
        norm_eps=float(_get(cfg, "norm_eps", default=1e-5)),
        norm_bias=bool(_get(cfg, "norm_bias", default=False)),
        dense_bias=bias,
        out_bias=bias,
        init_std=_std(cfg),
    )
    return Preset(
        "modernbert-decoder",
        Pool("last"),
        head,
        pool_mask="non_pad_token",
        hf_names=(("head/dense_0", "head.dense"), ("head/norm_0", "head.norm"), ("head/out_proj", "classifier")),
        hf_class="ModernBertDecoderForSequenceClassification",
    )


EUROBERT_POOLING = ("bos", "mean", "late")


def _eurobert(cfg, n):
    # EuroBertForSequenceClassification: dense -> GELU -> classifier, no dropout. classifier_pooling "bos"
    # (position 0) or "mean" (masked mean) pool first; "late" runs dense -> GELU on every token and averages
    # the per-token logits, which (the classifier being linear) is the classifier of the masked mean
    pooling = _get(cfg, "classifier_pooling", default="late")
    if pooling not in EUROBERT_POOLING:
        raise ConfigError(
            f"EuroBERT classifier_pooling must be one of {EUROBERT_POOLING}, got {pooling!r}: fix config.json"
        )
    if pooling == "late":
        pooler = LateDensePooler(activation="gelu", pool="mean", init_std=_std(cfg))
    else:
        pooler = DensePooler(activation="gelu", source="cls" if pooling == "bos" else "mean", init_std=_std(cfg))
    return Preset(
        "eurobert",
        pooler,
        LinearHead(n, dropout=0.0, init_std=_std(cfg)),
        hf_names=(("pooler/dense", "dense"), ("head/classifier", "classifier")),
        hf_class="EuroBertForSequenceClassification",
    )


PRESETS: dict[str, Callable[[Any, int], Preset]] = {
    "bert": _bert,
    "albert": _albert,
    "roberta": _dense_act_head("roberta", "tanh", "classifier", "RobertaForSequenceClassification"),
    "xlm-roberta": _dense_act_head("xlm-roberta", "tanh", "classifier", "XLMRobertaForSequenceClassification"),
    "electra": _dense_act_head("electra", "gelu", "classifier", "ElectraForSequenceClassification"),
    "distilbert": _distilbert,
    "bart": _bart,
    "gpt2": _gpt2,
    "xlnet": _xlnet,
    "deberta-v2": _deberta_v2,
    "modernbert": _modernbert,
    "nomic_bert": _bert_like("nomic_bert", "nomic_bert", "NomicBertForSequenceClassification"),
    "gte": _bert_like("gte", "gte", "GteForSequenceClassification"),
    "jina_embeddings_v3": _dense_act_head(
        "jina_embeddings_v3", "tanh", "classifier", "JinaEmbeddingsV3ForSequenceClassification"
    ),
    "modernbert-decoder": _modernbert_decoder,
    "eurobert": _eurobert,
    **{arch: _decoder(arch) for arch in DECODER_HF_CLASSES},
}


def preset_for(hf_config, num_labels: int) -> Preset | None:
    """The HF-exact preset for ``hf_config.model_type``, or ``None`` when there is none."""
    make = PRESETS.get(getattr(hf_config, "model_type", None) or "")
    return None if make is None else make(hf_config, num_labels)


def same_structure(a, b) -> bool:
    """Same module config ignoring dropout rates and init scale (they do not change the weights' meaning)."""

    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in _NOT_STRUCTURE}
        if isinstance(d, list):
            return [strip(x) for x in d]
        return d

    return strip(_config.to_dict(a)) == strip(_config.to_dict(b))


@dataclasses.dataclass(frozen=True)
class PresetMatch:
    """How a (pooler, head, pool mask) relates to the backbone's HF preset (see :func:`match_preset`)."""

    preset: Preset | None  # the backbone's HF preset; None when its model_type has none
    pool_mask: str  # the mask the pooler sees
    same_pooler: bool = False  # the pooler has the preset's structure (its pretrained weights fit)
    same_head: bool = False  # the head has the preset's structure

    @property
    def exact(self) -> bool:
        """Pooler, head and pool mask are the preset's: the model is the PyTorch ``hf_class``."""
        return (
            self.same_pooler and self.same_head and self.preset is not None and self.pool_mask == self.preset.pool_mask
        )

    @property
    def arch(self) -> str | None:
        """The preset's name when :attr:`exact`, else None."""
        return self.preset.arch if self.exact and self.preset is not None else None

    @property
    def weight_names(self) -> tuple[tuple[str, str], ...]:
        """``(our path, HF name)`` of the modules whose pretrained HF weights fit (structure matches)."""
        if self.preset is None:
            return ()
        return tuple(
            (p, n)
            for p, n in self.preset.hf_names
            if (p.startswith("pooler/") and self.same_pooler) or (p.startswith("head/") and self.same_head)
        )

    @property
    def hf_names(self) -> tuple[tuple[str, str], ...]:
        """The preset's HF names when :attr:`exact`, else ``()`` (what a model records as ``hf_names``)."""
        return self.preset.hf_names if self.exact and self.preset is not None else ()


def match_preset(hf_config, num_labels: int, pooler: Pooler, head: Head, pool_mask: str | None = None) -> PresetMatch:
    """THE decision whether ``(pooler, head, pool_mask)`` on this backbone is its Hugging Face preset.

    ``pool_mask=None`` picks the preset's mask when the pooler is the preset's, else the
    attention mask. The mask name is checked (:class:`PoolMaskError`); whether the backbone
    can provide it is :func:`check_pool_mask`'s job."""
    preset = preset_for(hf_config, num_labels)
    same_pooler = preset is not None and same_structure(pooler, preset.pooler)
    as_linear = getattr(head, "as_linear", None)  # a TokenLogits head is the linear head its kernel fills
    same_head = preset is not None and same_structure(as_linear() if as_linear else head, preset.head)
    if pool_mask is None:
        pool_mask = preset.pool_mask if preset is not None and same_pooler else "attention_mask"
    if pool_mask not in POOL_MASKS:
        raise PoolMaskError(f"pool_mask must be one of {POOL_MASKS}, got {pool_mask!r}")
    return PresetMatch(preset, pool_mask, same_pooler, same_head)


def check_pool_mask(
    pool_mask: str,
    *,
    pad_token_id: int | None,
    eos_token_id: int | None,
    subject: str,
    error: type[FlaxheadsError] = PoolMaskError,
) -> None:
    """Raise ``error`` unless the backbone can provide ``pool_mask``: ``non_pad_token`` needs a
    ``pad_token_id``, ``eos_token`` an ``eos_token_id``. ``subject`` says whose mask it is."""
    if pool_mask not in POOL_MASKS:
        raise error(f"{subject}: pool_mask must be one of {POOL_MASKS}, got {pool_mask!r}")
    if pool_mask == "non_pad_token" and pad_token_id is None:
        raise error(
            f"pad_token_id missing: {subject} pools the last non-pad token (GPT-2's rule, pool_mask='non_pad_token'), "
            "which needs config.pad_token_id, but it is None. Set config.pad_token_id on the backbone (e.g. "
            "`config.pad_token_id = config.eos_token_id`) and save it, or use pool_mask='attention_mask' to pool "
            "the last attended token instead."
        )
    if pool_mask == "eos_token" and eos_token_id is None:
        raise error(
            f"eos_token_id missing: {subject} pools the last <eos> token (BART's rule, pool_mask='eos_token'), "
            "which needs config.eos_token_id, but it is None. Set config.eos_token_id, or use "
            "pool_mask='attention_mask' to pool the last attended token instead."
        )
