"""LoRA against full fine-tuning on a decoder classifier: train-step time and peak memory.

    python bench/lora.py [--layers 24] [--hidden 1024] [--intermediate 4352] [--vocab 32000]
                         [--batch 4] [--seq 128] [--repeats 3] [--rank 8] [--targets q_proj,v_proj]

A random Qwen2-style decoder (default: hidden 1024, 24 layers, 16 heads, 4 key/value heads,
SwiGLU 4352, vocabulary 32000: about 0.45 B parameters) with a 2-label head on the last token,
float32, AdamW. Two systems, each in its own fresh process (so one's peak does not hide the
other's):

* ``full``: the whole backbone and the head train (optimizer moments for every weight);
* ``lora``: adapters of ``--rank`` (alpha = 2 x rank) on ``--targets`` plus the head train; the
  base stays frozen (no gradient buffers or moments for it);
* ``lora-bf16`` (``--systems full,lora,lora-bf16``): ``lora`` with the frozen base stored in
  bfloat16 (``SequenceModel.with_base_dtype``; the compute dtype is float32, or bfloat16 with ``--bf16``).

Per system: the first step (trace + compile + run), the median of ``--repeats`` steps after
it, the process's peak resident set (``ru_maxrss``: params, optimizer state, activations,
XLA's buffers), the resident-set growth during one steady-state step (:class:`bench.common.PeakRSS`)
and XLA's own buffer sizes for the compiled step. Ratios: full / LoRA (> 1: LoRA cheaper).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

SYSTEMS = ("full", "lora", "lora-bf16")


def _config(a) -> dict:
    return dict(
        model_type="qwen2",
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=a.hidden // 16,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )


def build_model(a):
    """A random decoder classifier (last-token pooling, linear head), built without a folder."""
    import jax
    import jax.numpy as jnp

    from flaxheads.backbones.base import HFConfig
    from flaxheads.backbones.families.decoder import DecoderBackbone
    from flaxheads.model.pretrained import _init_head
    from flaxheads.model.sequence import SequenceModel, build_head

    cfg = DecoderBackbone.complete_config(HFConfig(_config(a)))
    backbone = DecoderBackbone(
        cfg,
        jax.jit(DecoderBackbone.init_params, static_argnums=0)(cfg, jax.random.key(0)),
        dtype=jnp.bfloat16 if a.bf16 else jnp.float32,
    )
    head, _ = build_head(cfg, 2, pooler="last", head="linear")
    head_params, _ = _init_head(head, a.hidden, 0, (), {})
    return SequenceModel(
        backbone=backbone,
        head=head,
        num_labels=2,
        problem_type="single_label_classification",
        params={"backbone": backbone.params, "head": head_params},
        pad_token_id=0,
    )


def measure(a) -> dict:
    """One system's numbers (runs in a fresh process)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flaxheads.training.optim import OptimConfig, count_params, make_optimizer, trainable
    from flaxheads.training.steps import create_state, make_train_step

    model = build_model(a)
    if a.system == "lora-bf16":
        model = model.with_base_dtype(jnp.bfloat16)
    if a.system.startswith("lora"):
        model = model.with_lora(rank=a.rank, alpha=2.0 * a.rank, targets=tuple(a.targets.split(",")))
    tx = make_optimizer(
        OptimConfig(learning_rate=1e-4, warmup_steps=0, total_steps=1000), fold_reductions=model.plan.fold_reductions
    )
    state = create_state(model.params, tx)
    rng = np.random.default_rng(0)
    batch = {
        "input_ids": jnp.asarray(rng.integers(3, a.vocab, (a.batch, a.seq)), jnp.int32),
        "attention_mask": jnp.ones((a.batch, a.seq), jnp.int32),
        "labels": jnp.asarray(rng.integers(0, 2, a.batch)),
        "weights": jnp.ones(a.batch, jnp.float32),
    }
    step = common.jit_train_step(make_train_step(model, tx), model.plan)
    xla = common.xla_bytes(step, state, batch)
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    with common.PeakRSS() as pk:
        state, m = step(state, batch)
        jax.block_until_ready(m)
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return {
        "system": a.system,
        "params": count_params(model.params),
        "trained": count_params(trainable(model.params, False)),
        "opt_state": count_params(state.opt_state),
        "first_s": first,
        "step_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_rss": pk.peak,
        "xla_bytes": xla,
        "loss": float(m["loss"]),
        "base_bytes": sum(x.nbytes for x in jax.tree.leaves(model.params["backbone"])),
    }


def run_system(system: str, argv: list[str]) -> dict | str:
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--system", system, *argv], capture_output=True, text=True
    )
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        return f"failed (exit {p.returncode}: {tail[0][:160]})"
    return json.loads(p.stdout.strip().splitlines()[-1])


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (
        ("layers", 24),
        ("hidden", 1024),
        ("intermediate", 4352),
        ("vocab", 32000),
        ("batch", 4),
        ("seq", 128),
        ("repeats", 3),
        ("rank", 8),
    ):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 compute (params float32 unless lora-bf16)")
    ap.add_argument("--system", choices=SYSTEMS, default=None, help="(internal) measure one system")
    ap.add_argument("--systems", default="full,lora", help=f"which systems, comma-separated ({', '.join(SYSTEMS)})")
    ap.add_argument("--xla-flags", default=None)
    a = ap.parse_args()
    common.configure_xla(a.xla_flags)
    if a.system is not None:
        print(json.dumps(measure(a)))
        return
    argv = [x for x in sys.argv[1:]]
    systems = a.systems.split(",")
    if set(systems) - set(SYSTEMS):
        ap.error(f"--systems: expected names among {', '.join(SYSTEMS)}, got {a.systems}")
    print(
        f"# LoRA vs full fine-tuning: qwen2-style decoder, hidden {a.hidden}, {a.layers} layers, SwiGLU "
        f"{a.intermediate}, vocab {a.vocab}; batch {a.batch} x {a.seq} tokens, "
        f"{'bfloat16' if a.bf16 else 'float32'} compute, AdamW; LoRA rank "
        f"{a.rank}, alpha {2 * a.rank}, targets {a.targets}"
    )
    print(f"# {common.environment()}")
    res = {s: run_system(s, argv) for s in systems}
    print(
        "| system | params | trained | optimizer state | base params (GiB) | first step (s) | "
        "step (s), median (min..max) | peak RSS (GiB) | step RSS growth (GiB) | XLA buffers (GiB) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s, r in res.items():
        if isinstance(r, str):
            print(f"| {s} | {r} | | | | | | | | |")
            continue
        print(
            f"| {s} | {r['params'] / 1e6:.1f} M | {r['trained'] / 1e6:.2f} M | {r['opt_state'] / 1e6:.2f} M | "
            f"{_gib(r['base_bytes'])} | "
            f"{r['first_s']:.1f} | {r['step_s']:.2f} ({r['min_s']:.2f}..{r['max_s']:.2f}) | {_gib(r['maxrss'])} | "
            f"{_gib(r['step_rss'])} | {_gib(r['xla_bytes'])} |"
        )
    full, lora = res.get("full"), res.get("lora")
    if isinstance(full, dict) and isinstance(lora, dict):
        xla = f"{full['xla_bytes'] / lora['xla_bytes']:.2f}x" if full["xla_bytes"] and lora["xla_bytes"] else "n/a"
        print(
            f"\nfull / LoRA: step time {full['step_s'] / lora['step_s']:.2f}x, peak RSS "
            f"{full['maxrss'] / lora['maxrss']:.2f}x, XLA buffers {xla}"
        )


if __name__ == "__main__":
    main()
