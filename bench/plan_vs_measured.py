"""The memory plan against the measured peak of a CPU train step, for three configurations.

Each configuration runs in its own process: ``fh.plan_memory`` on the folder's config.json (no weights
read), then the real model is loaded, its train step compiled ahead of time, the process's peak RSS
reset (``/proc/self/clear_refs``), the optimizer state made and one step run. The measured peak is the
peak RSS over the RSS before the state was made, plus the params that were already resident (the
state's params are the model's arrays). glibc is told to map every buffer above 128 KiB on its own
(``MALLOC_MMAP_THRESHOLD_``) so that freed buffers leave the RSS and reused heap does not hide a peak.

    python bench/plan_vs_measured.py          # prints a markdown table (the CPU named)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from bench import common  # noqa: E402

CONFIGS = {
    "llama H512 L4, full fine-tune f32, 8 x 256": dict(
        arch="llama",
        over=dict(
            hidden_size=512,
            num_hidden_layers=4,
            intermediate_size=1376,
            vocab_size=8000,
            num_attention_heads=8,
            head_dim=64,
            max_position_embeddings=512,
        ),
        plan=dict(batch_size=8, max_length=256),
    ),
    "llama H512 L4, LoRA r8 on bf16 base, bf16, 8 x 256": dict(
        arch="llama",
        over=dict(
            hidden_size=512,
            num_hidden_layers=4,
            intermediate_size=1376,
            vocab_size=8000,
            num_attention_heads=8,
            head_dim=64,
            max_position_embeddings=512,
        ),
        plan=dict(batch_size=8, max_length=256, precision="bfloat16", base_dtype="bfloat16", lora=8),
    ),
    "bert H384 L6, remat full, 16 x 128": dict(
        arch="bert",
        over=dict(
            hidden_size=384,
            num_hidden_layers=6,
            intermediate_size=1536,
            vocab_size=8000,
            num_attention_heads=6,
            max_position_embeddings=256,
        ),
        plan=dict(batch_size=16, max_length=128, remat="full"),
    ),
}


def worker(name: str, folder: str) -> dict:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np
    from hf_tiny import save_tiny

    import flaxheads as fh
    from flaxheads.model.quantize import device_bytes
    from flaxheads.runtime import ComputePlan
    from flaxheads.training.loop import TrainConfig, Trainer
    from flaxheads.training.memory_plan import lora_from_flags, plan_batch
    from flaxheads.training.optim import OptimConfig

    c = CONFIGS[name]
    opts = dict(c["plan"])
    lora = lora_from_flags(opts.pop("lora", None))
    save_tiny(folder, c["arch"], seed=0, **c["over"])
    plan = fh.plan_memory(folder, lora=lora, **opts)
    prec = opts.get("precision", "float32")
    model = fh.from_pretrained(
        folder,
        dtype=jnp.dtype(prec),
        plan=ComputePlan.for_host(precision=prec),
        remat=opts.get("remat", False),
        base_dtype=jnp.bfloat16 if opts.get("base_dtype") == "bfloat16" else None,
    )
    if lora is not None:
        model = model.with_lora(lora)
    trainer = Trainer.build(model, OptimConfig(), TrainConfig(batch_size=opts["batch_size"]))
    shapes = plan_batch(model, opts["batch_size"], opts["max_length"])
    compiled = trainer.train_step.lower(trainer.abstract_state(), shapes).compile()
    rng = np.random.RandomState(0)
    batch = {
        k: jnp.asarray(rng.randint(3, 99, s.shape).astype(s.dtype))
        if k == "input_ids"
        else jnp.ones(s.shape, s.dtype)
        if k != "labels"
        else jnp.zeros(s.shape, s.dtype)
        for k, s in shapes.items()
    }
    resident = device_bytes(model.params) + device_bytes(batch)
    gc.collect()
    before = common.proc_status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    state = trainer.init_state()
    out = compiled(state, batch)
    jax.block_until_ready(out)
    measured = common.proc_status_bytes("VmHWM") - before + resident
    return {"name": name, "plan": plan.total, "measured": measured, "lines": plan.lines()}


def main() -> None:
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.path.join(HERE, "..") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    print(f"CPU: {common.cpu_name()}\n")
    print("| configuration | plan (MiB) | measured peak (MiB) | plan / measured |\n| --- | --- | --- | --- |")
    for name in CONFIGS:
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", name, tmp], env=env, capture_output=True, text=True
            )
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"| {name} | {r['plan'] / 2**20:.1f} | {r['measured'] / 2**20:.1f} | {r['plan'] / r['measured']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(sys.argv[2], sys.argv[3])))
    else:
        main()
