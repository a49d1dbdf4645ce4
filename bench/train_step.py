"""One training step (forward + backward + AdamW) of a BERT classifier: flaxheads vs HF Flax
(run_flax_glue-style jitted step) vs PyTorch eager.

    python bench/train_step.py [--batch 32] [--seq 128] [--repeats 8]

Same checkpoint (all-MiniLM-L6-v2 + a seeded 5-label classifier), same batch, dropout on,
interleaved; ``--precision bfloat16``: flaxheads' bf16 backbone (float32 master weights, head and
loss) against PyTorch's bf16 autocast around forward and loss. Systems:

* ``flaxheads``: ``flaxheads.train.make_train_step`` + ``flaxheads.optim.make_optimizer``
  (clip 1.0, AdamW), jitted with the state donated, default encoder (flaxheads' own BERT); BERT's
  pooler reads [CLS] only, so the last layer runs at that token alone (``pooled_token_only``)
* ``flaxheads_all_tokens``: the same step computing every position's last hidden state, as
  PyTorch does (``pooled_token_only=False``: what a mean-pooled model's step costs)
* ``flaxheads_hf_backbone``: the same step with ``implementation="hf_flax"``
* ``hf_flax``: ``FlaxBertForSequenceClassification``, ``optax.adamw``, ``jax.value_and_grad``
  of softmax cross-entropy, jitted with the state donated (transformers' run_flax_glue.py step)
* ``pytorch``: ``BertForSequenceClassification.train()``, ``torch.optim.AdamW``,
  clip_grad_norm_ 1.0, ``loss.backward()``, ``step()``, ``zero_grad()``
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv=None):
    from bench import common

    ap = common.parser(__doc__, repeats=8, systems=common.default_systems())
    common.add_precision(ap)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    from bench import common

    common.configure_xla(args.xla_flags)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import torch

    from bench.forward import classifier_checkpoint

    src = args.model or common.minilm_path()
    b, t = args.batch, args.seq
    ids, mask, rng = common.token_batch(b, t)
    labels = rng.integers(0, args.labels, (b,)).astype(np.int32)
    want = common.precision_systems(args.systems, args.precision)
    bf16 = args.precision == "bfloat16"
    dtype = jax.numpy.bfloat16 if bf16 else jax.numpy.float32
    systems, xla = {}, {}
    batch = {
        "input_ids": jnp.asarray(ids),
        "attention_mask": jnp.asarray(mask),
        "labels": jnp.asarray(labels),
        "weights": jnp.ones((b,), jnp.float32),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = classifier_checkpoint(src, args.labels, tmp)
        import flaxheads as fh
        from flaxheads.training.optim import OptimConfig, make_optimizer
        from flaxheads.training.steps import create_state, make_train_step

        for name, impl, only in (
            ("flaxheads", "native", True),
            ("flaxheads_all_tokens", "native", False),
            ("flaxheads_hf_backbone", "hf_flax", True),
        ):
            if name not in want:
                continue
            m = dataclasses.replace(fh.from_pretrained(path, implementation=impl, dtype=dtype), pooled_token_only=only)
            tx = make_optimizer(
                OptimConfig(learning_rate=2e-5, total_steps=1000), fold_reductions=m.plan.fold_reductions
            )
            box = {"s": create_state(m.params, tx, seed=0)}
            step = common.jit_train_step(make_train_step(m, tx), m.plan)
            xla[name] = common.xla_bytes(step, box["s"], batch)

            def run(step=step, box=box):
                box["s"], met = step(box["s"], batch)
                met["loss"].block_until_ready()

            systems[name] = run
            cfg = m.backbone.config
        if "hf_flax" in want:
            from transformers import FlaxBertForSequenceClassification

            hf = FlaxBertForSequenceClassification.from_pretrained(path, local_files_only=True)
            htx = optax.adamw(2e-5, weight_decay=0.01)
            hbox = {"s": (hf.params, htx.init(hf.params), jax.random.PRNGKey(0))}

            def hf_step(state, batch):
                params, opt, key = state
                key, drop = jax.random.split(key)

                def loss_fn(p):
                    logits = hf(batch["input_ids"], batch["attention_mask"], params=p, dropout_rng=drop, train=True)[0]
                    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

                loss, g = jax.value_and_grad(loss_fn)(params)
                upd, opt = htx.update(g, opt, params)
                return (optax.apply_updates(params, upd), opt, key), loss

            hstep = common.jit_train_step(hf_step)
            xla["hf_flax"] = common.xla_bytes(hstep, hbox["s"], batch)

            def run_hf():
                hbox["s"], loss = hstep(hbox["s"], batch)
                loss.block_until_ready()

            systems["hf_flax"] = run_hf
            cfg = hf.config
        if "pytorch" in want:
            from transformers import BertForSequenceClassification

            tm = BertForSequenceClassification.from_pretrained(path).train()
            opt = torch.optim.AdamW(tm.parameters(), lr=2e-5, weight_decay=0.01)
            tids, tmask = torch.tensor(ids).long(), torch.tensor(mask).long()
            tlab = torch.tensor(labels).long()

            def run_torch():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # HF Trainer(bf16=True)'s form
                    loss = tm(tids, attention_mask=tmask, labels=tlab).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(tm.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            systems["pytorch"] = run_torch
            cfg = tm.config
    flops = common.train_flops(common.bert_forward_flops(cfg, b, t, args.labels))
    print(f"# train step, {os.path.basename(src.rstrip('/'))}, batch {b} x seq {t}, {flops / 1e9:.1f} GFLOP/step")
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
    if "flaxheads" in res:
        print("#", common.POOLED_TOKEN_NOTE)
    print(common.table(f"train {t}x{b}", res, roof["roof"]))
    ours = "flaxheads" if "flaxheads" in res else next(iter(res))
    print("#", common.summary_line(f"train {t}x{b}", res, ours, roof["roof"]))
    return res


if __name__ == "__main__":
    main()
