"""flaxheads' nomic-bert, GTE and Jina Embeddings v3 backbones (one computation,
:mod:`flaxheads.backbones.families.rotary_bert`) against transformers 5's PyTorch classes on the same
weights: ``NomicBertModel``, ``GteModel`` (with static NTK RoPE scaling, as transformers writes it:
a ``linear`` RoPE) and ``JinaEmbeddingsV3Model``, and their ``XForSequenceClassification``.

One harness for the three families, one layer each: hidden states and classifier logits on right-
and left-padded batches, gradients by PyTorch name, the export of changed weights, LoRA against PEFT.
Then what only one family has: the hub folders written for the models' own code (``auto_map``) read as
transformers' classes (nomic's GPT-2-style keys, GTE's ``new`` with NTK scaling under ``new.``, jina's
``xlm-roberta`` with ``parametrize`` LoRA tensors), Jina's task adapters in both layouts (jina's and PEFT
subfolders) against PEFT and jina's formula, GTE's dropout sites, bf16 and remat; the advice for a
``model_type`` no family serves. transformers 4.57 (the legacy stack) has none of the three classes:
their tests skip there, saying so."""

from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from hf_tiny import (  # noqa: E402
    NH,
    H,
    check_bf16_and_remat,
    check_dropout_spread,
    check_export,
    check_gradients,
    check_hidden_states,
    check_logits,
    check_lora_matches_peft,
    check_train_needs_key,
    padded_batch,
    save_tiny,
    scale_matrices,
)

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families.gte import GteBackbone, ntk_as_linear  # noqa: E402
from flaxheads.backbones.families.jina_v3 import JinaV3Backbone  # noqa: E402
from flaxheads.backbones.families.nomic_bert import NomicBertBackbone  # noqa: E402
from flaxheads.backbones.families.rotary_bert import RotaryBertBackbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402
from flaxheads.errors import FlaxheadsError  # noqa: E402
from flaxheads.model.task_adapters import task_names, with_task  # noqa: E402

ARCHS = ("nomic_bert", "gte", "jina_embeddings_v3")
CLASSES = {"nomic_bert": NomicBertBackbone, "gte": GteBackbone, "jina_embeddings_v3": JinaV3Backbone}
#: GTE's hub checkpoints scale RoPE by static NTK (factor 8 here); transformers writes it as linear RoPE
NTK_THETA, NTK_FACTOR, HEAD_DIM = 10_000.0, 8.0, H // NH
GTE_ROPE = ntk_as_linear(NTK_THETA, {"type": "ntk", "factor": NTK_FACTOR}, HEAD_DIM)


def _has(arch: str) -> bool:
    try:
        transformers.AutoConfig.for_model(arch)
    except (ValueError, KeyError):
        return False
    return True


def _param(arch: str):
    return pytest.param(
        arch,
        id=arch,
        marks=pytest.mark.skipif(
            not _has(arch),
            reason=f"transformers {transformers.__version__} has no {arch} (its PyTorch class came "
            "with transformers 5): nothing to compare against",
        ),
    )


FAMILIES = [_param(a) for a in ARCHS]


def _over(arch: str) -> dict:
    return {"rope_parameters": dict(GTE_ROPE)} if arch == "gte" else {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = save_tiny(tmp_path_factory.mktemp(arch) / "model", arch, **_over(arch))
        return made[arch]

    return get


def _logits(pt, ids, mask):
    with torch.no_grad():
        return pt.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def _ours(model, ids, mask, params=None):
    return np.asarray(jax.jit(model.apply)(model.params if params is None else params, ids, mask))


# ---- the shared harness -------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_hidden_states_match_pytorch(folders, arch, side):
    path, pt = folders(arch)
    bb = check_hidden_states(path, pt, arch, side)
    assert type(bb) is CLASSES[arch]
    if arch == "gte":  # the NTK-scaled RoPE as transformers writes it: lower frequencies than the plain one
        plain = NTK_THETA ** (-(HEAD_DIM - 2) / HEAD_DIM)
        assert GTE_ROPE["rope_type"] == "linear" and bb.settings.rope.inv_freq[-1] < 0.2 * plain


@pytest.mark.parametrize("arch", FAMILIES)
def test_classifier_logits_match_pytorch(folders, arch):
    """The HF preset head with every weight from the checkpoint; right padding (hf_tiny), then left."""
    path, pt = folders(arch)
    check_logits(path, pt, arch, CLASSES[arch])
    model = fh.from_pretrained(path)
    ids, mask = padded_batch(arch, pt.config, "left")
    np.testing.assert_allclose(_ours(model, ids, mask), _logits(pt, ids, mask), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", FAMILIES)
def test_gradients_match_torch_autograd(folders, arch):
    """Every parameter's gradient by PyTorch name, the key bias's included (rotated by position, softmax does
    not cancel it as it cancels BERT's)."""
    check_gradients(*folders(arch), arch, softmax_cancelled=lambda name: False)


@pytest.mark.parametrize("arch", FAMILIES)
def test_export_of_changed_weights_loads_in_pytorch(folders, arch, tmp_path):
    check_export(*folders(arch), arch, tmp_path / "out")


@pytest.mark.parametrize("arch", FAMILIES)
def test_lora_gives_peft_logits(folders, arch):
    mlp = "fc1" if arch == "jina_embeddings_v3" else "up_proj"
    check_lora_matches_peft(*folders(arch), arch, targets=("q_proj", "v_proj", mlp))


# ---- what one family shows for all three --------------------------------------------------------------------
def test_gte_dropout_sites_match_pytorch_statistically(tmp_path):
    """Embedding, attention-probability, attention-output, gated-product and feed-forward-output dropout
    (GTE has every site the three families have): the train-mode spread is PyTorch's within 20%."""
    if not _has("gte"):
        pytest.skip(f"transformers {transformers.__version__} has no gte")
    path, pt = save_tiny(
        tmp_path,
        "gte",
        edit=lambda m: scale_matrices(m, 4.0),
        hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.2,
        **_over("gte"),
    )
    check_dropout_spread(path, pt, "gte", low=0.8, high=1.2)


@pytest.mark.parametrize("arch", [_param("gte")])
def test_bf16_logits_remat_gradients_and_dropout_key(folders, arch):
    check_bf16_and_remat(*folders(arch), arch, atol=0.05)
    check_train_needs_key(*folders(arch), arch)


def test_init_params_have_every_checkpoint_shape(folders):
    for arch in (a for a in ARCHS if _has(a)):
        bb = load_backbone(folders(arch)[0])
        shapes = jax.tree.map(np.shape, type(bb).init_params(bb.config, jax.random.PRNGKey(0)))
        assert shapes == jax.tree.map(np.shape, bb.params), arch


# ---- hub folders for the models' own code -------------------------------------------------------------------
def _write(folder, config: dict, state: dict) -> str:
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, os.path.join(folder, "model.safetensors"))
    return str(folder)


def _saved(path) -> dict:
    from safetensors.numpy import load_file

    return dict(load_file(os.path.join(path, "model.safetensors")))


def _nomic_hub_config(pt) -> dict:
    """nomic's ``config.json`` of the model ``pt`` (GPT-2-style keys, ``auto_map`` to its code)."""
    c = pt.config
    hub = {
        "model_type": "nomic_bert",
        "architectures": ["NomicBertForSequenceClassification"],
        "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig"},
        "n_embd": c.hidden_size,
        "n_layer": c.num_hidden_layers,
        "n_head": c.num_attention_heads,
        "n_inner": c.intermediate_size,
        "n_positions": 2048,
        "layer_norm_epsilon": c.layer_norm_eps,
        "activation_function": "swiglu",
        "rotary_emb_base": 1000,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "prenorm": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "type_vocab_size": c.type_vocab_size,
        "vocab_size": c.vocab_size,
        "resid_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "num_labels": 3,
    }
    return hub


def _gte_hub(pt, path) -> tuple[dict, dict]:
    """Alibaba's ``config.json`` (``model_type new``, NTK scaling, ``auto_map``) and state dict (``new.``) of
    the model ``pt`` saved at ``path``."""
    c = pt.config
    hub = {
        "model_type": "new",
        "architectures": ["NewForSequenceClassification"],
        "auto_map": {"AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig"},
        "position_embedding_type": "rope",
        "rope_theta": NTK_THETA,
        "rope_scaling": {"type": "ntk", "factor": NTK_FACTOR},
        "layer_norm_type": "layer_norm",
        "pack_qkv": True,
        "unpad_inputs": False,
        "logn_attention_scale": False,
        **{
            k: getattr(c, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "hidden_act",
                "layer_norm_eps",
                "type_vocab_size",
                "pad_token_id",
                "max_position_embeddings",
            )
        },
        "num_labels": 3,
    }
    state = {("new" + k[3:] if k.startswith("gte.") else k): v for k, v in _saved(path).items()}
    return hub, state


@pytest.mark.skipif(not _has("nomic_bert"), reason="transformers has no nomic_bert")
def test_nomic_hub_config_reads_as_nomic_bert_config(folders, tmp_path):
    """nomic's ``config.json`` (GPT-2-style keys, ``auto_map`` to its code) on the same weights gives
    NomicBertForSequenceClassification's logits; a setting transformers' class lacks is refused by name."""
    path, pt = folders("nomic_bert")
    c, hub = pt.config, _nomic_hub_config(pt)
    folder = _write(tmp_path / "hub", hub, _saved(path))
    model = fh.from_pretrained(folder)
    assert model.model_type == "nomic_bert" and model.arch == "nomic_bert" and model.report.new == []
    ids, mask = padded_batch("nomic_bert", c)
    np.testing.assert_allclose(_ours(model, ids, mask), _logits(pt, ids, mask), atol=1e-4, rtol=0)
    assert "auto_map" not in model.backbone.config and model.backbone.config.hidden_size == H
    bad = _write(tmp_path / "prenorm", {**hub, "prenorm": True, "qkv_proj_bias": True}, _saved(path))
    with pytest.raises(BackboneError, match=r"prenorm.*qkv_proj_bias.*NomicBertModel"):
        load_backbone(bad)


@pytest.mark.skipif(not _has("gte"), reason="transformers has no gte")
def test_gte_hub_folder_with_ntk_scaling_and_new_prefix(folders, tmp_path):
    """Alibaba's folder (``model_type new``, ``rope_scaling: {type: ntk}``, the classifier under ``new.``)
    gives GteForSequenceClassification's logits with its pooler and classifier; the frequencies are those
    of the hub code's NTK formula, ``(theta f) ** (-2i / d) / f ** (2 / d)``."""
    path, pt = folders("gte")
    c = pt.config
    hub, state = _gte_hub(pt, path)
    folder = _write(tmp_path / "hub", hub, state)
    model = fh.from_pretrained(folder)
    assert model.arch == "gte" and model.report.new == []  # pooler and classifier found under new.
    ids, mask = padded_batch("gte", c)
    np.testing.assert_allclose(_ours(model, ids, mask), _logits(pt, ids, mask), atol=1e-4, rtol=0)
    i = np.arange(0, HEAD_DIM, 2, dtype=np.float64)
    hub_inv = 1.0 / (NTK_THETA * NTK_FACTOR) ** (i / HEAD_DIM) / NTK_FACTOR ** (2.0 / HEAD_DIM)
    np.testing.assert_allclose(model.backbone.settings.rope.inv_freq, hub_inv, rtol=1e-6)
    for change, match in (
        ({"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}}, "mixed_b"),
        ({"logn_attention_scale": True}, "logn_attention_scale"),
    ):
        with pytest.raises(BackboneError, match=match):
            load_backbone(_write(tmp_path / match, {**hub, **change}, state))


TASKS = ["retrieval.query", "retrieval.passage", "separation", "classification", "text-matching"]


def _jina_hub_folder(pt, path, folder, rank=4, alpha=2.0, seed=0):
    """jina's layout of the same model: ``xlm-roberta`` config for its own code, every linear and embedding
    weight a ``parametrize`` parametrization with five tasks' adapters. Returns (folder, {task: PyTorch model
    with that task's adapters merged by jina's formula})."""
    rng = np.random.default_rng(seed)
    state, out, deltas = _saved(path), {}, {t: {} for t in TASKS}
    for k, w in state.items():
        module = k[: -len(".weight")]
        adapted = k.endswith(".weight") and w.ndim == 2 and k.startswith("roberta.") and "LayerNorm" not in k
        if not adapted:
            out[k] = w
            continue
        out[f"{module}.parametrizations.weight.original"] = w
        emb = module.endswith("_embeddings")
        a_shape, b_shape = (
            ((len(TASKS), w.shape[0], rank), (len(TASKS), rank, w.shape[1]))
            if emb
            else ((len(TASKS), rank, w.shape[1]), (len(TASKS), w.shape[0], rank))
        )
        a, b = (0.3 * rng.normal(size=s).astype(np.float32) for s in (a_shape, b_shape))
        out[f"{module}.parametrizations.weight.0.lora_A"], out[f"{module}.parametrizations.weight.0.lora_B"] = a, b
        for t, task in enumerate(TASKS):
            deltas[task][module] = (alpha / rank) * (a[t] @ b[t] if emb else b[t] @ a[t])
    c = pt.config
    hub = {
        "model_type": "xlm-roberta",
        "architectures": ["XLMRobertaLoRA"],
        "position_embedding_type": "rotary",
        "auto_map": {
            "AutoConfig": "jinaai/xlm-roberta-flash-implementation--configuration_xlm_roberta.XLMRobertaFlashConfig"
        },
        "rotary_emb_base": 20000.0,
        "lora_adaptations": TASKS,
        "lora_rank": rank,
        "lora_alpha": alpha,
        "lora_dropout_p": 0.0,
        "load_trained_adapters": True,
        "use_flash_attn": True,
        "num_labels": 3,
        **{
            k: getattr(c, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "hidden_act",
                "layer_norm_eps",
                "type_vocab_size",
                "pad_token_id",
                "bos_token_id",
                "eos_token_id",
                "max_position_embeddings",
            )
        },
    }
    refs = {}
    for task in TASKS[:2]:
        ref = copy.deepcopy(pt)
        sd = ref.state_dict()
        for module, d in deltas[task].items():
            native = module.replace("encoder.layers", "layers").replace("mixer.out_proj", "self_attn.o_proj")
            if native.endswith("mixer.Wqkv"):
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), np.split(d, 3, axis=0)):
                    sd[native.replace("mixer.Wqkv", f"self_attn.{proj}") + ".weight"] += torch.tensor(part)
            else:
                sd[native + ".weight"] += torch.tensor(d)
        ref.load_state_dict(sd)
        refs[task] = ref
    return _write(folder, hub, out), refs


@pytest.mark.skipif(not _has("jina_embeddings_v3"), reason="transformers has no jina_embeddings_v3")
def test_jina_hub_folder_and_its_task_adapters(folders, tmp_path):
    """jina's own folder reads as JinaEmbeddingsV3 (no task: the base weights); a task's adapters, as LoRA
    or merged, give the logits of the weights with jina's ``W + (alpha / r) B A`` (embeddings ``A B``)."""
    path, pt = folders("jina_embeddings_v3")
    folder, refs = _jina_hub_folder(pt, path, tmp_path / "hub")
    model = fh.from_pretrained(folder)
    assert model.model_type == "jina_embeddings_v3" and model.arch == "jina_embeddings_v3" and not model.report.new
    ids, mask = padded_batch("jina_embeddings_v3", pt.config)
    np.testing.assert_allclose(_ours(model, ids, mask), _logits(pt, ids, mask), atol=1e-4, rtol=0)
    assert task_names(model) == TASKS
    for task, ref in refs.items():
        want = _logits(ref, ids, mask)
        assert np.abs(want - _logits(pt, ids, mask)).max() > 1e-2, task
        adapted = with_task(model, task)
        assert adapted.lora.rank == 4 and adapted.lora.alpha == 2.0
        assert {t.rsplit("/", 1)[1] for t in adapted.lora.targets} == {
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "fc1",
            "fc2",
        }
        np.testing.assert_allclose(_ours(adapted, ids, mask), want, atol=1e-4, rtol=0)
        merged = with_task(model, task, merge=True)
        assert merged.lora is None
        np.testing.assert_allclose(_ours(merged, ids, mask), want, atol=1e-4, rtol=0)
    with pytest.raises(FlaxheadsError, match=r"unknown task 'summarize'.*retrieval.query"):
        with_task(model, "summarize")
    absolute = _write(
        tmp_path / "absolute", {**json.load(open(f"{folder}/config.json")), "position_embedding_type": "absolute"}, {}
    )
    with pytest.raises(BackboneError, match="jina-reranker-v2"):
        load_backbone(absolute)


@pytest.mark.skipif(not _has("jina_embeddings_v3"), reason="transformers has no jina_embeddings_v3")
def test_task_chosen_when_loading_is_with_task(folders, tmp_path, tiny_bert):
    """``from_pretrained(folder, task=...)`` and ``fh.load(folder, task=...)`` are ``with_task`` on the model as
    loaded: the weights with that task's adapters (jina's formula, in PyTorch), different for each task; an
    unknown task is one line naming the folder's tasks, before any weight is read."""
    from flaxheads.errors import UsageError

    path, pt = folders("jina_embeddings_v3")
    folder, refs = _jina_hub_folder(pt, path, tmp_path / "hub")
    for name in os.listdir(
        tiny_bert
    ):  # a tokenizer, for Classifier (its vocabulary is not the model's: no text is read)
        if name.startswith(("vocab", "tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tiny_bert, name), folder)
    ids, mask = padded_batch("jina_embeddings_v3", pt.config, "left")
    base = fh.from_pretrained(folder)
    got = {}
    for task, ref in refs.items():
        chosen = fh.from_pretrained(folder, task=task)
        got[task] = _ours(chosen, ids, mask)
        np.testing.assert_array_equal(got[task], _ours(with_task(base, task), ids, mask))
        np.testing.assert_allclose(got[task], _logits(ref, ids, mask), atol=1e-4, rtol=0)
        np.testing.assert_array_equal(_ours(fh.load(folder, task=task), ids, mask), got[task])
        clf = fh.Classifier.from_pretrained(folder, task=task)
        np.testing.assert_array_equal(_ours(clf.model, ids, mask), got[task])
    assert np.abs(got[TASKS[0]] - got[TASKS[1]]).max() > 1e-2
    for load in (fh.from_pretrained, fh.load):
        with pytest.raises(UsageError) as e:
            load(folder, task="summarize")
        assert "\n" not in str(e.value) and all(t in str(e.value) for t in TASKS)
    with pytest.raises(FlaxheadsError, match="jina_embeddings_v3.*load it without task"):
        fh.from_pretrained(_write(tmp_path / "bert", {"model_type": "bert"}, {}), task="retrieval.query")


@pytest.mark.skipif(not _has("jina_embeddings_v3"), reason="transformers has no jina_embeddings_v3")
def test_jina_peft_task_adapters_give_peft_logits(folders, tmp_path):
    """transformers' layout: a PEFT LoRA folder per task (subfolder ``retrieval_query``), on the attention,
    feed-forward and word-embedding modules; ``with_task`` gives ``PeftModel``'s logits, as LoRA (kept
    trainable and exportable) or merged."""
    peft = pytest.importorskip("peft")
    import shutil

    path, pt = folders("jina_embeddings_v3")
    folder = shutil.copytree(path, tmp_path / "hf")
    pm = peft.get_peft_model(
        copy.deepcopy(pt),
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "word_embeddings"],
        ),
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    pm.save_pretrained(folder / "retrieval_query")
    ids, mask = padded_batch("jina_embeddings_v3", pt.config)
    want = _logits(pm, ids, mask)
    assert np.abs(want - _logits(pt, ids, mask)).max() > 1e-2
    model = fh.from_pretrained(folder)
    assert task_names(model) == ["retrieval_query"]
    adapted = with_task(model, "retrieval.query")
    assert adapted.lora.rank == 4 and len(adapted.lora.targets) == 6 * pt.config.num_hidden_layers
    np.testing.assert_allclose(_ours(adapted, ids, mask), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(
        _ours(with_task(model, "retrieval_query", merge=True), ids, mask), want, atol=1e-4, rtol=0
    )
    with pytest.raises(FlaxheadsError, match="already has LoRA adapters"):
        with_task(adapted, "retrieval.query")


def _hub_folder(arch: str, pt, path, folder) -> str:
    """The tiny model of ``arch`` in the form its hub folder takes: a ``config.json`` for the model's own code."""
    if arch == "nomic_bert":
        return _write(folder, _nomic_hub_config(pt), _saved(path))
    if arch == "gte":
        return _write(folder, *_gte_hub(pt, path))
    return _jina_hub_folder(pt, path, folder)[0]


@pytest.mark.parametrize("arch", FAMILIES)
def test_hub_folders_read_by_every_loading_path(folders, arch, tmp_path):
    """A hub folder written for the model's own code is the family's on every path that reads a folder, as
    in from_pretrained: ``fh.load`` (a transformers classifier: GTE's ``New...`` class named as ``Gte...``),
    the shapes-only model (memory plans, mesh layouts) and the read onto a mesh give PyTorch's logits."""
    from flaxheads.model.abstract import abstract_model

    path, pt = folders(arch)
    folder = _hub_folder(arch, pt, path, tmp_path / "hub")
    ids, mask = padded_batch(arch, pt.config)
    want = _logits(pt, ids, mask)
    loaded = fh.load(folder)
    assert loaded.model_type == arch and loaded.arch == arch
    np.testing.assert_allclose(_ours(loaded, ids, mask), want, atol=1e-4, rtol=0)
    shapes = abstract_model(folder)
    assert shapes.model_type == arch
    assert jax.tree.map(np.shape, shapes.params) == jax.tree.map(np.shape, loaded.params)
    on_mesh = fh.from_pretrained(folder, mesh="fsdp=1")
    assert on_mesh.report.new == []  # the pooler and classifier found, GTE's under new. too
    np.testing.assert_allclose(_ours(on_mesh, ids, mask), want, atol=1e-4, rtol=0)


# ---- refusals -----------------------------------------------------------------------------------------------
def test_a_model_type_no_family_serves_gets_advice_true_for_it(tmp_path):
    """The hf-flax extra is offered only for a model_type transformers 4.x had a Flax model of; a folder for
    a model's own code says flaxheads does not run it."""
    cases = {"mpnet": {}, "t5": {}, "acme_bert": {"auto_map": {"AutoConfig": "acme/bert--configuration.AcmeConfig"}}}
    for mt, extra in cases.items():
        d = tmp_path / mt
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": mt, **extra}))
        with pytest.raises(BackboneError) as e:
            load_backbone(d, implementation="native" if mt == "t5" else "auto")
        msg = str(e.value)
        assert f"model_type {mt!r} has no native flaxheads backbone" in msg and "nomic_bert, gte" in msg
        if mt == "t5":
            assert "Flax model of it" in msg
        else:
            assert "never had a Flax model" in msg and "install" not in msg
        if extra:
            assert "acme/bert--configuration.AcmeConfig" in msg and "never runs" in msg


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_attention_heads": 5}, "not divisible"),
        ({"hidden_act": "swoosh"}, "swoosh"),
        ({"rope_parameters": {"rope_type": "ntk", "rope_theta": 1e4}}, "ntk"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
    ],
)
def test_refused_config_is_a_clear_error(change, match):
    from flaxheads.backbones.base import HFConfig

    cfg = NomicBertBackbone.complete_config(
        HFConfig({"model_type": "nomic_bert", "hidden_size": 32, "num_attention_heads": 4, **change})
    )
    with pytest.raises(BackboneError, match=match):
        NomicBertBackbone.check_config(cfg)
    assert issubclass(NomicBertBackbone, RotaryBertBackbone)
