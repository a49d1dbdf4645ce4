"""An ONNX folder for serving: ``model.onnx`` (inputs ``input_ids``, ``attention_mask`` and, for
backbones with token types, ``token_type_ids``; output ``logits``; batch and sequence axes dynamic),
``config.json`` (labels, problem type, multi-label threshold) and the tokenizer files.

The graph is traced from the PyTorch model of the transformers export (:mod:`.transformers`: an HF
class for a preset, flaxheads' own PyTorch code for any other pooler + head), so it needs torch and
transformers at export time (``pip install flaxheads[onnx]``); serving needs onnxruntime only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from flaxheads.disk.files import write_json
from flaxheads.interop.files import TOKENIZER_FILES, ExportError, atomic_dir, read_json
from flaxheads.interop.transformers import export_transformers

ONNX_FILE = "model.onnx"
#: ONNX operator set of the graph (onnxruntime 1.17+ runs it)
OPSET = 17


def _torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise ExportError(
            "an ONNX export traces the PyTorch model: it needs torch and transformers (pip install 'flaxheads[onnx]')"
        ) from None
    return torch


def torch_model(folder: str):
    """The PyTorch model of a transformers export folder, in eval mode with eager attention (which traces
    to plain ONNX operators); flaxheads' own code is imported from the package, not from the folder."""
    from flaxheads.interop.remote_code import is_flaxheads_config

    if is_flaxheads_config(read_json(os.path.join(folder, "config.json"))):
        from flaxheads.interop.modeling_flaxheads import FlaxheadsForSequenceClassification

        return FlaxheadsForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()


def input_names(backbone_config) -> list[str]:
    """The graph's inputs: token types only where the backbone has more than one type (BERT, ELECTRA, ALBERT)."""
    types = int(getattr(backbone_config, "type_vocab_size", 0) or 0)
    return ["input_ids", "attention_mask"] + (["token_type_ids"] if types > 1 else [])


def _example(names: list[str], vocab: int) -> tuple:
    """A padded batch of two rows to trace with (the axes stay dynamic)."""
    import torch

    ids = torch.tensor(np.random.default_rng(0).integers(3, max(4, min(vocab, 100)), size=(2, 8)))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return tuple({"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}[n] for n in names)


def _logits_module(pt, names: list[str]):
    import torch

    class Logits(torch.nn.Module):
        """The graph's inputs (``names``, in order) -> logits, its one output."""

        def __init__(self):
            super().__init__()
            self.model = pt

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
            return self.model(**{n: inputs[n] for n in names}, return_dict=True).logits

    return Logits().eval()


def trace(pt, names: list[str], example: tuple, path: str) -> None:
    """``model.onnx`` of ``pt`` with dynamic batch and sequence axes.

    The TorchScript exporter first: it traces in well under a second into plain operators. Where the
    model's code is beyond a trace (transformers 4.57 builds decoders' causal masks with ``vmap``),
    the ``torch.export`` based exporter, which takes seconds to minutes but follows such code."""
    import torch

    module = _logits_module(pt, names)
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    with torch.no_grad(), warnings.catch_warnings():
        # the tracer's notes on Python-side checks in transformers' code: the graph is checked against
        # flaxheads on other shapes than the traced one (tests/interop/test_export_onnx.py)
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                module,
                example,
                path,
                dynamic_axes={**axes, "logits": {0: "batch"}},
                dynamo=False,
                input_names=names,
                output_names=["logits"],
                opset_version=OPSET,
            )
            return
        except Exception as e:  # noqa: BLE001 - any tracing failure: the other exporter decides
            first = f"{type(e).__name__}: {str(e)[:200]}"
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
        shapes: dict[str, Any] = {
            n: {0: batch, 1: seq} for n in ("input_ids", "attention_mask", "token_type_ids") if n in names
        }
        try:
            # weights beside the graph (model.onnx.data) only past protobuf's 2 GB limit
            big = sum(p.numel() * p.element_size() for p in pt.parameters()) > 1.8e9
            torch.onnx.export(
                module,
                example,
                path,
                dynamic_shapes=shapes,
                dynamo=True,
                external_data=big,
                input_names=names,
                output_names=["logits"],
                opset_version=OPSET,
            )
        except Exception as e:  # noqa: BLE001
            raise ExportError(
                f"torch.onnx cannot export this {type(pt).__name__}: TorchScript exporter: {first}; "
                f"dynamo exporter: {type(e).__name__}: {str(e)[:200]}"
            ) from None


def export_onnx(
    model,
    out: str | os.PathLike,
    *,
    params: Mapping | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    threshold: float | None = None,
    overwrite: bool = False,
) -> str:
    """Write ``model`` as ``model.onnx`` + ``config.json`` + tokenizer files; returns ``out``.

    Any model :func:`~flaxheads.interop.transformers.export_transformers` writes (HF presets and any
    other pooler + head on a native backbone); ``threshold``: the multi-label threshold recorded."""
    _torch()
    with tempfile.TemporaryDirectory() as tmp:
        pt_dir = os.path.join(tmp, "pt")
        export_transformers(model, pt_dir, params=params, tokenizer_from=tokenizer_from, threshold=threshold)
        pt = torch_model(pt_dir)
        names = input_names(model.backbone.config)
        with atomic_dir(out, overwrite) as o:
            trace(pt, names, _example(names, int(model.backbone.config.vocab_size)), os.path.join(o, ONNX_FILE))
            cfg = read_json(os.path.join(pt_dir, "config.json"))
            cfg.pop("auto_map", None)  # no Python code here: AutoTokenizer must not ask to run any
            cfg.setdefault("threshold", 0.5 if threshold is None else float(threshold))
            cfg["onnx_inputs"] = names
            write_json(os.path.join(o, "config.json"), cfg)
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(pt_dir, name)):
                    shutil.copyfile(os.path.join(pt_dir, name), os.path.join(o, name))
    return os.fspath(out)
