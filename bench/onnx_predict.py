"""Texts/s of text-in prediction served by onnxruntime (CPU) from ``flaxheads export --format onnx``,
against flaxheads' Classifier (``flaxheads predict``) and PyTorch transformers'
``pipeline("text-classification")`` on the transformers export of the same model: all-MiniLM-L6-v2
with ``flaxheads train``'s default head (mean pooler + linear, 5 labels, so flaxheads' own PyTorch
code), on BBC News articles (cut at --max-length tokens by every system) and on single words.

onnxruntime's time includes tokenizing (the export's fast tokenizer, padded to the longest text of
each batch), as the other two systems' do. Each system gets its fastest batch size among
--batch-sizes, then the systems run interleaved (bench/common.run_interleaved); ratios are against
the pipeline, measured in the same run.

  python bench/onnx_predict.py --long 64 --short 512
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402
from bench.predict import fastest, samples  # noqa: E402


def onnx_predictor(folder: str, max_length: int):
    """``f(texts, batch_size) -> logits`` of the ONNX export, tokenizing per batch."""
    import numpy as np
    import onnxruntime as ort
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count() or 1
    sess = ort.InferenceSession(os.path.join(folder, "model.onnx"), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def predict(texts, batch_size):
        out = []
        for i in range(0, len(texts), batch_size):
            enc = tok(
                texts[i : i + batch_size], padding=True, truncation=True, max_length=max_length, return_tensors="np"
            )
            out.append(sess.run(["logits"], {n: enc[n].astype(np.int64) for n in names})[0])
        return np.concatenate(out)

    return predict


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--long", type=int, default=64, help="BBC News articles")
    ap.add_argument("--short", type=int, default=512, help="single words")
    ap.add_argument("--batch-sizes", default="8,32,128")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per text")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    common.configure_xla(args.xla_flags)
    import warnings

    from flaxheads.predict import TruncationWarning

    warnings.simplefilter("ignore", TruncationWarning)

    import numpy as np
    import onnxruntime
    from transformers import pipeline

    import flaxheads as fh
    from flaxheads.predict import Classifier

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    long_texts, short_texts = samples(args.long, args.short)
    tmp = tempfile.mkdtemp(prefix="bench-onnx-")
    model = fh.from_pretrained(
        common.minilm_path(), pooler="mean", head="linear", num_labels=5, seed=0, ignore_mismatched_sizes=True
    )
    pt_dir = fh.export(model, os.path.join(tmp, "pt"))
    onnx_dir = fh.export(model, os.path.join(tmp, "onnx"), format="onnx")
    L = args.max_length
    pipe = pipeline("text-classification", model=pt_dir, top_k=None, device="cpu", trust_remote_code=True)
    clf = Classifier.from_pretrained(pt_dir, max_length=L)
    run_onnx = onnx_predictor(onnx_dir, L)

    print(common.environment())
    print(f"onnxruntime {onnxruntime.__version__}, {os.cpu_count()} threads")
    print(
        f"texts: {len(long_texts)} BBC News articles (cut at {L} tokens), {len(short_texts)} single words; "
        f"batch sizes tried: {sizes}\n"
    )
    print("| texts | system | texts/s | median s (min..max) | batch | vs pipeline | vs flaxheads predict |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, texts in (("BBC News", long_texts), ("single words", short_texts)):
        systems = {
            "onnxruntime": lambda b: run_onnx(texts, b),
            "flaxheads predict": lambda b: clf.predict(texts, batch_size=b, progress=False),
            "pipeline": lambda b: pipe(texts, batch_size=b, truncation=True, max_length=L),
        }
        ours = clf.predict(texts, batch_size=32, progress=False).logits
        served = run_onnx(texts, 32)
        print(f"<!-- {label}: max |logit diff| onnxruntime vs flaxheads {np.abs(ours - served).max():.1e} -->")
        chosen = {name: fastest(fn, sizes)[0] for name, fn in systems.items()}
        res = common.run_interleaved(
            {n: (lambda f=fn, b=chosen[n]: f(b)) for n, fn in systems.items()},
            repeats=args.repeats,
            warmup=1,
            examples=len(texts),
            flops=0.0,
        )
        for name, r in res.items():
            print(
                f"| {label} | {name} | {r.eps:.1f} | {r.spread(scale=1.0, digits=2)} | {chosen[name]} | "
                f"{r.eps / res['pipeline'].eps:.2f}x | {r.eps / res['flaxheads predict'].eps:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
