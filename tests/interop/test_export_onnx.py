"""``--format onnx``: onnxruntime runs ``model.onnx`` with flaxheads' logits (within 1e-4) on padded
batches of other sizes than the traced one, for HF presets and custom poolers + heads on BERT,
RoBERTa, DeBERTa-v3, ModernBERT and a left-padded decoder; the folder carries labels and tokenizer."""

import json

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed on this stack")

from hf_tiny import padded_batch, tiny_torch_model  # noqa: E402

import flaxheads as fh  # noqa: E402

#: (arch, padding side, pooler, head, head options); pooler None = the family's HF preset. The legacy
#: stack (torch 2.13's exporter) runs an encoder preset, a decoder preset and a custom pooler + head;
#: the newest stack runs them all.
CASES = [
    pytest.param("bert", "right", None, None, {}, marks=pytest.mark.legacy),
    pytest.param(
        "bert",
        "right",
        ["cls", "attention"],
        "mlp",
        {"hidden_dims": (16,), "layer_norm": True},
        marks=pytest.mark.legacy,
    ),
    ("roberta", "right", "max", "linear", {}),
    ("deberta-v2", "right", None, None, {}),
    ("modernbert", "right", "weighted_mean", "projection", {"features": 3, "normalize": True}),
    pytest.param("qwen3", "left", None, None, {}, marks=pytest.mark.legacy),
    ("qwen3", "left", ["last", "mean"], "mlp", {}),
]


def _run(folder, names, ids, mask):
    sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == names
    feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    return sess.run(["logits"], {n: feed[n] for n in names})[0]


@pytest.mark.full  # export round trips through onnxruntime
@pytest.mark.parametrize(
    "arch,side,pooler,head,options",
    CASES,
    ids=[f"{c[0]}-{c[3] or 'preset'}" for c in (getattr(c, "values", c) for c in CASES)],
)
def test_onnxruntime_logits_equal_flaxheads(arch, side, pooler, head, options, tmp_path):
    over = {"pooler_hidden_act": "gelu"} if arch == "deberta-v2" else {}
    tiny_torch_model(arch, num_labels=3, seed=4, **over).save_pretrained(tmp_path / "src", safe_serialization=True)
    model = fh.from_pretrained(
        tmp_path / "src",
        pooler=pooler,
        head=head,
        head_options=options or None,
        id2label=["x", "y", "z"],
        ignore_mismatched_sizes=True,
    )
    fh.interop.export_onnx(model, tmp_path / "onnx")
    cfg = json.loads((tmp_path / "onnx" / "config.json").read_text())
    assert cfg["id2label"] == {"0": "x", "1": "y", "2": "z"} and cfg["problem_type"] == model.problem_type
    assert "auto_map" not in cfg and not (tmp_path / "onnx" / "modeling_flaxheads.py").exists()
    names = cfg["onnx_inputs"]
    assert names[:2] == ["input_ids", "attention_mask"]
    ids, mask = padded_batch(arch, model.backbone.config, side)  # 3 x 9, traced with 2 x 8
    shorter = slice(2, 9) if side == "left" else slice(0, 6)  # a shorter padded batch, its padding kept
    forward = jax.jit(model.apply)  # eagerly each operation compiles on its own, for each of the three shapes
    for rows, cols in ((slice(None), slice(None)), (slice(0, 1), slice(None)), (slice(None), shorter)):
        i, m = np.ascontiguousarray(ids[rows, cols]), np.ascontiguousarray(mask[rows, cols])
        want = np.asarray(forward(model.params, i, m))
        np.testing.assert_allclose(_run(tmp_path / "onnx", names, i, m), want, atol=1e-4, rtol=0)


@pytest.mark.legacy
def test_onnx_folder_is_not_read_back_as_weights(tmp_path):
    tiny_torch_model("bert", num_labels=2).save_pretrained(tmp_path / "src", safe_serialization=True)
    fh.interop.export_onnx(
        fh.from_pretrained(tmp_path / "src", pooler="mean", head="linear", ignore_mismatched_sizes=True),
        tmp_path / "onnx",
    )
    with pytest.raises(fh.FlaxheadsError, match="ONNX export.*onnxruntime"):
        fh.interop.load_transformers(tmp_path / "onnx")
