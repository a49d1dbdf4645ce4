"""Gradients and forward values with oneDNN's dots (the XLA flags chosen on CPUs with AMX: oneDNN's
dots, YNNPACK's reductions, forward attention fused by YNNPACK, LayerNorm's statistics as products)
equal those of XLA's own dots, for every family's shape of layer, in float32 and bfloat16.

XLA:CPU rewrites dots and what follows them (bias, GELU, residual add) into oneDNN calls; a
rewrite that goes wrong shows only in the gradients (jaxlib 0.12 once fused a GELU whose
pre-activation the derivative still read, and the forward stayed exact). Each side runs in its own
process, since XLA reads its flags once; the models are PyTorch's (random, small but above
oneDNN's size threshold of 2^24 flops per product)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from flaxheads.runtime.cpu import CpuInfo
from flaxheads.runtime.xla_flags import ONEDNN_FLAGS
from tests.hf_tiny import save_tiny

#: flaxheads chooses these flags only on CPUs with AMX (``host.xla_flags.cpu_xla_flags``): elsewhere no
#: program of its runs oneDNN's dots, and the check would spend minutes on flags nobody gets
pytestmark = [
    pytest.mark.full,
    pytest.mark.skipif(not CpuInfo.read().amx, reason="oneDNN's dots are chosen only on CPUs with AMX"),
]

#: hidden 128, feed-forward 512, 4 heads: at 8 x 64 tokens every dense product is >= 2^24 flops
SIZES = {
    "bert": dict(hidden_size=128, intermediate_size=512, max_position_embeddings=128),
    "electra": dict(hidden_size=128, intermediate_size=512, max_position_embeddings=128),
    "distilbert": dict(dim=128, hidden_dim=512, max_position_embeddings=128),
    "gpt2": dict(n_embd=128, n_inner=512, n_positions=128),
    "bart": dict(d_model=128, encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=128),
    "deberta-v2": dict(hidden_size=128, intermediate_size=512, max_position_embeddings=128),
    "modernbert": dict(hidden_size=128, intermediate_size=512, max_position_embeddings=128),
    "qwen3": dict(hidden_size=128, intermediate_size=512, head_dim=32, max_position_embeddings=128),
}

_GRADS = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flaxheads.backbones.registry import load_backbone
jobs, out, what = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
grads, calls = {}, 0
for (arch, path), dtype in [(j, d) for j in jobs for d in ("float32", "bfloat16")]:
    bb = load_backbone(path, dtype=jnp.dtype(dtype), implementation="native")
    r = np.random.default_rng(0)
    lengths = r.integers(20, 65, 8)
    lengths[0] = 64
    mask = (np.arange(64)[None] < lengths[:, None]).astype(np.int32)
    ids = np.where(mask > 0, r.integers(3, 99, (8, 64)), bb.config.get("pad_token_id") or 0).astype(np.int32)
    if arch == "bart":
        ids[np.arange(8), lengths - 1] = bb.config["eos_token_id"]
    w = r.normal(size=(8, 64, bb.hidden_size)).astype(np.float32)
    if what == "grad":
        f = jax.jit(jax.grad(lambda p: jnp.sum(bb.encode(p, ids, mask) * w * mask[..., None])))
    else:
        f = jax.jit(lambda p: (bb.encode(p, ids, mask) * mask[..., None]).astype(jnp.float32))
    compiled = f.lower(bb.params).compile()
    calls += sum("__onednn$matmul" in l and "custom-call(" in l for l in compiled.as_text().splitlines())
    for path_, leaf in jax.tree_util.tree_leaves_with_path(compiled(bb.params)):
        grads[f"{arch}/{dtype}" + jax.tree_util.keystr(path_)] = np.asarray(leaf, np.float32)
np.savez(out, **grads)
print(json.dumps({"onednn_calls": calls, "attention": bb.plan.attention}))
"""


def _grads(jobs, out, xla_flags, what="grad"):
    env = {**os.environ, "XLA_FLAGS": xla_flags, "FLAXHEADS_XLA_DEFAULTS": "0", "JAX_PLATFORMS": "cpu"}
    env.pop("FLAXHEADS_ATTENTION", None)
    r = subprocess.run(
        [sys.executable, "-c", _GRADS, json.dumps(jobs), str(out), what],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), np.load(out)


def _onednn_and_xla(tmp_path, what):
    """Each family's ``what`` ("grad" or "forward") under the AMX flags and under XLA's own dots."""
    jobs = [(arch, save_tiny(tmp_path / arch, arch, **over)[0]) for arch, over in SIZES.items()]
    info, onednn = _grads(jobs, tmp_path / "onednn.npz", " ".join(ONEDNN_FLAGS), what)
    if info["onednn_calls"] == 0:
        pytest.skip(
            "this jaxlib's XLA:CPU made no oneDNN matmul calls with these flags (jax 0.10, or a build without oneDNN)"
        )
    plain, xla = _grads(jobs, tmp_path / "xla.npz", "--xla_cpu_experimental_ynn_fusion_type=", what)
    assert sorted(onednn.files) == sorted(xla.files)
    return info, plain, onednn, xla


def _differ(got, want, rel_f32: float, rel_bf16: float) -> list[str]:
    """The arrays of ``want`` that ``got`` misses by more than ``rel`` of their largest magnitude."""
    bad = []
    for name in want.files:
        a, b = got[name], want[name]
        err, scale = float(np.abs(a - b).max()), float(np.abs(b).max())
        if err > (rel_bf16 if "/bfloat16" in name else rel_f32) * scale + 1e-6:
            bad.append(f"{name}: max |diff| {err:.2e}, max |value| {scale:.2e}")
    return bad


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="oneDNN's dots are XLA:CPU's")
def test_gradients_with_onednn_dots_equal_xla_dots(tmp_path):
    _, _, onednn, xla = _onednn_and_xla(tmp_path, "grad")
    # bfloat16: the two dot libraries round products differently (bf16 or float32 outputs)
    bad = _differ(onednn, xla, 1e-3, 0.1)
    assert not bad, f"{len(bad)} of {len(xla.files)} gradients differ under oneDNN's dots:\n" + "\n".join(bad[:20])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="oneDNN's dots are XLA:CPU's")
def test_forward_with_ynn_attention_equals_xla_dots(tmp_path):
    info, plain, fused, xla = _onednn_and_xla(tmp_path, "forward")
    assert info["attention"] == "ynn" and plain["attention"] != "ynn"
    bad = _differ(fused, xla, 1e-4, 0.05)
    assert not bad, f"{len(bad)} of {len(xla.files)} forward outputs differ:\n" + "\n".join(bad)
