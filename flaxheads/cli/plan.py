"""flaxheads plan: per-device memory of a training run, from the model folder's config.json alone
(no weights read), and which devices it fits (:func:`flaxheads.memory_plan.plan_memory`)."""
from __future__ import annotations

import argparse
import json

from .train import _model_flags, add_lora_flags, flags, mesh_flag


def add_plan_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-device memory of a training run, from config.json alone", description=__doc__)
    _model_flags(p)
    add_lora_flags(p)
    p.add_argument("--mesh", type=mesh_flag, default=None, help="device mesh, e.g. fsdp=8 (default: one device)")
    p.add_argument("--batch-size", type=flags.positive_int, default=16)
    p.add_argument("--max-length", type=flags.positive_int, default=128)
    p.add_argument("--freeze-backbone", action="store_true")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace, program=None) -> int:
    from ..memory_plan import _mesh_devices, force_host_devices

    force_host_devices(_mesh_devices(args.mesh))  # before JAX's backend starts
    from ..memory_plan import lora_from_flags, plan_memory

    plan = plan_memory(args.model, batch_size=args.batch_size, max_length=args.max_length, mesh=args.mesh,
                       lora=lora_from_flags(args.lora_rank, args.lora_alpha, args.lora_targets),
                       base_dtype=args.base_dtype, precision="bfloat16" if args.bf16 else args.precision or "float32",
                       remat=args.remat, quantize=args.quantize, freeze_backbone=args.freeze_backbone)
    print(json.dumps(plan.to_dict()) if args.json else "\n".join(plan.lines()))
    return 0
