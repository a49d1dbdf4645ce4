"""Any pooler x any head on a native backbone exports as a transformers folder with flaxheads' own
PyTorch code: ``AutoModelForSequenceClassification.from_pretrained(dir, trust_remote_code=True)``
loads it with no missing or unexpected keys and gives flaxheads' logits on padded batches (PyTorch's
own backbone classes do the encoding); flaxheads reads the folder back from config + weights alone.

Parametrised to cover every pooler (on BERT), every head (on RoBERTa) and one combination per
family (BERT, RoBERTa, DeBERTa-v3, ModernBERT, a left-padded decoder)."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
from hf_tiny import padded_batch, tiny_torch_model  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.interop.files import ExportError  # noqa: E402
from flaxheads.interop.remote_code import CODE_FILE  # noqa: E402

# on the legacy stack (transformers 4.57) too: all but the pooler and head sweeps (they exercise the
# exported PyTorch code, the same file on both stacks)

#: every pooler flaxheads names (parametric ones with non-default options), concatenations included
POOLERS = {
    "cls": ("cls", {}),
    "first_non_pad": ("first_non_pad", {}),
    "last": ("last", {}),
    "mean": ("mean", {}),
    "max": ("max", {}),
    "mean_sqrt_len": ("mean_sqrt_len", {}),
    "weighted_mean": ("weighted_mean", {}),
    "attention": ("attention", {}),
    "dense": ("dense", {"features": 24, "activation": "gelu", "source": "mean"}),
    "deberta": ("deberta", {}),
    "sequence_summary": ("sequence_summary", {"summary_type": "first", "activation": "tanh"}),
    "concat": (["cls", "attention", "max", "weighted_mean"], {}),
}
#: every head kind, the MLP with and without LayerNorm
HEADS = {
    "linear": ("linear", {"dropout": 0.2}),
    "linear_no_bias": ("linear", {"use_bias": False}),
    "mlp": ("mlp", {"hidden_dims": (16, 8), "activation": "relu"}),
    "mlp_layer_norm": (
        "mlp",
        {"hidden_dims": (None,), "layer_norm": True, "norm_bias": False, "dense_bias": False, "activation": "gelu_new"},
    ),
    "projection": ("projection", {"features": (12, 6), "activation": "silu", "normalize": True}),
    "identity": ("identity", {"normalize": True}),
}
#: one custom combination per family; decoders pool real tokens only (under left padding position 0 is
#: a pad token, whose hidden state no two implementations need agree on)
FAMILIES = {
    "bert": ("right", ["mean", "attention"], "mlp", {"hidden_dims": (16,), "layer_norm": True}),
    "roberta": ("right", "max", "linear", {}),
    "deberta-v2": ("right", "weighted_mean", "mlp", {"hidden_dims": (8,)}),
    "modernbert": ("right", ["first_non_pad", "mean"], "linear", {}),
    "qwen3": ("left", ["last", "attention"], "mlp", {"hidden_dims": (16,), "layer_norm": True}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{arch: (folder, PyTorch config)}`` of tiny random classifiers, made once."""
    made = {}

    def get(arch):
        if arch not in made:
            d = tmp_path_factory.mktemp(arch.replace("-", "_"))
            over = {"pooler_hidden_act": "gelu"} if arch == "deberta-v2" else {}
            pt = tiny_torch_model(arch, num_labels=3, seed=2, **over)
            pt.save_pretrained(d, safe_serialization=True)
            made[arch] = (str(d), pt.config)
        return made[arch]

    return get


def _perturbed(model, seed=0):
    """The model with every head weight moved: a trained head, not the fresh one (zero query, zero biases)."""
    rng = np.random.default_rng(seed)
    model.params = {
        **model.params,
        "head": jax.tree.map(
            lambda x: np.asarray(x) + rng.normal(0, 0.2, np.shape(x)).astype(np.float32), model.params["head"]
        ),
    }
    return model


def _torch_logits(folder, ids, mask):
    pt, info = AutoModelForSequenceClassification.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return pt.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def _check(folders, tmp_path, arch, side, pooler, head, pooler_options=None, head_options=None):
    src, cfg = folders(arch)
    model = _perturbed(
        fh.from_pretrained(
            src,
            pooler=pooler,
            head=head,
            pooler_options=pooler_options or None,
            head_options=head_options or None,
            num_labels=3,
            ignore_mismatched_sizes=True,
        )
    )
    out = tmp_path / "out"
    fh.interop.export_transformers(model, out)
    ids, mask = padded_batch(arch, cfg, side)
    ours = np.asarray(model.apply(model.params, ids, mask))
    got = _torch_logits(out, ids, mask)
    assert got.shape == ours.shape and np.abs(ours).max() > 1e-2
    np.testing.assert_allclose(got, ours, atol=1e-5, rtol=0)
    back = fh.interop.load_transformers(out)
    assert back.head == model.head and back.pool_mask == model.pool_mask
    np.testing.assert_array_equal(np.asarray(back.apply(back.params, ids, mask)), ours)
    return out, model


@pytest.mark.parametrize("name", sorted(POOLERS))
def test_every_pooler(folders, tmp_path, name):
    pooler, options = POOLERS[name]
    _check(folders, tmp_path, "bert", "right", pooler, "linear", pooler_options=options)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head(folders, tmp_path, name):
    head, options = HEADS[name]
    _check(folders, tmp_path, "roberta", "right", "mean", head, head_options=options)


@pytest.mark.legacy
@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_one_combination_per_family(folders, tmp_path, arch):
    side, pooler, head, options = FAMILIES[arch]
    _check(folders, tmp_path, arch, side, pooler, head, head_options=options)


@pytest.mark.legacy
def test_folder_contents_and_import_without_its_code(folders, tmp_path):
    """config.json names the code and the labels; PyTorch trains the folder with transformers' loss;
    flaxheads reads it back with the Python file gone (it never runs it); the multi-label threshold
    is recorded."""
    src, cfg = folders("bert")
    model = _perturbed(
        fh.from_pretrained(src, pooler="max", head="mlp", id2label=["a", "b", "c"], problem_type=fh.losses.MULTI_LABEL)
    )
    fh.interop.export_transformers(model, tmp_path / "out", threshold=0.3)
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    model_class = raw["auto_map"]["AutoModelForSequenceClassification"]
    assert model_class == "modeling_flaxheads.FlaxheadsForSequenceClassification"
    assert raw["id2label"] == {"0": "a", "1": "b", "2": "c"} and raw["label2id"] == {"a": 0, "b": 1, "c": 2}
    assert raw["problem_type"] == "multi_label_classification" and raw["threshold"] == 0.3
    assert raw["backbone_hf_config"]["model_type"] == "bert"
    pt = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert pt.config.id2label == {0: "a", 1: "b", 2: "c"} and pt.config.threshold == 0.3
    # it trains in PyTorch: transformers' multi-label loss (BCE with logits), gradients down to the embeddings
    ids, mask = padded_batch("bert", cfg)
    labels = np.array([[1, 0, 1], [0, 0, 1], [1, 1, 0]], np.float32)
    out = pt.train()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    z = out.logits.detach().numpy()
    bce = np.mean(np.maximum(z, 0) - z * labels + np.log1p(np.exp(-np.abs(z))))
    assert float(out.loss) == pytest.approx(bce, rel=1e-5)
    out.loss.backward()
    assert pt.backbone.embeddings.word_embeddings.weight.grad.abs().sum() > 0

    os.remove(tmp_path / "out" / CODE_FILE)
    back = fh.interop.load_transformers(tmp_path / "out")
    np.testing.assert_array_equal(
        np.asarray(back.apply(back.params, ids, mask)), np.asarray(model.apply(model.params, ids, mask))
    )
    assert back.id2label == {0: "a", 1: "b", 2: "c"} and back.problem_type == fh.losses.MULTI_LABEL


@pytest.mark.legacy
def test_lora_model_exports_merged(folders, tmp_path):
    src, cfg = folders("bert")
    model = fh.from_pretrained(src, pooler="mean", head="linear").with_lora(rank=2)
    model.params = {**model.params, "lora": jax.tree.map(lambda x: np.asarray(x) + 0.1, model.params["lora"])}
    fh.interop.export_transformers(model, tmp_path / "out")
    ids, mask = padded_batch("bert", cfg)
    np.testing.assert_allclose(
        _torch_logits(tmp_path / "out", ids, mask), np.asarray(model.apply(model.params, ids, mask)), atol=1e-5, rtol=0
    )


@pytest.mark.legacy
def test_broken_folders_say_what_is_wrong(folders, tmp_path):
    src, _ = folders("bert")
    fh.interop.export_transformers(
        _perturbed(fh.from_pretrained(src, pooler="attention", head="linear")), tmp_path / "out"
    )
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    raw["sequence_head"]["head"]["num_labels"] = 5
    (tmp_path / "out" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(fh.FlaxheadsError, match="mismatched shapes"):
        fh.interop.load_transformers(tmp_path / "out")


@pytest.mark.legacy
def test_head_only_source_cannot_be_a_transformers_folder(folders, tmp_path):
    src, _ = folders("bert")
    model = fh.from_pretrained(src, pooler="attention", head="linear")
    model.backbone = None
    with pytest.raises(ExportError, match="only a head"):
        fh.interop.export_transformers(model, tmp_path / "out")


@pytest.mark.skipif(
    not __import__("flaxheads.backbones.hf_flax", fromlist=["available"]).available(),
    reason="HF Flax models need transformers < 5",
)
@pytest.mark.legacy
def test_backbone_without_native_family_is_refused(tmp_path):
    """A backbone on HF's Flax code: no transformers folder (nothing checks it against PyTorch's AutoModel)."""
    tiny_torch_model("bert").save_pretrained(tmp_path / "src", safe_serialization=True)
    model = fh.from_pretrained(
        tmp_path / "src",
        pooler="mean",
        head="linear",
        num_labels=3,
        implementation="hf_flax",
        ignore_mismatched_sizes=True,
    )
    with pytest.raises(ExportError, match="no native flaxheads family"):
        fh.interop.export_transformers(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
