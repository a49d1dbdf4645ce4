"""Native backbone families: flaxheads (jitted) vs PyTorch eager, forward and one train step.

    python bench/backbones.py [--families bart] [--batch 32] [--seq 128] [--repeats 10]

Each family is a random ``XForSequenceClassification`` of one small realistic size (hidden
384, 12 heads, FFN 1536, 6 layers; BART: 6 encoder + 6 decoder layers), saved as an HF
folder that both systems load. Same batch (random ids, the last token <eos> where the head
needs one, no padding), interleaved, medians over ``--repeats`` after warm-up.

* forward: ``fh.from_pretrained(folder).apply`` jitted vs ``model.eval()`` under ``torch.no_grad()``;
* train step: ``make_train_step`` with ``optax.adamw`` (backbone trained, dropout on), jitted
  with the state donated, vs ``model.train()``, cross-entropy ``backward()``, ``AdamW.step()``.

Add a family with one entry in :data:`CONFIGS`.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZE = dict(hidden=384, heads=12, ffn=1536, layers=6, vocab=30522, positions=512)


def _bart(tf, s, **kw):
    return tf.BartConfig(
        vocab_size=s["vocab"],
        d_model=s["hidden"],
        encoder_layers=s["layers"],
        decoder_layers=s["layers"],
        encoder_attention_heads=s["heads"],
        decoder_attention_heads=s["heads"],
        encoder_ffn_dim=s["ffn"],
        decoder_ffn_dim=s["ffn"],
        max_position_embeddings=s["positions"],
        **kw,
    )


def _bert_like(name: str, **fixed):
    def make(tf, s, **kw):
        return getattr(tf, name)(
            vocab_size=s["vocab"],
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            intermediate_size=s["ffn"],
            max_position_embeddings=s["positions"],
            **fixed,
            **kw,
        )

    return make


def _distilbert(tf, s, **kw):
    return tf.DistilBertConfig(
        vocab_size=s["vocab"],
        dim=s["hidden"],
        n_layers=s["layers"],
        n_heads=s["heads"],
        hidden_dim=s["ffn"],
        max_position_embeddings=s["positions"],
        **kw,
    )


def _gpt2(tf, s, **kw):
    # token ids inside the vocabulary (GPT2Config's default <eos> 50256 is not), pad for the last-token head
    return tf.GPT2Config(
        vocab_size=s["vocab"],
        n_embd=s["hidden"],
        n_layer=s["layers"],
        n_head=s["heads"],
        n_inner=s["ffn"],
        n_positions=s["positions"],
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        **kw,
    )


def _modernbert(tf, s, **kw):
    # GeGLU (Wi is 2 x intermediate wide), local window 128 (dense at --seq 128), a global layer every 3rd;
    # special ids inside the vocabulary (ModernBertConfig's defaults are not)
    return tf.ModernBertConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        intermediate_size=s["ffn"],
        max_position_embeddings=s["positions"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        **kw,
    )


def _decoder(name: str, **fixed):
    # grouped-query attention (4 key/value heads for 12 query heads); pad id for the last-token head
    def make(tf, s, **kw):
        return getattr(tf, name)(
            vocab_size=s["vocab"],
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=4,
            intermediate_size=s["ffn"],
            max_position_embeddings=s["positions"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **fixed,
            **kw,
        )

    return make


#: family -> f(transformers module, SIZE, **config kwargs) -> config of the PyTorch model
CONFIGS = {
    "bart": _bart,
    "roberta": _bert_like("RobertaConfig", pad_token_id=1, bos_token_id=0, eos_token_id=2),
    "electra": _bert_like("ElectraConfig", embedding_size=128),
    "distilbert": _distilbert,
    "albert": _bert_like("AlbertConfig", embedding_size=128),
    "gpt2": _gpt2,
    "modernbert": _modernbert,
    # DeBERTa-v3 layout (the settings of deberta-v3-xsmall/small/base/large)
    "deberta-v2": _bert_like(
        "DebertaV2Config",
        relative_attention=True,
        position_buckets=256,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        max_relative_positions=-1,
        type_vocab_size=0,
    ),
    "llama": _decoder("LlamaConfig"),
    "qwen3": _decoder("Qwen3Config", head_dim=32),
}


def parse(argv=None):
    from bench import common

    ap = common.parser(__doc__, repeats=10)
    ap.add_argument("--families", default=",".join(CONFIGS), help=f"comma-separated, of {sorted(CONFIGS)}")
    return ap.parse_args(argv)


def _folder(family: str, labels: int, out: str) -> str:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = CONFIGS[family](tf, SIZE, num_labels=labels)
    tf.AutoModelForSequenceClassification.from_config(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _batch(cfg, b: int, t: int, labels: int):
    from bench import common

    ids, mask, rng = common.token_batch(b, t)
    ids = ids % cfg.vocab_size
    if getattr(cfg, "eos_token_id", None) is not None:
        ids[ids == cfg.eos_token_id] = 5
        ids[:, -1] = cfg.eos_token_id  # BART's head reads the last <eos>
    return ids, mask, rng.integers(0, labels, (b,)).astype("int32")


def _systems(path: str, ids, mask, labels):
    """{("forward"|"train", "flaxheads"|"pytorch"): blocking callable}."""
    import jax
    import jax.numpy as jnp
    import optax
    import torch
    from transformers import AutoModelForSequenceClassification

    import flaxheads as fh
    from bench import common
    from flaxheads.training.steps import create_state, make_train_step

    m = fh.from_pretrained(path)
    fwd = jax.jit(m.apply)
    tx = optax.adamw(2e-5, weight_decay=0.01)
    box = {"s": create_state(m.params, tx)}
    step = common.jit_train_step(make_train_step(m, tx), m.plan)
    batch = {
        "input_ids": jnp.asarray(ids),
        "attention_mask": jnp.asarray(mask),
        "labels": jnp.asarray(labels),
        "weights": jnp.ones(len(ids), jnp.float32),
    }

    def train_fx():
        box["s"], met = step(box["s"], batch)
        met["loss"].block_until_ready()

    tm = AutoModelForSequenceClassification.from_pretrained(path)
    opt = torch.optim.AdamW(tm.parameters(), lr=2e-5, weight_decay=0.01)
    tids, tmask, tlab = (torch.tensor(x).long() for x in (ids, mask, labels))

    def forward_pt():
        tm.eval()
        with torch.no_grad():
            tm(input_ids=tids, attention_mask=tmask).logits.numpy()

    def train_pt():
        tm.train()
        loss = torch.nn.functional.cross_entropy(tm(input_ids=tids, attention_mask=tmask).logits, tlab)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return {
        ("forward", "flaxheads"): lambda: fwd(m.params, ids, mask).block_until_ready(),
        ("forward", "pytorch"): forward_pt,
        ("train", "flaxheads"): train_fx,
        ("train", "pytorch"): train_pt,
    }


def main(argv=None) -> dict:
    args = parse(argv)
    from bench import common

    common.configure_xla(args.xla_flags)
    import transformers as tf

    print(f"# {common.environment()}")
    print(f"# size {SIZE}, batch {args.batch} x {args.seq}, median of {args.repeats} after warm-up")
    print("| family | bench | flaxheads ms | PyTorch ms | flaxheads / PyTorch speed | first call s (flaxheads) |")
    print("| --- | --- | --- | --- | --- | --- |")
    out = {}
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = _folder(family, args.labels, tmp)
            ids, mask, labels = _batch(tf.AutoConfig.from_pretrained(path), args.batch, args.seq, args.labels)
            systems = _systems(path, ids, mask, labels)
            for bench in ("forward", "train"):
                pair = {k[1]: f for k, f in systems.items() if k[0] == bench}
                res = common.run_interleaved(pair, repeats=args.repeats, examples=args.batch, flops=0.0)
                fx, pt = res["flaxheads"], res["pytorch"]
                out[(family, bench)] = res
                print(
                    f"| {family} | {bench} | {fx.spread()} | {pt.spread()} | "
                    f"{pt.median / fx.median:.2f}x | {fx.first:.1f} |",
                    flush=True,
                )
    return out


if __name__ == "__main__":
    main()
