"""flaxheads' native ModernBERT against PyTorch transformers (``ModernBertModel`` /
``ModernBertForSequenceClassification`` on the same weights, ``attn_implementation`` eager and sdpa).

The tiny models have 3 layers (global, local, global) and a local window of 8 (a token sees 4
positions either side), and most batches are 37 tokens long, right-padded to 37 / 25 / 9 real
tokens, so every layer kind runs, the window cuts, and the blocked sliding-window attention
(taken above four half-windows) is what runs. PyTorch's padded positions are free (its
flash-attention path drops them): outputs are compared on the real tokens."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import (
    V,
    assert_grads_match,
    check_bf16_and_remat,
    check_export,
    check_logits,  # noqa: E402
    check_train_needs_key,
    dropout_spread_flax,
    dropout_spread_torch,
    edited_copy,
    last_hidden,
    save_tiny,
    scale_matrices,
    torch_hidden_grads,
)

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families import modernbert as mb
from flaxheads.backbones.families.modernbert import ModernBertBackbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402
from flaxheads.runtime.plan import ComputePlan  # noqa: E402

KINDS = ["full_attention", "sliding_attention", "full_attention"]


def pattern(**extra) -> dict:
    """Config overrides for 3 layers (global, local, global) and a window of 8, in both stacks'
    spelling: transformers 5 reads ``layer_types``, 4.x ``global_attn_every_n_layers``."""
    return {
        "num_hidden_layers": 3,
        "layer_types": list(KINDS),
        "global_attn_every_n_layers": 2,
        "local_attention": 8,
        **extra,
    }


def long_batch(t: int = 37, lengths=(37, 25, 9), seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    return np.where(mask > 0, rng.integers(3, V, size=(len(lengths), t)), 0), mask


def torch_hidden(pt, ids, mask, impl="eager", **inputs):
    pt.config._attn_implementation = impl
    try:
        with torch.no_grad():
            return pt.model(
                torch.tensor(ids), attention_mask=torch.tensor(mask), **{k: torch.tensor(v) for k, v in inputs.items()}
            ).last_hidden_state.numpy()
    finally:
        pt.config._attn_implementation = "eager"


def assert_real_tokens_close(ours, ref, mask, atol=1e-4):
    valid = np.asarray(mask).astype(bool)
    np.testing.assert_allclose(np.asarray(ours)[valid], ref[valid], atol=atol, rtol=0)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("modernbert", **pattern())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hidden_states_match_pytorch_on_long_padded_batches(tiny, impl):
    """Both local-attention arrangements (blocked, dense) give PyTorch's hidden states."""
    path, pt = tiny
    bb = load_backbone(path, implementation="native")
    assert isinstance(bb, ModernBertBackbone) and bb.settings.kinds == tuple(KINDS)
    ids, mask = long_batch()
    ref = torch_hidden(pt, ids, mask, impl)
    for local_impl in ("auto", "dense", "blocked"):
        ours = last_hidden(ModernBertBackbone(bb.config, bb.params, local_impl=local_impl), ids, mask)
        assert_real_tokens_close(ours, ref, mask)


def test_window_and_rope_bases_are_read(tiny, tmp_path):
    """Another window or RoPE base in config.json changes the output by well over the 1e-4 parity
    tolerance (so the parity tests see them; the tiny model's attention is close to uniform, so
    the RoPE base moves it by ~7e-3 only)."""
    path, pt = tiny
    ids, mask = long_batch()
    ref = torch_hidden(pt, ids, mask)
    for change in (
        {"local_attention": 64},
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
            }
        },
    ):
        folder = edited_copy(path, tmp_path / str(len(list(tmp_path.iterdir()))), **change)
        got = np.asarray(load_backbone(folder)(ids, mask)[0])
        assert np.abs(got - ref)[mask.astype(bool)].max() > 2e-3, change


def test_other_rope_bases_and_every_bias_match_pytorch(tmp_path):
    """Own RoPE bases per layer kind, LayerNorm / attention / MLP biases, a 4-token window."""
    thetas = {"full_attention": 1000.0, "sliding_attention": 50.0}
    path, pt = save_tiny(
        tmp_path,
        "modernbert",
        **pattern(
            local_attention=4,
            norm_bias=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={k: {"rope_type": "default", "rope_theta": v} for k, v in thetas.items()},
            global_rope_theta=thetas["full_attention"],
            local_rope_theta=thetas["sliding_attention"],
        ),
    )
    bb = load_backbone(path)
    assert dict(bb.settings.thetas) == thetas and bb.settings.window_half == 2
    assert "bias" in bb.params["layers"]["1"]["attn"]["Wqkv"] and "bias" in bb.params["final_norm"]
    ids, mask = long_batch(t=23, lengths=(23, 17, 5))
    assert_real_tokens_close(last_hidden(bb, ids, mask), torch_hidden(pt, ids, mask), mask)


def test_transformers_4_config_format(tiny, tmp_path):
    """A config.json as transformers 4.x writes it (``global_attn_every_n_layers``,
    ``global_rope_theta`` / ``local_rope_theta``, no ``layer_types`` / ``rope_parameters``)."""
    path, pt = tiny
    import json

    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg.pop("layer_types", None)
    cfg.pop("rope_parameters", None)
    cfg.update(global_attn_every_n_layers=2, global_rope_theta=160000.0, local_rope_theta=10000.0)
    folder = edited_copy(path, tmp_path / "v4")
    with open(f"{folder}/config.json", "w") as f:
        json.dump(cfg, f)
    bb = load_backbone(folder)
    assert bb.settings.kinds == tuple(KINDS) and dict(bb.settings.thetas) == {
        "full_attention": 160000.0,
        "sliding_attention": 10000.0,
    }
    ids, mask = long_batch()
    assert_real_tokens_close(last_hidden(bb, ids, mask), torch_hidden(pt, ids, mask), mask)


def test_position_ids_match_pytorch(tiny):
    path, pt = tiny
    ids, mask = long_batch()
    pos = np.broadcast_to(np.arange(37)[::-1] + 3, ids.shape).copy()
    ours = load_backbone(path)(ids, mask, position_ids=pos)[0]
    assert_real_tokens_close(ours, torch_hidden(pt, ids, mask, position_ids=pos), mask)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classifier_logits_match_pytorch(tiny, tmp_path, pooling):
    """``fh.from_pretrained`` gives ModernBertForSequenceClassification (head dense -> gelu -> norm ->
    classifier over the cls token or the masked mean), on the short and on the long batches."""
    path, pt = tiny
    if pooling == "mean":
        path = edited_copy(path, tmp_path / "mean", classifier_pooling="mean")
        pt.config.classifier_pooling = "mean"
    try:
        check_logits(path, pt, "modernbert", ModernBertBackbone)
        model = fh.from_pretrained(path)
        ids, mask = long_batch()
        with torch.no_grad():
            ref = pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        np.testing.assert_allclose(np.asarray(model.apply(model.params, ids, mask)), ref, atol=1e-4, rtol=0)
    finally:
        pt.config.classifier_pooling = "cls"


def test_gradients_match_torch_autograd(tiny):
    """Every parameter's gradient of sum(hidden * w * mask) on the long batch, by PyTorch name; the pad
    row of the token table gets none (``padding_idx``), as in PyTorch."""
    path, pt = tiny
    bb = load_backbone(path)
    ids, mask = long_batch()
    w = np.random.default_rng(0).normal(size=ids.shape + (bb.hidden_size,)).astype(np.float32)
    _, ref = torch_hidden_grads(pt.model, ids, mask, w)
    g = jax.jit(jax.grad(lambda p: jnp.sum(bb.encode(p, ids, mask) * w * mask[..., None])))(bb.params)
    ours = bb.state_from_params(g)
    assert not ours["embeddings.tok_embeddings.weight"][0].any()
    assert_grads_match(ours, ref)


def _qkv(b=2, t=45, nh=3, d=4, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return [jax.random.normal(k, (b, t, nh, d)) for k in ks]


@pytest.mark.parametrize("half,block", [(4, None), (3, 7), (5, 5), (0, None), (6, 16)])
def test_blocked_sliding_window_equals_dense_and_numpy(half, block):
    """Blocked (query blocks against three key blocks) and dense (masked T x T) sliding-window
    attention: equal values and gradients, and a NumPy band-masked softmax; padded keys hidden.
    (Queries that see no valid key, deep in the padding, are free: left out.)"""
    q, k, v = _qkv()
    valid = np.ones((2, 45), bool)
    valid[1, 30:] = False
    pos = np.arange(45)
    keep = (np.abs(pos[:, None] - pos[None, :]) <= half)[None, None] & valid[:, None, None, :]
    seen = keep.any(-1)[:, 0]  # [B, Tq]: the query sees a valid key

    def run(impl):
        return lambda q, k, v: mb.sliding_window_attention(q, k, v, jnp.asarray(valid), half, impl=impl, block=block)

    # jitted: eagerly each operation compiles on its own (~60 programs a case)
    dense, blocked = jax.jit(run("dense"))(q, k, v), jax.jit(run("blocked"))(q, k, v)
    np.testing.assert_allclose(np.asarray(blocked)[seen], np.asarray(dense)[seen], atol=1e-6, rtol=1e-6)
    w = jax.random.normal(jax.random.PRNGKey(5), q.shape) * seen[..., None, None]
    grads = [
        jax.jit(jax.grad(lambda *a, f=run(i): jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(q, k, v)
        for i in ("dense", "blocked")
    ]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    s = np.einsum("bqhd,bkhd->bhqk", q, k)
    p = np.where(keep, np.exp(s - np.where(keep, s, -np.inf).max(-1, keepdims=True)), 0.0)
    ref = np.einsum("bhqk,bkhd->bqhd", p / np.maximum(p.sum(-1, keepdims=True), 1e-30), v)
    np.testing.assert_allclose(np.asarray(blocked)[seen], ref[seen], atol=1e-5)


def test_blocked_sliding_window_memory_is_linear_in_t():
    """No intermediate of the blocked form (forward and backward) holds T x T scores: the largest
    is ~3 x block per query, against T per query for the dense form."""
    q, k, v = _qkv(b=1, t=512, nh=2, d=4)
    valid = jnp.ones((1, 512), bool)

    def largest(impl):
        f = lambda q, k, v: jnp.sum(mb.sliding_window_attention(q, k, v, valid, 8, impl=impl))
        jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
        sizes = [
            int(np.prod(var.aval.shape))
            for eqn in jaxpr.jaxpr.eqns
            for var in eqn.outvars
            if hasattr(var.aval, "shape")
        ]
        return max(sizes)

    assert largest("dense") >= 2 * 512 * 512
    assert largest("blocked") <= 2 * 512 * 3 * 8 * 2  # scores [.., 8, 24] per block (+ masks)


def test_long_global_attention_in_query_chunks_is_the_same(tiny, monkeypatch):
    """Global attention split into query chunks (what sequences past ~1-2k tokens get) gives the
    unsplit values and gradients; so does the whole model."""
    q, k, v = _qkv(t=33)
    bias = jnp.zeros((2, 1, 1, 33)).at[1, ..., 20:].set(jnp.finfo(jnp.float32).min)
    w = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    plan = ComputePlan.for_host()

    def value_and_grads():
        f = lambda q, k, v: jnp.sum(mb.global_attention(q, k, v, bias, plan=plan) * w)
        return f(q, k, v), jax.grad(f, argnums=(0, 1, 2))(q, k, v)

    whole = value_and_grads()
    path, _ = tiny
    bb = load_backbone(path)
    ids, mask = long_batch()
    before = np.asarray(bb(ids, mask)[0])
    monkeypatch.setattr(mb, "_GLOBAL_CHUNK_BYTES", 2048)  # 5 chunks of the 33 queries here
    chunked = value_and_grads()
    program = str(jax.make_jaxpr(lambda q: mb.global_attention(q, k, v, bias, plan=plan))(q))
    assert "while" in program or "scan" in program
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(bb(ids, mask)[0]), before, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "rates",
    [dict(embedding_dropout=0.1), dict(attention_dropout=0.1), dict(mlp_dropout=0.1)],
    ids=["embeddings", "attention", "mlp"],
)
def test_dropout_matches_pytorch_statistically(rates, tmp_path):
    """Train-mode spread around the eval output over 32 copies of a 16 x 24 batch, one dropout kind
    at a time (``attention_dropout`` acts on the probabilities and after ``Wo``): PyTorch's within 10%."""
    path, pt = save_tiny(tmp_path, "modernbert", edit=lambda m: scale_matrices(m, 4.0), **pattern(**rates))
    bb = load_backbone(path)
    ids, mask = np.random.default_rng(0).integers(3, V, size=(16, 24)), np.ones((16, 24), np.int64)
    ours, ref = dropout_spread_flax(bb, ids, mask), dropout_spread_torch(pt.model, ids, mask)
    assert ref > 1e-4
    assert abs(ours / ref - 1) < 0.1, (ours, ref)


def test_train_needs_a_dropout_key(tiny):
    check_train_needs_key(*tiny, "modernbert")


def test_export_of_changed_weights_loads_in_pytorch(tiny, tmp_path):
    check_export(*tiny, "modernbert", tmp_path / "out")


def test_bf16_logits_and_remat_gradients(tiny):
    check_bf16_and_remat(*tiny, "modernbert", atol=0.05)  # measured: 0.008 off, on logits up to 1.7


def test_init_params_are_hf_init(tiny):
    """Fresh params: every checkpoint weight's shape, truncated normals within ``initializer_cutoff_factor``
    std, the output projections' std divided by sqrt(2 * layers), no ``attn_norm`` in layer 0."""
    path, _ = tiny
    bb = load_backbone(path)
    fresh = ModernBertBackbone.init_params(
        bb.config.replace(hidden_size=64, intermediate_size=96, num_attention_heads=4), jax.random.PRNGKey(0)
    )
    assert "attn_norm" not in fresh["layers"]["0"] and "attn_norm" in fresh["layers"]["1"]
    std = 0.02
    wqkv, wo = (np.asarray(fresh["layers"]["1"]["attn"][n]["kernel"]) for n in ("Wqkv", "Wo"))
    assert np.abs(wqkv).max() <= 2.0 * std + 1e-7 and abs(wqkv.std() / (0.88 * std) - 1) < 0.05
    assert abs(wo.std() / (0.88 * std / np.sqrt(6.0)) - 1) < 0.1  # std of N(0, 1) truncated at 2: ~0.88
    shapes = jax.tree.map(np.shape, ModernBertBackbone.init_params(bb.config, jax.random.PRNGKey(0)))
    assert shapes == jax.tree.map(np.shape, bb.params)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_attention_heads": 5}, "not divisible"),
        ({"num_attention_heads": 32}, "odd"),
        ({"hidden_activation": "swoosh"}, "swoosh"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "linear",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention", "full_attention", "sliding_attention"]}, "global_attn_every_n_layers"),
    ],
)
def test_refused_config_is_a_clear_error(tiny, tmp_path, change, match):
    folder = edited_copy(tiny[0], tmp_path / "bad", **change)
    if "global_attn" in match:  # both spellings of the pattern, disagreeing
        folder = edited_copy(folder, tmp_path / "bad2", global_attn_every_n_layers=2)
    with pytest.raises(BackboneError, match=match):
        load_backbone(folder, implementation="native")
