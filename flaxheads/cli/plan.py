"""flaxheads plan: per-device memory of a training run from the model folder's config.json alone."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from flaxheads.cli.train import _model_flags, add_lora_flags, flags, mesh_flag


def add_plan_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-device memory of a training run, from config.json alone", description=__doc__)
    _model_flags(p)
    add_lora_flags(p)
    p.add_argument("--mesh", type=mesh_flag, default=None, help="device mesh, e.g. fsdp=8 (default: one device)")
    p.add_argument("--batch-size", type=flags.positive_int, default=16)
    p.add_argument("--max-length", type=flags.positive_int, default=128)
    p.add_argument("--freeze-backbone", action="store_true")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=lambda args, program=None: print(plan_command(vars(args))) or 0)


def plan_command(a: Mapping[str, Any]) -> str:
    # imported here: the mesh's host devices are forced first
    from flaxheads.training.memory_plan import plan_from_flags

    return plan_from_flags(**{k: a[k] for k in a if k not in ("func", "command")})
