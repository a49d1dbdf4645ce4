"""Frozen-backbone head training on BBC News: cached features vs recomputing the backbone,
the whole linear probe vs PyTorch encoding alone, and a K-head vmapped sweep vs one head.

    python bench/cached_head.py [--limit 500] [--max-length 256] [--epochs 20] [--sweep 16] [--precision bfloat16]

``--limit 0`` uses all 2225 documents (the full corpus; several minutes).
Systems, on the same documents and length buckets:

* flaxheads encode: ``flaxheads.features.cache_features`` (mean pooling, all-MiniLM-L6-v2)
* PyTorch encode: ``AutoModel`` under ``torch.inference_mode``, the same batches, each at its
  group's padded length (``flaxheads.features.encode_groups``; flaxheads may run a short group
  padded further, when that costs less than a compile), mean pool; the two systems' encodes
  alternate
* ``--precision bfloat16``: flaxheads' bf16 backbone (float32 parameters and pooled features)
  against PyTorch under ``autocast(bfloat16)``
* head epochs on the cache: ``flaxheads.sweep.sweep`` with one head (linear, AdamW), as
  ``flaxheads train --cache-features`` runs them; the time includes its compile
* head epoch recomputing the backbone: ``make_train_step(freeze_backbone=True)``; a few
  batches are timed and scaled to the epoch's batch count
* sweep: ``flaxheads.sweep.sweep`` with K heads (lr x weight decay x seed) vs K=1
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv=None):
    from bench import common

    ap = common.parser(__doc__)
    ap.add_argument("--limit", type=int, default=500, help="documents (0: all 2225)")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--sweep", type=int, default=16)
    ap.add_argument("--recompute-batches", type=int, default=4)
    common.add_precision(ap)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    from bench import common

    common.configure_xla(args.xla_flags)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    import flaxheads as fh
    from flaxheads.data.batching import make_buckets
    from flaxheads.data.splits import split_indices, tokenize
    from flaxheads.data.tables import bbc_news_path, load_class_folder
    from flaxheads.training.feature_cache import encode_groups
    from flaxheads.training.features import cache_features
    from flaxheads.training.optim import OptimConfig, make_optimizer
    from flaxheads.training.steps import create_state, make_train_step
    from flaxheads.training.sweep import Variant, grid, sweep

    path = common.minilm_path()
    table = load_class_folder(bbc_news_path())
    names = sorted(set(table.labels))
    rng = np.random.default_rng(0)
    idx = np.sort(rng.permutation(len(table))[: args.limit]) if args.limit else np.arange(len(table))
    table = table.take(idx)
    labels = np.asarray([names.index(x) for x in table.labels], np.int32)
    tok = AutoTokenizer.from_pretrained(path)
    split = tokenize(table, labels, tok, args.max_length)
    buckets = make_buckets(args.max_length, 64)
    n = len(split)
    print(
        f"# cached-feature head training, BBC News {n} docs, max_length {args.max_length}, buckets {buckets}, "
        f"batch {args.batch}, {args.precision}"
    )
    if "pytorch" not in common.precision_systems("pytorch", args.precision):
        raise SystemExit("bench/cached_head.py: no PyTorch reference in bfloat16 on this CPU; run it in float32")
    print("#", common.environment())

    bf16 = args.precision == "bfloat16"
    model = fh.from_pretrained(
        path, pooler="mean", head="linear", num_labels=len(names), dtype=jnp.bfloat16 if bf16 else jnp.float32
    )
    # flaxheads encode (compile included: it is part of what a user waits for); run twice, report both
    from flaxheads.training.features import make_encoder

    enc = make_encoder(model, "pooled", ("mean",))  # reused: the second run has every bucket compiled

    def flaxheads_encode():
        return cache_features(
            model, model.params["backbone"], split, batch_size=args.batch, buckets=buckets, encoder=enc
        )

    # PyTorch encode: the batches flaxheads encoded, each at its group's padded length
    tm = AutoModel.from_pretrained(path).eval()
    groups = encode_groups(split.lengths, args.batch, buckets)

    def torch_encode():
        out = np.zeros((n, model.hidden_size), np.float32)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for t, rows in groups.items():
                for s in range(0, len(rows), args.batch):
                    r = rows[s : s + args.batch]
                    ids = np.zeros((len(r), t), np.int64)
                    m = np.zeros((len(r), t), np.int64)
                    for k, i in enumerate(r):
                        x = split.input_ids[i][:t]
                        ids[k, : len(x)], m[k, : len(x)] = x, 1
                    h = tm(torch.from_numpy(ids), attention_mask=torch.from_numpy(m)).last_hidden_state
                    mm = torch.from_numpy(m).unsqueeze(-1).float()
                    out[r] = ((h.float() * mm).sum(1) / mm.sum(1).clamp(min=1e-9)).numpy()
        return out

    enc_times, torch_times = [], []
    for _ in range(2):  # interleaved: the machine drifts over minutes
        t0 = time.perf_counter()
        cache = flaxheads_encode()
        enc_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pooled_t = torch_encode()
        torch_times.append(time.perf_counter() - t0)
    diff = float(np.abs(pooled_t - np.asarray(cache.buckets[0].hidden)[np.argsort(cache.buckets[0].index), 0]).max())

    # the head's epochs on the cache, as `flaxheads train --cache-features` runs them (a one-head
    # sweep: a whole epoch per call); its time includes the compile
    tr_idx, va_idx = split_indices(n, [0.8, 0.2], seed=0, strata=labels)
    cache.labels = labels
    spe = int(np.ceil(n / args.batch))
    cfg = OptimConfig(learning_rate=1e-2, freeze_backbone=True, total_steps=spe * args.epochs, weight_decay=0.0)
    tx = make_optimizer(cfg, fold_reductions=model.plan.fold_reductions)
    head = sweep(model, cache, [Variant(1e-2)], optim=cfg, epochs=args.epochs, batch_size=args.batch)
    head_epoch = head.seconds / args.epochs
    # What a user waits for: the first encode (it compiles every bucket) and the head's training
    # (compile included). The warm figure reuses the compiled encoder.
    probe_total = enc_times[0] + head.seconds
    probe_warm = enc_times[-1] + head.seconds

    # an epoch recomputing the backbone (frozen): time a few real batches, scale to the epoch
    from flaxheads.data.splits import iterate_batches

    fstate = create_state(jax.tree.map(jnp.copy, model.params), tx, freeze_backbone=True)  # donated below
    fstep = common.jit_train_step(make_train_step(model, tx, freeze_backbone=True), model.plan)
    batches = list(iterate_batches(split, args.batch, buckets, seed=0, epoch=0, group_by_length=True))
    sample = batches[: args.recompute_batches]
    for b in sample:  # compile every bucket in the sample first
        fstate, met = fstep(fstate, b)
    met["loss"].block_until_ready()
    t0 = time.perf_counter()
    for b in sample:
        fstate, met = fstep(fstate, b)
    met["loss"].block_until_ready()
    recompute_epoch = (time.perf_counter() - t0) / len(sample) * len(batches)

    # sweep K vs 1 (same epochs)
    tr_cache = _subset(cache, tr_idx)
    va_cache = _subset(cache, va_idx)
    k = args.sweep
    lrs = [1e-3, 3e-3, 1e-2, 3e-2][: max(1, min(4, k))]
    variants = grid(lrs, weight_decays=(0.0, 0.01), seeds=(0, 1))[:k]
    while len(variants) < k:
        variants += grid([1e-2], seeds=(len(variants),))
    r1 = sweep(model, tr_cache, variants[:1], epochs=args.epochs, batch_size=args.batch, val=va_cache)
    rk = sweep(model, tr_cache, variants, epochs=args.epochs, batch_size=args.batch, val=va_cache)
    r1b = sweep(model, tr_cache, variants[:1], epochs=args.epochs, batch_size=args.batch, val=va_cache)
    one = min(r1.seconds, r1b.seconds)

    rows = [
        "| bench | measure | flaxheads | PyTorch | ratio |",
        "| --- | --- | --- | --- | --- |",
        f"| cached BBC {n}x{args.max_length} | encode once, s (2nd run; 1st incl. compile {enc_times[0]:.1f}) | "
        f"{enc_times[-1]:.1f} | {min(torch_times):.1f} | {min(torch_times) / enc_times[-1]:.2f}x |",
        f"| cached BBC {n}x{args.max_length} | head epoch on cache (incl. compile), ms | {head_epoch * 1e3:.1f} | - | "
        f"{recompute_epoch / head_epoch:.0f}x faster than recomputing ({recompute_epoch:.1f} s/epoch) |",
        f"| cached BBC {n}x{args.max_length} | linear probe: encode (incl. compiles) + {args.epochs} epochs, s | "
        f"{probe_total:.1f} | {min(torch_times):.1f} (encode only) | {min(torch_times) / probe_total:.2f}x |",
        f"| cached BBC {n}x{args.max_length} | linear probe, encoder already compiled, s | {probe_warm:.1f} | "
        f"{min(torch_times):.1f} (encode only) | {min(torch_times) / probe_warm:.2f}x |",
        f"| cached BBC {n}x{args.max_length} | sweep K={k} vs K=1, s for {args.epochs} epochs | {rk.seconds:.2f} "
        f"vs {one:.2f} | - | {rk.seconds / one:.2f}x the cost of one head |",
    ]
    print(f"# max |flaxheads - PyTorch| mean-pooled features: {diff:.1e}")
    print("\n".join(rows))
    print(
        f"# sweep best: {rk.variants[rk.best].label()} val {rk.metric} {rk.scores[rk.best]:.4f} "
        f"(K=1 head: {r1.scores[0]:.4f})"
    )
    print(
        f"# cached: probe {probe_total:.1f} s (incl. compiles) vs PyTorch encode {min(torch_times):.1f} s; "
        f"head epoch {recompute_epoch / head_epoch:.0f}x faster on cache; "
        f"K={k} sweep {rk.seconds / one:.2f}x one head"
    )


def _subset(cache, idx):
    """A pooled cache restricted to examples ``idx`` (same example numbering)."""
    import dataclasses

    import numpy as np

    b = cache.buckets[0]
    keep = np.isin(b.index, idx)
    nb = dataclasses.replace(b, index=b.index[keep], hidden=np.asarray(b.hidden)[keep], mask=np.asarray(b.mask)[keep])
    return dataclasses.replace(cache, buckets=[nb])


if __name__ == "__main__":
    main()
