"""Sharding past data parallel: logical axis names of every family's params, the rules that put
them on a data x fsdp x tensor mesh, and training on 8 (forced CPU) devices: one device,
data=8, data=2,fsdp=4 and fsdp=2,tensor=4 give the same losses and params; a run saved on
one mesh and restored onto another continues as the uninterrupted run."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flaxheads.backbones.families.gpt2 import GPT2Backbone
from flaxheads.errors import TrainingError
from flaxheads.runtime.axes import EMBED, HEADS, KV, MLP, VOCAB, generic_param_axes
from flaxheads.runtime.sharding import DEFAULT_RULES, Layout, make_mesh, parse_mesh, spec_for

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharding_worker.py")


def _axes(path: str, shape):
    return generic_param_axes(tuple(path.split("/")), shape)


@pytest.mark.parametrize(
    "path, shape, want",
    [
        # BERT-like (ELECTRA, RoBERTa share it)
        ("embeddings/word_embeddings/embedding", (99, 32), (VOCAB, EMBED)),
        ("embeddings/position_embeddings/embedding", (64, 32), (None, EMBED)),
        ("encoder/layer/0/attention/self/query/kernel", (32, 32), (EMBED, HEADS)),
        ("encoder/layer/0/attention/self/query/bias", (32,), (HEADS,)),
        ("encoder/layer/0/attention/self/key/kernel", (32, 32), (EMBED, KV)),
        ("encoder/layer/0/attention/output/dense/kernel", (32, 32), (HEADS, EMBED)),
        ("encoder/layer/0/attention/output/dense/bias", (32,), (EMBED,)),
        ("encoder/layer/0/attention/output/LayerNorm/scale", (32,), (None,)),
        ("encoder/layer/0/intermediate/dense/kernel", (32, 37), (EMBED, MLP)),
        ("encoder/layer/0/output/dense/kernel", (37, 32), (MLP, EMBED)),
        # DistilBERT, ALBERT, BART
        ("transformer/layer/0/attention/q_lin/kernel", (32, 32), (EMBED, HEADS)),
        ("transformer/layer/0/ffn/lin2/kernel", (37, 32), (MLP, EMBED)),
        ("encoder/albert_layer_groups/0/albert_layers/0/attention/dense/kernel", (32, 32), (HEADS, EMBED)),
        ("encoder/albert_layer_groups/0/albert_layers/0/ffn/kernel", (32, 37), (EMBED, MLP)),
        ("encoder/albert_layer_groups/0/albert_layers/0/ffn_output/kernel", (37, 32), (MLP, EMBED)),
        ("decoder/layers/0/encoder_attn/out_proj/kernel", (32, 32), (HEADS, EMBED)),
        ("decoder/layers/0/fc1/kernel", (32, 37), (EMBED, MLP)),
        ("shared/embedding", (99, 32), (VOCAB, EMBED)),
        # the names of the DeBERTa, ModernBERT and Llama-style families
        ("encoder/layer/0/attention/self/query_proj/kernel", (32, 32), (EMBED, HEADS)),
        ("encoder/rel_embeddings/embedding", (128, 32), (None, EMBED)),
        ("embeddings/tok_embeddings/embedding", (99, 32), (VOCAB, EMBED)),
        ("layers/0/attn/Wqkv/kernel", (32, 96), (EMBED, HEADS)),
        ("layers/0/attn/Wo/kernel", (32, 32), (HEADS, EMBED)),
        ("layers/0/mlp/Wi/kernel", (32, 74), (EMBED, MLP)),
        ("layers/0/mlp/Wo/kernel", (37, 32), (MLP, EMBED)),
        ("embed_tokens/embedding", (99, 32), (VOCAB, EMBED)),
        ("layers/0/self_attn/q_proj/kernel", (32, 32), (EMBED, HEADS)),
        ("layers/0/self_attn/k_proj/kernel", (32, 16), (EMBED, KV)),
        ("layers/0/self_attn/o_proj/kernel", (32, 32), (HEADS, EMBED)),
        ("layers/0/mlp/gate_proj/kernel", (32, 37), (EMBED, MLP)),
        ("layers/0/mlp/up_proj/kernel", (32, 37), (EMBED, MLP)),
        ("layers/0/mlp/down_proj/kernel", (37, 32), (MLP, EMBED)),
        ("layers/0/input_layernorm/scale", (32,), (None,)),
        ("layers/0/self_attn/q_norm/scale", (8,), (None,)),
        # heads: any other dense layer splits its input; unknown leaves stay whole
        ("pooler/dense/kernel", (32, 32), (EMBED, None)),
        ("head/classifier/kernel", (32, 3), (EMBED, None)),
        ("head/classifier/bias", (3,), (None,)),
        ("pooler/query", (32,), (None,)),
        ("layers/0/self_attn/q_proj/lora_a", (32, 4), (None, None)),
    ],
)
def test_generic_axes(path, shape, want):
    assert _axes(path, shape) == want


#: Dense layers outside attention and feed-forward blocks: the generic (embed, None) is right for them.
OTHER_DENSE = ("embeddings_project", "embedding_hidden_mapping_in")


@pytest.mark.parametrize(
    "arch",
    [
        "bert",
        "roberta",
        "distilbert",
        "albert",
        "electra",
        "gpt2",
        "bart",
        "deberta-v2",
        "modernbert",
        "llama",
        "qwen2",
        "gemma3_text",
    ],
)
def test_every_family_weight_has_its_names(arch):
    """Every registered family's attention / feed-forward kernels get their logical names from its
    hook, and every embedding table its embed axis (the names a config.json makes, via eval_shape)."""
    from hf_tiny import tiny_config

    from flaxheads.backbones.base import HFConfig
    from flaxheads.backbones.registry import family_for

    cfg = HFConfig(tiny_config(arch).to_dict())
    fam = family_for(cfg["model_type"])
    if fam is None:
        pytest.skip(f"no native {arch} backbone in this tree")
    shapes = fam.param_shapes(fam.complete_config(cfg))
    kinds = set()
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        names = tuple(str(getattr(k, "key", k)) for k in path)
        axes = fam.param_axes(names, x.shape)
        assert len(axes) == len(x.shape), names
        if names[-1] in ("kernel", "embedding") and len(x.shape) == 2:
            assert EMBED in axes, names
            if names[-1] == "kernel" and names[-2] not in OTHER_DENSE:
                assert set(axes) & {HEADS, KV, MLP}, (names, axes)
                kinds.add(axes)
    assert (HEADS, EMBED) in kinds and (EMBED, MLP) in kinds and (MLP, EMBED) in kinds


def test_gpt2_hook_reverses_conv1d_kernels():
    assert GPT2Backbone.param_axes(("h", "0", "attn", "c_attn", "kernel"), (96, 32)) == (HEADS, EMBED)
    assert GPT2Backbone.param_axes(("h", "0", "mlp", "c_proj", "kernel"), (32, 128)) == (EMBED, MLP)
    assert GPT2Backbone.param_axes(("h", "0", "attn", "c_attn", "bias"), (96,)) == (HEADS,)
    assert GPT2Backbone.param_axes(("wte", "embedding"), (99, 32)) == (VOCAB, EMBED)


def test_spec_rules_and_fallbacks():
    mesh = make_mesh("fsdp=2,tensor=2")  # 4 devices (conftest)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    assert spec_for((EMBED, MLP), (32, 64), mesh, DEFAULT_RULES) == P("fsdp", "tensor")
    # 37 does not split over 2 tensor devices: that dimension stays whole, the other is still sharded
    assert spec_for((EMBED, MLP), (32, 37), mesh, DEFAULT_RULES) == P("fsdp")
    assert spec_for((VOCAB, EMBED), (99, 32), mesh, DEFAULT_RULES) == P(None, "fsdp")
    assert spec_for((None, None), (4, 4), mesh, DEFAULT_RULES) == P()
    # a mesh axis is used once per array; size-1 axes are left out
    assert spec_for((EMBED, EMBED), (32, 32), mesh, DEFAULT_RULES) == P("fsdp")
    assert spec_for((EMBED, HEADS), (32, 32), make_mesh("data=4"), DEFAULT_RULES) == P()
    assert spec_for((EMBED,), (8,), mesh, {EMBED: ("fsdp", "tensor")}) == P(("fsdp", "tensor"))


def test_optimizer_state_sharded_like_its_params():
    import optax

    class M:  # a model-like object: params and a backbone class with the generic hook
        params = {
            "backbone": {"layer": {"query": {"kernel": np.zeros((8, 16), np.float32)}}},
            "head": {"classifier": {"kernel": np.zeros((8, 3), np.float32)}},
        }
        backbone = object()

    layout = Layout.for_model(make_mesh("fsdp=2,tensor=2"), M())
    opt = optax.adamw(1e-3).init(M.params)
    sh = layout.shardings({"params": M.params, "opt_state": opt})
    q = ("backbone", "layer", "query", "kernel")
    assert sh["params"]["backbone"]["layer"]["query"]["kernel"].spec == P("fsdp", "tensor")
    mu = opt[0].mu
    got = jax.tree.map(lambda _, s: s.spec, mu, layout.shardings(mu))
    assert got["backbone"]["layer"]["query"]["kernel"] == P("fsdp", "tensor")
    assert got["head"]["classifier"]["kernel"] == P("fsdp")
    assert layout.spec_of(("x", "count"), ()) == P()
    assert layout.spec_of(("mu",) + q, (4, 4)) == P()  # same path, other shape: not that param


@pytest.mark.parametrize(
    "text, want", [("data=2,fsdp=4", {"data": 2, "fsdp": 4}), ("tensor=2", {"tensor": 2}), ("fsdp=-1", {"fsdp": -1})]
)
def test_parse_mesh(text, want):
    assert parse_mesh(text) == want


@pytest.mark.parametrize(
    "text, match",
    [
        ("data=2,model=2", "unknown axis 'model'"),
        ("data2", "axis=size"),
        ("data=2,data=2", "twice"),
        ("fsdp=0", "positive"),
    ],
)
def test_parse_mesh_refuses(text, match):
    with pytest.raises(TrainingError, match=match):
        parse_mesh(text)


def test_make_mesh_sizes():
    assert dict(make_mesh().shape) == {"data": 4, "fsdp": 1, "tensor": 1}
    assert dict(make_mesh("fsdp=-1,tensor=2").shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    with pytest.raises(TrainingError, match="needs 8 devices"):
        make_mesh("data=2,fsdp=2,tensor=2")
    with pytest.raises(TrainingError, match="do not split"):
        make_mesh("tensor=3")


# ---- 8 devices, in a subprocess ---------------------------------------------------------------------


def _eight_devices_env() -> dict:
    # the conftest's flags with 8 devices instead of 4, and a collective timeout of a minute, not the
    # conftest's 6 s: 8 device threads on 2 cores beside another test can leave one that long
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f and "terminate_timeout" not in f
    ]
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(
            [
                "--xla_force_host_platform_device_count=8",
                "--xla_cpu_collective_call_terminate_timeout_seconds=60",
                *flags,
            ]
        ),
    }


def _worker(folder, out, case):
    p = subprocess.run(
        [sys.executable, WORKER, folder, out, case],
        env=_eight_devices_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.load(open(out + ".json"))


def _assert_params_close(a, b):
    a, b = np.load(a), np.load(b)
    assert set(a.files) == set(b.files)
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=1e-5, err_msg=k)


@pytest.fixture(scope="module")
def bert(tiny_bert):
    return tiny_bert


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from hf_tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("shard_gpt2"), "gpt2", pad_token_id=0)[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from hf_tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("shard_llama"), "llama")[0]


# GPT-2 (fused query/key/value kernels) is the next test's: its data=2,fsdp=4 and fsdp=2,tensor=4 runs
# against the single-device one
@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])
@pytest.mark.serial
def test_meshes_train_the_single_device_run(family, request, tmp_path):
    out = str(tmp_path / "res")
    rep = _worker(request.getfixturevalue(family), out, "meshes")
    single = rep["single"]["losses"]
    assert len(single) == 3
    for mesh in ("data=8", "data=2,fsdp=4", "fsdp=2,tensor=4"):
        np.testing.assert_allclose(rep[mesh]["losses"], single, rtol=1e-5, atol=1e-6, err_msg=mesh)
        _assert_params_close(f"{out}.{mesh}.npz", f"{out}.single.npz")
    # the meshes really split the work: batch width, and params sharded on fsdp / tensor
    assert [rep[m]["width"] for m in ("data=8", "data=2,fsdp=4", "fsdp=2,tensor=4")] == [8, 8, 2]
    assert not any("fsdp" in s or "tensor" in s for s in rep["data=8"]["specs"].values())
    fsdp, tensor = rep["data=2,fsdp=4"]["specs"], rep["fsdp=2,tensor=4"]["specs"]
    assert sum("'fsdp'" in s for s in fsdp.values()) > len(fsdp) // 3
    assert any("'fsdp', 'tensor'" in s for s in tensor.values()) and any(
        "'tensor', 'fsdp'" in s for s in tensor.values()
    )


@pytest.mark.slow
@pytest.mark.serial
def test_restore_onto_another_mesh_continues_the_run(gpt2, tmp_path):
    out = str(tmp_path / "res")
    rep = _worker(gpt2, out, "resume")
    assert rep["saved_steps"] == [2]
    assert any("tensor" in s for s in rep["restored_specs"])  # restored straight onto the new mesh's shards
    np.testing.assert_allclose(rep["resumed"], rep["whole"][2:], rtol=1e-5, atol=1e-6)
    _assert_params_close(out + ".resumed.npz", out + ".whole.npz")


@pytest.mark.slow  # not serial: it compiles and runs nothing, so no collective can time out
def test_fsdp8_holds_an_eighth_of_a_1b_llama_per_device(tmp_path):
    """A ~1B-parameter Llama sized with jax.eval_shape and XLA's memory analysis of the compiled
    train step (nothing allocated): under fsdp=8 each device holds ~1/8 of the params and
    optimizer moments that data=8 replicates, by the shardings and by XLA's own count."""
    out = str(tmp_path / "res")
    rep = _worker("-", out, "memory")
    assert 0.95e9 < rep["params"] < 1.1e9
    rep8, fsdp = rep["data=8"], rep["fsdp=8"]
    assert rep8["params"] == rep8["params_replicated"] == 4 * rep["params"]
    assert 0.125 <= fsdp["params"] / rep8["params"] < 0.126  # only norm scales stay whole
    assert 0.125 <= fsdp["opt_state"] / rep8["opt_state"] < 0.126
    # XLA's arguments are params + optimizer state + batch; its temporaries hold the gradients
    assert rep8["xla_arguments"] >= rep8["params"] + rep8["opt_state"]
    assert 0.125 <= fsdp["xla_arguments"] / rep8["xla_arguments"] < 0.13
    assert fsdp["xla_temp"] < rep8["xla_temp"] / 2


def test_frozen_backbone_on_a_mesh_is_the_single_device_run(bert):
    """Linear probe on fsdp=2,tensor=2 (4 devices): the frozen backbone is sharded but never
    differentiated, the optimizer state covers the head only, and the head ends as on one device."""
    from train_helpers import random_split

    import flaxheads as fh
    from flaxheads.training.loop import TrainConfig, Trainer, fit
    from flaxheads.training.optim import OptimConfig

    heads = []
    for mesh in (None, "fsdp=2,tensor=2"):
        model = fh.from_pretrained(bert, pooler="mean", head="linear", num_labels=3, head_options={"dropout": 0.0})
        cfg = TrainConfig(batch_size=4, max_steps=2, seed=1, parallel="mesh" if mesh else "single", mesh=mesh)
        tr = Trainer.build(model, OptimConfig(learning_rate=1e-2, total_steps=2, freeze_backbone=True), cfg)
        res = fit(tr, random_split(6, seed=2), buckets=(16,), progress=False)
        state = tr.parallel.get_state(res.state)
        assert set(state.opt_state[1].inner_states) == {"head"}
        heads.append(state.params)
    _close = np.testing.assert_allclose
    for a, b in zip(jax.tree.leaves(heads[0]), jax.tree.leaves(heads[1])):
        _close(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)
    assert not np.allclose(
        heads[0]["head"]["head"]["classifier"]["kernel"],
        fh.from_pretrained(bert, pooler="mean", head="linear", num_labels=3).params["head"]["head"]["classifier"][
            "kernel"
        ],
    )
