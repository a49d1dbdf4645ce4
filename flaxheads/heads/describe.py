"""``describe(model)``: what the head does, step by step, and where each weight came from."""

from __future__ import annotations

import jax
import numpy as np

from flaxheads.losses import LOSS_NAMES


def _count(tree) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(tree)))


def describe(model, params=None, *, file=None) -> str:
    """Return (and print, unless ``file=False``) a step-by-step account of ``model``."""
    params = model.params if params is None else params
    h = model.hidden_size
    cfg = model.backbone.config
    head_p = params["head"]
    pooler, head = model.head.pooler, model.head.head
    pooled = pooler.out_features(h)
    pre = {p: n for p, n in model.report.pretrained}

    def origin(prefix: str) -> str:
        mods = [p for p in model.report.new + list(pre) if p.startswith(prefix + "/")]
        if not mods:
            return "no weights"
        parts = [
            f"{p.split('/', 1)[1]} " + (f"pretrained ({pre[p]})" if p in pre else "NEW (random init)")
            for p in sorted(mods)
        ]
        return ", ".join(parts)

    dtype = getattr(model.backbone, "dtype", None)
    lines = [
        f"flaxheads model on {model.name_or_path or '<in memory>'}",
        f"  backbone : {type(model.backbone).__name__} ({cfg.model_type}), hidden {h}, compute dtype "
        f"{np.dtype(dtype).name if dtype is not None else 'float32'}, {_count(params['backbone']):,} params, "
        "pretrained",
        f"             input_ids [B,T] -> last hidden state [B,T,{h}]",
        f"  pool mask: {model.pool_mask}"
        + {
            "non_pad_token": f" (input_ids != pad_token_id={model.pad_token_id})",
            "eos_token": f" (input_ids == eos_token_id={model.eos_token_id})",
        }.get(model.pool_mask, ""),
        f"  pooler   : {type(pooler).__name__}: " + " -> ".join(pooler.steps(h)) + f"  => [B,{pooled}]",
        f"             {_count(head_p.get('pooler', {})):,} params; {origin('pooler')}",
        f"  head     : {type(head).__name__}: "
        + " -> ".join(head.steps(pooled))
        + f"  => [B,{head.out_features() or pooled}]",
        f"             {_count(head_p.get('head', {})):,} params; {origin('head')}",
        f"  output   : [B,{model.num_labels}] float32",
    ]
    if model.id2label:
        lines.append("  labels   : " + ", ".join(f"{i}={n}" for i, n in sorted(model.id2label.items())))
    lines.append(f"  problem  : {model.problem_type}; loss: {LOSS_NAMES.get(model.problem_type, '?')}")
    lines.append(
        "  preset   : "
        + (
            f"HF-exact {model.arch} head (same weights and numbers as PyTorch "
            f"transformers' {model.model_type} sequence classifier)"
            if model.arch
            else "custom pooler/head combination"
        )
    )
    lines.append(f"  total    : {_count(params):,} params ({_count(head_p):,} in the head)")
    text = "\n".join(lines)
    if file is not False:
        print(text, file=file)
    return text
