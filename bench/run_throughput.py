"""A run's reported throughput against the bench's own timing of the same train step.

    python bench/run_throughput.py [--batch 32] [--seq 128] [--steps 12] [--repeats 10]

``fh.train`` on the packaged all-MiniLM-L6-v2 (mean pooler, every row truncated to ``--seq`` tokens,
so every batch is ``batch x seq`` token slots; no validation, no checkpoints) reports tokens/s in its
``summary.json`` (the steps after the first, evaluations left out). The bench then times the same
model's train step on a ``batch x seq`` batch as ``bench/mfu.py`` does (``make_train_step``,
jitted with the state donated, median over ``--repeats``) and prints both and their ratio, with the
model TFLOP/s of each (one FLOP count: ``flaxheads.training.flops``). The run's rate includes what a
run does around the step (batches built on the host, placed, the loss read back each step).
"""

from __future__ import annotations

import csv
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = (
    "market bank share profit goal match team player score film music actor award song vote party minister "
    "election phone computer software internet game"
).split()


def parse(argv=None):
    from bench import common

    ap = common.parser(__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=10)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    from bench import common

    common.configure_xla(args.xla_flags)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import flaxheads as fh
    from bench.mfu import device_name
    from flaxheads.training.flops import StepFlops
    from flaxheads.training.steps import create_state, make_train_step

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "long.csv")
        with open(data, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows(
                [[" ".join(rng.choice(WORDS, 4 * args.seq)), f"c{i % 4}"] for i in range(args.batch * args.steps)]
            )
        run = fh.train(
            data=data,
            max_length=args.seq,
            bucket_step=args.seq,
            batch_size=args.batch,
            max_steps=args.steps,
            split=(1.0, 0.0, 0.0),
            checkpoint_every=0,
            log_every=1,
            output_dir=os.path.join(tmp, "run"),
            progress=False,
            report_to="none",
            pack=False,
        )
    t = run.summary["throughput"]

    model = run.model
    ids, mask, rng = common.token_batch(args.batch, args.seq)
    batch = {
        "input_ids": jnp.asarray(ids),
        "attention_mask": jnp.asarray(mask),
        "labels": jnp.asarray(rng.integers(0, model.num_labels, (args.batch,)).astype("int32")),
        "weights": jnp.ones((args.batch,), jnp.float32),
    }
    tx = optax.adamw(2e-5, weight_decay=0.01)
    box = {"s": create_state(model.params, tx)}
    step = common.jit_train_step(make_train_step(model, tx), model.plan)

    def one():
        box["s"], met = step(box["s"], batch)
        met["loss"].block_until_ready()

    flops = StepFlops.of(model)(args.batch, args.seq)
    res = common.run_interleaved({"step": one}, repeats=args.repeats, warmup=2, examples=args.batch, flops=flops)
    bench_tps = args.batch * args.seq / res["step"].median
    out = {
        "device": device_name(),
        "run_tokens_per_s": t["tokens_per_s"],
        "bench_tokens_per_s": bench_tps,
        "ratio": t["tokens_per_s"] / bench_tps,
        "run_model_tflops_per_s": t.get("model_tflops_per_s"),
        "bench_model_tflops_per_s": flops / res["step"].median / 1e12,
        "run_steps_timed": t["steps_timed"],
        "bench_ms_per_step": res["step"].spread(digits=1),
    }
    print(f"# {out['device']}; all-MiniLM-L6-v2, mean pooler, {args.batch} x {args.seq} tokens")
    print("| measured by | tokens/s | model TFLOP/s |")
    print("| --- | --- | --- |")
    print(
        f"| fh.train summary ({t['steps_timed']} steps) | {t['tokens_per_s']:.0f} | "
        f"{t.get('model_tflops_per_s', float('nan')):.4f} |"
    )
    print(
        f"| bench step (median of {args.repeats}: {out['bench_ms_per_step']} ms) | {bench_tps:.0f} | "
        f"{out['bench_model_tflops_per_s']:.4f} |"
    )
    print(f"run / bench: {out['ratio']:.3f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
