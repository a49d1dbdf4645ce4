"""A model from a Hugging Face folder: :func:`from_pretrained` reads the backbone (eagerly, or onto a
mesh one tensor at a time) and attaches a pooler and head, HF's own for the architecture unless chosen.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.backbones.base import BackboneError, check_params
from flaxheads.backbones.lazy import NotLazyLoadable, load_sharded
from flaxheads.backbones.registry import folder_config, load_backbone
from flaxheads.backbones.weights import WeightsNotFoundError, head_from_hf, read_state_dict
from flaxheads.errors import ConfigError
from flaxheads.heads import linen, token_logits
from flaxheads.heads.heads import Head, IdentityHead, ProjectionHead, SequenceHead, TokenLogits
from flaxheads.heads.poolers import Pooler
from flaxheads.heads.presets import check_pool_mask, match_preset
from flaxheads.losses import REGRESSION, check_problem_type, infer_problem_type
from flaxheads.model.abstract import abstract_model
from flaxheads.model.quantize import check_family, quantizable, quantize_onto
from flaxheads.model.sequence import LoadReport, SequenceModel, _module_paths, build_head
from flaxheads.model.task_adapters import check_task, with_task
from flaxheads.runtime.plan import ComputePlan
from flaxheads.runtime.sharding import Layout, make_mesh


def from_pretrained(
    path: str | os.PathLike,
    *,
    pooler: str | Sequence[str] | Pooler | None = None,
    head: str | Head | None = None,
    num_labels: int | None = None,
    problem_type: str | None = None,
    id2label: dict | Sequence[str] | None = None,
    dtype=jnp.float32,
    seed: int = 0,
    ignore_mismatched_sizes: bool = False,
    pooler_options: dict | None = None,
    head_options: dict | None = None,
    pool_mask: str | None = None,
    implementation: str = "auto",
    remat: bool | str = False,
    plan: ComputePlan | None = None,
    base_dtype=None,
    quantize: str | None = None,
    mesh=None,
    task: str | None = None,
) -> SequenceModel:
    """Load a local HF model folder as backbone and attach a pooler + head.

    Defaults to the HF-exact preset for the backbone's ``model_type`` (and copies its
    pretrained pooler/classifier weights when the checkpoint has them); ``pooler`` and
    ``head`` pick any other combination. ``dtype=jnp.bfloat16`` runs the backbone in
    bfloat16; params, head and logits stay float32. ``implementation``: ``"auto"`` (flaxheads'
    native backbone for the folder's ``model_type``, else HF's Flax wrapper when transformers
    < 5 is installed), ``"native"`` or ``"hf_flax"`` (see :mod:`flaxheads.backbones.registry`).
    ``remat``: what the backward pass keeps of each layer, ``none | full | save-dots | save-named``
    (``True``: ``full``, each layer recomputed; see :mod:`flaxheads.layers.remat`).
    ``plan``: how the programs compute on this host (default :meth:`ComputePlan.for_host`).
    ``base_dtype``: the storage dtype of the backbone's params (default float32; ``jnp.bfloat16``
    halves a base that stays frozen: :meth:`SequenceModel.with_base_dtype`). ``quantize``: ``int8 |
    int4 | nf4`` layer kernels of a frozen base (:meth:`SequenceModel.with_quantized_base`).
    ``mesh``: a :class:`jax.sharding.Mesh` (or its shape, ``"fsdp=8"``) to read the backbone onto:
    each param is read from the safetensors tensor by tensor, each process reading only the part its
    devices hold, straight onto its sharding under the default layout
    (:func:`flaxheads.backbones.lazy.load_sharded`), in ``base_dtype`` and, with ``quantize``, each
    layer kernel quantised as soon as it is read; no host copy of the whole model. ``task``: the task whose
    adapters the folder holds (Jina Embeddings v3: ``retrieval.query``, ``retrieval.passage``, ``separation``,
    ``classification``, ``text-matching``), put on the model as LoRA adapters
    (:func:`~flaxheads.model.task_adapters.with_task`; an unknown name is refused before any weight is read)."""
    if quantize is not None:
        check_family(folder_config(path)[0].get("model_type"))  # before any weight is read
    if task is not None:
        check_task(path, folder_config(path)[0], task)
    path = os.fspath(path)
    loaded = None
    if mesh is not None:
        loaded = _load_onto_mesh(
            path, mesh, dtype=dtype, remat=remat, plan=plan, base_dtype=base_dtype, quantize=quantize
        )
    if loaded is not None:
        backbone, state = loaded
    else:
        state = _read_state_if_any(path)  # read once: the backbone's weights and the head's
        backbone = load_backbone(
            path, dtype=dtype, state=state or None, remat=remat, implementation=implementation, plan=plan
        )
    cfg = backbone.config
    labels = _labels(id2label, num_labels, cfg)
    n = len(labels) if labels else int(num_labels or cfg.get("num_labels", 2))
    seq_head, _ = build_head(cfg, n, pooler=pooler, head=head, pooler_options=pooler_options, head_options=head_options)
    if isinstance(seq_head.head, TokenLogits):  # its tokens say how many outputs it has
        n = seq_head.head.num_labels
        if labels is not None and len(labels) != n:
            if id2label is not None:
                raise ConfigError(f"id2label has {len(labels)} entries but the TokenLogits head outputs {n}")
            labels = None  # a causal LM config's default labels say nothing of this head
        ptype = problem_type or infer_problem_type(n)
    elif isinstance(seq_head.head, (ProjectionHead, IdentityHead)):
        # an embedding head: its width is the output size; MSE (e.g. distillation) is the natural loss
        n = seq_head.head.out_features() or seq_head.pooler.out_features(cfg.hidden_size)
        ptype = problem_type or REGRESSION
        if labels is not None and len(labels) != n:
            if id2label is not None:
                raise ConfigError(
                    f"id2label has {len(labels)} entries but the {type(seq_head.head).__name__} outputs {n} values"
                )
            labels = None  # the backbone config's classification labels do not describe an embedding
    else:
        ptype = problem_type or getattr(cfg, "problem_type", None) or infer_problem_type(n)
    check_problem_type(ptype, n)
    # an explicitly chosen pooler pools the attention mask unless told otherwise, even one equal to the preset's
    match = match_preset(
        cfg,
        n,
        seq_head.pooler,
        seq_head.head,
        pool_mask if pool_mask is not None or pooler is None else "attention_mask",
    )
    pad, eos = getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None)
    check_pool_mask(match.pool_mask, pad_token_id=pad, eos_token_id=eos, subject=f"{cfg.model_type} backbone {path!r}")
    base = getattr(backbone, "base_model_prefix", "") or ""
    names = match.weight_names
    if isinstance(seq_head.head, TokenLogits):  # its kernel comes from the LM head rows, never from ``score``
        names = tuple((p, n) for p, n in names if not p.startswith("head/"))
    head_params, report = _init_head(
        seq_head,
        cfg.hidden_size,
        seed,
        names,
        state,
        strip_prefixes=[base] if base else [],
        ignore_mismatched_sizes=ignore_mismatched_sizes,
        source=path,
    )
    if isinstance(seq_head.head, TokenLogits):
        head_params, report = _token_logits(seq_head.head, cfg, state, backbone, head_params, report, path)
    params = {"backbone": backbone.params, "head": jax.tree.map(jnp.asarray, head_params)}
    model = SequenceModel(
        backbone=backbone,
        head=seq_head,
        num_labels=n,
        problem_type=ptype,
        params=params,
        id2label=labels,
        pool_mask=match.pool_mask,
        pad_token_id=pad,
        eos_token_id=eos,
        arch=match.arch,
        hf_names=match.hf_names,
        name_or_path=path,
        report=report,
    )
    # the task's deltas and adapters go on the weights as read, before a storage dtype or quantisation
    model = model if task is None else with_task(model, task)
    if loaded is not None:  # read in base_dtype, and quantised tensor by tensor, already
        return model
    model = model if base_dtype is None else model.with_base_dtype(base_dtype)
    return model if quantize is None else model.with_quantized_base(quantize)


def _load_onto_mesh(path: str, mesh, *, dtype, remat, plan, base_dtype, quantize=None):
    """The native backbone of ``path`` read onto ``mesh`` (its default layout) in ``base_dtype``, each
    :func:`~flaxheads.model.quantize.quantizable` kernel quantised right after it is read when ``quantize`` is
    set, and the folder's other tensors; None where the folder has no safetensors or the family's params
    are not stored tensors (then it loads eagerly and is placed by the run)."""
    from jax.sharding import Mesh, NamedSharding

    mesh = mesh if isinstance(mesh, Mesh) else make_mesh(mesh)
    config, fam = folder_config(path)
    if fam is None:
        raise BackboneError(
            f"{path}: model_type {config.get('model_type')!r} has no native backbone to read onto a "
            "mesh; load it without mesh="
        )
    config = fam.complete_config(config)
    fam.check_config(config)

    layout = Layout.for_model(
        mesh, abstract_model(path, remat=remat, plan=plan, base_dtype=base_dtype, quantize=quantize)
    )

    def on_layout(names: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(mesh, layout.spec_of(("backbone",) + names, shape))

    def sharding(p: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
        # a kernel to quantise is read where its codes will lie, so the quantisation moves nothing
        return on_layout(p + ("qvalue",) if quantize is not None and quantizable(p, shape) else p, shape)

    def quantized(p: tuple[str, ...], x: jax.Array):
        if not quantizable(p, x.shape):
            return x
        return quantize_onto(x, quantize, lambda part, shape: on_layout(p + (part,), shape))

    try:
        params, rest = load_sharded(
            path,
            fam,
            config,
            sharding,
            dtype=jnp.float32 if base_dtype is None else base_dtype,
            transform=None if quantize is None else quantized,
            check=lambda shapes: check_params(
                fam.param_shapes(config), shapes, source=path, model_type=config.get("model_type")
            ),
        )
    except (WeightsNotFoundError, NotLazyLoadable):
        return None
    return fam(config, params, dtype=dtype, remat=remat, plan=plan), rest


def _init_head(seq_head: SequenceHead, hidden_size: int, seed: int, names, state, **load) -> tuple[dict, LoadReport]:
    """Fresh head params, with the modules named in ``names`` copied from the checkpoint ``state``
    (``load``: :func:`~flaxheads.backbones.weights.head_from_hf`'s options)."""
    fresh = linen.init_head(seq_head, hidden_size, jax.random.PRNGKey(seed))
    head_params, loaded, _ = head_from_hf(jax.device_get(fresh), names, state, **load)
    done = {p for p, _ in loaded}
    return head_params, LoadReport(pretrained=loaded, new=[p for p in _module_paths(head_params) if p not in done])


def _token_logits(
    head: TokenLogits, cfg, state, backbone, head_params: dict, report: LoadReport, path: str
) -> tuple[dict, LoadReport]:
    """The TokenLogits kernel filled from the folder's LM head rows (:mod:`flaxheads.heads.token_logits`)."""
    tied = getattr(cfg, "tie_word_embeddings", False)
    embedding = (getattr(backbone, "params", None) or {}).get("embed_tokens", {}).get("embedding") if tied else None
    w = token_logits.kernel(head, cfg, state or {}, None if embedding is None else jax.device_get(embedding), path)
    inner = dict(head_params["head"])
    inner["classifier"] = {**inner["classifier"], "kernel": w.astype(np.asarray(inner["classifier"]["kernel"]).dtype)}
    report = LoadReport(
        pretrained=[p for p in report.pretrained if p[0] != "head/classifier"]
        + [("head/classifier", token_logits.describe(head))],
        new=[p for p in report.new if p != "head/classifier"],
    )
    return {**head_params, "head": inner}, report


def _labels(id2label, num_labels, cfg) -> dict[int, str] | None:
    if id2label is not None:
        labels = (
            {int(k): str(v) for k, v in id2label.items()} if isinstance(id2label, dict) else dict(enumerate(id2label))
        )
        if num_labels is not None and num_labels != len(labels):
            raise ConfigError(f"num_labels={num_labels} but id2label has {len(labels)} entries")
        if sorted(labels) != list(range(len(labels))):
            raise ConfigError(f"id2label keys must be 0..{len(labels) - 1}, got {sorted(labels)}")
        return labels
    cfg_labels = getattr(cfg, "id2label", None)
    if cfg_labels and (num_labels is None or len(cfg_labels) == num_labels):
        return {int(k): str(v) for k, v in cfg_labels.items()}
    return None


def _read_state_if_any(path: str) -> dict[str, np.ndarray]:
    try:
        return read_state_dict(path)
    except FileNotFoundError:
        return {}
