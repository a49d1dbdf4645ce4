"""flaxheads' native decoder LLMs (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text) against
PyTorch transformers (``<Family>Model`` / ``<Family>ForSequenceClassification`` on the same weights).

Every tiny model has grouped-query attention (4 query, 2 key/value heads); the families with
sliding-window layers get a window of 3 on a 9-token batch, with sliding and full layers mixed
where the family has both. Padding: given no ``position_ids``, transformers numbers positions
``0..T-1`` whatever the attention mask says (a left-padded text starts at ``#pads``); rotary
embeddings only see position differences, so that offset changes nothing but rounding. Both
paddings are compared. The classifier pools the rightmost token that is
not ``pad_token_id`` (transformers 4.57 and 5 alike: ``argmax(arange(T) * (ids != pad))``; releases
before 4.48 took the first pad token - 1, which is wrong under left padding)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import (
    DECODERS,
    check_dropout_spread,
    check_export,  # noqa: E402
    check_gradients,
    check_hidden_states,
    check_train_needs_key,
    edited_copy,
    padded_batch,
    save_tiny,
)

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families.decoder import DecoderBackbone, attend_textbook  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402
from flaxheads.heads.presets import PoolMaskError  # noqa: E402
from flaxheads.layers.attention import attend_chunked  # noqa: E402
from flaxheads.layers.masks import mask_bias  # noqa: E402
from flaxheads.runtime.plan import ComputePlan  # noqa: E402

SLIDING, FULL = "sliding_attention", "full_attention"
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
#: config overrides per family: windows shorter than the 9-token test batch, sliding and full layers mixed
OVERRIDES = {
    "mistral": dict(sliding_window=3),
    "qwen2": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1, layer_types=[FULL, SLIDING]),
    "qwen3": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1, layer_types=[FULL, SLIDING]),
    "gemma2": dict(sliding_window=3),  # layer 0 sliding, layer 1 full (Gemma 2's alternation)
    "gemma3_text": dict(sliding_window=3, layer_types=[SLIDING, FULL]),
}
SLIDING_FAMILIES = tuple(OVERRIDES)


def _supported(arch: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as names

    return arch in names


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """``tiny(arch)`` -> ``(folder, PyTorch model)``."""

    def get(arch):
        if not _supported(arch):
            pytest.skip(f"this transformers has no sequence classifier for {arch}")
        return tiny_model(arch, **OVERRIDES.get(arch, {}))

    return get


def _torch_logits(pt, ids, mask, **inputs):
    with torch.no_grad():
        return pt(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            **{k: torch.tensor(v) for k, v in inputs.items()},
        ).logits.numpy()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", DECODERS)
def test_hidden_states_and_logits_match_pytorch(tiny, arch, side):
    path, pt = tiny(arch)
    check_hidden_states(path, pt, arch, side=side)
    model = fh.from_pretrained(path)
    assert isinstance(model.backbone, DecoderBackbone) and model.arch == arch and model.report.new == []
    assert model.pool_mask == "non_pad_token" and "bias" not in model.params["head"]["head"]["classifier"]
    ids, mask = padded_batch(arch, pt.config, side)
    ref = _torch_logits(pt, ids, mask)
    np.testing.assert_allclose(np.asarray(model.apply(model.params, ids, mask)), ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 1e-2


def test_left_and_right_padding_agree(tiny):
    """No position ids: positions ``0..T-1`` whatever the padding, as PyTorch (checked against it
    above). A left-padded text sits ``#pads`` positions later, but rotary embeddings make attention
    depend only on position differences, so the same 3 tokens come out the same either way."""
    path, pt = tiny("gemma3_text")
    bb = load_backbone(path, implementation="native")
    (l_ids, l_mask), (r_ids, r_mask) = (padded_batch("gemma3_text", pt.config, s) for s in ("left", "right"))
    np.testing.assert_array_equal(r_ids[2, :3], l_ids[2, 6:])
    left, right = np.asarray(bb(l_ids, l_mask)[0])[2, 6:], np.asarray(bb(r_ids, r_mask)[0])[2, :3]
    np.testing.assert_allclose(left, right, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_explicit_position_ids_match_pytorch(tiny, arch):
    """Position ids counted over the real tokens (as generation passes them for left padding)."""
    path, pt = tiny(arch)
    ids, mask = padded_batch(arch, pt.config, "left")
    check_hidden_states(path, pt, arch, side="left", position_ids=np.maximum(np.cumsum(mask, axis=1) - 1, 0))


@pytest.mark.parametrize("arch", SLIDING_FAMILIES)
def test_sliding_window_is_applied(tiny, tmp_path, arch):
    """The parity tests above run with a window of 3 on 9 tokens; the same weights with a window
    wider than the batch give other hidden states, so the window really shapes the result."""
    path, pt = tiny(arch)
    bb = load_backbone(path, implementation="native")
    assert 3 in bb.spec.windows
    if arch != "mistral":
        assert None in bb.spec.windows  # sliding and full layers mixed
    wide = load_backbone(edited_copy(path, tmp_path / "wide", sliding_window=64), implementation="native")
    ids, mask = padded_batch(arch, pt.config)
    assert np.abs(np.asarray(bb(ids, mask)[0]) - np.asarray(wide(ids, mask)[0]))[0, 5:].max() > 1e-3


@pytest.mark.parametrize("arch", DECODERS)
def test_gradients_match_torch_autograd(tiny, arch):
    """Every parameter's gradient, by PyTorch name (Qwen2's key bias is rotated with the key, so
    softmax does not cancel it: a real gradient)."""
    check_gradients(*tiny(arch), arch, softmax_cancelled=lambda k: False)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text"])
def test_export_of_changed_weights_loads_in_pytorch(tiny, tmp_path, arch):
    """Every weight layout (Mistral and Gemma have Llama's module tree): changed, exported, loaded by
    PyTorch with no missing or unexpected keys, same logits of the changed weights."""
    check_export(*tiny(arch), arch, tmp_path / "out")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_bf16_logits_and_remat_gradients(tiny, arch):
    """bfloat16 activations (float32 params) within 0.03 of the float32 logits (measured: llama 0.005,
    gemma3_text 0.009, on logits up to 0.55); remat (a checkpoint per layer) gives the same gradients
    to float32 reassociation: within 1e-5 of each tensor's largest entry (measured < 1e-6; the
    gradients of ``sum(hidden * w)`` reach ~180, so an absolute 1e-5 would be tighter than float32)."""
    path, pt = tiny(arch)
    ids, mask = padded_batch(arch, pt.config)
    f32, bf16 = fh.from_pretrained(path), fh.from_pretrained(path, dtype=jnp.bfloat16)
    assert jax.jit(lambda p: bf16.backbone.encode(p, ids, mask))(bf16.params["backbone"]).dtype == jnp.bfloat16
    logits = [np.asarray(jax.jit(lambda p, m=m: m.apply(p, ids, mask))(m.params)) for m in (f32, bf16)]
    np.testing.assert_allclose(logits[1], logits[0], atol=0.03, rtol=0)
    remat = fh.from_pretrained(path, remat=True).backbone
    w = jax.random.normal(jax.random.PRNGKey(0), ids.shape + (f32.hidden_size,))

    def grads(bb):
        return jax.jit(jax.grad(lambda p: jnp.sum(bb.encode(p, ids, mask) * w)))

    assert "checkpoint" in str(jax.make_jaxpr(grads(remat))(remat.params)) or "remat" in str(
        jax.make_jaxpr(grads(remat))(remat.params)
    )
    plain = jax.tree.leaves(grads(f32.backbone)(f32.backbone.params))
    for a, b in zip(plain, jax.tree.leaves(grads(remat)(remat.params))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * float(np.abs(a).max()), rtol=0)


def test_attention_dropout_matches_pytorch_statistically(tmp_path):
    """``attention_dropout`` (the only dropout these models have) on the attention probabilities:
    the train-mode spread around eval mode is PyTorch's within [0.8, 1.25]."""
    check_dropout_spread(*save_tiny(tmp_path, "llama", attention_dropout=0.3), "llama")


def test_train_needs_a_dropout_key(tiny):
    check_train_needs_key(*tiny("llama"), "llama")


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_textbook_attention_equals_shared_attention(softcap):
    """The grouped-query attention used on sliding / soft-capped layers equals the shared causal
    attention (key/value heads repeated) without them, and a NumPy reference with soft-capping."""
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (2, 6, 4, 8)) * 2
    k, v = (jax.random.normal(kk, (2, 6, 2, 8)) * 2 for kk in ks[1:])
    mask = np.ones((2, 6), np.int32)
    mask[1, :2] = 0
    keep = np.tril(np.ones((6, 6), bool))[None, None] & (mask[:, None, None, :] > 0)
    ours = np.asarray(attend_textbook(q, k, v, jnp.asarray(keep), scaling=0.3, softcap=softcap, rate=0.0, rng=None))
    valid = mask.astype(bool)
    if softcap is None:
        shared = attend_chunked(
            q * 0.3,
            jnp.repeat(k, 2, axis=2),
            jnp.repeat(v, 2, axis=2),
            mask_bias(jnp.asarray(mask), jnp.float32),
            plan=ComputePlan.for_host(),
            causal=True,
        )
        np.testing.assert_allclose(ours[valid], np.asarray(shared)[valid], atol=1e-5)
        return
    kr, vr = np.repeat(np.asarray(k), 2, axis=2), np.repeat(np.asarray(v), 2, axis=2)
    s = np.tanh(np.einsum("bqhd,bkhd->bhqk", np.asarray(q), kr) * 0.3 / softcap) * softcap
    p = np.where(keep, np.exp(s - s.max(-1, keepdims=True)), 0.0)
    ref = np.einsum("bhqk,bkhd->bqhd", p / np.maximum(p.sum(-1, keepdims=True), 1e-30), vr)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 500.0,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 500.0},
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_types_match_pytorch(tmp_path, rope):
    """RoPE scaling (small base, so the scaled frequencies matter within 9 positions); ``dynamic``
    equals ``default`` up to ``max_position_embeddings`` and is refused past it."""
    if TRANSFORMERS_5:
        over = dict(rope_parameters=dict(rope))
    else:  # transformers 4.x reads rope_theta and rope_scaling
        over = dict(rope_theta=rope["rope_theta"], rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    path, pt = save_tiny(tmp_path, "llama", **over)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    assert (saved["rope_parameters"] if TRANSFORMERS_5 else saved["rope_scaling"])["rope_type"] == rope["rope_type"]
    for side in ("right", "left"):
        bb = check_hidden_states(path, pt, "llama", side=side)
    if rope["rope_type"] == "dynamic":
        ids = np.ones((1, 65), np.int64)
        with pytest.raises(BackboneError, match="dynamic RoPE"):
            bb(ids, ids)


def test_gemma3_older_rope_keys_match_pytorch(tiny, tmp_path):
    """A Gemma 3 config.json from before ``rope_parameters`` (``rope_theta``, ``rope_local_base_freq``,
    ``rope_scaling`` for the full-attention layers only): transformers 5 converts it, so do we."""
    path, _ = tiny("gemma3_text")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=900.0, rope_local_base_freq=300.0, rope_scaling={"rope_type": "linear", "factor": 3.0})
    old = tmp_path / "old"
    os.makedirs(old)
    with open(old / "config.json", "w") as f:
        json.dump(cfg, f)
    os.link(os.path.join(path, "model.safetensors"), old / "model.safetensors")
    pt = transformers.AutoModelForSequenceClassification.from_pretrained(old, attn_implementation="eager").eval()
    if TRANSFORMERS_5:
        assert pt.config.rope_parameters[FULL]["rope_theta"] == 900.0
    check_hidden_states(str(old), pt, "gemma3_text", side="left")


def test_params_tree_keeps_pytorch_module_names(tiny):
    """``layers/<i>/self_attn/q_proj/kernel`` [in, out] & co.: adapters and name maps select modules by name."""
    bb = load_backbone(tiny("qwen3")[0], implementation="native")
    attn = bb.params["layers"]["1"]["self_attn"]
    assert sorted(attn) == ["k_norm", "k_proj", "o_proj", "q_norm", "q_proj", "v_proj"]
    assert attn["q_proj"]["kernel"].shape == (32, 32) and attn["k_proj"]["kernel"].shape == (32, 16)
    assert sorted(bb.params["layers"]["0"]["mlp"]) == ["down_proj", "gate_proj", "up_proj"]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_init_params_have_the_checkpoint_shapes(tiny, arch):
    """HF's init: the same tree and shapes as the checkpoint; norms 1 (Gemma: 0, it scales by 1 + w)."""
    bb = load_backbone(tiny(arch)[0], implementation="native")
    fresh = DecoderBackbone.init_params(bb.config, jax.random.PRNGKey(0))
    assert jax.tree.map(np.shape, fresh) == jax.tree.map(np.shape, bb.params)
    assert float(fresh["norm"]["scale"][0]) == (0.0 if arch == "gemma2" else 1.0)
    assert not np.asarray(fresh["embed_tokens"]["embedding"][bb.config.pad_token_id]).any()


def test_missing_pad_token_is_a_clear_error(tiny, tmp_path):
    """PyTorch pools the last position for a batch of one and raises for larger batches when
    ``pad_token_id`` is None; flaxheads asks for it when the model is loaded."""
    path, pt = tiny("llama")
    ids, mask = padded_batch("llama", pt.config)
    pt.config.pad_token_id = None
    try:
        with pytest.raises(ValueError, match="no padding token"):
            _torch_logits(pt, ids, mask)
    finally:
        pt.config.pad_token_id = 0
    with pytest.raises(PoolMaskError, match="pad_token_id"):
        fh.from_pretrained(edited_copy(path, tmp_path / "nopad", pad_token_id=None))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_act": "swoosh"}, "swoosh"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
    ],
)
def test_refused_config_is_a_clear_error(tiny, tmp_path, change, match):
    with pytest.raises(BackboneError, match=match):
        load_backbone(edited_copy(tiny("llama")[0], tmp_path / "bad", **change), implementation="native")
