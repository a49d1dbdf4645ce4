"""flaxheads' native DeBERTa-v2/v3 against PyTorch transformers (``DebertaV2Model`` /
``DebertaV2ForSequenceClassification`` on the same weights), on both stacks.

Variants (tiny random models, every weight perturbed): v3 (log position buckets, c2p + p2c through
the shared query/key projections, LayerNorm'd relative table, no absolute positions), v2 (own
``pos_key_proj``/``pos_query_proj``, distances clipped at ``max_relative_positions``, absolute
positions), the convolution after the first layer, c2p only, p2c only, no relative attention, and
token types with an ``embed_proj``. The padded batch has rows of 9, 6 and 3 tokens: distances
up to 8 pass the bucket edge (4) and the clipping (5, 6) of the variants that have them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import (
    DROPOUT_SITES,
    P,
    check_bf16_and_remat,
    check_dropout_site,  # noqa: E402
    check_export,
    check_gradients,
    check_hidden_states,
    check_logits,
    check_train_needs_key,
    edited_copy,
    padded_batch,
    reweight,
    save_tiny,
)

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.base import BackboneError, HFConfig  # noqa: E402
from flaxheads.backbones.families import deberta
from flaxheads.backbones.families.deberta import DebertaV2Backbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402
from flaxheads.backbones.weights import read_state_dict  # noqa: E402
from flaxheads.layers.positions import diagonals_to_keys  # noqa: E402

ARCH = "deberta-v2"
V3 = dict(
    relative_attention=True,
    position_buckets=8,
    pos_att_type=["p2c", "c2p"],
    share_att_key=True,
    norm_rel_ebd="layer_norm",
    position_biased_input=False,
)
VARIANTS = {
    "v3": V3,
    "v2": dict(relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=False, max_relative_positions=6),
    "conv": dict(V3, conv_kernel_size=3, conv_groups=2, conv_act="gelu", layers=2),  # the first layer's alone
    "c2p": dict(relative_attention=True, pos_att_type=["c2p"], max_relative_positions=5),
    "p2c": dict(V3, pos_att_type=["p2c"]),
    # the score scale still counts pos_att_type's terms without relative attention, as in PyTorch
    "absolute": dict(relative_attention=False, pos_att_type=["p2c", "c2p"]),
    "token_types": dict(V3, type_vocab_size=2, embedding_size=16, position_biased_input=True),
}
#: gradients softmax removes exactly (ours 0, PyTorch rounding noise): the c2p projection bias, and the
#: key bias where no p2c term reads the keys
CANCELLED = {
    name: (
        lambda k, p2c=("p2c" in (v.get("pos_att_type") or []) and v.get("relative_attention")): (
            k.endswith("pos_key_proj.bias") or (not p2c and k.endswith("key_proj.bias"))
        )
    )
    for name, v in VARIANTS.items()
}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """``tiny(variant)``: the saved folder and PyTorch model of a variant."""
    return lambda name: tiny_model(ARCH, **VARIANTS[name])


def _torch_logits(pt, ids, mask, **inputs):
    with torch.no_grad():
        return pt(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            **{k: torch.tensor(v) for k, v in inputs.items()},
        ).logits.numpy()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hidden_states_and_logits_match_pytorch(tiny, variant):
    """Right padding: hidden states and the preset's (ContextPooler + classifier) logits."""
    path, pt = tiny(variant)
    bb = check_hidden_states(path, pt, ARCH)
    assert isinstance(bb, DebertaV2Backbone)
    check_logits(path, pt, ARCH, DebertaV2Backbone)


@pytest.mark.parametrize("variant", ["v3", "conv"])
def test_left_padding_pools_a_pad_row_as_pytorch(tiny, variant):
    """Left padding: the pooler reads position 0, a pad, whose hidden state is PyTorch's only if a padded
    query attends uniformly to every position (the outer-product mask): every row is compared."""
    path, pt = tiny(variant)
    ids, mask = padded_batch(ARCH, pt.config, "left")
    model = fh.from_pretrained(path)
    with torch.no_grad():
        ref = pt.base_model(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    np.testing.assert_allclose(np.asarray(model.backbone(ids, mask)[0]), ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(
        np.asarray(model.apply(model.params, ids, mask)), _torch_logits(pt, ids, mask), atol=1e-4, rtol=0
    )


def test_token_type_and_position_inputs_match_pytorch(tiny):
    path, pt = tiny("token_types")
    ids, mask = padded_batch(ARCH, pt.config)
    tt = np.zeros_like(ids)
    tt[:, 4:] = 1
    pos = np.broadcast_to(np.arange(ids.shape[1])[::-1] + 3, ids.shape).copy()
    check_hidden_states(path, pt, ARCH, token_type_ids=tt, position_ids=pos)
    bb = load_backbone(path)
    assert np.abs(np.asarray(bb(ids, mask, tt)[0]) - np.asarray(bb(ids, mask)[0])).max() > 1e-3  # types count


def test_relative_only_model_runs_past_max_position_embeddings(tiny):
    """No absolute positions (v3): any length, as PyTorch; with them, a clear error past the table."""
    path, pt = tiny("v3")
    ids = np.random.default_rng(0).integers(3, 99, size=(1, P + 6))
    mask = np.ones_like(ids)
    with torch.no_grad():
        ref = pt.base_model(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    np.testing.assert_allclose(np.asarray(load_backbone(path)(ids, mask)[0]), ref, atol=1e-4, rtol=0)
    with pytest.raises(BackboneError, match="max_position_embeddings"):
        load_backbone(tiny("v2")[0])(ids, mask)


@pytest.mark.parametrize("buckets, max_rel", [(8, 64), (32, 100), (256, 512), (-1, 7), (-1, 512)])
@pytest.mark.parametrize("t", [1, 2, 9, 130, 600])
def test_relative_tables_are_transformers(buckets, max_rel, t):
    """The per-diagonal rows, laid out by ``diagonals_to_keys``, are exactly the indices PyTorch gathers:
    ``c2p_pos[i, j]`` and ``p2c_pos[j, i]`` from transformers' ``build_relative_position`` (float32 log buckets)."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    cfg = HFConfig(
        dict(
            hidden_size=8,
            num_attention_heads=2,
            num_hidden_layers=1,
            layer_norm_eps=1e-7,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=max_rel,
            type_vocab_size=0,
            relative_attention=True,
            position_buckets=buckets,
            pos_att_type=["c2p", "p2c"],
        )
    )
    s = deberta.Settings.from_config(cfg)
    x = torch.zeros(1, t, 1)
    rel = build_relative_position(x, x, bucket_size=buckets, max_position=max_rel)[0].numpy()
    span = s.span
    c2p_rows, p2c_rows = deberta.diagonal_rows(t, s)
    lay = lambda rows: np.asarray(diagonals_to_keys(jnp.broadcast_to(jnp.asarray(rows), (t, 2 * t - 1))))
    np.testing.assert_array_equal(lay(c2p_rows), np.clip(rel + span, 0, 2 * span - 1))
    np.testing.assert_array_equal(lay(p2c_rows), np.clip(-rel + span, 0, 2 * span - 1))  # [key, query]


@pytest.mark.parametrize("variant", ["v3", "v2", "conv", "c2p", "absolute", "token_types"])
def test_gradients_match_pytorch(tiny, variant):
    """Every parameter gradient by PyTorch name (the pad row of the word table gets none)."""
    check_gradients(*tiny(variant), ARCH, softmax_cancelled=CANCELLED[variant])


@pytest.mark.parametrize("site", DROPOUT_SITES)
def test_dropout_acts_where_pytorch_does(site, tmp_path):
    """One residual branch dominant, the other silenced (absolute-position model): a missing or extra
    dropout site moves the spread ratio 3x or more, the right ones keep it near 1."""
    check_dropout_site(
        tmp_path,
        ARCH,
        site,
        attn_out=r"attention\.output\.dense\.",
        ffn=r"layer\.\d+\.(intermediate|output)\.dense\.",
        ffn_out=r"layer\.\d+\.output\.dense\.",
    )


#: the dropout sites DeBERTa adds to BERT's: flaxheads' Settings field, the PyTorch module names' ending, and
#: the weights made large so that the site moves the output (relative scores deciding the attention)
EXTRA_SITES = {
    "v2-relative": ("v2", "pos_dropout", "pos_dropout", r"rel_embeddings|(query|key)_proj\.weight"),
    "v3-relative": ("v3", "pos_dropout", "pos_dropout", r"(query|key)_proj\.weight"),
    "convolution": ("conv", "conv_dropout", "conv.dropout", r"conv\.conv\.weight"),
}


def _mean_spread(run, ref, mask, seeds) -> float:
    """Mean squared change of the valid outputs of ``run(seed)`` (train mode) against ``ref`` (eval mode)."""
    valid = mask.astype(bool)
    return float(np.mean([((run(k) - ref) ** 2)[valid].mean() for k in seeds]))


@pytest.mark.parametrize("case", sorted(EXTRA_SITES))
def test_relative_table_and_convolution_dropout_match_pytorch(case, tmp_path):
    """``hidden_dropout_prob`` also drops the relative table in every layer and the convolution's output.
    Each alone (every other dropout off on both sides). The relative table's mask is one per layer for the
    whole batch, so the spread is averaged over 48 seeds, not over copies of the batch: PyTorch's within
    15% (measured within 6-10% at 24 seeds; a dropout left out makes it 0)."""
    variant, field, module, amplify = EXTRA_SITES[case]
    path, pt = save_tiny(
        tmp_path,
        ARCH,
        edit=lambda m: reweight(m, zero=r"^$", scale=amplify, factor=6.0),
        hidden_dropout_prob=0.3,
        attention_probs_dropout_prob=0.0,
        **VARIANTS[variant],
    )
    for name, m in pt.named_modules():
        if isinstance(m, torch.nn.Dropout) and not name.endswith(module):
            m.p = 0.0
    bb = load_backbone(path)
    bb.settings = dataclasses.replace(
        bb.settings, **{**dict(hidden_dropout=0.0, pos_dropout=0.0, conv_dropout=0.0), field: 0.3}
    )
    ids, mask = padded_batch(ARCH, pt.config)
    base, tids, tmask = pt.base_model, torch.tensor(ids), torch.tensor(mask)

    def torch_run(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return base(tids, attention_mask=tmask).last_hidden_state.numpy()

    with torch.no_grad():
        ref = base.eval()(tids, attention_mask=tmask).last_hidden_state.numpy()
    base.train()
    want = _mean_spread(torch_run, ref, mask, range(48))
    base.eval()
    train = jax.jit(lambda key: bb.encode(bb.params, ids, mask, train=True, rng=key))
    got = _mean_spread(lambda k: np.asarray(train(jax.random.PRNGKey(k))), ref, mask, range(48))
    assert want > 1e-4, want  # this dropout alone moves PyTorch's output
    assert abs(got / want - 1) < 0.15, (got, want)


def test_train_needs_a_dropout_key(tiny):
    check_train_needs_key(*tiny("v3"), ARCH)


@pytest.mark.parametrize("variant", ["conv", "v2"])
def test_export_of_changed_weights_loads_in_pytorch(tiny, variant, tmp_path):
    """Every weight changed, exported, loaded strictly by DebertaV2ForSequenceClassification:
    the convolution kernel goes back to PyTorch's layout, the position projections by name."""
    check_export(*tiny(variant), ARCH, tmp_path / "out")


def test_bf16_logits_and_remat_gradients(tiny):
    check_bf16_and_remat(*tiny("conv"), ARCH, atol=0.01)  # measured: 5e-4 off, on logits up to 0.11


def test_v3_checkpoint_with_an_unused_position_table_loads(tiny):
    """DeBERTa-v3 checkpoints carry ``embeddings.position_embeddings`` they do not use (PyTorch ignores it);
    so does flaxheads, and a config that spells ``pos_att_type`` as ``"p2c|c2p"`` reads the same."""
    path, pt = tiny("v3")
    state = read_state_dict(path)
    state["deberta.embeddings.position_embeddings.weight"] = np.ones((P, 32), np.float32)
    state["deberta.embeddings.position_ids"] = np.arange(P)[None]
    cfg = load_backbone(path).config.replace(pos_att_type="p2c|c2p")
    bb = DebertaV2Backbone.from_state(cfg, state)
    assert "position_embeddings" not in bb.params["embeddings"]
    ids, mask = padded_batch(ARCH, pt.config)
    np.testing.assert_allclose(np.asarray(bb(ids, mask)[0]), np.asarray(load_backbone(path)(ids, mask)[0]), atol=1e-6)
    assert sorted(bb.state_from_params(bb.params)) == sorted(
        k[len("deberta.") :] for k in read_state_dict(path) if k.startswith("deberta.")
    )


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "deberta"}, "model_type"),
        ({"num_attention_heads": 5}, "not divisible"),
        ({"attention_head_size": 4}, "attention_head_size"),
        ({"conv_kernel_size": 4}, "even conv_kernel_size"),
        ({"conv_kernel_size": 3, "conv_groups": 5}, "conv_groups"),
        ({"conv_kernel_size": 3, "conv_act": "swoosh"}, "swoosh"),
        ({"hidden_act": "swoosh"}, "swoosh"),
        ({"position_buckets": 1}, "position_buckets"),
    ],
)
def test_refused_config_is_a_clear_error(tiny, tmp_path, change, match):
    with pytest.raises(BackboneError, match=match):
        load_backbone(edited_copy(tiny("v3")[0], tmp_path / "bad", **change), implementation="native")
