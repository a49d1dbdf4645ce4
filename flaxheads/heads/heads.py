"""Head configs: what maps the pooled vector [B, H'] to logits / an embedding [B, N].

Each head's config is a plain frozen dataclass (the one place of its fields, defaults and
validation, and its JSON form); its modules are built from it, the Linen form in
:mod:`flaxheads.heads.linen` and the NNX form in :mod:`flaxheads.nnx.layers`. Every Hugging Face
classification head is a configuration of :class:`LinearHead` or :class:`MLPHead` (see
``presets.py``); :class:`ProjectionHead` maps embeddings to another width.
"""

from __future__ import annotations

import dataclasses

from flaxheads.config import SINCE_FORMAT_1, register
from flaxheads.errors import ConfigError
from flaxheads.heads.poolers import Pooler, config_class
from flaxheads.layers.activations import get_activation


def _check_positive(what: str, v: int) -> None:
    if not isinstance(v, int) or v < 1:
        raise ConfigError(f"{what} must be a positive integer, got {v!r}")


def _check_rate(what: str, p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"{what} must be in [0, 1), got {p!r}")


@config_class
class Head:
    """Base of the head configs; a module built from one maps ``x [B, H'] -> [B, N]``."""

    def out_features(self) -> int:
        raise NotImplementedError

    def steps(self, in_features: int) -> list[str]:
        raise NotImplementedError


@register("linear")
@config_class
class LinearHead(Head):
    """dropout -> dense (``classifier``). BERT/ALBERT/DeBERTa-v2 (``classifier``), XLNet
    (``logits_proj``, no dropout), GPT-2 (``score``, no dropout, no bias)."""

    num_labels: int = 2
    dropout: float = 0.1
    use_bias: bool = True
    init_std: float = 0.02

    def __post_init__(self):
        _check_positive("num_labels", self.num_labels)
        _check_rate("dropout", self.dropout)

    def out_features(self):
        return self.num_labels

    def steps(self, in_features):
        s = [f"dropout({self.dropout})"] if self.dropout else []
        return s + [f"dense {in_features}->{self.num_labels}{'' if self.use_bias else ' (no bias)'}"]


@register("token_logits")
@config_class
class TokenLogits(LinearHead):
    """A causal LM's language-model head rows for ``tokens`` at the pooled (last) token: LLM rerankers
    (Qwen3-Reranker: ``("no", "yes")``; mxbai-rerank-v2: ``("0", "1")``) as a linear ``classifier``.

    ``two_way`` (two tokens): one output, ``logit(tokens[1]) - logit(tokens[0])``, the row difference
    ``W[tokens[1]] - W[tokens[0]]`` (vLLM's ``from_2_way_softmax``): its sigmoid is the 2-way softmax's
    probability of ``tokens[1]``. Otherwise one output per token, that token's logit. Tokens are
    vocabulary entries (or ids); :func:`flaxheads.from_pretrained` fills the kernel from the LM head
    (or the tied embeddings). ``template``: the prompt template the pairs are written in
    (:data:`flaxheads.heads.templates.TEMPLATES`). Once loaded it is the preset's linear ``score``
    head, so it trains, and exports as ``XForSequenceClassification``, as that head does."""

    num_labels: int = 0  # 0: from the tokens (1 when two_way, else one per token)
    dropout: float = 0.0
    use_bias: bool = False
    tokens: tuple[str | int, ...] = ("no", "yes")
    two_way: bool = True
    template: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(self.tokens))
        if not self.tokens or not all(isinstance(t, (str, int)) and t != "" for t in self.tokens):
            raise ConfigError(f"TokenLogits tokens must be non-empty strings or token ids, got {self.tokens!r}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ConfigError(f"TokenLogits tokens repeat: {self.tokens!r}")
        if self.two_way and len(self.tokens) != 2:
            raise ConfigError(
                f"TokenLogits(two_way=True) takes two tokens (negative, positive), got {self.tokens!r}; "
                "pass two_way=False for one logit per token"
            )
        n = 1 if self.two_way else len(self.tokens)
        if self.num_labels not in (0, n):
            raise ConfigError(
                f"TokenLogits{self.tokens!r} (two_way={self.two_way}) gives {n} outputs, "
                f"not num_labels={self.num_labels}; leave num_labels out"
            )
        object.__setattr__(self, "num_labels", n)
        if self.use_bias:
            raise ConfigError("TokenLogits has no bias (a language-model head has none); leave use_bias out")
        if self.template is not None:
            from flaxheads.heads.templates import get_template

            get_template(self.template)
        super().__post_init__()

    def as_linear(self) -> LinearHead:
        """The linear head this is once its kernel is filled (what presets and exports compare)."""
        return LinearHead(self.num_labels, dropout=self.dropout, use_bias=False, init_std=self.init_std)

    def steps(self, in_features):
        what = (
            f"logit({self.tokens[1]!r}) - logit({self.tokens[0]!r})"
            if self.two_way
            else "logits of " + ", ".join(map(repr, self.tokens))
        )
        return super().steps(in_features)[:-1] + [f"dense {in_features}->{self.num_labels} (no bias): {what}"]


@register("mlp")
@config_class
class MLPHead(Head):
    """input dropout -> [dense ``dense_i`` -> act -> (LayerNorm ``norm_i``) -> dropout] x depth -> dense ``out_proj``.

    ``hidden_dims`` entries of ``None`` mean "the input width". HF presets:
    RoBERTa/XLM-R/BART (input_dropout=p, tanh), ELECTRA (input_dropout=p, gelu),
    DistilBERT (input_dropout=0, relu), ModernBERT (input_dropout=0, act, LayerNorm), the
    ModernBERT decoder (``out_bias=classifier_bias``)."""

    num_labels: int = 2
    hidden_dims: tuple[int | None, ...] = (None,)
    activation: str | None = "gelu"
    dropout: float = 0.1
    input_dropout: float = 0.0
    layer_norm: bool = False
    norm_eps: float = 1e-5
    norm_bias: bool = True
    dense_bias: bool = True
    init_std: float = 0.02
    out_bias: bool = dataclasses.field(default=True, metadata=SINCE_FORMAT_1)  # ``out_proj``'s bias

    def __post_init__(self):
        object.__setattr__(self, "hidden_dims", tuple(self.hidden_dims))  # a list would make it unhashable
        _check_positive("num_labels", self.num_labels)
        _check_rate("dropout", self.dropout)
        _check_rate("input_dropout", self.input_dropout)
        for d in self.hidden_dims:
            if d is not None:
                _check_positive("hidden_dims entry", d)
        get_activation(self.activation)

    def out_features(self):
        return self.num_labels

    def steps(self, in_features):
        s = [f"dropout({self.input_dropout})"] if self.input_dropout else []
        w = in_features
        for d in self.hidden_dims:
            o = d or w
            s.append(f"dense {w}->{o}{'' if self.dense_bias else ' (no bias)'}")
            if self.activation:
                s.append(self.activation)
            if self.layer_norm:
                s.append(f"LayerNorm(eps={self.norm_eps}{'' if self.norm_bias else ', no bias'})")
            if self.dropout:
                s.append(f"dropout({self.dropout})")
            w = o
        return s + [f"dense {w}->{self.num_labels}{'' if self.out_bias else ' (no bias)'}"]


@register("projection")
@config_class
class ProjectionHead(Head):
    """dense ``dense_i`` -> act for each width in ``features``, then optional L2 normalisation.

    Maps embeddings to another width (distillation, CLIP-style alignment); the layers are
    sentence-transformers ``Dense`` modules and ``normalize`` its ``Normalize``."""

    features: int | tuple[int, ...] = 256
    activation: str | None = None
    use_bias: bool = True
    normalize: bool = False
    dropout: float = 0.0
    init_std: float = 0.02

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.features,) if isinstance(self.features, int) else tuple(self.features)

    def __post_init__(self):
        if isinstance(self.features, list):
            object.__setattr__(self, "features", tuple(self.features))  # a list would make it unhashable
        if not self.widths:
            raise ConfigError("ProjectionHead needs at least one output width in `features`")
        for d in self.widths:
            _check_positive("projection width", d)
        _check_rate("dropout", self.dropout)
        get_activation(self.activation)

    def out_features(self):
        return self.widths[-1]

    def steps(self, in_features):
        s = [f"dropout({self.dropout})"] if self.dropout else []
        w = in_features
        for d in self.widths:
            s.append(f"dense {w}->{d}{'' if self.use_bias else ' (no bias)'}")
            if self.activation:
                s.append(self.activation)
            w = d
        return s + (["L2 normalise"] if self.normalize else [])


@register("identity")
@config_class
class IdentityHead(Head):
    """No head: the pooled vector itself (plain sentence embeddings), optionally L2-normalised
    (sentence-transformers ``Pooling`` -> ``Normalize`` with no ``Dense`` in between)."""

    width: int = 0
    normalize: bool = False

    def out_features(self):
        return self.width

    def steps(self, in_features):
        return ["L2 normalise"] if self.normalize else ["identity"]


@register("sequence_head")
@config_class
class SequenceHead:
    """Everything after the encoder's last hidden state: ``pooler`` then ``head`` (two configs).

    Its modules cast the hidden states to float32 first, so a bfloat16 backbone still gives
    float32 logits. Params: ``{"pooler": ..., "head": ...}`` (``pooler`` absent when it has none)."""

    pooler: Pooler
    head: Head

    def __post_init__(self):
        if not isinstance(self.pooler, Pooler):
            raise ConfigError(
                f"SequenceHead's pooler must be a pooler config (fh.make_pooler(...)), got {self.pooler!r}"
            )
        if not isinstance(self.head, Head):
            raise ConfigError(f"SequenceHead's head must be a head config (fh.make_head(...)), got {self.head!r}")


HEAD_NAMES = {
    "linear": LinearHead,
    "mlp": MLPHead,
    "projection": ProjectionHead,
    "identity": IdentityHead,
    "token_logits": TokenLogits,
}


def make_head(spec: str | Head, **options) -> Head:
    """A head config from a name (``linear``, ``mlp``, ``projection``, ``identity``, ``token_logits``) and options,
    or an already-made head config."""
    if isinstance(spec, Head):
        if options:
            raise ConfigError(f"head options {sorted(options)} given with an already-made head {spec!r}")
        return spec
    if spec not in HEAD_NAMES:
        raise ConfigError(
            f"unknown head {spec!r}; valid heads: {sorted(HEAD_NAMES)} "
            "(the HF heads are presets: see flaxheads.heads.presets.PRESETS)"
        )
    try:
        return HEAD_NAMES[spec](**options)
    except TypeError as e:
        raise ConfigError(f"head {spec!r} does not take options {sorted(options)}: {e}") from None
