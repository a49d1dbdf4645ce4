"""The LoRA flags of ``flaxheads train``: adapters of ``--lora-rank`` on the kernels
``--lora-targets`` names (default: the backbone's attention query/value projections), or the
adapters and head of a PEFT adapter folder (``--lora-from``) to train on; the base stays frozen,
the adapters and the head train (see :mod:`flaxheads.model.lora`; checked by :mod:`flaxheads.run.checks`)."""

from __future__ import annotations

import argparse

from flaxheads.cli import flags


def targets_list(text: str) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` -> ``("q_proj", "v_proj")``."""
    names = tuple(t.strip() for t in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated kernel names or path globs (e.g. query,value), got {text!r}"
        )
    return names


def add_lora_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("LoRA adapters (the backbone stays frozen; adapters + head train)")
    g.add_argument(
        "--lora-rank",
        type=flags.positive_int,
        default=None,
        help="train LoRA adapters of this rank instead of the whole backbone",
    )
    g.add_argument(
        "--lora-alpha",
        type=flags.positive_float,
        default=None,
        help="adapter scale alpha (the update is alpha/rank * A B; default: 2 x rank)",
    )
    g.add_argument(
        "--lora-dropout",
        type=flags.below_one,
        default=0.0,
        help="dropout on the adapter input; only 0 is supported (adapters are merged into the weights)",
    )
    g.add_argument(
        "--lora-targets",
        type=targets_list,
        default=None,
        help="kernels to adapt: comma-separated module names (query,value; q_proj,v_proj; c_attn) or "
        "/-separated path globs (default: the attention query and value projections)",
    )
    g.add_argument(
        "--lora-from",
        default=None,
        metavar="ADAPTER_DIR",
        help="continue training a PEFT LoRA sequence-classification adapter folder on --model (its base): "
        "its rank, targets, adapters and classifier head (the base's Hugging Face head; --pooler "
        "and --head do not apply)",
    )
