"""Every HF-exact preset gives PyTorch transformers' logits on the same weights."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from hf_tiny import padded_batch, tiny_torch_model  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.weights import head_from_hf  # noqa: E402
from flaxheads.heads import linen
from flaxheads.heads.presets import preset_for  # noqa: E402

pytestmark = pytest.mark.legacy

TRANSFORMERS_4 = int(pytest.importorskip("transformers").__version__.split(".")[0]) < 5
FLAX_ARCHS = ["bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "gpt2", "bart"]


@pytest.mark.parametrize("arch", FLAX_ARCHS)
def test_full_model_logits_match_pytorch(arch, tmp_path):
    pt = tiny_torch_model(arch)
    pt.save_pretrained(tmp_path, safe_serialization=True)
    model = fh.from_pretrained(tmp_path)
    assert model.arch == arch
    assert model.report.new == [], f"every head weight should come from the checkpoint: {model.report}"
    sides = ["right", "left"] if arch == "gpt2" else ["right"]
    for side in sides:
        ids, mask = padded_batch(arch, pt.config, side)
        with torch.no_grad():
            ref = pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
        assert np.abs(ref).max() > 1e-2  # the comparison is not between two near-zero outputs


def _run_torch_head(pt, arch, hidden, mask):
    """Run the real HF forward with the encoder replaced by given hidden states."""
    body = {"xlnet": "transformer", "deberta-v2": "deberta", "modernbert": "model"}[arch]
    enc = getattr(pt, body)
    from transformers.modeling_outputs import BaseModelOutput

    out = BaseModelOutput(last_hidden_state=torch.tensor(hidden))
    out.mems = None  # XLNet reads it
    enc.forward = lambda *a, **k: out
    ids = torch.ones(mask.shape, dtype=torch.long) * 5
    with torch.no_grad():
        return pt(input_ids=ids, attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.mark.parametrize(
    "arch,over",
    [
        ("xlnet", {}),
        # no activation: None where the config allows it (transformers 4), "linear" where it must be a str (5)
        ("xlnet", {"summary_type": "mean", "summary_activation": None if TRANSFORMERS_4 else "linear"}),
        ("xlnet", {"summary_type": "first", "summary_use_proj": False}),
        ("xlnet", {"summary_type": "cls_index", "summary_first_dropout": 0.1}),
        ("deberta-v2", {}),
        ("deberta-v2", {"pooler_hidden_act": "tanh"}),
        ("modernbert", {"classifier_pooling": "cls"}),
        ("modernbert", {"classifier_pooling": "mean", "classifier_bias": True, "norm_bias": True}),
    ],
)
def test_head_on_hidden_states_matches_pytorch(arch, over):
    pt = tiny_torch_model(arch, **over)
    preset = preset_for(pt.config, pt.config.num_labels)
    head = fh.SequenceHead(preset.pooler, preset.head)
    rng = np.random.default_rng(1)
    hidden = rng.normal(size=(3, 7, pt.config.hidden_size)).astype(np.float32)
    mask = np.array([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    import jax

    init = linen.module(head).init(jax.random.PRNGKey(0), jnp.asarray(hidden), jnp.asarray(mask))["params"]
    state = {k: v.numpy() for k, v in pt.state_dict().items()}
    params, loaded, new = head_from_hf(init, preset.hf_names, state)
    assert new == [] and len(loaded) == len([p for p, _ in preset.hf_names if _has(init, p)])
    got = np.asarray(linen.module(head).apply({"params": params}, jnp.asarray(hidden), jnp.asarray(mask)))
    ref = _run_torch_head(pt, arch, hidden, mask)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def _has(tree, path):
    for p in path.split("/"):
        if p not in tree:
            return False
        tree = tree[p]
    return True


def test_gpt2_without_pad_token_is_a_clear_error(tmp_path):
    pt = tiny_torch_model("gpt2", pad_token_id=None)
    pt.save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="pad_token_id"):
        fh.from_pretrained(tmp_path)
    model = fh.from_pretrained(tmp_path, pool_mask="attention_mask")
    assert model.pool_mask == "attention_mask"
    # GPT-2's head weights still load, but pooled by the attention mask it is not GPT2ForSequenceClassification
    assert (
        model.arch is None and model.hf_names == () and [p for p, _ in model.report.pretrained] == ["head/classifier"]
    )
    # so it exports with flaxheads' own PyTorch code instead of GPT-2's class
    fh.interop.export_transformers(model, tmp_path / "out")
    assert (tmp_path / "out" / "modeling_flaxheads.py").is_file()


def test_mismatched_num_labels_needs_opt_in(tmp_path):
    tiny_torch_model("bert", num_labels=3).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="ignore_mismatched_sizes"):
        fh.from_pretrained(tmp_path, num_labels=4)
    model = fh.from_pretrained(tmp_path, num_labels=4, ignore_mismatched_sizes=True)
    assert model.report.new == ["head/classifier"]
    assert [p for p, _ in model.report.pretrained] == ["pooler/dense"]
