"""Importing PyTorch folders: pytorch_model.bin through torch.load(weights_only=True) only,
and every bad input a clear error with nothing half-written."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from hf_tiny import padded_batch, tiny_torch_model  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.interop import transformers as tf_folder  # noqa: E402

pytestmark = pytest.mark.legacy


def _logits(pt, ids, mask):
    with torch.no_grad():
        return pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.fixture(scope="module")
def bert(tiny_model):
    from pathlib import Path

    path, pt = tiny_model("bert", seed=3, layers=2)  # a test drops one layer's weight
    return pt, Path(path)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_pytorch_model_bin_imports_with_same_logits(tmp_path):
    pt = tiny_torch_model("distilbert", seed=4)
    pt.config.save_pretrained(tmp_path)  # transformers 5 writes safetensors only: the .bin by hand
    torch.save(pt.state_dict(), tmp_path / "pytorch_model.bin")
    assert (tmp_path / "pytorch_model.bin").exists() and not (tmp_path / "model.safetensors").exists()
    model = fh.interop.load_transformers(tmp_path)
    ids, mask = padded_batch("distilbert", pt.config)
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))), _logits(pt, ids, mask), atol=1e-4, rtol=0
    )
    # and out again as safetensors: a bin -> safetensors conversion
    fh.interop.export_transformers(model, tmp_path / "out")
    from transformers import AutoModelForSequenceClassification

    pt2 = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(_logits(pt2, ids, mask), _logits(pt, ids, mask), atol=1e-5, rtol=0)


class _Evil:
    """Unpickling this would create a folder: a stand-in for arbitrary code execution."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


@pytest.mark.parametrize("payload", ["evil", "module", "nested"])
def test_pickle_that_is_not_a_plain_state_dict_is_refused(bert, tmp_path, payload):
    pt, src = bert
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    marker = tmp_path / "pwned"
    obj = {"evil": {"x": _Evil(str(marker))}, "module": pt.classifier, "nested": {"state_dict": pt.state_dict()}}[
        payload
    ]
    torch.save(obj, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="refused to load|flat state dict") as e:
        fh.interop.load_transformers(d)
    assert "pytorch_model.bin" in str(e.value)
    assert not marker.exists()


def test_missing_weights(bert, tmp_path):
    _, src = bert
    d = _copy(src, tmp_path / "m")
    os.remove(d / "model.safetensors")
    (d / "tf_model.h5").write_bytes(b"not read")
    with pytest.raises(fh.interop.ModelImportError, match="no model weights.*tf_model.h5"):
        fh.interop.load_transformers(d)
    # a base model saved under a classifier config: the head weights are missing
    state = load_file(src / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("classifier.")}, d / "model.safetensors")
    with pytest.raises(fh.interop.ModelImportError, match=r"missing weights.*classifier"):
        fh.interop.load_transformers(d)
    # a backbone weight missing
    save_file({k: v for k, v in state.items() if "layer.1.output.dense" not in k}, d / "model.safetensors")
    with pytest.raises(ValueError, match="does not provide"):
        fh.interop.load_transformers(d)


def test_mismatched_shapes(bert, tmp_path):
    _, src = bert
    d = _copy(src, tmp_path / "m")
    state = load_file(src / "model.safetensors")
    bad = dict(
        state, **{"classifier.weight": np.zeros((5, 32), np.float32), "classifier.bias": np.zeros(5, np.float32)}
    )
    save_file(bad, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"classifier has shape \(32, 5\).*needs \(32, 3\).*ignore_mismatched_sizes"):
        fh.interop.load_transformers(d)
    bad = dict(state, **{"bert.encoder.layer.0.intermediate.dense.weight": np.zeros((36, 32), np.float32)})
    save_file(bad, d / "model.safetensors")
    with pytest.raises(fh.interop.ModelImportError, match=r"mismatched shapes.*intermediate\.dense\.weight"):
        fh.interop.load_transformers(d)


def test_unknown_architecture(bert, tmp_path):
    _, src = bert
    d = _copy(src, tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, architectures=["BertForMaskedLM"])))
    with pytest.raises(fh.interop.ModelImportError, match="unknown architecture 'BertForMaskedLM'"):
        fh.interop.load_transformers(d)
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="t5", architectures=["T5ForConditionalGeneration"])))
    with pytest.raises(fh.interop.ModelImportError, match="unknown architecture.*'t5'"):
        fh.interop.load_transformers(d)
    os.remove(d / "config.json")
    with pytest.raises(fh.interop.ModelImportError, match="no config.json"):
        fh.interop.load_transformers(d)


def test_nothing_half_written(bert, tmp_path, monkeypatch):
    pt, src = bert
    model = fh.interop.load_transformers(src)
    out = tmp_path / "out"
    calls = []

    def boom(tensors, path):
        calls.append(path)
        raise OSError("disk full")

    monkeypatch.setattr(tf_folder, "save_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        fh.interop.export_transformers(model, out)
    assert calls and not out.exists()
    assert os.listdir(tmp_path) == []  # the temporary folder is gone too
    monkeypatch.undo()

    # an existing, non-empty folder is never replaced without overwrite=True, and a failed
    # overwrite leaves the old export intact
    fh.interop.export_transformers(model, out)
    before = sorted(os.listdir(out))
    with pytest.raises(FileExistsError, match="overwrite"):
        fh.interop.export_transformers(model, out)
    monkeypatch.setattr(tf_folder, "save_safetensors", boom)
    with pytest.raises(OSError):
        fh.interop.export_transformers(model, out, overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == before and sorted(os.listdir(tmp_path)) == ["out"]
    fh.interop.export_transformers(model, out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["out"]

    # the export is created as the umask says (another user can read it); a plain file in its place
    # is never replaced, overwrite or not, and the refusal is a FlaxheadsError
    old = os.umask(0o022)
    try:
        fh.interop.export_transformers(model, tmp_path / "shared")
    finally:
        os.umask(old)
    assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o755
    assert all((tmp_path / "shared" / f).stat().st_mode & 0o777 == 0o644 for f in os.listdir(tmp_path / "shared"))
    plain = tmp_path / "notes.txt"
    plain.write_text("mine")
    with pytest.raises(fh.FlaxheadsError, match="is a file, not a folder"):
        fh.interop.export_transformers(model, plain, overwrite=True)
    assert plain.read_text() == "mine"
