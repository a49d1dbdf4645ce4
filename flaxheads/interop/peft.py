"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) for a model
with LoRA adapters, written with numpy only.

``peft.PeftModel.from_pretrained(base, folder)``, with ``base`` the PyTorch
``AutoModelForSequenceClassification`` of the backbone folder (``num_labels`` as trained), gives
the flaxheads model's logits. What PEFT expects, and what this writes:

* adapter weights ``base_model.model.<torch module>.lora_A.weight [r, in]`` and
  ``.lora_B.weight [out, r]``; ``target_modules`` lists the full torch module names, so PEFT
  adapts exactly the kernels flaxheads adapted; ``fan_in_fan_out`` for GPT-2's ``Conv1D``;
* ``task_type: SEQ_CLS`` and the trained head as ``modules_to_save``, saved under the
  classifier's own names (``base_model.model.classifier.weight``, BERT's
  ``base_model.model.bert.pooler.dense.*``), as PEFT saves them.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from ..backbones.weights import head_to_hf
from ..lora import A, B, LORA, adapter_modules, kernels_out_in
from .files import ExportError, atomic_dir, np_tree, save_safetensors, write_json
from .transformers import backbone_state_dict, check_transformers_exportable, exportable_family

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
#: The head modules PEFT itself keeps trainable for SEQ_CLS (a name inside them is saved under them).
SEQ_CLS_HEADS = ("classifier", "score")


def torch_module_names(model, modules, prefix: str) -> dict[tuple[str, ...], str]:
    """``{module path: PyTorch module name}`` of backbone kernels, found by writing a distinct
    constant into each and reading where the backbone's own name map puts it."""
    flat = flatten_dict(model.params["backbone"])
    marks = {m + ("kernel",): float(i + 1) for i, m in enumerate(modules)}
    tree = unflatten_dict({k: np.full(np.shape(v), marks.get(k, 0.0), np.float32) for k, v in flat.items()})
    plain = dataclasses.replace(model, lora=None)
    state = backbone_state_dict(plain, {"backbone": tree, "head": {}}, prefix=prefix)
    by_mark = {float(v.flat[0]): k for k, v in state.items() if v.size and v.flat[0] != 0 and np.all(v == v.flat[0])}
    out = {}
    for m in modules:
        name = by_mark.get(marks[m + ("kernel",)])
        if name is None or not name.endswith(".weight"):
            raise ExportError(f"the kernel {'/'.join(m)} has no single PyTorch weight of its own, so PEFT cannot "
                              "adapt it; export the merged model with export_transformers instead")
        out[m] = name[: -len(".weight")]
    return out


def modules_to_save(hf_names) -> list[str]:
    """PEFT's ``modules_to_save`` for the head modules ``hf_names`` (HF names, in order)."""
    out: list[str] = []
    for _, name in hf_names:
        top = name.split(".")[0]
        pick = top if top in SEQ_CLS_HEADS else name
        if pick not in out:
            out.append(pick)
    return out


def adapter_config(model, target_modules: list[str], saved: list[str]) -> dict:
    """``adapter_config.json`` of a LoRA ``SEQ_CLS`` adapter (PEFT's keys)."""
    cfg = model.lora
    return {"peft_type": "LORA", "task_type": "SEQ_CLS",
            "base_model_name_or_path": os.path.abspath(model.name_or_path) if model.name_or_path else None,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": target_modules, "modules_to_save": saved,
            "fan_in_fan_out": kernels_out_in(model.model_type), "bias": "none", "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "inference_mode": True, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def peft_state_dict(model, params: Mapping | None = None) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """(tensors of ``adapter_model.safetensors``, target module names, modules_to_save)."""
    if getattr(model, "lora", None) is None:
        raise ExportError("this model has no LoRA adapters: a PEFT folder holds adapters; export the model with "
                          "export_transformers, or add adapters with model.with_lora(...) and train them")
    match = check_transformers_exportable(model)
    params = params or model.params
    adapters = {m: {k: np.asarray(v, np.float32) for k, v in ab.items()}
                for m, ab in adapter_modules(np_tree(params[LORA])).items()}
    names = torch_module_names(model, list(adapters), exportable_family(match.arch).base_model_prefix)
    state = {}
    for m, ab in adapters.items():
        state[f"{PEFT_PREFIX}{names[m]}.lora_A.weight"] = ab[A].T  # [r, in]
        state[f"{PEFT_PREFIX}{names[m]}.lora_B.weight"] = ab[B].T  # [out, r]
    state.update({PEFT_PREFIX + k: v for k, v in head_to_hf(np_tree(params["head"]), match.hf_names).items()})
    return state, sorted(set(names.values())), modules_to_save(match.hf_names)


def export_peft(model, out: str | os.PathLike, *, params: Mapping | None = None, overwrite: bool = False) -> str:
    """Write ``model``'s LoRA adapters and head as a PEFT adapter folder; returns ``out``.

    The model must be an HF-exact preset (like :func:`~flaxheads.interop.transformers.export_transformers`);
    the folder loads with ``PeftModel.from_pretrained(AutoModelForSequenceClassification
    .from_pretrained(backbone_folder, num_labels=N), out)``."""
    state, targets, saved = peft_state_dict(model, params)
    with atomic_dir(out, overwrite) as tmp:
        write_json(os.path.join(tmp, ADAPTER_CONFIG), adapter_config(model, targets, saved))
        save_safetensors(state, os.path.join(tmp, ADAPTER_WEIGHTS))
    return os.fspath(out)
