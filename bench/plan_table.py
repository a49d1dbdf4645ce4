"""The memory plan table of docs/performance.md: Llama-3.1-8B and -70B shapes (configs written from
the published values in bench/configs; no weights) on 1x H100, 8x H100, v5e-8 and v5p-8, for a full
fine-tune, LoRA on a bfloat16 base and QLoRA nf4. Each plan is XLA:CPU's compile of the real train step
on 1 or 8 forced host devices (see flaxheads/training/memory_plan.py).

    python bench/plan_table.py [batch] [length]      # prints a markdown table
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flaxheads as fh  # noqa: E402
from flaxheads.model.lora import LoraConfig  # noqa: E402
from flaxheads.training.memory_plan import plan_table  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = {
    "full fine-tune": dict(precision="bfloat16", base_dtype="float32"),
    "LoRA r16, bf16 base": dict(precision="bfloat16", base_dtype="bfloat16", lora=LoraConfig(16, 32.0)),
    "QLoRA nf4 r16": dict(precision="bfloat16", base_dtype="bfloat16", lora=LoraConfig(16, 32.0), quantize="nf4"),
}
DEVICES = ["H100 80GB", "TPU v5e 16GB", "TPU v5p 95GB"]


def main(batch: int = 8, length: int = 2048) -> None:
    rows = []
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        for run, opts in RUNS.items():
            for mesh in (None, "fsdp=8"):
                t = time.perf_counter()
                p = fh.plan_memory(
                    os.path.join(HERE, "configs", name),
                    batch_size=batch,
                    max_length=length,
                    mesh=mesh,
                    remat="full",
                    **opts,
                )
                rows.append((f"{name} {run}", p))
                print(
                    f"{name} {run} {mesh}: peak {p.total / 2**30:.1f} GiB ({time.perf_counter() - t:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    print(plan_table(rows, DEVICES))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
