"""Quantised frozen bases (flaxheads.model.quantize on Qwix): the NF4 code book is QLoRA's (built here from
its published construction, bitsandbytes' ``create_normal_map``, with scipy's normal quantiles), nf4
blocks and int8 channels dequantise to what the published schemes give (numpy), the arrays' device
bytes are the packed codes plus scales, the quantised matmul's backward equals the dequantised
kernel's, and a QLoRA model exports as a PEFT adapter that peft loads on the float base."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxheads as fh
from flaxheads.errors import UsageError
from flaxheads.layers.quantized import dequantize, qmatmul
from flaxheads.model.quantize import BLOCK, device_bytes, quantization_of, quantize_kernel

qwix = pytest.importorskip("qwix")


def normal_map(offset: float = 0.9677083) -> np.ndarray:
    """bitsandbytes' ``create_normal_map(offset, use_extra_value=True)``: the 16 NF4 values."""
    from scipy.stats import norm

    v1 = norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    v3 = -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    v = np.sort(np.concatenate([v1, [0.0], v3]))
    return v / v.max()


def test_nf4_code_book_is_qloras():
    from qwix._src.core.numerics import get_nf4_buckets

    np.testing.assert_allclose(np.asarray(get_nf4_buckets()), normal_map(), atol=2e-7)


def _kernel(shape=(256, 96), seed=0):
    return np.random.RandomState(seed).standard_normal(shape).astype(np.float32) * 0.02


def test_nf4_blocks_dequantise_as_bitsandbytes_scheme():
    w = _kernel()
    q = quantize_kernel(w, "nf4")
    blocks = w.T.reshape(-1, BLOCK)  # PyTorch's [out, in] weight, flattened in blocks of 64 inputs
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    code = normal_map()
    ref = code[np.abs(blocks[..., None] / absmax[..., None] - code).argmin(-1)] * absmax
    got = np.asarray(dequantize(q)).T.reshape(-1, BLOCK)
    assert np.mean(np.abs(got - ref) > 1e-6) < 1e-3  # ties aside, the same code for every value
    np.testing.assert_allclose(got, ref, atol=float(absmax.max()) * 0.2)


def _symmetric(x, levels, axis):
    """Qwix's symmetric absmax scheme: the scale maps absmax to ``qmax + 0.5`` (the top bucket a full
    step wide), values rounded to the nearest level and clipped to the type's range."""
    scale = np.abs(x).max(axis=axis, keepdims=True) / (levels + 0.5)
    return np.clip(np.round(x / scale), -levels - 1, levels) * scale


def _same_levels(got, ref, x, step):
    """The same level for every value, except a value exactly between two (the block's -absmax at
    ``-(qmax + 0.5)``), which may round either way."""
    tie = np.abs(np.abs(x / step) % 1 - 0.5) < 1e-4
    off = np.abs(got - ref) > 1e-7
    assert not (off & ~tie).any() and (np.abs(got - ref) <= step * 1.001).all()


def test_int8_per_channel_and_int4_blocks_against_numpy():
    w = _kernel()
    _same_levels(
        np.asarray(dequantize(quantize_kernel(w, "int8"))), _symmetric(w, 127, 0), w, np.abs(w).max(axis=0) / 127.5
    )
    blocks = w.T.reshape(-1, BLOCK)
    _same_levels(
        np.asarray(dequantize(quantize_kernel(w, "int4"))).T.reshape(-1, BLOCK),
        _symmetric(blocks, 7, 1),
        blocks,
        np.abs(blocks).max(axis=1, keepdims=True) / 7.5,
    )


def test_device_bytes_are_packed_codes_plus_scales():
    w = jnp.asarray(_kernel((1024, 512)))
    f32 = device_bytes(w)
    assert device_bytes(quantize_kernel(w, "int8")) / f32 <= 0.27
    for q in ("int4", "nf4"):
        assert device_bytes(quantize_kernel(w, q)) / f32 <= 0.16


@pytest.mark.parametrize("q", ["int8", "int4", "nf4"])
def test_a_bfloat16_kernel_keeps_its_scales_in_bfloat16(q):
    """A base stored in bfloat16 keeps its block scales in bfloat16: the same codes as the float32
    scheme on the same values, the float32 scales rounded, 4.25 bits a weight for the 4-bit schemes."""
    w = jnp.asarray(_kernel((1024, 512))).astype(jnp.bfloat16)
    ref, got = quantize_kernel(w.astype(jnp.float32), q), quantize_kernel(w, q)
    assert ref.scale.dtype == jnp.float32 and got.scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.qvalue.astype(jnp.int8)), np.asarray(ref.qvalue.astype(jnp.int8)))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(ref.scale.astype(jnp.bfloat16)))
    bits = 8 * device_bytes(got) / w.size
    assert bits == (8 + 16 / 1024 if q == "int8" else 4 + 16 / BLOCK), bits


def test_quantised_matmul_gradient_is_the_dequantised_kernels():
    w, x = _kernel((128, 64)), jnp.asarray(np.random.RandomState(1).standard_normal((5, 128)), jnp.float32)
    q = quantize_kernel(w, "nf4")
    dense = dequantize(q)
    np.testing.assert_allclose(np.asarray(qmatmul(x, q)), np.asarray(x @ dense), rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(qmatmul(x, q))))(x)
    np.testing.assert_allclose(
        np.asarray(g), np.asarray(jax.grad(lambda x: jnp.sum(jnp.sin(x @ dense)))(x)), rtol=1e-5, atol=1e-6
    )


def test_a_family_without_shared_matmuls_is_refused(tiny_bert):
    with pytest.raises(UsageError, match="not available for model_type 'bert'.*bfloat16"):
        fh.from_pretrained(tiny_bert, quantize="nf4")


@pytest.mark.full
def test_qlora_exports_as_peft_on_the_float_base(tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from hf_tiny import padded_batch, save_tiny
    from transformers import AutoModelForSequenceClassification

    base, _ = save_tiny(tmp_path / "base", "qwen3", seed=3, hidden_size=128, intermediate_size=256, head_dim=32)
    model = fh.from_pretrained(base, num_labels=3, ignore_mismatched_sizes=True).with_lora(rank=4)
    rng = np.random.RandomState(0)  # adapters off their init, as after training
    model.params["lora"] = jax.tree.map(
        lambda a: a + 0.05 * rng.standard_normal(a.shape).astype(np.float32), model.params["lora"]
    )
    qlora = model.with_quantized_base("nf4")
    assert quantization_of(qlora.params["backbone"]) == "nf4"
    ids, mask = padded_batch("qwen3", type("C", (), {"vocab_size": 99, "pad_token_id": 0})(), "left")
    exact = np.asarray(model.apply(model.params, ids, mask))
    ours = np.asarray(jax.jit(qlora.apply)(qlora.params, ids, mask))
    err = np.abs(ours - exact).max() / np.abs(exact).max()
    assert 1e-3 < err < 0.5, err  # the base really is quantised (random tiny weights: nf4 error is large)
    fh.interop.export_peft(qlora, tmp_path / "adapter")
    fresh = AutoModelForSequenceClassification.from_pretrained(base, num_labels=3, ignore_mismatched_sizes=True)
    pm = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(theirs, exact, atol=1e-4)  # adapters + head on the float base: LoRA's logits
    merged = fh.lora.merge_model(qlora)  # a merged export dequantises: a plain float32 base with the same logits
    assert quantization_of(merged.params["backbone"]) is None
    np.testing.assert_allclose(np.asarray(merged.apply(merged.params, ids, mask)), ours, atol=1e-4)
