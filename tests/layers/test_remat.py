"""Remat policies by name: every policy gives the gradients of no remat (jax's recompute semantics
are the reference) on a tiny BERT and a tiny Qwen3 decoder; each keeps what it says (jax's own
listing of saved residuals: save-named exactly the named attention / feed-forward outputs) and the
compiled backward keeps less with more recomputation (XLA's memory analysis: full <= save-dots <=
none); the names reach a run through ``--remat`` and the spec."""

import contextlib
import io

import numpy as np
import pytest

pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import padded_batch  # noqa: E402
from jax.ad_checkpoint import print_saved_residuals  # noqa: E402

from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402
from flaxheads.errors import ConfigError, UsageError  # noqa: E402
from flaxheads.layers.remat import REMAT_POLICIES, remat_policy  # noqa: E402

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def folders(tiny_model):
    return {arch: tiny_model(arch, seed=3, layers=2) for arch in ("bert", "qwen3")}


def _grad_fn(backbone, ids, mask):
    w = jax.random.normal(jax.random.PRNGKey(0), np.shape(ids) + (backbone.hidden_size,))
    return jax.jit(jax.grad(lambda p: jnp.sum(backbone.encode(p, ids, mask) * w)))


@pytest.mark.parametrize("arch", ["bert", "qwen3"])
def test_every_policy_gives_the_same_gradients(folders, arch):
    path, pt = folders[arch]
    ids, mask = padded_batch(arch, pt.config)
    backbones = [load_backbone(path, remat=policy) for policy in REMAT_POLICIES]
    assert [(b.remat, b.remat_policy) for b in backbones] == [(p != "none", p) for p in REMAT_POLICIES]
    w = jax.random.normal(jax.random.PRNGKey(0), np.shape(ids) + (backbones[0].hidden_size,))
    grads = [jax.grad(lambda p, b=b: jnp.sum(b.encode(p, ids, mask) * w)) for b in backbones]
    every = jax.jit(lambda p: [g(p) for g in grads])  # one program: the policies side by side
    program = str(jax.make_jaxpr(grads[1])(backbones[0].params))
    assert "remat" in program or "checkpoint" in program  # the layers really are checkpointed
    want, *others = (jax.tree.leaves(g) for g in every(backbones[0].params))
    for policy, got in zip(REMAT_POLICIES[1:], others, strict=True):
        for a, b in zip(want, got, strict=True):
            # the programs may sum in other orders: float32 rounding relative to the leaf's scale
            scale = max(1.0, float(np.abs(np.asarray(a)).max()))
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6 * scale, rtol=1e-5, err_msg=policy)


def _saved(backbone, ids, mask) -> list[str]:
    """What jax keeps from the forward for the backward pass (its own residual listing)."""
    w = jnp.ones(np.shape(ids) + (backbone.hidden_size,))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: jnp.sum(backbone.encode(p, ids, mask) * w), backbone.params)
    return out.getvalue().splitlines()


def test_policies_keep_what_they_say(folders):
    path, pt = folders["bert"]
    ids, mask = padded_batch("bert", pt.config)
    saved = {policy: _saved(load_backbone(path, remat=policy), ids, mask) for policy in REMAT_POLICIES}
    named = {
        p: sorted(line.split("named '")[1].split("'")[0] for line in s if "named '" in line) for p, s in saved.items()
    }
    layers = pt.config.num_hidden_layers
    assert named["save-named"] == ["attention_out"] * layers + ["mlp_out"] * layers  # exactly the named outputs
    assert named["full"] == named["save-dots"] == []
    assert len(saved["full"]) < len(saved["save-named"]) < len(saved["none"])
    assert len(saved["full"]) < len(saved["save-dots"]) < len(saved["none"])


def test_compiled_memory_orders_the_policies(folders):
    """XLA's temporaries of the compiled gradient: recomputing more keeps less."""
    path, _ = folders["bert"]
    ids = np.random.default_rng(0).integers(3, 99, (16, 64))
    mask = np.ones_like(ids)
    temp = {}
    for policy in ("none", "save-dots", "full"):
        bb = load_backbone(path, remat=policy)
        analysis = _grad_fn(bb, ids, mask).lower(bb.params).compile().memory_analysis()
        if analysis is None or not getattr(analysis, "temp_size_in_bytes", None):
            pytest.skip("this XLA backend reports no memory analysis of a compiled program")
        temp[policy] = analysis.temp_size_in_bytes
    assert temp["full"] <= temp["save-dots"] <= temp["none"], temp
    assert temp["full"] < temp["none"], temp


def test_names_and_flags(folders):
    from flaxheads.cli.train import build_parser, spec_from_args
    from flaxheads.run.checks import check_spec
    from flaxheads.run.program import build_model
    from flaxheads.run.spec import RunSpec
    from flaxheads.runtime import ComputePlan

    assert (remat_policy(True), remat_policy(False), remat_policy(None)) == ("full", "none", "none")
    with pytest.raises(ConfigError, match="not one of none, full, save-dots, save-named"):
        remat_policy("dots")
    path, _ = folders["bert"]
    with pytest.raises(BackboneError, match="remat 'dots'"):
        load_backbone(path, remat="dots")
    assert not load_backbone(path, remat=False).remat and load_backbone(path, remat=True).remat_policy == "full"
    spec = spec_from_args(build_parser().parse_args(["--model", path, "--remat", "save-dots"]))
    assert spec.model.remat == "save-dots" and RunSpec().model.remat == "none"
    model = build_model(check_spec(spec), path, None, ComputePlan.for_host())
    assert model.backbone.remat_policy == "save-dots"
    with pytest.raises(UsageError, match="--remat 'all'"):
        check_spec(RunSpec.from_kwargs(model=path, remat="all"))
