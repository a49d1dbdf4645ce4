"""LoRA adapters against PyTorch PEFT: the same adapter weights give the same logits on tiny BERT,
GPT-2 (``Conv1D`` kernels, ``fan_in_fan_out``) and Llama-style decoders; after training, the
merged transformers export and the PEFT adapter folder load in PyTorch with flaxheads' logits;
the base stays bitwise unchanged and the optimizer holds moments for adapters + head only;
adapters survive checkpoints and are checked against the backbone they are loaded on."""

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import padded_batch, save_tiny  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.checkpoint import IncompatibleCheckpointError, RunCheckpointer  # noqa: E402
from flaxheads.checkpoint.adapters import load_adapters  # noqa: E402
from flaxheads.checkpoint.inspect import format_meta  # noqa: E402
from flaxheads.errors import ConfigError, TrainingError  # noqa: E402
from flaxheads.interop.peft import ADAPTER_CONFIG, export_peft  # noqa: E402
from flaxheads.model.lora import LoraConfig, adapter_modules, merge_model  # noqa: E402
from flaxheads.training.optim import OptimConfig, make_optimizer  # noqa: E402
from flaxheads.training.steps import create_state, make_train_step  # noqa: E402


def _has_decoder() -> bool:
    try:
        import flaxheads.backbones.families.decoder  # noqa: F401
    except ImportError:
        return False
    return True


DECODER = pytest.param(
    "llama",
    ("q_proj", "v_proj"),
    marks=pytest.mark.skipif(
        not _has_decoder(), reason="no native decoder backbone (flaxheads.backbones.families.decoder) in this tree"
    ),
)
# (arch, targets): BERT's attention projections, GPT-2's fused Conv1D c_attn plus the MLP input
CASES = [("bert", ("query", "value")), ("gpt2", ("c_attn", "c_fc")), DECODER]


@pytest.fixture(scope="module")
def folders(tiny_model):
    return lambda arch: tiny_model(arch, seed=3, layers=2)  # targets pick a layer


def _random_adapters(params, seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(scale * rng.normal(size=x.shape), jnp.float32), params["lora"])


def _peft_model(pt, model, lora):
    """PEFT's LoRA on a copy of the PyTorch classifier, with ``lora``'s weights copied in by the
    PyTorch module names (the params trees follow them under the base model prefix)."""
    cfg, prefix = model.lora, pt.base_model_prefix
    names = {m: f"{prefix}." + ".".join(m) for m in adapter_modules(lora)}
    pm = peft.get_peft_model(
        copy.deepcopy(pt),
        peft.LoraConfig(
            task_type="SEQ_CLS", r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, target_modules=list(names.values())
        ),
    )
    with torch.no_grad():
        for m, ab in adapter_modules(lora).items():
            mod = pm.base_model.model.get_submodule(names[m])
            mod.lora_A["default"].weight.copy_(torch.tensor(np.asarray(ab["lora_A"]).T))
            mod.lora_B["default"].weight.copy_(torch.tensor(np.asarray(ab["lora_B"]).T))
    return pm.eval()


def _torch_logits(m, ids, mask):
    with torch.no_grad():
        return m(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.mark.parametrize(
    "arch,targets", CASES + [("deberta-v2", ("query_proj", "value_proj")), ("modernbert", ("Wqkv", "Wi"))]
)
def test_same_logits_as_peft(folders, arch, targets):
    path, pt = folders(arch)
    model = fh.from_pretrained(path).with_lora(rank=4, alpha=8, targets=targets)
    assert len(adapter_modules(model.params["lora"])) == 2 * len(targets)  # 2 layers
    ids, mask = padded_batch(arch, pt.config)
    # fresh adapters (B = 0) leave the base model's logits
    np.testing.assert_allclose(np.asarray(model(ids, mask)), _torch_logits(pt, ids, mask), atol=1e-5, rtol=0)
    lora = _random_adapters(model.params)
    ours = np.asarray(model.apply({**model.params, "lora": lora}, ids, mask))
    want = _torch_logits(_peft_model(pt, model, lora), ids, mask)
    assert np.abs(want - _torch_logits(pt, ids, mask)).max() > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(ours, want, atol=1e-5, rtol=1e-4)


def _train(model, steps=3, lr=5e-2, seed=0):
    cfg = model.backbone.config
    ids, mask = padded_batch(model.model_type, cfg, seed=seed)
    tx = make_optimizer(
        OptimConfig(
            learning_rate=lr,
            head_learning_rate=lr,
            warmup_steps=0,
            total_steps=steps,
            schedule="constant",
            weight_decay=0.01,
        )
    )
    state = create_state(model.params, tx)
    step = jax.jit(make_train_step(model, tx))
    batch = {
        "input_ids": jnp.asarray(ids),
        "attention_mask": jnp.asarray(mask),
        "labels": jnp.asarray([0, 1, 2]),
        "weights": jnp.ones(3),
    }
    for _ in range(steps):
        state, _ = step(state, batch)
    return state, ids, mask


@pytest.mark.full  # a training run
def test_training_updates_adapters_and_head_only(folders):
    path, _ = folders("bert")
    model = fh.from_pretrained(path).with_lora(rank=4, alpha=8)
    assert model.lora.targets == ("query", "value")  # BERT's default targets
    base_before = jax.tree.map(np.array, model.params["backbone"])
    state, ids, mask = _train(model)
    # the frozen base: bitwise the same arrays
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.params["backbone"], base_before)
    for part in ("lora", "head"):
        moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), state.params[part], model.params[part])
        assert min(jax.tree.leaves(moved)) > 0, part
    # optimizer state: AdamW moments (2x) for adapters + head, a few scalar counters, nothing for the base
    n = lambda t: sum(x.size for x in jax.tree.leaves(t))  # noqa: E731
    trained = n(model.params["lora"]) + n(model.params["head"])
    assert 2 * trained <= n(state.opt_state) <= 2 * trained + 16
    assert n(state.opt_state) < n(model.params["backbone"]) / 4  # a full fine-tune would hold 2x the base


@pytest.mark.full  # a training run and two exports
@pytest.mark.parametrize("arch,targets", CASES)
def test_trained_adapters_export_merged_and_as_peft(folders, tmp_path, arch, targets):
    path, _ = folders(arch)
    model = fh.from_pretrained(path).with_lora(rank=4, alpha=16, targets=targets)
    state, ids, mask = _train(model)
    ours = np.asarray(model.apply(state.params, ids, mask))
    assert np.abs(ours - np.asarray(model(ids, mask))).max() > 1e-3  # training changed the logits

    fh.interop.export_transformers(model, tmp_path / "merged", params=state.params)
    pt, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    np.testing.assert_allclose(_torch_logits(pt.eval(), ids, mask), ours, atol=1e-5, rtol=1e-4)
    merged = merge_model(model, state.params)
    assert merged.lora is None and "lora" not in merged.params
    np.testing.assert_allclose(np.asarray(merged(ids, mask)), ours, atol=1e-6, rtol=0)

    export_peft(model, tmp_path / "peft", params=state.params)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=model.num_labels)
    pm = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    np.testing.assert_allclose(_torch_logits(pm, ids, mask), ours, atol=1e-5, rtol=1e-4)
    # PEFT adapted exactly the kernels flaxheads adapted
    adapted = {n for n, mod in pm.named_modules() if hasattr(mod, "lora_A")}
    assert len(adapted) == len(adapter_modules(state.params["lora"]))


def test_peft_folder_layout(folders, tmp_path):
    import json

    from safetensors.numpy import load_file

    path, _ = folders("gpt2")
    model = fh.from_pretrained(path).with_lora(rank=2, alpha=4)
    export_peft(model, tmp_path / "peft")
    cfg = json.loads((tmp_path / "peft" / ADAPTER_CONFIG).read_text())
    assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"], cfg["fan_in_fan_out"]) == (
        "LORA",
        "SEQ_CLS",
        2,
        4.0,
        True,
    )
    assert cfg["target_modules"] == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    assert cfg["modules_to_save"] == ["score"]
    w = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert w["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (2, 32)  # [r, in]
    assert w["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape == (96, 2)  # [out, r]
    assert "base_model.model.score.weight" in w


def test_every_family_has_default_targets():
    """The default targets of every model type a native family serves select kernels of its tree."""
    from hf_tiny import tiny_config

    from flaxheads.backbones.base import HFConfig
    from flaxheads.backbones.registry import FAMILIES
    from flaxheads.model.lora import resolve_targets

    for fam in FAMILIES:
        for model_type in fam.model_types:
            try:
                cfg = fam.complete_config(HFConfig(tiny_config(model_type, layers=2).to_dict()))
            except KeyError:  # no tiny config for this alias (e.g. a decoder variant)
                continue
            assert fam.lora_targets, model_type
            picked = resolve_targets(LoraConfig(), fam.param_shapes(cfg), model_type)
            assert len(picked) >= cfg.get("num_hidden_layers", 2), (model_type, picked)


def test_targets_and_settings_are_checked(folders):
    path, _ = folders("bert")
    model = fh.from_pretrained(path)
    with pytest.raises(ConfigError, match=r"'q_proj' matches no kernel.*query.*value"):
        model.with_lora(targets=("q_proj",))
    for bad in (dict(rank=0), dict(rank=2.5), dict(alpha=0), dict(dropout=1.0), dict(targets=())):
        with pytest.raises(ConfigError):
            LoraConfig(**bad)
    with pytest.raises(ConfigError, match="dropout 0.1 is not supported"):
        LoraConfig(dropout=0.1)
    # a glob over the whole path picks one layer's kernels
    one = model.with_lora(rank=2, targets=("encoder/layer/1/*/query", "encoder/layer/1/*/value"))
    assert sorted("/".join(m) for m in adapter_modules(one.params["lora"])) == [
        "encoder/layer/1/attention/self/query",
        "encoder/layer/1/attention/self/value",
    ]
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        one.with_lora()
    with pytest.raises(TrainingError, match="LoRA adapters"):
        make_train_step(one, make_optimizer(OptimConfig()), freeze_backbone=True)


@pytest.mark.full  # a training run
def test_checkpoints_store_adapters_apart(folders, tmp_path):
    path, _ = folders("bert")
    model = fh.from_pretrained(path).with_lora(rank=4, alpha=8)
    state, ids, mask = _train(model)
    want = np.asarray(model.apply(state.params, ids, mask))
    with RunCheckpointer(tmp_path / "run", model, save_backbone=False) as ckr:
        ckr.save(3, state)
    step_dir = tmp_path / "run" / "checkpoints" / "3"
    assert (step_dir / "lora").is_dir() and not (step_dir / "backbone").exists()
    assert ckr.read_meta(3)["lora"]["rank"] == 4
    assert "LoRA:         rank 4, alpha 8.0, targets query,value (4 kernels)" in format_meta(ckr.read_meta(3))

    fresh = create_state(model.params, make_optimizer(OptimConfig()))
    restored = RunCheckpointer(tmp_path / "run", model, read_only=True).restore(target_state=fresh)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored.params, state.params
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored.opt_state, state.opt_state
    )
    run_model = fh.checkpoint.model_from_checkpoint(tmp_path / "run")
    np.testing.assert_allclose(np.asarray(run_model(ids, mask)), want, atol=1e-6)

    # resuming with other adapters (rank) or none is refused, naming the difference
    other = fh.from_pretrained(path).with_lora(rank=2, alpha=8)
    with pytest.raises(IncompatibleCheckpointError, match="rank: checkpoint 4 vs target 2"):
        RunCheckpointer(tmp_path / "run", other, read_only=True).restore(
            target_state=create_state(other.params, make_optimizer(OptimConfig()))
        )
    plain = fh.from_pretrained(path)
    with pytest.raises(IncompatibleCheckpointError, match="adapters"):
        RunCheckpointer(tmp_path / "run", plain, read_only=True).restore(
            target_state=create_state(plain.params, make_optimizer(OptimConfig()))
        )


def test_adapters_saved_with_head_load_on_their_base_only(folders, tmp_path):
    path, _ = folders("bert")
    model = fh.from_pretrained(path).with_lora(rank=4, alpha=8)
    state, ids, mask = _train(model)
    fh.save_head(tmp_path / "adapters", model, state.params)
    assert os.path.isdir(tmp_path / "adapters" / "0" / "lora")
    base = fh.from_pretrained(path)
    loaded = load_adapters(tmp_path / "adapters", fh.attach_head(base, fh.load_head(tmp_path / "adapters")))
    np.testing.assert_allclose(
        np.asarray(loaded(ids, mask)), np.asarray(model.apply(state.params, ids, mask)), atol=1e-6
    )
    # another base of the same architecture and shapes: refused (adapters only fit their base weights)
    other_path, _ = save_tiny(tmp_path / "other", "bert", seed=9, layers=2)
    with pytest.raises(IncompatibleCheckpointError, match="other base weights"):
        load_adapters(tmp_path / "adapters", fh.from_pretrained(other_path))
    # a backbone of another family
    gpt2_path, _ = folders("gpt2")
    with pytest.raises(IncompatibleCheckpointError, match="bert backbone"):
        load_adapters(tmp_path / "adapters", fh.from_pretrained(gpt2_path))
