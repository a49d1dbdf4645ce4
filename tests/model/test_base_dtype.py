"""A frozen base stored in bfloat16: its params really are bfloat16 (half the bytes), the head,
adapters and optimizer state stay float32 and the optimizer holds nothing of the base; the
forward stays within bfloat16 rounding of the float32 base; a LoRA run on it exports merged
(transformers) and as PEFT adapters that PyTorch loads with flaxheads' logits, and checkpoints
load it back as it was trained; a base that would be fine-tuned in bfloat16 is refused."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import padded_batch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.checkpoint import RunCheckpointer  # noqa: E402
from flaxheads.errors import TrainingError, UsageError  # noqa: E402
from flaxheads.interop.peft import export_peft  # noqa: E402
from flaxheads.model.base_dtype import base_dtype_of, resolve_base_dtype  # noqa: E402
from flaxheads.model.lora import delta, merge_model  # noqa: E402
from flaxheads.training.optim import OptimConfig, make_optimizer  # noqa: E402
from flaxheads.training.steps import create_state, make_train_step  # noqa: E402

pytestmark = pytest.mark.full

BF16 = jnp.bfloat16
TOL = 2e-2  # logits of a model whose weights were rounded to bfloat16 (8-bit mantissa)


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _dtypes(tree) -> set[str]:
    return {jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree)}


@pytest.fixture(scope="module")
def bert(tiny_model):
    return tiny_model("bert")


def _base_moments(opt_state) -> list[str]:
    """Optimizer leaves holding anything of the base (not the scalar step counts of its empty group)."""
    leaves = jax.tree_util.tree_leaves_with_path(opt_state)
    assert any(np.ndim(x) > 0 for _, x in leaves)  # there are moments (of the head / adapters)
    return [jax.tree_util.keystr(p) for p, x in leaves if "'backbone'" in jax.tree_util.keystr(p) and np.ndim(x) > 0]


def _logits(m, ids, mask):
    with torch.no_grad():
        return m.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def _train(model, *, freeze_backbone=False, steps=3, lr=5e-2):
    ids, mask = padded_batch("bert", model.backbone.config)
    tx = make_optimizer(
        OptimConfig(
            learning_rate=lr,
            head_learning_rate=lr,
            warmup_steps=0,
            total_steps=steps,
            schedule="constant",
            freeze_backbone=freeze_backbone,
        )
    )
    state = create_state(model.params, tx, freeze_backbone=freeze_backbone)
    step = jax.jit(make_train_step(model, tx, freeze_backbone=freeze_backbone))
    batch = {
        "input_ids": jnp.asarray(ids),
        "attention_mask": jnp.asarray(mask),
        "labels": jnp.asarray([0, 1, 2]),
        "weights": jnp.ones(3),
    }
    for _ in range(steps):
        state, _ = step(state, batch)
    return state, ids, mask


def test_auto_follows_frozen_and_precision():
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(BF16)
    assert resolve_base_dtype("auto", frozen=True, compute_dtype=BF16) == bf16
    assert resolve_base_dtype("auto", frozen=True, compute_dtype=jnp.float32) == f32
    assert resolve_base_dtype("auto", frozen=False, compute_dtype=BF16) == f32
    assert resolve_base_dtype("bfloat16", frozen=False, compute_dtype=jnp.float32) == bf16
    with pytest.raises(UsageError, match="not one of auto, float32, bfloat16"):
        resolve_base_dtype("fp8", frozen=True, compute_dtype=BF16)


def test_lora_on_bf16_base_trains_exports_and_reloads(bert, tmp_path):
    path, pt = bert
    plain = fh.from_pretrained(path).with_lora(rank=4, alpha=16)
    model = fh.from_pretrained(path, base_dtype=BF16).with_lora(rank=4, alpha=16)
    # the base is bfloat16 where it lives (the backbone object holds the same arrays), half the bytes
    assert _dtypes(model.params["backbone"]) == {"bfloat16"} and _dtypes(model.backbone.params) == {"bfloat16"}
    assert _dtypes(model.params["head"]) == _dtypes(model.params["lora"]) == {"float32"}
    assert _bytes(model.params["backbone"]) * 2 == _bytes(plain.params["backbone"])
    ids, mask = padded_batch("bert", pt.config)
    f32_logits = _logits(pt, ids, mask)
    fwd = jax.jit(lambda p: model.apply(p, ids, mask))  # one program for every logits of this model
    bf16_logits = np.asarray(fwd(model.params))
    assert 0 < np.abs(bf16_logits - f32_logits).max() < TOL  # rounded weights, float32 compute

    base_before = jax.tree.map(np.asarray, model.params["backbone"])
    state, ids, mask = _train(model)
    # the base is unchanged and still bfloat16; the optimizer holds adapters + head only, in float32
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.params["backbone"], base_before)
    assert not _base_moments(state.opt_state)
    assert _dtypes(state.opt_state) <= {"float32", "int32"}
    ours = np.asarray(fwd(state.params))
    assert np.abs(ours - bf16_logits).max() > 1e-3  # training moved the logits

    # merged: the adapted kernels are float32, W + (alpha/r) A @ B, not rounded to bfloat16
    merged = merge_model(model, state.params)
    kernel = merged.params["backbone"]["encoder"]["layer"]["0"]["attention"]["self"]["query"]["kernel"]
    base_kernel = model.params["backbone"]["encoder"]["layer"]["0"]["attention"]["self"]["query"]["kernel"]
    assert kernel.dtype == jnp.float32 and base_dtype_of(merged.params["backbone"]) == "mixed"
    ab = state.params["lora"]["encoder"]["layer"]["0"]["attention"]["self"]["query"]
    want = base_kernel.astype(jnp.float32) + delta(ab["lora_A"], ab["lora_B"], model.lora.scaling, False)
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(want), atol=1e-7, rtol=0)
    assert (kernel != kernel.astype(BF16).astype(jnp.float32)).any()  # not rounded to bfloat16
    fh.interop.export_transformers(model, tmp_path / "merged", params=state.params)
    written = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert {v.dtype for v in written.values()} == {np.dtype(np.float32)}
    pt_merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    # the same weights; the JAX forward also rounds some sums of bfloat16 params (embeddings) to bfloat16
    np.testing.assert_allclose(_logits(pt_merged, ids, mask), ours, atol=TOL, rtol=0)

    export_peft(model, tmp_path / "peft", params=state.params)  # adapters + head on the float32 base folder
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=model.num_labels)
    pm = peft.PeftModel.from_pretrained(base, tmp_path / "peft")
    np.testing.assert_allclose(_logits(pm, ids, mask), ours, atol=TOL, rtol=0)

    # a checkpoint records the base dtype; the model comes back on a bfloat16 base with the same logits
    with RunCheckpointer(tmp_path / "run", model, save_backbone=False) as ckr:
        ckr.save(3, state)
    assert ckr.read_meta(3)["base_dtype"] == "bfloat16"
    back = fh.checkpoint.model_from_checkpoint(tmp_path / "run")
    assert _dtypes(back.params["backbone"]) == {"bfloat16"} and back.lora == model.lora
    # the same arrays as trained (so the same logits): base read again and cast, adapters and head restored
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back.params, state.params)


def test_frozen_bf16_base_head_only_and_fine_tune_refused(bert):
    path, _ = bert
    model = fh.from_pretrained(path, base_dtype=BF16)
    state, ids, mask = _train(model, freeze_backbone=True)
    assert base_dtype_of(state.params["backbone"]) == "bfloat16"
    assert not _base_moments(state.opt_state)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), state.params["head"], model.params["head"])
    assert min(jax.tree.leaves(moved)) > 0
    tx = make_optimizer(OptimConfig())
    with pytest.raises(TrainingError, match="stored in bfloat16 and would be fine-tuned"):
        create_state(model.params, tx)
    # float32 storage is the default and stays the very same arrays
    plain = fh.from_pretrained(path)
    same = plain.with_base_dtype(jnp.float32)
    assert all(a is b for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(same.params)))


def test_run_spec_and_flag(bert):
    from flaxheads.cli.train import build_parser, spec_from_args
    from flaxheads.run.checks import check_spec
    from flaxheads.run.program import base_dtype, build_model
    from flaxheads.run.spec import RunSpec
    from flaxheads.runtime import ComputePlan

    path, _ = bert
    spec = spec_from_args(build_parser().parse_args(["--model", path, "--lora-rank", "4", "--base-dtype", "bfloat16"]))
    assert spec.model.base_dtype == "bfloat16"
    plan = ComputePlan.for_host()
    model = build_model(check_spec(spec), path, None, plan)
    assert model.lora is not None and base_dtype_of(model.params["backbone"]) == "bfloat16"
    assert base_dtype_of(model.params["lora"]) == "float32"
    # the default keeps float32 where the precision is float32 (this CPU's auto), and for a fine-tune
    f32 = jnp.dtype(jnp.float32)
    assert base_dtype(RunSpec(), plan) == f32
    assert RunSpec().model.base_dtype == "auto"
    with pytest.raises(UsageError, match="--base-dtype bfloat16 stores a base that does not train"):
        check_spec(RunSpec.from_kwargs(model=path, base_dtype="bfloat16"))
    check_spec(RunSpec.from_kwargs(model=path, base_dtype="bfloat16", freeze_backbone=True))
