"""EuroBERT, the ModernBERT decoder (Ettin decoders), EmbeddingGemma (Gemma 3 with
``use_bidirectional_attention``) and the ModernBERT variant configs (mmBERT, Ettin encoders,
ModernBERT-large) against PyTorch transformers on the same tiny random weights: one harness.

Every case is a tiny ``AutoModelForSequenceClassification`` saved as safetensors (one layer where
the family has no layer pattern; two or more where sliding and full layers alternate, with windows
that cut the 9-token batch). The ModernBERT variants are written as their hub folders are (4.x keys:
``global_attn_every_n_layers``, ``global_rope_theta`` / ``local_rope_theta``, no ``layer_types`` /
``rope_parameters``) and PyTorch reads them back from the folder, as a user's would:

* mmBERT: one RoPE base (160k) for both kinds, Gemma 2's token ids (pad 0, cls 2, sep 1), mean pooling;
* Ettin encoder: one RoPE base (160k) for both kinds, 2 heads of 16, ``cls`` pooling;
* ModernBERT-large: bases 160k / 10k, the 2.5625x MLP width (2624 / 1024), 4 layers (global, local,
  local, global), mean pooling.

transformers 4.57 has no EuroBERT: its cases skip there, saying so. It rotates the ModernBERT
decoder's sliding layers with the global RoPE base (5.x with their own); the tiny decoder keeps 4.57's
defaults there (one base for both), so both stacks check it. Gemma 3 configs written by 4.57 store the
converted window (``sliding_window // 2 + 1``): PyTorch is read back from the folder on both stacks.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from hf_tiny import (  # noqa: E402
    check_bf16_and_remat,
    check_dropout_spread,
    check_export,
    check_gradients,
    check_hidden_states,
    check_lora_matches_peft,
    edited_copy,
    padded_batch,
    save_tiny,
)

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families.decoder import DecoderBackbone  # noqa: E402
from flaxheads.backbones.families.eurobert import EuroBertBackbone  # noqa: E402
from flaxheads.backbones.families.modernbert import ModernBertBackbone  # noqa: E402
from flaxheads.backbones.families.modernbert_decoder import ModernBertDecoderBackbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402
from flaxheads.config import to_dict  # noqa: E402
from flaxheads.errors import ConfigError  # noqa: E402
from flaxheads.heads import linen  # noqa: E402
from flaxheads.nnx.layers import SequenceHead as NNXSequenceHead  # noqa: E402

SL, FU = "sliding_attention", "full_attention"
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str  # model_type
    backbone: type
    over: tuple = ()  # tiny_config overrides
    hub: tuple = ()  # config.json as the hub folder writes it: these keys set, layer_types / rope_parameters dropped


CASES = {
    "eurobert": Case("eurobert", EuroBertBackbone),
    "modernbert-decoder": Case("modernbert-decoder", ModernBertDecoderBackbone),
    # EmbeddingGemma: a sliding layer (|i - j| <= 2) then a full one, both without the causal mask
    "embeddinggemma": Case(
        "gemma3_text",
        DecoderBackbone,
        (("use_bidirectional_attention", True), ("sliding_window", 4), ("layer_types", (SL, FU))),
    ),
    "mmbert": Case(
        "modernbert",
        ModernBertBackbone,
        (("layers", 3), ("pad_token_id", 0)),
        (
            ("global_attn_every_n_layers", 3),
            ("local_attention", 8),
            ("global_rope_theta", 160000.0),
            ("local_rope_theta", 160000.0),
            ("classifier_pooling", "mean"),
            ("bos_token_id", 2),
            ("cls_token_id", 2),
            ("eos_token_id", 1),
            ("sep_token_id", 1),
            ("mask_token_id", 4),
        ),
    ),
    "ettin-encoder": Case(
        "modernbert",
        ModernBertBackbone,
        (("layers", 3), ("num_attention_heads", 2), ("intermediate_size", 48)),
        (
            ("global_attn_every_n_layers", 3),
            ("local_attention", 8),
            ("global_rope_theta", 160000.0),
            ("local_rope_theta", 160000.0),
            ("classifier_pooling", "cls"),
        ),
    ),
    "modernbert-large": Case(
        "modernbert",
        ModernBertBackbone,
        (("layers", 4), ("num_attention_heads", 2), ("intermediate_size", 82)),
        (
            ("global_attn_every_n_layers", 3),
            ("local_attention", 8),
            ("global_rope_theta", 160000.0),
            ("local_rope_theta", 10000.0),
            ("classifier_pooling", "mean"),
        ),
    ),
}
#: the new families (the variants are ModernBERT's computation, whose gradients, export and LoRA
#: test_backbone_modernbert.py covers)
FAMILIES = ("eurobert", "modernbert-decoder", "embeddinggemma")


def _skip_without(case: Case) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as names

    if case.arch not in names:
        pytest.skip(
            f"transformers {transformers.__version__} has no {case.arch} sequence classifier (the family "
            "is missing there)"
        )


def _hub_form(path: str, hub: dict) -> None:
    """Rewrite ``path``'s config.json as a 4.x hub folder holds it."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for k in ("layer_types", "rope_parameters", "sliding_window"):
        cfg.pop(k, None)
    cfg.update(hub)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(name)`` -> ``(folder, PyTorch classifier read back from the folder)``, made once per module."""
    made = {}

    def get(name):
        case = CASES[name]
        _skip_without(case)
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            path, _ = save_tiny(folder, case.arch, **{k: list(v) if isinstance(v, tuple) else v for k, v in case.over})
            if case.hub:
                _hub_form(path, dict(case.hub))
            pt = transformers.AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager")
            made[name] = (path, pt.eval())
        return made[name]

    return get


def _torch_logits(pt, ids, mask):
    with torch.no_grad():
        return pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", list(CASES))
def test_hidden_states_and_logits_match_pytorch(tiny, name, side):
    """The base model's last hidden state on the real tokens and the HF preset's logits, within 1e-4."""
    path, pt = tiny(name)
    case = CASES[name]
    bb = check_hidden_states(path, pt, case.arch, side=side)
    assert isinstance(bb, case.backbone)
    model = fh.from_pretrained(path)
    assert isinstance(model.backbone, case.backbone) and model.arch == case.arch and model.report.new == []
    ids, mask = padded_batch(case.arch, pt.config, side)
    ref = _torch_logits(pt, ids, mask)
    np.testing.assert_allclose(np.asarray(jax.jit(model.apply)(model.params, ids, mask)), ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 1e-2


@pytest.mark.parametrize("name", [*FAMILIES, "mmbert"])
def test_every_loading_path_reads_the_folder(tiny, name):
    """``fh.load`` (a transformers classifier), the shapes-only model (memory plans, mesh layouts) and the read
    onto a mesh take each new family's folder (mmBERT's in its hub form) as from_pretrained does."""
    from flaxheads.model.abstract import abstract_model

    path, pt = tiny(name)
    ids, mask = padded_batch(CASES[name].arch, pt.config, "left")
    want = _torch_logits(pt, ids, mask)
    loaded = fh.load(path)
    assert isinstance(loaded.backbone, CASES[name].backbone)
    np.testing.assert_allclose(np.asarray(jax.jit(loaded.apply)(loaded.params, ids, mask)), want, atol=1e-4, rtol=0)
    assert jax.tree.map(np.shape, abstract_model(path).params) == jax.tree.map(np.shape, loaded.params)
    on_mesh = fh.from_pretrained(path, mesh="fsdp=1")
    assert on_mesh.report.new == []
    np.testing.assert_allclose(np.asarray(jax.jit(on_mesh.apply)(on_mesh.params, ids, mask)), want, atol=1e-4, rtol=0)


def test_the_variants_and_new_families_read_their_switches(tiny):
    """What the parity above runs on: no causal mask, the windows, the RoPE bases, the pooling."""
    gemma = load_backbone(tiny("embeddinggemma")[0])
    assert not gemma.spec.causal and gemma.spec.windows == (2, None)
    euro = load_backbone(tiny("eurobert")[0])
    assert not euro.spec.causal and euro.spec.windows == (None,) and euro.spec.num_kv_heads == 2
    dec = load_backbone(tiny("modernbert-decoder")[0])
    assert dec.settings.kinds == (FU, SL) and dec.settings.window == 2
    assert dict(load_backbone(tiny("mmbert")[0]).settings.thetas) == {FU: 160000.0, SL: 160000.0}
    large = load_backbone(tiny("modernbert-large")[0])
    assert large.settings.kinds == (FU, SL, SL, FU) and dict(large.settings.thetas) == {FU: 160000.0, SL: 10000.0}
    assert fh.from_pretrained(tiny("ettin-encoder")[0]).head.pooler == fh.Pool("cls")


@pytest.mark.parametrize("pooling", ["bos", "mean"])
def test_eurobert_pooling_options_logits_match_pytorch(tiny, tmp_path, pooling):
    """``classifier_pooling`` bos / mean pool before the dense layer (late, the default, is above)."""
    path, pt = tiny("eurobert")
    path = edited_copy(path, tmp_path / pooling, classifier_pooling=pooling)
    pt = transformers.AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager").eval()
    model = fh.from_pretrained(path)
    assert model.arch == "eurobert" and model.head.pooler.source == ("cls" if pooling == "bos" else "mean")
    for side in ("right", "left"):
        ids, mask = padded_batch("eurobert", pt.config, side)
        np.testing.assert_allclose(
            np.asarray(jax.jit(model.apply)(model.params, ids, mask)), _torch_logits(pt, ids, mask), atol=1e-4, rtol=0
        )
    with pytest.raises(ConfigError, match="classifier_pooling"):
        fh.from_pretrained(edited_copy(path, tmp_path / "bad", classifier_pooling="max"))


@pytest.mark.parametrize("name", FAMILIES)
def test_gradients_match_torch_autograd(tiny, name):
    check_gradients(*tiny(name), CASES[name].arch, softmax_cancelled=lambda k: False)


@pytest.mark.parametrize("name", FAMILIES)
def test_export_of_changed_weights_loads_in_pytorch(tiny, tmp_path, name):
    """Every weight changed, exported as the family's ``XForSequenceClassification``, loaded by PyTorch
    with no missing or unexpected keys: flaxheads' logits of the changed weights."""
    check_export(*tiny(name), CASES[name].arch, tmp_path / "out")


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_gives_peft_logits(tiny, name):
    pytest.importorskip("peft")
    check_lora_matches_peft(*tiny(name), CASES[name].arch)


def test_modernbert_decoder_bf16_remat_and_dropout(tiny, tmp_path):
    """bfloat16 activations within 0.05 of the float32 logits, remat's gradients equal, and with every
    dropout on (embeddings, attention probabilities and output, MLP) the train-mode spread is PyTorch's."""
    check_bf16_and_remat(*tiny("modernbert-decoder"), "modernbert-decoder")
    over = dict(embedding_dropout=0.1, attention_dropout=0.2, mlp_dropout=0.2)
    check_dropout_spread(*save_tiny(tmp_path / "drop", "modernbert-decoder", **over), "modernbert-decoder")


def test_embeddinggemma_sentence_transformers_folder(tiny, tmp_path):
    """EmbeddingGemma's folder: Transformer (bidirectional Gemma 3) -> mean Pooling -> two Dense layers
    without bias or activation -> Normalize, read as sentence-transformers' own SentenceTransformer runs it."""
    pytest.importorskip("sentence_transformers")
    from hf_tiny import V
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import BertTokenizerFast

    path, pt = tiny("embeddinggemma")
    base = tmp_path / "gemma"
    pt.base_model.save_pretrained(base, safe_serialization=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(V - 5)]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(base)
    torch.manual_seed(0)
    identity = torch.nn.Identity()
    model = SentenceTransformer(
        modules=[
            models.Transformer(str(base)),
            models.Pooling(32, pooling_mode="mean"),
            models.Dense(32, 64, bias=False, activation_function=identity),
            models.Dense(64, 16, bias=False, activation_function=identity),
            models.Normalize(),
        ],
        device="cpu",
    )
    model.save(str(tmp_path / "st"))
    texts = ["w1 w2 w3 w4 w5 w6 w7", "w8 w9", "w10 w11 w12 w13"]
    ref = model.encode(texts, convert_to_numpy=True, batch_size=len(texts))
    ours = fh.load(tmp_path / "st")
    assert isinstance(ours.backbone, DecoderBackbone) and not ours.backbone.spec.causal
    assert ours.head.head == fh.ProjectionHead(features=(64, 16), activation=None, use_bias=False, normalize=True)
    enc = model.tokenizer(texts, padding=True, return_tensors="np")
    got = np.asarray(jax.jit(ours.apply)(ours.params, enc["input_ids"], enc["attention_mask"]))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)


def test_refused_configs_are_clear_errors(tiny, tmp_path):
    path = tiny("modernbert-decoder")[0]
    with pytest.raises(BackboneError, match="local_attention"):
        load_backbone(edited_copy(path, tmp_path / "nowindow", local_attention=None))
    with pytest.raises(BackboneError, match="use_bidirectional_attention"):
        load_backbone(edited_copy(tiny("embeddinggemma")[0], tmp_path / "llama", model_type="llama"))


def test_late_pooler_and_bias_free_mlp_head_in_every_form(tiny, tmp_path):
    """The two head pieces these presets added, off their presets: the ``late`` pooler and an ``MLPHead``
    without an output bias, exported with flaxheads' own PyTorch code, give flaxheads' logits; read back
    from the folder they are the same model; their NNX forms compute what the functional ones do."""
    path, pt = tiny("eurobert")
    head = fh.MLPHead(3, dropout=0.0, layer_norm=True, out_bias=False)
    model = fh.from_pretrained(path, pooler="late", head=head, num_labels=3)
    assert model.arch is None and "bias" not in model.params["head"]["head"]["out_proj"]
    assert "out_bias" not in to_dict(fh.MLPHead(3))  # the JSON of every other head is unchanged
    rng = np.random.default_rng(0)
    model = dataclasses.replace(
        model,
        params={
            **model.params,
            "head": jax.tree.map(
                lambda x: np.asarray(x) + rng.normal(0, 0.2, np.shape(x)).astype(np.float32), model.params["head"]
            ),
        },
    )
    fh.export(model, tmp_path / "out")
    ids, mask = padded_batch("eurobert", pt.config, "left")
    ours = np.asarray(jax.jit(model.apply)(model.params, ids, mask))
    pt_out, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "out", trust_remote_code=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    np.testing.assert_allclose(_torch_logits(pt_out.eval(), ids, mask), ours, atol=1e-5, rtol=0)
    back = fh.load(tmp_path / "out")
    assert back.head == model.head
    hidden = rng.normal(size=(3, 9, 32)).astype(np.float32)
    nnx_head = NNXSequenceHead(model.head, 32, params=model.params["head"])
    functional = linen.module(model.head).apply({"params": model.params["head"]}, hidden, mask)
    np.testing.assert_allclose(np.asarray(nnx_head(hidden, mask)), np.asarray(functional), atol=1e-6, rtol=0)
