"""Forward pass (inference) of a BERT classifier: flaxheads vs HF Flax vs PyTorch eager.

    python bench/forward.py [--batch 32] [--seq 128] [--repeats 10]

All systems load the same checkpoint (all-MiniLM-L6-v2 + a seeded 5-label classifier saved
in PyTorch layout), run the same full-length batch, interleaved, and their logits are
compared (max |diff| vs PyTorch is printed); ``--precision bfloat16`` runs flaxheads' bf16
backbone against PyTorch's bf16 autocast. Systems:

* ``flaxheads``: ``from_pretrained`` default (flaxheads' own BERT encoder), jitted ``apply``; BERT's
  pooler reads [CLS] only, so the last layer runs at that token alone (``pooled_token_only``)
* ``flaxheads_all_tokens``: the same computing every position's last hidden state, as PyTorch does
  (``pooled_token_only=False``: what a mean-pooled or token-level model costs)
* ``flaxheads_hf_backbone``: the same with ``implementation="hf_flax"`` (HF's Flax BERT inside)
* ``hf_flax``: ``FlaxBertForSequenceClassification``, jitted
* ``pytorch``: ``BertForSequenceClassification`` in eval mode under ``torch.inference_mode``
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv=None):
    from bench import common

    ap = common.parser(__doc__, repeats=10, systems=common.default_systems())
    common.add_precision(ap)
    return ap.parse_args(argv)


def classifier_checkpoint(src: str, num_labels: int, out: str) -> str:
    """``src`` backbone + a seeded classifier, saved in PyTorch layout: every system loads it."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    m = BertForSequenceClassification.from_pretrained(src, num_labels=num_labels)
    m.save_pretrained(out, safe_serialization=True)
    return out


def main(argv=None) -> dict:
    args = parse(argv)
    from bench import common

    common.configure_xla(args.xla_flags)

    import jax
    import numpy as np
    import torch

    src = args.model or common.minilm_path()
    b, t = args.batch, args.seq
    ids, mask, _ = common.token_batch(b, t)
    want = common.precision_systems(args.systems, args.precision)
    bf16 = args.precision == "bfloat16"
    dtype = jax.numpy.bfloat16 if bf16 else jax.numpy.float32
    systems, outputs, xla = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        path = classifier_checkpoint(src, args.labels, tmp)
        import flaxheads as fh

        jids, jmask = jax.numpy.asarray(ids), jax.numpy.asarray(mask)
        for name, impl, only in (
            ("flaxheads", "native", True),
            ("flaxheads_all_tokens", "native", False),
            ("flaxheads_hf_backbone", "hf_flax", True),
        ):
            if name in want:
                m = dataclasses.replace(
                    fh.from_pretrained(path, implementation=impl, dtype=dtype), pooled_token_only=only
                )
                f = jax.jit(m.apply)
                systems[name] = lambda f=f, p=m.params: f(p, jids, jmask).block_until_ready()
                outputs[name] = lambda f=f, p=m.params: np.asarray(f(p, jids, jmask))
                xla[name] = common.xla_bytes(f, m.params, jids, jmask)
                cfg = m.backbone.config
        if "hf_flax" in want:
            from transformers import FlaxBertForSequenceClassification

            hf = FlaxBertForSequenceClassification.from_pretrained(path, local_files_only=True)
            g = jax.jit(lambda p, i, a: hf(i, a, params=p).logits)
            systems["hf_flax"] = lambda: g(hf.params, jids, jmask).block_until_ready()
            outputs["hf_flax"] = lambda: np.asarray(g(hf.params, jids, jmask))
            xla["hf_flax"] = common.xla_bytes(g, hf.params, jids, jmask)
            cfg = hf.config
        if "pytorch" in want:
            from transformers import BertForSequenceClassification

            tm = BertForSequenceClassification.from_pretrained(path).eval()
            tids, tmask = torch.tensor(ids).long(), torch.tensor(mask).long()

            def run_torch():
                with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    return tm(tids, attention_mask=tmask).logits.float()

            systems["pytorch"] = run_torch
            outputs["pytorch"] = lambda: run_torch().numpy()
            cfg = tm.config
    flops = common.bert_forward_flops(cfg, b, t, args.labels)
    print(f"# forward, {os.path.basename(src.rstrip('/'))}, batch {b} x seq {t}, {flops / 1e9:.1f} GFLOP/call")
    print("#", common.environment())
    roof = common.matmul_roof(precision=args.precision)
    print(
        f"# {args.precision} matmul roof (2048^3): "
        + ", ".join(f"{k} {v:.0f}" for k, v in roof.items() if k != "roof")
        + " GFLOP/s"
    )
    res = common.run_interleaved(systems, repeats=args.repeats, warmup=2, examples=b, flops=flops)
    for k, r in res.items():
        r.xla_bytes = xla.get(k)
    ref = outputs.get("pytorch")
    if ref is not None:
        r0 = ref()
        diffs = {k: float(np.abs(o() - r0).max()) for k, o in outputs.items() if k != "pytorch"}
        print("# max |logits - PyTorch|:", ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    if "flaxheads" in res:
        print("#", common.POOLED_TOKEN_NOTE)
    print(common.table(f"forward {t}x{b}", res, roof["roof"]))
    ours = "flaxheads" if "flaxheads" in res else next(iter(res))
    print("#", common.summary_line(f"forward {t}x{b}", res, ours, roof["roof"]))
    return res


if __name__ == "__main__":
    main()
