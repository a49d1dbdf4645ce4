"""The LoRA flags of ``flaxheads train``: adapters of ``--lora-rank`` on the kernels
``--lora-targets`` names (default: the backbone's attention query/value projections), or the
adapters and head of a PEFT adapter folder (``--lora-from``) to train on; the base stays frozen,
the adapters and the head train (see :mod:`flaxheads.lora`)."""
from __future__ import annotations

import argparse
import os

from ..errors import UsageError
from ..lora import LoraConfig
from ..model import SequenceModel
from . import flags

#: Peak learning rate of adapters when --lr is not given (adapters start at B = 0 and need a larger step).
LORA_LR = 1e-3


def targets_list(text: str) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` -> ``("q_proj", "v_proj")``."""
    names = tuple(t.strip() for t in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated kernel names or path globs (e.g. query,value), "
                                         f"got {text!r}")
    return names


def add_lora_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("LoRA adapters (the backbone stays frozen; adapters + head train)")
    g.add_argument("--lora-rank", type=flags.positive_int, default=None,
                   help="train LoRA adapters of this rank instead of the whole backbone")
    g.add_argument("--lora-alpha", type=flags.positive_float, default=None,
                   help="adapter scale alpha (the update is alpha/rank * A B; default: 2 x rank)")
    g.add_argument("--lora-dropout", type=flags.below_one, default=0.0,
                   help="dropout on the adapter input; only 0 is supported (adapters are merged into the weights)")
    g.add_argument("--lora-targets", type=targets_list, default=None,
                   help="kernels to adapt: comma-separated module names (query,value; q_proj,v_proj; c_attn) or "
                        "/-separated path globs (default: the attention query and value projections)")
    g.add_argument("--lora-from", default=None, metavar="ADAPTER_DIR",
                   help="continue training a PEFT LoRA sequence-classification adapter folder on --model (its base): "
                        "its rank, targets, adapters and classifier head (the base's Hugging Face head; --pooler "
                        "and --head do not apply)")


def check_lora_flags(args: argparse.Namespace) -> None:
    """LoRA settings need ``--lora-rank`` and a backbone that runs forward with them (not cached features)."""
    if getattr(args, "lora_from", None) is not None:
        given = [f for f, v in (("--lora-rank", args.lora_rank), ("--lora-alpha", args.lora_alpha),
                                ("--lora-targets", args.lora_targets)) if v is not None]
        if given:
            raise UsageError(f"{given[0]} cannot be combined with --lora-from: the adapter folder sets its rank, alpha "
                             "and targets")
        if not os.path.isdir(args.lora_from):
            raise UsageError(f"--lora-from {args.lora_from!r} is not a folder (expected a PEFT adapter folder with "
                             "adapter_config.json)")
        if not os.path.isfile(os.path.join(args.lora_from, "adapter_config.json")):
            raise UsageError(f"--lora-from {args.lora_from}: no adapter_config.json; expected a PEFT adapter folder")
    if args.lora_rank is None and getattr(args, "lora_from", None) is None:
        given = [f for f, v in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets),
                                ("--lora-dropout", args.lora_dropout or None)) if v is not None]
        if given:
            raise UsageError(f"{given[0]} sets up LoRA adapters; it needs --lora-rank (e.g. --lora-rank 8)")
        return
    if args.freeze_backbone or args.cache_features or args.sweep:
        flag = "--lora-rank" if args.lora_rank is not None else "--lora-from"
        raise UsageError(f"{flag} trains adapters inside the backbone; it cannot run with --freeze-backbone, "
                         "--cache-features or --sweep (which train the head alone on fixed features)")


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    if args.lora_rank is None:
        return None
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    return LoraConfig(rank=args.lora_rank, alpha=alpha, dropout=args.lora_dropout, targets=args.lora_targets)


def trains_adapters(args: argparse.Namespace) -> bool:
    """Whether the run trains LoRA adapters (new ones, or a PEFT adapter's)."""
    return args.lora_rank is not None or getattr(args, "lora_from", None) is not None


def with_lora_flags(args: argparse.Namespace, model: SequenceModel) -> SequenceModel:
    """``model`` with the adapters the flags ask for (unchanged without ``--lora-rank``)."""
    cfg = lora_config(args)
    return model if cfg is None else model.with_lora(cfg, seed=args.seed)
