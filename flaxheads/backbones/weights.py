"""Read PyTorch state dicts without torch, and map head params to/from HF names.

A Flax ``Dense`` is ``{"kernel": [in, out], "bias": [out]}``; PyTorch ``nn.Linear`` is
``{name}.weight [out, in]`` and ``{name}.bias``. A Flax ``LayerNorm`` is
``{"scale", "bias"}``; PyTorch's is ``{name}.weight``, ``{name}.bias``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from flaxheads.errors import FlaxheadsError

SAFE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


class WeightsError(FlaxheadsError):
    """A weights file that is missing, truncated or corrupt (a download that stopped part-way, a
    disk that filled while it was saved): the message names the file and says to fetch it again."""


class WeightsNotFoundError(WeightsError, FileNotFoundError):
    """A model folder without weights flaxheads reads (also a ``FileNotFoundError``)."""


def _unreadable(path: str, err: BaseException) -> WeightsError:
    cause = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return WeightsError(
        f"{path}: the weights cannot be read ({type(err).__name__}: {cause}); the file is truncated "
        "or corrupt, as a download that stopped part-way leaves it: download the model again (or "
        "re-save it with save_pretrained)"
    )


def read_safetensors(path: str, *, check: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, in its stored dtype (bfloat16 and float8 as ``ml_dtypes``);
    :class:`WeightsError` for a missing, cut or damaged file. A file flaxheads wrote is checked block by
    block as it is read (:class:`~flaxheads.disk.checksums.ChecksumError` names the byte range)."""
    from flaxheads.backbones.safetensors_file import SafetensorsFile  # it imports this module

    if not os.path.isfile(path):
        raise WeightsNotFoundError(f"{path} is missing (listed in the folder's index): download the model again")
    try:
        with SafetensorsFile(path, check=check) as f:
            return f.read_all()
    except FlaxheadsError:
        raise
    except (OSError, ValueError) as e:
        raise _unreadable(path, e) from None


def _shards(index: str) -> list[str]:
    """The shard files a ``*.index.json`` names."""
    try:
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _unreadable(index, e) from None


def read_torch_bin(path: str) -> dict[str, np.ndarray]:
    """A ``pytorch_model.bin`` state dict as numpy, unpickled only by ``torch.load(weights_only=True)``:
    anything but a flat ``{name: tensor}`` dict is refused, never executed."""
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{path}: reading a pytorch_model.bin needs torch; install flaxheads[torch] or "
            "re-save the model with `save_pretrained(folder, safe_serialization=True)`"
        ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightsError(
            f"{path}: refused to load: it is not a plain PyTorch state dict that "
            f"torch.load(weights_only=True) accepts ({type(e).__name__}: {str(e)[:300]}). flaxheads never "
            "unpickles arbitrary objects; re-save the weights with save_pretrained(..., "
            "safe_serialization=True) from a source you trust."
        ) from None
    if (
        not isinstance(state, Mapping)
        or not state
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    ):
        what = (
            type(state).__name__
            if not isinstance(state, Mapping)
            else f"a dict with {sorted({type(v).__name__ for v in state.values()}) or 'no'} values"
        )
        raise WeightsError(
            f"{path}: expected a flat state dict {{name: tensor}}, found {what}. Save "
            "`model.state_dict()` (not the model object, an optimizer or a training dict)."
        )
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy() for k, v in state.items()}


def read_state_dict(folder: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint folder as numpy: single or sharded safetensors (no torch
    needed), else ``pytorch_model.bin`` (single or sharded) via ``torch.load(weights_only=True)``."""
    folder = os.fspath(folder)
    single, index = os.path.join(folder, SAFE), os.path.join(folder, SAFE_INDEX)
    if os.path.isfile(single):
        return read_safetensors(single)
    if os.path.isfile(index):
        out: dict[str, np.ndarray] = {}
        for s in _shards(index):
            out.update(read_safetensors(os.path.join(folder, s)))
        return out
    single, index = os.path.join(folder, BIN), os.path.join(folder, BIN_INDEX)
    if os.path.isfile(single):
        return read_torch_bin(single)
    if os.path.isfile(index):
        out = {}
        for s in _shards(index):
            out.update(read_torch_bin(os.path.join(folder, s)))
        return out
    present = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    raise WeightsNotFoundError(
        f"no {SAFE}, {SAFE_INDEX}, {BIN} or {BIN_INDEX} in {folder!r} (it holds: {present[:12]}); flaxheads "
        "reads safetensors checkpoints, and pytorch_model.bin only through torch.load(weights_only=True) "
        "(re-save a PyTorch model with `model.save_pretrained(folder, safe_serialization=True)`)"
    )


def _subtree(params: Mapping, path: str):
    node = params
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _set(params: dict, path: str, value: dict) -> dict:
    parts = path.split("/")
    out = dict(params)
    node = out
    for p in parts[:-1]:
        node[p] = dict(node[p])
        node = node[p]
    node[parts[-1]] = value
    return out


def module_to_hf(module_params: Mapping[str, Any], hf_name: str) -> dict[str, np.ndarray]:
    """One Dense or LayerNorm param dict -> ``{hf_name.weight, hf_name.bias}``."""
    out = {}
    if "kernel" in module_params:
        out[f"{hf_name}.weight"] = np.ascontiguousarray(np.asarray(module_params["kernel"]).T)
    elif "scale" in module_params:
        out[f"{hf_name}.weight"] = np.asarray(module_params["scale"])
    if "bias" in module_params:
        out[f"{hf_name}.bias"] = np.asarray(module_params["bias"])
    return out


def head_to_hf(head_params: Mapping, hf_names: Iterable[tuple[str, str]]) -> dict[str, np.ndarray]:
    """Head params -> PyTorch state-dict entries for the mapped modules."""
    out: dict[str, np.ndarray] = {}
    for path, hf_name in hf_names:
        sub = _subtree(head_params, path)
        if sub is None:
            raise KeyError(f"head params have no module at {path!r}; present: {sorted(head_params)}")
        out.update(module_to_hf(sub, hf_name))
    return out


def _find(state: Mapping[str, np.ndarray], hf_name: str, strip_prefixes: Iterable[str]) -> str | None:
    candidates = [hf_name] + [hf_name[len(p) + 1 :] for p in strip_prefixes if hf_name.startswith(p + ".")]
    for c in candidates:
        if f"{c}.weight" in state:
            return c
    return None


def head_from_hf(
    head_params: Mapping,
    hf_names: Iterable[tuple[str, str]],
    state: Mapping[str, np.ndarray],
    *,
    strip_prefixes: Iterable[str] = (),
    ignore_mismatched_sizes: bool = False,
    source: str = "checkpoint",
):
    """Copy mapped modules from an HF state dict into (a copy of) ``head_params``.

    Returns ``(params, loaded, new)`` where ``loaded`` lists ``(path, hf_name)`` copied and
    ``new`` the paths left at their fresh initialisation."""
    params = dict(head_params)
    loaded, new = [], []
    for path, hf_name in hf_names:
        sub = _subtree(params, path)
        if sub is None:
            continue
        name = _find(state, hf_name, strip_prefixes)
        if name is None:
            new.append(path)
            continue
        got: dict[str, np.ndarray] = {}
        w = state[f"{name}.weight"]
        key = "kernel" if "kernel" in sub else "scale"
        got[key] = w.T if key == "kernel" else w
        if "bias" in sub:
            if f"{name}.bias" not in state:
                raise WeightsError(f"{source}: {name}.weight is present but {name}.bias is missing")
            got["bias"] = state[f"{name}.bias"]
        mismatch = [(k, np.shape(sub[k]), got[k].shape) for k in got if np.shape(sub[k]) != got[k].shape]
        if mismatch:
            if ignore_mismatched_sizes:
                new.append(path)
                continue
            k, want, have = mismatch[0]
            raise WeightsError(
                f"{source}: {name} has shape {have} for {k} but the head needs {want} (e.g. a different "
                "num_labels). Pass ignore_mismatched_sizes=True to initialise this module fresh instead."
            )
        params = _set(params, path, {k: np.asarray(v, dtype=np.asarray(sub[k]).dtype) for k, v in got.items()})
        loaded.append((path, name))
    return params, loaded, new


# ---- whole-model name maps ------------------------------------------------------------------------
#: Last name segments of PyTorch ``nn.Embedding`` modules in the families flaxheads reads: their
#: ``weight`` is a Flax ``embedding`` (not transposed), where any other 2-D ``weight`` is a
#: ``Linear``'s and becomes a transposed ``kernel``.
EMBEDDING_SUFFIXES = ("_embeddings", "embed_tokens", "embed_positions", "wte", "wpe", "shared")


def is_embedding(module: str) -> bool:
    """Whether the PyTorch module named ``module`` (dotted) is an ``nn.Embedding`` by flaxheads' naming rule."""
    last = module.rsplit(".", 1)[-1]
    return last.endswith(EMBEDDING_SUFFIXES)


def tree_from_torch(state: Mapping[str, np.ndarray], *, embedding=is_embedding, transpose=lambda module: True) -> dict:
    """HF's PyTorch -> Flax rule for a whole state dict: ``a.b.0.c.weight`` -> ``{"a": {"b": {"0": {"c": ...}}}}``
    with ``weight`` [out, in] -> ``kernel`` [in, out] (``transpose(module)`` False keeps the layout:
    GPT-2's ``Conv1D``), ``weight`` of an embedding -> ``embedding``, 1-D ``weight`` -> ``scale``
    (LayerNorm; old checkpoints' ``gamma``/``beta`` too). ``bias`` stays ``bias``."""
    out: dict = {}
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        arr = np.asarray(value)
        if leaf in ("weight", "gamma") and arr.ndim == 1:
            leaf = "scale"
        elif leaf == "weight" and embedding(module):
            leaf = "embedding"
        elif leaf == "weight" and arr.ndim == 2:
            leaf, arr = "kernel", (arr.T if transpose(module) else arr)
        elif leaf == "beta":
            leaf = "bias"
        node = out
        for part in module.split(".") if module else []:
            node = node.setdefault(part, {})
        node[leaf] = arr
    return out


def torch_from_tree(params: Mapping, *, transpose=lambda module: True, prefix: str = "") -> dict[str, np.ndarray]:
    """Inverse of :func:`tree_from_torch`: ``kernel`` -> ``weight`` (transposed unless
    ``transpose(module)`` is False), ``embedding`` / ``scale`` -> ``weight``."""
    out: dict[str, np.ndarray] = {}

    def walk(node: Mapping, path: list[str]):
        for k, v in node.items():
            if isinstance(v, Mapping):
                walk(v, path + [str(k)])
                continue
            module = ".".join(path)
            arr = np.asarray(v)
            if k == "kernel":
                k, arr = "weight", (arr.T if transpose(module) else arr)
            elif k in ("embedding", "scale"):
                k = "weight"
            name = ".".join([prefix] * bool(prefix) + path + [k])
            out[name] = np.ascontiguousarray(arr)

    walk(params, [])
    return out


def pick(state: Mapping[str, np.ndarray], keep) -> dict[str, np.ndarray]:
    """The entries of ``state`` whose name ``keep(name)`` accepts."""
    return {k: v for k, v in state.items() if keep(k)}
