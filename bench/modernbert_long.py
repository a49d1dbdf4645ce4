"""Long sequences on ModernBERT: flaxheads' native backbone vs PyTorch (``attn_implementation="sdpa"``).

    python bench/modernbert_long.py [--lengths 512,2048,8192] [--layers 22] [--repeats 3]

A random ModernBERT-base-like model (hidden 768, 12 heads, GeGLU 1152, local window 128,
a global layer every 3rd; ``--layers`` fewer when the machine is slow), saved as an HF
folder both systems load. Batch 1, random ids, no padding; the backbone's last hidden state.

Per length, each in its own fresh process:

* memory, one process per system: after one 16-token call (so one-time runtime setup is not
  counted), flaxheads compiles ahead of time (XLA's buffer sizes from the compiled program's
  memory analysis), then its first execution at the length runs under the resident-set sampler
  of :mod:`bench.common` (peak growth over the level just before the call) and ``ru_maxrss``
  is read before and after it; PyTorch's first forward at the length under the same two probes;
* time, both systems in one process, interleaved, medians of ``--repeats`` after the first call;
  the two outputs are compared (max abs difference of the hidden states).

Ratios: PyTorch time / flaxheads time (> 1: flaxheads faster) and PyTorch peak / flaxheads peak
(> 1: flaxheads uses less).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE = dict(
    hidden_size=768,
    num_attention_heads=12,
    intermediate_size=1152,
    num_hidden_layers=22,
    local_attention=128,
    vocab_size=50368,
    max_position_embeddings=8192,
)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def make_folder(out: str, layers: int) -> str:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    every = 3
    kinds = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    cfg = tf.ModernBertConfig(
        **{**BASE, "num_hidden_layers": layers},
        layer_types=kinds,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    tf.ModernBertModel(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _ids(t: int):
    import numpy as np

    ids = np.random.default_rng(0).integers(5, BASE["vocab_size"], (1, t)).astype(np.int32)
    return ids, np.ones_like(ids)


def _flaxheads(folder: str, t: int):
    """(blocking forward, AOT-compiled program's XLA bytes) for flaxheads."""
    import jax

    from bench import common
    from flaxheads.backbones.registry import load_backbone

    bb = load_backbone(folder, implementation="native")
    ids, mask = _ids(t)
    fwd = jax.jit(lambda p, i, m: bb.encode(p, i, m))
    compiled = fwd.lower(bb.params, ids, mask).compile()
    m = compiled.memory_analysis()
    xla = {"temp": int(m.temp_size_in_bytes), "total": common.xla_bytes(fwd, bb.params, ids, mask)}
    return (lambda: compiled(bb.params, ids, mask).block_until_ready()), xla


def _pytorch(folder: str, t: int):
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    ids, mask = (torch.tensor(x).long() for x in _ids(t))

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).last_hidden_state

    return run, None


SYSTEMS = {"flaxheads": _flaxheads, "pytorch": _pytorch}


def child_memory(folder: str, system: str, t: int) -> dict:
    from bench import common

    SYSTEMS[system](folder, 16)[0]()  # one short call first: thread pools, kernels and caches exist before
    fn, xla = SYSTEMS[system](folder, t)
    before = _maxrss()
    with common.PeakRSS() as pk:
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
    return {"peak_rss": pk.peak, "maxrss_delta": max(0, _maxrss() - before), "xla": xla, "first_exec_s": first}


def child_time(folder: str, t: int, repeats: int) -> dict:
    import numpy as np

    runs = {name: make(folder, t)[0] for name, make in SYSTEMS.items()}
    outs, times = {}, {name: [] for name in runs}
    for name, fn in runs.items():
        outs[name] = np.asarray(fn())  # first call: compile (flaxheads is compiled already) + warm-up
    names = list(runs)
    for r in range(repeats):
        for name in names[r % 2 :] + names[: r % 2]:
            time.sleep(0.2)
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    diff = float(np.abs(outs["flaxheads"] - outs["pytorch"]).max())
    return {"times": times, "max_abs_diff": diff, "max_abs": float(np.abs(outs["pytorch"]).max())}


def _child(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse(argv=None):
    from bench import common

    ap = common.parser(__doc__)
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--layers", type=int, default=BASE["num_hidden_layers"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    from bench import common

    common.configure_xla(args.xla_flags)
    if args.child:
        kind, folder, *rest = args.child
        res = (
            child_memory(folder, rest[0], int(rest[1]))
            if kind == "memory"
            else child_time(folder, int(rest[0]), int(rest[1]))
        )
        print(json.dumps(res))
        return
    mb = 2**20
    print(f"# {common.environment()}")
    kinds = ["global" if i % 3 == 0 else "local" for i in range(args.layers)]
    print(
        f"# ModernBERT-base-like, {args.layers} layers ({kinds.count('global')} global, {kinds.count('local')} "
        f"local, window 128), batch 1; PyTorch attn_implementation='sdpa'; median of {args.repeats}"
    )
    print(
        "| tokens | flaxheads ms | PyTorch ms | speed (PyTorch / flaxheads time) | flaxheads peak MB (RSS growth / "
        "maxrss delta / XLA temp) | PyTorch peak MB (RSS growth / maxrss delta) | memory ratio (PyTorch / "
        "flaxheads RSS growth) | max abs diff |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(tmp, args.layers)
        for t in (int(x) for x in args.lengths.split(",")):
            mem = {s: _child(["memory", folder, s, str(t)]) for s in SYSTEMS}
            tim = _child(["time", folder, str(t), str(args.repeats)])
            fx, pt = (statistics.median(tim["times"][s]) for s in SYSTEMS)
            f, p = mem["flaxheads"], mem["pytorch"]
            print(
                f"| {t} | {fx * 1e3:.0f} | {pt * 1e3:.0f} | {pt / fx:.2f}x | {f['peak_rss'] / mb:.0f} / "
                f"{f['maxrss_delta'] / mb:.0f} / {f['xla']['temp'] / mb:.0f} | {p['peak_rss'] / mb:.0f} / "
                f"{p['maxrss_delta'] / mb:.0f} | {p['peak_rss'] / max(f['peak_rss'], 1):.2f}x | "
                f"{tim['max_abs_diff']:.1e} (of {tim['max_abs']:.1f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
