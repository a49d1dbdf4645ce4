"""Train-step model FLOP utilisation (MFU) of flaxheads' BERT, fused attention and remat on/off.

    python bench/mfu.py [--dtype bfloat16] [--peak-tflops 989] [--batch 32] [--repeats 10]

On one GPU (bf16 activations, the dense bf16 peak of the card; H100 SXM: 989 TFLOP/s):

    python bench/mfu.py --dtype bfloat16 --peak-tflops 989

Smoke run (seconds, any backend): ``python bench/mfu.py --layers 1 --batch 2 --repeats 1 --seq 32``.

Models: random-init ``BertForSequenceClassification`` folders (``transformers``, seed 0, 2 labels)
of BERT-base size (hidden 768, 12 layers, 12 heads, FFN 3072) at 128 and 512 tokens and
MiniLM-L6 size (hidden 384, 6 layers, 12 heads, FFN 1536) at 128 tokens. Attention dropout is
0 in every variant (the fused kernels have none; hidden dropout 0.1 stays on), so the four
variants run the same function. Step: ``make_train_step`` with ``optax.adamw``, jitted with
the state donated; each variant compiled ahead of time with its attention choice
(``FLAXHEADS_ATTENTION=fused`` or the backend's unfused default) and timed interleaved with the
others of its model, median over ``--repeats``.

Model FLOPs per step (fwd + bwd = 3 x forward, 2 FLOPs per multiply-add; embeddings, norms,
softmax and the optimizer not counted; remat's recomputation not counted, as MFU defines it):

    6 x N_matmul x B x T  +  12 x L x T^2 x H x B  +  6 x (H^2 + H x labels) x B

with ``N_matmul = L x (4 H^2 + 2 H x FFN)`` (q, k, v, output, the two FFN matrices), the middle
term the score and context products (``QK^T`` and ``PV``: ``4 T^2 H`` per layer forward), the
last the pooler and classifier. MFU = model FLOPs / step time / peak. The count is the library's
(``flaxheads.training.flops``), the one a run's logged MFU uses.

Peak: ``--peak-tflops``; without it, measured: on CPU the fp32 GEMM roof of
:func:`bench.common.matmul_roof` (2048^3, JAX or PyTorch, whichever is faster), elsewhere a JAX
8192^3 matmul in ``--dtype``. The table names the device and the peak it used.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: name -> (hidden, layers, heads, ffn)
SIZES = {"bert-base": (768, 12, 12, 3072), "minilm-l6": (384, 6, 12, 1536)}
DEFAULT_RUNS = "bert-base:128,bert-base:512,minilm-l6:128"
LABELS = 2


def parse(argv=None):
    from bench import common

    ap = common.parser(__doc__)
    ap.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated size:tokens (sizes: {', '.join(SIZES)})")
    ap.add_argument("--seq", type=int, default=None, help="tokens for every run (overrides --runs' lengths)")
    ap.add_argument("--layers", type=int, default=None, help="layers for every model (smoke runs)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s to divide by (else measured)")
    ap.add_argument("--variants", default="unfused,fused,unfused+remat,fused+remat")
    return ap.parse_args(argv)


def model_flops(hidden: int, layers: int, ffn: int, batch: int, seq: int, labels: int = LABELS) -> float:
    """Model FLOPs of one train step (forward + backward), the formula in the module docstring:
    3 x :func:`bench.common.bert_forward_flops`, which counts the same products."""
    from types import SimpleNamespace

    from bench import common

    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers)
    return common.train_flops(common.bert_forward_flops(cfg, batch, seq, labels))


def device_name() -> str:
    import jax

    kind = jax.devices()[0].device_kind
    if jax.default_backend() != "cpu":
        return f"{jax.default_backend()}: {kind} x{jax.device_count()} (1 used)"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), kind)
    except (OSError, subprocess.SubprocessError):
        model = kind
    return f"cpu: {model}, {os.cpu_count()} cores"


def peak_flops(args) -> tuple[float, str]:
    """(FLOP/s, how it was obtained)."""
    import jax

    from bench import common

    if args.peak_tflops:
        return args.peak_tflops * 1e12, "given (--peak-tflops)"
    if jax.default_backend() == "cpu":
        roof = common.matmul_roof()
        return roof["roof"] * 1e9, "measured fp32 GEMM 2048^3 (best of JAX / PyTorch)"
    import jax.numpy as jnp

    n = 8192
    a = jnp.ones((n, n), args.dtype)
    mm = jax.jit(lambda x: x @ x)
    res = common.run_interleaved(
        {"mm": lambda: mm(a).block_until_ready()}, repeats=10, examples=1, flops=2.0 * n**3, settle=0.0
    )
    return max(2.0 * n**3 / t for t in res["mm"].times), f"measured JAX {args.dtype} matmul {n}^3"


def _folder(size: str, layers: int | None, out: str) -> str:
    import torch
    import transformers as tf

    h, n, heads, ffn = SIZES[size]
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        hidden_size=h,
        num_hidden_layers=layers or n,
        num_attention_heads=heads,
        intermediate_size=ffn,
        num_labels=LABELS,
        attention_probs_dropout_prob=0.0,
    )
    tf.BertForSequenceClassification(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _compiled_step(path: str, dtype, remat: bool, fused: bool, batch: dict):
    """(a blocking callable running one donated train step compiled with the attention choice, compile s)."""
    import optax

    import flaxheads as fh
    from bench import common
    from flaxheads.layers.attention import ATTENTION_ENV
    from flaxheads.training.steps import create_state, make_train_step

    m = fh.from_pretrained(path, dtype=dtype, remat=remat)
    tx = optax.adamw(2e-5, weight_decay=0.01)
    box = {"s": create_state(m.params, tx)}
    before = os.environ.get(ATTENTION_ENV)
    os.environ[ATTENTION_ENV] = "fused" if fused else "auto"
    t0 = time.perf_counter()
    try:  # the choice is read while tracing: compile now, under it
        step = common.jit_train_step(make_train_step(m, tx), m.plan).lower(box["s"], batch).compile()
    finally:
        if before is None:
            os.environ.pop(ATTENTION_ENV)
        else:
            os.environ[ATTENTION_ENV] = before

    def run():
        box["s"], met = step(box["s"], batch)
        met["loss"].block_until_ready()

    return run, time.perf_counter() - t0


def main(argv=None) -> list[dict]:
    args = parse(argv)
    from bench import common

    common.configure_xla(args.xla_flags)
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(args.dtype)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    peak, how = peak_flops(args)
    print(f"# train-step MFU, {device_name()}; activations {args.dtype}; batch {args.batch}")
    print(
        f"# peak {peak / 1e12:.2f} TFLOP/s: {how}; unfused = the backend's default attention "
        f"({'CPU-tuned' if jax.default_backend() == 'cpu' else 'textbook'})"
    )
    print("#", common.environment())
    rows = []
    print("| model | tokens | variant | ms/step (min..max) | model TFLOP/step | TFLOP/s | MFU | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in (r.strip() for r in args.runs.split(",") if r.strip()):
        size, seq = run.split(":")
        seq = args.seq or int(seq)
        h, n, _, ffn = SIZES[size]
        n = args.layers or n
        ids, mask, rng = common.token_batch(args.batch, seq)
        batch = {
            "input_ids": jnp.asarray(ids),
            "attention_mask": jnp.asarray(mask),
            "labels": jnp.asarray(rng.integers(0, LABELS, (args.batch,)).astype("int32")),
            "weights": jnp.ones((args.batch,), jnp.float32),
        }
        flops = model_flops(h, n, ffn, args.batch, seq)
        with tempfile.TemporaryDirectory() as tmp:
            path = _folder(size, args.layers, tmp)
            built = {v: _compiled_step(path, dtype, "remat" in v, v.startswith("fused"), batch) for v in variants}
            systems = {v: f for v, (f, _) in built.items()}
            res = common.run_interleaved(systems, repeats=args.repeats, warmup=2, examples=args.batch, flops=flops)
        for v, r in res.items():
            tps = flops / r.median
            rows.append(
                dict(model=f"{size} x{n}", tokens=seq, variant=v, ms=r.median * 1e3, tflops=tps / 1e12, mfu=tps / peak)
            )
            print(
                f"| {size} ({n} layers) | {seq} | {v} | {r.spread(digits=1)} | {flops / 1e12:.4f} | "
                f"{tps / 1e12:.3f} | {100 * tps / peak:.1f}% | {built[v][1]:.1f} |",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
