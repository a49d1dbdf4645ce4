"""flaxheads <-> PyTorch transformers: every HF-exact preset exports to a folder that
``AutoModelForSequenceClassification`` loads with no missing/unexpected keys and the same
logits, imports back with identical params; heads without a Flax backbone export head-only."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import padded_batch, tiny_torch_model  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.registry import family_for  # noqa: E402
from flaxheads.heads import linen  # noqa: E402
from flaxheads.heads.presets import preset_for  # noqa: E402
from flaxheads.interop.head_files import load_head_export  # noqa: E402
from flaxheads.interop.transformers import ExportError  # noqa: E402

pytestmark = pytest.mark.legacy

FLAX_ARCHS = ["bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "gpt2", "bart"]


def _pt_logits(pt, ids, mask):
    with torch.no_grad():
        return pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def _leaves(tree):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("arch", FLAX_ARCHS)
def test_preset_roundtrip_through_pytorch(arch, tmp_path):
    """PyTorch -> flaxheads (same logits) -> PyTorch (loads strictly, same logits) -> flaxheads (same params)."""
    src, out = tmp_path / "src", tmp_path / "out"
    pt = tiny_torch_model(arch, num_labels=3, seed=1)
    pt.save_pretrained(src, safe_serialization=True)
    ids, mask = padded_batch(arch, pt.config)
    ref = _pt_logits(pt, ids, mask)

    model = fh.interop.load_transformers(src)
    assert model.arch == arch
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)

    # a head "fine-tuned in JAX": change every head weight so the export cannot just echo the source file
    params = dict(model.params)
    params["head"] = jax.tree.map(lambda x: x + 0.01 * jnp.sign(x) + 0.003, params["head"])
    model.params = params
    flax_logits = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    fh.interop.export_transformers(model, out)

    with open(out / "config.json") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == [type(pt).__name__]
    assert cfg["num_labels"] == 3 and cfg["problem_type"] == model.problem_type
    assert cfg["id2label"] == {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    key = family_for(arch).classifier_dropout_key
    if key is not None:
        assert cfg[key] == pytest.approx(model.head.head.dropout)
    pt2, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    # lists in transformers 4, sets in 5
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    pt2.eval()
    exported = _pt_logits(pt2, ids, mask)
    np.testing.assert_allclose(exported, flax_logits, atol=1e-4, rtol=0)
    assert np.abs(exported - ref).max() > 1e-3  # the new head weights were exported, not the old ones

    back = fh.interop.load_transformers(out)
    a, b = _leaves(model.params), _leaves(back.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_labels_problem_type_and_dropout_in_config(tmp_path):
    pt = tiny_torch_model("roberta", num_labels=2)
    pt.save_pretrained(tmp_path / "src", safe_serialization=True)
    model = fh.from_pretrained(tmp_path / "src", id2label=["neg", "pos"], problem_type=fh.losses.MULTI_LABEL)
    fh.interop.export_transformers(model, tmp_path / "out")
    pt2 = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert pt2.config.id2label == {0: "neg", 1: "pos"} and pt2.config.label2id == {"neg": 0, "pos": 1}
    assert pt2.config.problem_type == "multi_label_classification"
    assert pt2.classifier.dropout.p == pytest.approx(model.head.head.dropout)


def test_tokenizer_files_are_copied(tmp_path):
    pt = tiny_torch_model("bert")
    pt.save_pretrained(tmp_path / "src", safe_serialization=True)
    (tmp_path / "src" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]))
    model = fh.from_pretrained(tmp_path / "src")
    fh.interop.export_transformers(model, tmp_path / "out")
    assert (tmp_path / "out" / "vocab.txt").read_text() == (tmp_path / "src" / "vocab.txt").read_text()


def test_head_sentence_transformers_cannot_express_points_to_head_export(tmp_path):
    pt = tiny_torch_model("bert")
    pt.save_pretrained(tmp_path / "src", safe_serialization=True)
    model = fh.from_pretrained(
        tmp_path / "src",
        pooler=["mean", "attention"],
        head="mlp",
        head_options={"hidden_dims": (16,), "layer_norm": True},
        num_labels=3,
    )
    with pytest.raises(ExportError, match="format='head'"):
        fh.interop.export_sentence_transformers(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temp folder left behind

    fh.interop.export_head(model, tmp_path / "head")
    head, params, cfg = load_head_export(tmp_path / "head")
    assert head == model.head and cfg["num_labels"] == 3 and cfg["backbone_model_type"] == "bert"
    a, b = _leaves(model.params["head"]), _leaves(params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # PyTorch names and [out, in] layout
    from safetensors.numpy import load_file

    state = load_file(tmp_path / "head" / "head.safetensors")
    k = np.asarray(model.params["head"]["head"]["dense_0"]["kernel"])
    np.testing.assert_array_equal(state["head.dense_0.weight"], k.T)
    assert "pooler.parts_1.query" in state or any(n.endswith(".query") for n in state)


def test_preset_head_export_uses_pytorch_names(tmp_path):
    pt = tiny_torch_model("bert")
    pt.save_pretrained(tmp_path / "src", safe_serialization=True)
    fh.interop.export_head(fh.from_pretrained(tmp_path / "src"), tmp_path / "head")
    from safetensors.numpy import load_file

    state = load_file(tmp_path / "head" / "head.safetensors")
    ref = {k: v.numpy() for k, v in pt.state_dict().items() if k.startswith(("bert.pooler.", "classifier."))}
    assert sorted(state) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(state[k], ref[k], err_msg=k)


def _run_torch_head(pt, arch, hidden, mask):
    """The real HF forward with the encoder replaced by given hidden states."""
    from transformers.modeling_outputs import BaseModelOutput

    body = {"xlnet": "transformer", "deberta-v2": "deberta", "modernbert": "model"}[arch]
    out = BaseModelOutput(last_hidden_state=torch.tensor(hidden))
    out.mems = None  # XLNet reads it
    getattr(pt, body).forward = lambda *a, **k: out
    with torch.no_grad():
        ids = torch.ones(mask.shape, dtype=torch.long) * 5
        return pt(input_ids=ids, attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.mark.parametrize(
    "arch,over", [("xlnet", {}), ("deberta-v2", {}), ("modernbert", {"classifier_pooling": "mean"})]
)
def test_head_only_export_loads_into_pytorch_head(arch, over, tmp_path):
    """No Flax backbone for these: the head export must load into the PyTorch head modules
    (strict on the head's names) and give the same logits on the same hidden states."""
    pt = tiny_torch_model(arch, **over)
    preset = preset_for(pt.config, pt.config.num_labels)
    head = fh.SequenceHead(preset.pooler, preset.head)
    rng = np.random.default_rng(2)
    hidden = rng.normal(size=(3, 7, pt.config.hidden_size)).astype(np.float32)
    mask = np.array([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    params = linen.module(head).init(jax.random.PRNGKey(3), jnp.asarray(hidden), jnp.asarray(mask))["params"]
    params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(4), x.shape), params)
    fh.interop.export_head(
        head,
        tmp_path / "head",
        params=params,
        hf_names=preset.hf_names,
        meta={"arch": arch, "num_labels": pt.config.num_labels},
    )
    from safetensors.torch import load_file

    res = pt.load_state_dict(load_file(tmp_path / "head" / "head.safetensors"), strict=False)
    assert res.unexpected_keys == []
    head_modules = {name for _, name in preset.hf_names}
    assert not [k for k in res.missing_keys if k.rsplit(".", 1)[0] in head_modules]
    got = np.asarray(linen.module(head).apply({"params": params}, jnp.asarray(hidden), jnp.asarray(mask)))
    np.testing.assert_allclose(got, _run_torch_head(pt, arch, hidden, mask), atol=1e-5, rtol=0)


_NO_TORCH = """
import sys
sys.modules["torch"] = None  # as if torch were not installed: import fails, find_spec returns None
import flaxheads as fh
src, out = sys.argv[1], sys.argv[2]
m = fh.from_pretrained(src)
fh.interop.export_transformers(m, out + "/pt")
fh.interop.export_head(m, out + "/head")
fh.interop.export_sentence_transformers(m, out + "/st")
assert not [k for k in sys.modules if k.startswith("torch.")]
"""


@pytest.mark.full  # a fresh process
def test_export_needs_no_torch(tmp_path):
    import subprocess
    import sys

    pt = tiny_torch_model("bert", seed=6)
    pt.save_pretrained(tmp_path / "src", safe_serialization=True)
    (tmp_path / "src" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]))
    r = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(tmp_path / "src"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    pt2, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "pt", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for k, v in pt.state_dict().items():
        if k in pt2.state_dict():
            np.testing.assert_array_equal(pt2.state_dict()[k].numpy(), v.numpy(), err_msg=k)
    assert {"1_Pooling", "2_Dense", "modules.json", "vocab.txt"} <= set(os.listdir(tmp_path / "out" / "st"))
