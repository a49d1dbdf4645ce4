"""Data parallel: one device, pmap over 4 and jit over a 4-device mesh give the same loss and
params (odd dataset size: the padded last batch puts its padding on some devices only), and the
multi-host mesh path with two processes on loopback (gloo CPU collectives)."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from train_helpers import random_split

import flaxheads as fh
from flaxheads.runtime.parallel import Parallel, process_rows
from flaxheads.training.loop import TrainConfig, Trainer, fit
from flaxheads.training.optim import OptimConfig

N_TRAIN, N_EVAL, BATCH, STEPS = 21, 13, 8, 3  # 21 = 8 + 8 + 5: last batch has 3 padding rows


@pytest.fixture(scope="module")
def folder(tiny_bert):
    return tiny_bert


@pytest.fixture(scope="module")
def single(folder):
    return _run(folder, "single")


def _run(folder, mode):
    model = fh.from_pretrained(folder, pooler="mean", head="linear", num_labels=3, head_options={"dropout": 0.0})
    cfg = TrainConfig(batch_size=BATCH, eval_batch_size=BATCH, max_steps=STEPS, seed=1, log_every=1, parallel=mode)
    ocfg = OptimConfig(learning_rate=1e-3, head_learning_rate=1e-2, total_steps=STEPS, warmup_steps=1)
    trainer = Trainer.build(model, ocfg, cfg, Parallel(mode))
    res = fit(
        trainer,
        random_split(N_TRAIN, seed=4),
        evals={"validation": random_split(N_EVAL, seed=6)},
        buckets=(16, 24),
        progress=False,
        group_by_length=False,
    )
    logits, labels = trainer.predict(res.state.params, _eval_batches())
    return (
        trainer.parallel.get_state(res.state).params,
        [h["loss"] for h in res.history if "loss" in h],
        res.history[-1]["eval"]["validation"],
        logits,
    )


def _eval_batches():
    from flaxheads.data.splits import iterate_batches

    return iterate_batches(random_split(N_EVAL, seed=6), BATCH, (16, 24), shuffle=False)


def _close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


@pytest.mark.full  # three runs of a train step: beyond make test-fast
def test_single_pmap_mesh_agree(folder, single):
    assert jax.device_count() == 4, "conftest sets 4 fake CPU devices"
    p1, l1, e1, g1 = single
    assert len(l1) == STEPS
    for mode in ("pmap", "mesh"):
        p, losses, ev, logits = _run(folder, mode)
        np.testing.assert_allclose(losses, l1, rtol=1e-5, atol=1e-6)
        _close(p, p1)
        # evaluation counts each of the 13 examples exactly once on 4 devices
        assert logits.shape == (N_EVAL, 3)
        np.testing.assert_allclose(logits, g1, atol=1e-5)
        assert ev["accuracy"] == pytest.approx(e1["accuracy"])
    # the run really changed the params
    assert not np.allclose(
        p1["head"]["head"]["classifier"]["kernel"],
        fh.from_pretrained(folder, pooler="mean", head="linear", num_labels=3).params["head"]["head"]["classifier"][
            "kernel"
        ],
    )


@pytest.mark.full
@pytest.mark.parametrize("mode", ["single", "mesh"])
def test_train_steps_compile_with_the_gradient_options(folder, mode):
    """The trainer compiles its train step with the plan's gradient options and hands them to XLA;
    other programs keep the process's settings. The options here turn YNNPACK off, which this
    process has on (XLA's defaults): its fusions leave the train step only."""
    from flaxheads.data.splits import iterate_batches

    model = fh.from_pretrained(folder, pooler="mean", head="linear", num_labels=3)
    off = model.plan.replace(gradient_options=(("xla_cpu_experimental_ynn_fusion_type", ""),))
    model.backbone.plan, default_plan = off, model.plan
    cfg = TrainConfig(batch_size=BATCH, max_steps=STEPS, parallel=mode)
    trainer = Trainer.build(model, OptimConfig(learning_rate=1e-3, total_steps=STEPS), cfg, Parallel(mode))
    state = trainer.parallel.put_state(trainer.init_state())
    batch = trainer.parallel.put_rows(next(iterate_batches(random_split(BATCH, seed=4), BATCH, (16,), shuffle=False)))
    if "__ynn_fusion" not in jax.jit(lambda a: a @ a).lower(np.ones((64, 64), np.float32)).compile().as_text():
        pytest.skip("this jaxlib's XLA:CPU has no YNNPACK fusions by default")
    assert "__ynn_fusion" in trainer.eval_step.lower(state.params, batch).compile().as_text()
    assert "__ynn_fusion" not in trainer.train_step.lower(state, batch).compile().as_text()
    # the two libraries' steps train alike
    model.backbone.plan = default_plan
    plain = Trainer.build(model, OptimConfig(learning_rate=1e-3, total_steps=STEPS), cfg, Parallel(mode))
    params = [
        p.parallel.get_state(p.train_step(p.parallel.put_state(p.init_state()), batch)[0]).params
        for p in (trainer, plain)
    ]
    _close(*params)


def test_process_rows_slices_global_batch():
    b = {"x": np.arange(8), "y": np.arange(8) * 10}
    parts = [process_rows(b, i, 4) for i in range(4)]
    np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), b["x"])
    np.testing.assert_array_equal(parts[2]["y"], [40, 50])
    with pytest.raises(ValueError, match="does not split"):
        process_rows({"x": np.arange(6)}, 0, 4)


WORKER = textwrap.dedent("""
    import json, sys, numpy as np, jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid, port, folder, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    mesh, local = sys.argv[6] or None, int(sys.argv[7])
    jax.distributed.initialize(coordinator_address="127.0.0.1:" + port, num_processes=2, process_id=pid)
    sys.path.insert(0, sys.argv[5])
    import flaxheads as fh
    from flaxheads.training.optim import OptimConfig
    from flaxheads.training.loop import TrainConfig, Trainer, fit
    from train_helpers import random_split
    assert jax.device_count() == 2 * local and jax.local_device_count() == local
    model = fh.from_pretrained(folder, pooler="mean", head="linear", num_labels=3, head_options={"dropout": 0.0})
    cfg = TrainConfig(batch_size=8, eval_batch_size=8, max_steps=3, seed=1, log_every=1, parallel="mesh", mesh=mesh)
    ocfg = OptimConfig(learning_rate=1e-3, head_learning_rate=1e-2, total_steps=3, warmup_steps=1)
    trainer = Trainer.build(model, ocfg, cfg)
    if mesh:  # the fsdp axis spans the two processes: each holds half of every sharded param
        sh = trainer.parallel.shardings(model.params)
        split = [p for p, s in jax.tree_util.tree_leaves_with_path(sh) if "fsdp" in str(s.spec)]
        assert len(split) > 10, split
        assert trainer.parallel.local_rows_fraction == (pid, 2)
    res = fit(trainer, random_split(21, seed=4), evals={"validation": random_split(13, seed=6)},
              buckets=(16, 24), progress=False, group_by_length=False)
    params = trainer.parallel.get_state(res.state).params
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(out + f".{pid}.npz", **flat)
    json.dump({"losses": [h["loss"] for h in res.history if "loss" in h],
               "acc": res.history[-1]["eval"]["validation"]["accuracy"]}, open(out + f".{pid}.json", "w"))
    jax.distributed.shutdown()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, local", [("", 1), ("data=1,fsdp=2,tensor=2", 2)])
@pytest.mark.serial
def test_multi_host_mesh_matches_single_process(folder, single, tmp_path, mesh, local):
    """Two processes, jax.distributed on a loopback port: each feeds its half of every global
    batch; both end with the single-process params. 1 CPU device each (data parallel), or 2 each
    on a mesh whose fsdp axis spans the processes (tensor inside each)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={local}", "JAX_PLATFORMS": "cpu"}
    port, out = str(_free_port()), str(tmp_path / "res")
    helpers = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: train_helpers
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), port, folder, out, helpers, mesh, str(local)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-host workers timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    p1, l1, e1, _ = single
    flat1 = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
        for path, v in jax.tree_util.tree_flatten_with_path(p1)[0]
    }
    for pid in range(2):
        got = np.load(f"{out}.{pid}.npz")
        assert set(got.files) == set(flat1)
        for k in flat1:
            np.testing.assert_allclose(got[k], flat1[k], atol=1e-5, rtol=1e-5, err_msg=k)
        meta = json.load(open(f"{out}.{pid}.json"))
        np.testing.assert_allclose(meta["losses"], l1, rtol=1e-5)
        assert meta["acc"] == pytest.approx(e1["accuracy"])
