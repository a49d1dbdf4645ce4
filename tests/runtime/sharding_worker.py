"""Runs in a subprocess with 8 forced CPU devices (the test process has 4): trains a tiny model
on one device and on several meshes, and a run checkpointed on one mesh and resumed on
another; writes every run's losses and params for tests/runtime/test_sharding.py to compare.

usage: python sharding_worker.py FOLDER OUT CASE   (CASE: meshes | resume)
"""

import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: train_helpers

from train_helpers import random_split  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.checkpoint import RunCheckpointer  # noqa: E402
from flaxheads.heads import linen  # noqa: E402
from flaxheads.runtime.sharding import abstract  # noqa: E402
from flaxheads.training.loop import FitCheckpointing, TrainConfig, Trainer, fit  # noqa: E402
from flaxheads.training.optim import OptimConfig  # noqa: E402

N_TRAIN, BATCH, STEPS = 21, 8, 3  # 21 = 8 + 8 + 5: the last batch has 3 padding rows
MESHES = (None, "data=8", "data=2,fsdp=4", "fsdp=2,tensor=4")


def trainer(folder, mesh, steps=STEPS, total=STEPS):
    model = fh.from_pretrained(folder, pooler="mean", head="linear", num_labels=3, head_options={"dropout": 0.0})
    cfg = TrainConfig(
        batch_size=BATCH,
        eval_batch_size=BATCH,
        max_steps=steps,
        seed=1,
        log_every=1,
        parallel="mesh" if mesh else "single",
        mesh=mesh,
    )
    ocfg = OptimConfig(learning_rate=1e-3, head_learning_rate=1e-2, total_steps=total, warmup_steps=1)
    return Trainer.build(model, ocfg, cfg)


def run(tr, state=None, callbacks=()):
    res = fit(
        tr,
        random_split(N_TRAIN, seed=4),
        buckets=(16, 24),
        progress=False,
        group_by_length=False,
        state=state,
        callbacks=callbacks,
    )
    return res, [h["loss"] for h in res.history if "loss" in h]


def flat(params) -> dict:
    return {
        "/".join(str(getattr(k, "key", k)) for k in p): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(params)
    }


def specs(tr) -> dict:
    """How many params each run really sharded (a mesh that shards nothing proves nothing)."""
    if tr.parallel.mode != "mesh":
        return {}
    sh = tr.parallel.shardings(tr.model.params)
    return {
        "/".join(str(getattr(k, "key", k)) for k in p): str(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(sh)
    }


def meshes(folder, out):
    report = {}
    for mesh in MESHES:
        tr = trainer(folder, mesh)
        res, losses = run(tr)
        name = mesh or "single"
        np.savez(f"{out}.{name}.npz", **flat(tr.parallel.get_state(res.state).params))
        report[name] = {"losses": losses, "specs": specs(tr), "width": tr.parallel.width}
    json.dump(report, open(out + ".json", "w"))


def resume(folder, out):
    """4 steps on data=2,fsdp=4 saving at step 2; restore onto fsdp=2,tensor=4 and finish."""
    total = 4
    whole = trainer(folder, None, steps=total, total=total)
    res_w, losses_w = run(whole)
    first = trainer(folder, "data=2,fsdp=4", steps=total, total=total)
    first.cfg.max_steps = 2
    ckr = RunCheckpointer(out + ".run", first.model, keep=None, async_save=False)
    run(first, callbacks=[FitCheckpointing(ckr, every=None)])
    ckr.close()
    second = trainer(folder, "fsdp=2,tensor=4", steps=total, total=total)
    target = second.abstract_state()
    target = abstract(target, second.parallel.shardings(target))
    ckr = RunCheckpointer(out + ".run", second.model, read_only=True)
    restored = ckr.restore(2, target_state=target)
    ckr.close()
    on_mesh = {str(s.spec) for s in jax.tree.leaves(jax.tree.map(lambda x: x.sharding, restored.params))}
    res_r, losses_r = run(second, state=restored)
    np.savez(out + ".whole.npz", **flat(whole.parallel.get_state(res_w.state).params))
    np.savez(out + ".resumed.npz", **flat(second.parallel.get_state(res_r.state).params))
    json.dump(
        {
            "whole": losses_w,
            "resumed": losses_r,
            "restored_specs": sorted(on_mesh),
            "saved_steps": sorted(int(x) for x in os.listdir(out + ".run/checkpoints") if x.isdigit()),
        },
        open(out + ".json", "w"),
    )


#: A ~1B-parameter Llama (Llama-2-7B's widths, 5 layers): sized, never allocated.
LLAMA_1B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "pad_token_id": 0,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
}


def abstract_model(config: dict):
    """A SequenceModel whose params are ``jax.eval_shape`` shapes (mean pooler, linear head)."""
    from flaxheads.backbones.base import HFConfig
    from flaxheads.backbones.registry import family_for
    from flaxheads.model.sequence import SequenceModel, build_head

    fam = family_for(config["model_type"])
    cfg = fam.complete_config(HFConfig(config))
    shapes = fam.param_shapes(cfg)
    head, _ = build_head(cfg, 2, pooler="mean", head="linear")
    hidden = int(cfg.hidden_size)
    hp = jax.eval_shape(lambda: linen.init_head(head, hidden))
    return SequenceModel(fam(cfg, shapes), head, 2, "single_label_classification", {"backbone": shapes, "head": hp})


def memory(folder, out):
    """Per-device bytes of the ~1B Llama's train step, replicated (data=8) and under fsdp=8."""
    from flaxheads.training.memory import memory_report

    model = abstract_model(LLAMA_1B)
    batch = {
        "input_ids": np.zeros((8, 128), np.int32),
        "attention_mask": np.ones((8, 128), np.int32),
        "labels": np.zeros(8, np.int32),
        "weights": np.ones(8, np.float32),
    }
    rep = {"params": int(sum(x.size for x in jax.tree.leaves(model.params)))}
    for mesh in ("data=8", "fsdp=8"):
        cfg = TrainConfig(batch_size=8, max_steps=1, parallel="mesh", mesh=mesh)
        tr = Trainer.build(model, OptimConfig(total_steps=1), cfg)
        r = memory_report(tr, batch)
        print("\n".join(r.lines()), flush=True)
        rep[mesh] = {
            k: getattr(r, k)
            for k in (
                "params",
                "opt_state",
                "params_replicated",
                "xla_arguments",
                "xla_temp",
                "xla_outputs",
                "xla_aliased",
            )
        }
    json.dump(rep, open(out + ".json", "w"))


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    {"meshes": meshes, "resume": resume, "memory": memory}[sys.argv[3]](sys.argv[1], sys.argv[2])
