"""With transformers not importable, flaxheads still tokenises (tokenizer.json), trains, saves a head
checkpoint and exports; PyTorch transformers then loads the export with the trained logits."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from train_helpers import tiny_bert_folder  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

pytestmark = pytest.mark.legacy

TEXTS = ["alpha beta gamma delta", "stock market bank share profit", "film music actor", "goal match team player"]

_SCRIPT = r"""
import json, sys
sys.modules["transformers"] = None  # as if not installed: `import transformers` raises ImportError
import jax, jax.numpy as jnp, numpy as np
import flaxheads as fh
from flaxheads.data import tables
from flaxheads.data import splits as D
from flaxheads.training.optim import OptimConfig, make_optimizer
from flaxheads.training.steps import create_state, make_train_step

src, out, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tok = fh.load_tokenizer(src)
assert type(tok) is fh.Tokenizer, tok
table = tables.TextTable(texts=texts, labels=["a", "b", "c", "a"], source="memory", rows=[""] * len(texts))
split = D.tokenize(table, np.array([0, 1, 2, 0], np.int32), tok, max_length=16)
model = fh.from_pretrained(src, num_labels=3)
# a frozen backbone: the head checkpoint then holds everything that changed
tx = make_optimizer(OptimConfig(learning_rate=5e-2, total_steps=2, schedule="constant", freeze_backbone=True))
state = create_state(model.params, tx, freeze_backbone=True)
batch = {k: jnp.asarray(v) for k, v in D.collate(split, np.arange(4), 4, (16,), pad_id=tok.pad_token_id).items()}
state, metrics = jax.jit(make_train_step(model, tx, freeze_backbone=True))(state, batch)
assert np.isfinite(float(metrics["loss"])), metrics
model.params = state.params
fh.save_head(out + "/ckpt", model)
fh.interop.export_transformers(model, out + "/pt")
fh.interop.export_head(model, out + "/head")
again = fh.checkpoint.model_from_checkpoint(out + "/ckpt")
enc = tok(texts)
logits = np.asarray(model(jnp.asarray(enc["input_ids"]), jnp.asarray(enc["attention_mask"]),
                          token_type_ids=jnp.asarray(enc["token_type_ids"])))
np.testing.assert_array_equal(
    logits, np.asarray(again(jnp.asarray(enc["input_ids"]), jnp.asarray(enc["attention_mask"]),
                             token_type_ids=jnp.asarray(enc["token_type_ids"]))))
assert sys.modules["transformers"] is None and not [m for m in sys.modules if m.startswith("transformers.")]
np.savez(out + "/result.npz", logits=logits, **enc)
"""


@pytest.mark.slow
def test_tokenize_train_checkpoint_export_without_transformers(tmp_path):
    src = tiny_bert_folder(tmp_path / "src")
    assert os.path.isfile(os.path.join(src, "tokenizer.json"))
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, src, str(out), json.dumps(TEXTS)],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = np.load(out / "result.npz")
    ref = AutoTokenizer.from_pretrained(src)(TEXTS, padding=True, truncation=True, return_tensors="np")
    for k in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    pt = AutoModelForSequenceClassification.from_pretrained(out / "pt").eval()
    with torch.no_grad():
        want = pt(**{k: torch.tensor(ref[k]) for k in ref}).logits.numpy()
    np.testing.assert_allclose(got["logits"], want, atol=1e-4, rtol=0)
    before = AutoModelForSequenceClassification.from_pretrained(src).eval()
    with torch.no_grad():
        untrained = before(**{k: torch.tensor(ref[k]) for k in ref}).logits.numpy()
    assert np.abs(untrained - want).max() > 1e-3  # the export carries the trained weights
    assert {"head.safetensors", "head_config.json"} <= set(os.listdir(out / "head"))
