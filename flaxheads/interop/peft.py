"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) of a sequence
classifier, both ways, with numpy only.

Import (:func:`load_peft`): a ``SEQ_CLS`` LoRA adapter on its base folder becomes a flaxheads model
with the same adapters (``model.lora``, ``params["lora"]``: it trains on and exports back) and the
head PEFT saved through ``modules_to_save``; its logits are ``PeftModel``'s.

Export:

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
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from flaxheads.backbones.weights import head_from_hf, head_to_hf, read_safetensors, read_torch_bin
from flaxheads.disk.files import write_json
from flaxheads.errors import FlaxheadsError
from flaxheads.heads.presets import preset_for
from flaxheads.interop.files import (
    TOKENIZER_FILES,
    ExportError,
    ModelImportError,
    atomic_dir,
    np_tree,
    read_json,
    save_safetensors,
)
from flaxheads.interop.transformers import (
    backbone_state_dict,
    check_transformers_exportable,
    preset_family,
    read_config,
)
from flaxheads.model.lora import LORA, A, B, LoraConfig, adapter_modules, check_adapters, kernel_modules, kernels_out_in

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
#: The head modules PEFT itself keeps trainable for SEQ_CLS (a name inside them is saved under them).
SEQ_CLS_HEADS = ("classifier", "score")


def _kernel_names(model, modules, prefix: str) -> dict[tuple[str, ...], str | None]:
    """``{module path: PyTorch weight name, or None}`` of backbone kernels, found by writing a distinct
    constant into each and reading where the backbone's own name map puts it."""
    flat = flatten_dict(model.params["backbone"])
    marks = {m + ("kernel",): float(i + 1) for i, m in enumerate(modules)}
    tree = unflatten_dict({k: np.full(np.shape(v), marks.get(k, 0.0), np.float32) for k, v in flat.items()})
    plain = dataclasses.replace(model, lora=None)
    state = backbone_state_dict(plain, {"backbone": tree, "head": {}}, prefix=prefix)
    by_mark = {float(v.flat[0]): k for k, v in state.items() if v.size and v.flat[0] != 0 and np.all(v == v.flat[0])}
    return {m: by_mark.get(marks[m + ("kernel",)]) for m in modules}


def torch_module_names(model, modules, prefix: str) -> dict[tuple[str, ...], str]:
    """``{module path: PyTorch module name}`` of backbone kernels (each must have one weight of its own)."""
    found = _kernel_names(model, modules, prefix)
    out = {}
    for m in modules:
        name = found[m]
        if name is None or not name.endswith(".weight"):
            raise ExportError(
                f"the kernel {'/'.join(m)} has no single PyTorch weight of its own, so PEFT cannot "
                "adapt it; export the merged model with export_transformers instead"
            )
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
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS",
        "base_model_name_or_path": os.path.abspath(model.name_or_path) if model.name_or_path else None,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": target_modules,
        "modules_to_save": saved,
        "fan_in_fan_out": kernels_out_in(model.model_type),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def peft_state_dict(model, params: Mapping | None = None) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """(tensors of ``adapter_model.safetensors``, target module names, modules_to_save)."""
    if getattr(model, "lora", None) is None:
        raise ExportError(
            "this model has no LoRA adapters: a PEFT folder holds adapters; export the model with "
            "export_transformers, or add adapters with model.with_lora(...) and train them"
        )
    match = check_transformers_exportable(model)
    params = params or model.params
    adapters = {
        m: {k: np.asarray(v, np.float32) for k, v in ab.items()}
        for m, ab in adapter_modules(np_tree(params[LORA])).items()
    }
    _, family = preset_family(match)
    names = torch_module_names(model, list(adapters), family.base_model_prefix)
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


# ---- import -------------------------------------------------------------------------------------------
ADAPTER_BIN = "adapter_model.bin"


def adapter_config_of(folder: str) -> dict:
    """``adapter_config.json``, checked to be a LoRA sequence-classification adapter flaxheads applies exactly."""
    raw = read_json(os.path.join(folder, ADAPTER_CONFIG))
    if raw.get("peft_type") != "LORA":
        raise ModelImportError(
            f"{folder}: a PEFT {raw.get('peft_type')!r} adapter; flaxheads reads LoRA adapters (peft_type LORA) only"
        )
    if raw.get("task_type") != "SEQ_CLS":
        raise ModelImportError(
            f"{folder}: a PEFT adapter for task {raw.get('task_type')!r}; flaxheads reads sequence "
            "classifiers (task_type SEQ_CLS, saved from a PeftModel on an "
            "AutoModelForSequenceClassification)"
        )
    refused = [k for k in ("use_dora", "rank_pattern", "alpha_pattern") if raw.get(k)]
    if raw.get("bias", "none") != "none":
        refused.append(f"bias={raw['bias']!r}")
    if refused:
        raise ModelImportError(
            f"{folder}: the adapter uses {', '.join(refused)}, which flaxheads' LoRA does not "
            "compute (one rank and alpha for every module, no DoRA, no trained biases)"
        )
    return raw


def adapter_base(folder: str, raw: dict, backbone: str | os.PathLike | None = None) -> str:
    """The base model folder of an adapter: ``backbone`` when given, else ``base_model_name_or_path``."""
    from flaxheads.model.hub import resolve_model_source

    name = os.fspath(backbone) if backbone is not None else raw.get("base_model_name_or_path")
    if not name:
        raise ModelImportError(
            f"{folder} is a PEFT adapter whose adapter_config.json names no base model: pass the "
            "base model folder it was trained on (backbone=..., --backbone)"
        )
    try:
        return resolve_model_source(name, what="base model")
    except FlaxheadsError:
        raise ModelImportError(
            f"{folder} is a PEFT adapter of the base model {name!r}, which is missing here (not a "
            "folder, not in the hub cache): pass the base model folder it was trained on "
            "(backbone=..., --backbone)"
        ) from None


def _adapter_state(folder: str) -> dict[str, np.ndarray]:
    safe, binary = os.path.join(folder, ADAPTER_WEIGHTS), os.path.join(folder, ADAPTER_BIN)
    if os.path.isfile(safe):
        state = read_safetensors(safe)  # checked block by block as it is read
    elif os.path.isfile(binary):
        state = read_torch_bin(binary)
    else:
        raise ModelImportError(
            f"{folder}: no {ADAPTER_WEIGHTS} (or {ADAPTER_BIN}); a PEFT adapter folder holds "
            "adapter_config.json and the adapter weights"
        )
    return {k[len(PEFT_PREFIX) :] if k.startswith(PEFT_PREFIX) else k: v for k, v in state.items()}


def _split_adapters(state) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """``({torch module: {"lora_A": [r, in], "lora_B": [out, r]}}, the other saved tensors)``."""
    lora: dict[str, dict[str, np.ndarray]] = {}
    rest = {}
    for k, v in state.items():
        for part in (A, B):
            tag = f".{part}."
            if tag in k:
                module, _, leaf = k.partition(tag)
                if leaf not in ("weight", "default.weight"):
                    raise ModelImportError(f"adapter tensor {k!r}: expected {module}{tag}weight")
                lora.setdefault(module, {})[part] = v
                break
        else:
            rest[k] = v
    return lora, rest


def _num_labels(folder: str, base_cfg, saved) -> int:
    """The classifier's output count, from the output layer PEFT saved through ``modules_to_save``."""
    preset = preset_for(base_cfg, 2)
    if preset is None:
        raise ModelImportError(
            f"{folder}: the base model_type {base_cfg.get('model_type')!r} has no flaxheads "
            "sequence-classification preset, so its PEFT classifier has no known layout"
        )
    out_layer = preset.hf_names[-1][1]
    if f"{out_layer}.weight" not in saved:
        raise ModelImportError(
            f"{folder}: the adapter holds no classifier weights ({out_layer}.weight): PEFT saves "
            "the trained head through modules_to_save (task_type SEQ_CLS does it by itself); "
            "without it the adapter is not a trained classifier"
        )
    return int(saved[f"{out_layer}.weight"].shape[0])


def load_peft(
    folder: str | os.PathLike,
    *,
    backbone: str | os.PathLike | None = None,
    dtype=jnp.float32,
    plan=None,
    id2label=None,
    problem_type: str | None = None,
    remat: bool | str = False,
    **ignored,
):
    """A PEFT LoRA ``SEQ_CLS`` adapter folder on its base model folder, as a flaxheads model with the
    same logits as ``PeftModel.from_pretrained(AutoModelForSequenceClassification(base), folder)``.

    ``backbone``: the base folder (default: ``base_model_name_or_path`` of ``adapter_config.json``).
    The model keeps the adapters (``model.lora``), so it trains on and exports back with
    :func:`export_peft`. Adapter dropout is left out (it changes no logits; training continues without it)."""
    from flaxheads.model.pretrained import from_pretrained

    del ignored
    folder = os.fspath(folder)
    raw = adapter_config_of(folder)
    base = adapter_base(folder, raw, backbone)
    lora_state, saved = _split_adapters(_adapter_state(folder))
    if not lora_state:
        raise ModelImportError(f"{folder}: the adapter holds no lora_A / lora_B weights")
    n = _num_labels(folder, read_config(base), saved)
    model = from_pretrained(
        base,
        num_labels=n,
        id2label=id2label,
        problem_type=problem_type,
        dtype=dtype,
        plan=plan,
        ignore_mismatched_sizes=True,
        remat=remat,
    )
    prefix = model.backbone.base_model_prefix if hasattr(model.backbone, "base_model_prefix") else ""
    head, loaded, _ = head_from_hf(np_tree(model.params["head"]), model.hf_names, saved, strip_prefixes=[])
    used = {f"{name}.{leaf}" for _, name in loaded for leaf in ("weight", "bias")}
    backbone_params = _with_saved_backbone_weights(model, saved, used, prefix, folder)
    if float(raw.get("lora_dropout") or 0.0) > 0:
        warnings.warn(
            f"{folder}: adapter dropout {raw['lora_dropout']} is left out (flaxheads merges adapters "
            "into the weights); predictions are unchanged, further training runs without it",
            stacklevel=2,
        )
    rank = int(raw.get("r", 8))
    # rsLoRA scales by alpha / sqrt(r): the same update as alpha * sqrt(r) / r
    alpha = float(raw.get("lora_alpha", 8)) * (rank**0.5 if raw.get("use_rslora") else 1.0)
    names = {
        v: k
        for k, v in _kernel_names(model, list(kernel_modules(model.params["backbone"])), prefix).items()
        if v is not None and v.endswith(".weight")
    }
    tree = {}
    for module, ab in lora_state.items():
        path = names.get(f"{module}.weight")
        if path is None or set(ab) != {A, B}:
            raise ModelImportError(
                f"{folder}: adapter module {module!r} is not a kernel of this "
                f"{model.model_type} base model (or lacks lora_A / lora_B)"
            )
        tree[path + (A,)], tree[path + (B,)] = np.asarray(ab[A]).T, np.asarray(ab[B]).T
    config = LoraConfig(
        rank=rank, alpha=alpha, targets=tuple("/".join(p) for p in adapter_modules(unflatten_dict(tree)))
    )
    lora = jax.tree.map(jnp.asarray, unflatten_dict(tree))
    try:
        check_adapters(config, lora, backbone_params, model.model_type, folder)
    except FlaxheadsError as e:
        raise ModelImportError(str(e)) from None
    return dataclasses.replace(
        model, lora=config, params={"backbone": backbone_params, "head": jax.tree.map(jnp.asarray, head), LORA: lora}
    )


def _with_saved_backbone_weights(model, saved, used, prefix: str, folder: str) -> dict:
    """The backbone params with the backbone tensors the adapter saved (``modules_to_save`` inside the
    base model) in place; a saved tensor that is neither head nor backbone is an error."""
    rest = {k: v for k, v in saved.items() if k not in used}
    if not rest:
        return model.params["backbone"]
    bb = model.backbone
    state = bb.state_from_params(np_tree(model.params["backbone"]))
    p = prefix + "." if prefix else ""
    unknown = [k for k in rest if not k.startswith(p) or k[len(p) :] not in state]
    if unknown:
        raise ModelImportError(
            f"{folder}: the adapter saves {unknown[:4]}, which are neither the classifier nor "
            f"weights of this {model.model_type} base model"
        )
    for k, v in rest.items():
        state[k[len(p) :]] = np.asarray(v, np.float32)
    return jax.tree.map(jnp.asarray, type(bb).params_from_state(bb.config, state))


def adapter_tokenizer_folder(folder: str, base: str) -> str:
    """The adapter folder when it holds tokenizer files (PEFT users often save them there), else the base."""
    return folder if any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES) else base
