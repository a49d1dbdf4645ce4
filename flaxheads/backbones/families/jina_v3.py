"""Jina Embeddings v3 (``model_type`` ``jina_embeddings_v3``): transformers 5's ``JinaEmbeddingsV3Model``.

XLM-RoBERTa with rotary positions (base 20000) instead of absolute ones: a post-LayerNorm BERT with
q/k/v/o biases and a plain ``fc1 -> gelu -> fc2`` feed-forward
(:mod:`~flaxheads.backbones.families.rotary_bert` computes it). Its classifier
(``JinaEmbeddingsV3ForSequenceClassification``, base prefix ``roberta``) is RoBERTa's: first token ->
dropout -> dense -> tanh -> dropout -> ``out_proj``. Weights are stored fused
(``encoder.layers.<i>.mixer.Wqkv``, ``mixer.out_proj``, ``emb_ln``, ``norm1``, ``norm2``).

**Task adapters.** The model ships five LoRA adapters, one per task (``retrieval.query``,
``retrieval.passage``, ``separation``, ``classification``, ``text-matching``), in one of two layouts:

* jina's hub folder (``config.json`` for jina's own code: ``model_type xlm-roberta``, ``auto_map`` to
  ``XLMRobertaFlashConfig``, ``position_embedding_type rotary``, ``lora_adaptations``): every linear
  and embedding weight is a ``torch.nn.utils.parametrize`` parametrization holding all tasks' adapters,
  ``<module>.parametrizations.weight.original`` the weight, ``...weight.0.lora_A`` / ``lora_B`` the
  adapters stacked on a first task axis (linear: ``A [n, r, in]``, ``B [n, out, r]``, delta ``B A``;
  embedding: ``A [n, vocab, r]``, ``B [n, r, dim]``, delta ``A B``), scaled by ``lora_alpha / lora_rank``;
* transformers' folder (``jina-embeddings-v3-hf``): a PEFT LoRA adapter folder per task in a
  subfolder named after it (``retrieval_query``, ..., ``text_matching``), on transformers' module names
  (linear ``lora_A [r, in]`` / ``lora_B [out, r]``, embedding ``lora_embedding_A [r, vocab]`` /
  ``lora_embedding_B [dim, r]``, scaled by ``lora_alpha / r``).

:func:`task_adapters` reads one task's adapters in either layout as flaxheads' LoRA modules (the
fused ``Wqkv`` adapter becomes q, k and v adapters sharing ``A``) plus the embedding deltas (which have
no LoRA form in flaxheads: :func:`flaxheads.model.task_adapters.with_task` adds them to the tables).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping

import numpy as np

from flaxheads.backbones.base import BackboneError, HFConfig, strip_prefix
from flaxheads.backbones.families.rotary_bert import (
    COMMON_KEYS,
    LAYERS_RENAME,
    RotaryBertBackbone,
    custom_config_class,
    hub_to_native,
    native_keys,
)
from flaxheads.backbones.lazy import safetensors_files
from flaxheads.backbones.weights import WeightsNotFoundError, read_state_dict

#: jina's hub code: the ``AutoConfig`` class of its ``config.json``
HUB_CONFIG = "configuration_xlm_roberta.XLMRobertaFlashConfig"
#: jina's task names, in the order of its adapters when ``lora_adaptations`` is not given
TASKS = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")
_ADAPTER_CONFIG, _ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


class JinaV3Backbone(RotaryBertBackbone):
    """Jina Embeddings v3: see the module docstring."""

    model_types = ("jina_embeddings_v3",)
    family = "Jina-v3"
    base_model_prefix = "roberta"
    default_theta = 20_000.0
    gated = False
    attention_bias = True
    tokenizer_token_types = False  # XLMRobertaTokenizer
    # transformers' JinaEmbeddingsV3Config defaults
    defaults = {
        "vocab_size": 250002,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 8194,
        "type_vocab_size": 1,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-5,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "classifier_dropout": None,
    }
    hub_renames = (
        LAYERS_RENAME,
        (r"^emb_ln\.", "embeddings.LayerNorm."),
        (r"\.mixer\.out_proj\.", ".self_attn.o_proj."),
        (r"\.norm1\.", ".post_attention_layernorm."),
        (r"\.norm2\.", ".post_mlp_layernorm."),
    )
    hub_fused = ((r"mixer\.Wqkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),)

    @classmethod
    def from_custom_config(cls, config: HFConfig) -> HFConfig | None:
        if custom_config_class(config) != HUB_CONFIG:
            return None
        where = object.__getattribute__(config, "_source") or "config.json"
        if config.get("position_embedding_type") != "rotary":
            raise BackboneError(
                f"{where}: jina's own XLM-RoBERTa code with position_embedding_type "
                f"{config.get('position_embedding_type')!r} (e.g. jina-reranker-v2): transformers has no class for it "
                "and flaxheads no backbone; jina-embeddings-v3 (rotary positions) loads as jina_embeddings_v3"
            )
        theta = float(config.get("rotary_emb_base") or cls.default_theta)
        return native_keys(
            config,
            COMMON_KEYS + ("lora_adaptations", "lora_rank", "lora_alpha", "task_instructions"),
            model_type="jina_embeddings_v3",
            architectures=None,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
        )


# ---- task adapters ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TaskAdapters:
    """One task's adapters on a Jina v3 params tree: ``kernels`` ``{module path: (A [in, r], B [r, out])}``
    scaled by ``alpha / rank``, and ``deltas`` ``{param path: array}`` to add to other params (embedding
    tables, already scaled)."""

    task: str
    rank: int
    alpha: float
    kernels: dict
    deltas: dict


def task_dir(task: str) -> str:
    """The subfolder of a task's PEFT adapter in transformers' layout (``retrieval.query`` -> ``retrieval_query``)."""
    return re.sub(r"[.\-]", "_", task)


def task_names(folder: str, config: Mapping) -> list[str]:
    """The tasks whose adapters the folder holds: jina's ``lora_adaptations`` and the PEFT adapter subfolders."""
    names = list(config.get("lora_adaptations") or [])
    if os.path.isdir(folder):
        names += sorted(d for d in os.listdir(folder) if os.path.isfile(os.path.join(folder, d, _ADAPTER_CONFIG)))
    return names


def task_adapters(folder: str | os.PathLike, config: Mapping, task: str) -> TaskAdapters:
    """The adapters of ``task`` in a Jina v3 folder (either layout; see the module docstring)."""
    folder = os.fspath(folder)
    for sub in (task_dir(task), task):
        if os.path.isfile(os.path.join(folder, sub, _ADAPTER_CONFIG)):
            return _peft_adapters(os.path.join(folder, sub), task)
    known = task_names(folder, config)
    lora = _lora_tensors(folder) if config.get("lora_adaptations") else {}
    if task not in (config.get("lora_adaptations") or []) or not lora:
        raise BackboneError(
            f"{folder}: no adapters for the task {task!r}: the folder has adapters for "
            f"{known or 'no task'} (jina's lora_adaptations with LoRA tensors in its weights, or a "
            "PEFT adapter subfolder per task)"
        )
    return _parametrized_adapters(lora, config, task)


def _lora_tensors(folder: str) -> dict[str, np.ndarray]:
    """The ``parametrize`` LoRA tensors of a folder's weights (only those read, from safetensors)."""
    try:
        files = safetensors_files(folder)
    except WeightsNotFoundError:  # PyTorch .bin weights: read whole
        return {k: v for k, v in read_state_dict(folder).items() if ".parametrizations.weight.0.lora_" in k}
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for path in files:
        with safe_open(path, "numpy") as f:
            out.update((k, f.get_tensor(k)) for k in f.keys() if ".parametrizations.weight.0.lora_" in k)
    return out


def _tree_path(name: str) -> tuple[str, ...]:
    """The params path of a base-model PyTorch module name in transformers 5's spelling."""
    parts = name.split(".")
    return tuple(parts)


def _parametrized_adapters(lora: Mapping[str, np.ndarray], config: Mapping, task: str) -> TaskAdapters:
    t = list(config["lora_adaptations"]).index(task)
    rank, alpha = int(config.get("lora_rank") or 4), float(config.get("lora_alpha") or 1.0)
    scale = alpha / rank
    base = strip_prefix(lora, JinaV3Backbone.base_model_prefix)
    modules = sorted({k.partition(".parametrizations.")[0] for k in base})
    kernels, deltas = {}, {}
    for module in modules:
        a = np.asarray(base[f"{module}.parametrizations.weight.0.lora_A"][t], np.float32)
        b = np.asarray(base[f"{module}.parametrizations.weight.0.lora_B"][t], np.float32)
        (name,) = hub_to_native({f"{module}.weight": a}, JinaV3Backbone.hub_renames, ()).keys()
        module = name[: -len(".weight")]
        if module.split(".")[0] not in JinaV3Backbone.top_level:
            continue  # jina's pooler: not part of the backbone (the classifier preset pools by its own dense)
        if module.endswith("_embeddings"):  # A [vocab, r], B [r, dim]: the table's delta A B
            deltas[_tree_path(module) + ("embedding",)] = scale * (a @ b)
        elif module.endswith("mixer.Wqkv"):  # one A, B [3H, r] cut into q, k, v
            head = module[: -len("mixer.Wqkv")]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), np.split(b, 3, axis=0)):
                kernels[_tree_path(f"{head}self_attn.{proj}")] = (a.T, part.T)
        else:  # A [r, in], B [out, r]
            kernels[_tree_path(module)] = (a.T, b.T)
    return TaskAdapters(task, rank, alpha, kernels, deltas)


def _peft_adapters(folder: str, task: str) -> TaskAdapters:
    from safetensors.numpy import load_file

    with open(os.path.join(folder, _ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if (
        cfg.get("peft_type") != "LORA"
        or cfg.get("use_dora")
        or cfg.get("rank_pattern")
        or cfg.get("alpha_pattern")
        or cfg.get("bias", "none") != "none"
    ):
        raise BackboneError(
            f"{folder}: the adapter of task {task!r} is not a plain LoRA adapter (peft_type "
            f"{cfg.get('peft_type')!r}, DoRA, per-module ranks or trained biases), which flaxheads "
            "applies exactly only as one rank and alpha on every module"
        )
    rank = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", 8)) * (rank**0.5 if cfg.get("use_rslora") else 1.0)
    state = {
        k[len(_PEFT_PREFIX) :] if k.startswith(_PEFT_PREFIX) else k: v
        for k, v in load_file(os.path.join(folder, _ADAPTER_WEIGHTS)).items()
    }
    state = strip_prefix(state, JinaV3Backbone.base_model_prefix)
    kernels: dict = {}
    deltas: dict = {}
    parts: dict[str, dict[str, np.ndarray]] = {}
    for k, v in state.items():
        m = re.match(r"(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)(\.default)?(\.weight)?$", k)
        if m is None:
            raise BackboneError(
                f"{folder}: adapter tensor {k!r} is not a LoRA weight of the backbone (a task adapter "
                "holds lora_A / lora_B, or lora_embedding_A / lora_embedding_B, only)"
            )
        parts.setdefault(m.group(1), {})[m.group(2)] = np.asarray(v, np.float32)
    for module, ab in parts.items():
        path = _tree_path(module)
        if "lora_embedding_A" in ab:  # A [r, vocab], B [dim, r]: delta (B A)^T
            deltas[path + ("embedding",)] = (alpha / rank) * (ab["lora_embedding_B"] @ ab["lora_embedding_A"]).T
        else:
            kernels[path] = (ab["lora_A"].T, ab["lora_B"].T)
    return TaskAdapters(task, rank, alpha, kernels, deltas)
