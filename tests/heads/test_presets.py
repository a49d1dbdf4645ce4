"""The one decision "is this (pooler, head, pool mask) the backbone's HF preset" and the one pool-mask check."""

import pytest

from flaxheads.backbones.base import HFConfig
from flaxheads.heads.heads import LinearHead, MLPHead
from flaxheads.heads.poolers import DensePooler, Pool
from flaxheads.heads.presets import PoolMaskError, check_pool_mask, match_preset, preset_for, same_structure

GPT2 = HFConfig({"model_type": "gpt2", "n_embd": 32, "pad_token_id": 0})
BERT = HFConfig({"model_type": "bert", "hidden_size": 32, "hidden_dropout_prob": 0.1})


def test_exact_preset_needs_pooler_head_and_mask():
    p = preset_for(GPT2, 3)
    m = match_preset(GPT2, 3, p.pooler, p.head)
    assert m.pool_mask == "non_pad_token" and m.exact and m.arch == "gpt2" and m.hf_names == p.hf_names
    # GPT-2's pooler and head, pooled by the attention mask: not GPT2ForSequenceClassification, but
    # the pretrained score weights still fit the head
    m = match_preset(GPT2, 3, p.pooler, p.head, "attention_mask")
    assert not m.exact and m.arch is None and m.hf_names == () and m.weight_names == (("head/classifier", "score"),)


def test_dropout_and_init_scale_do_not_matter_but_shapes_do():
    p = preset_for(BERT, 3)
    m = match_preset(BERT, 3, DensePooler(activation="tanh", init_std=0.5), LinearHead(3, dropout=0.4))
    assert m.exact and m.arch == "bert" and m.pool_mask == "attention_mask"
    assert same_structure(p.head, LinearHead(3, dropout=0.0)) and not same_structure(p.head, LinearHead(4))
    m = match_preset(BERT, 3, p.pooler, MLPHead(3, hidden_dims=(8,)))
    assert m.same_pooler and not m.same_head and m.arch is None
    assert m.weight_names == (("pooler/dense", "bert.pooler.dense"),)
    # another pooler: the attention mask by default, no preset weights for it
    m = match_preset(BERT, 3, Pool("mean"), p.head)
    assert m.pool_mask == "attention_mask" and m.weight_names == (("head/classifier", "classifier"),)


def test_model_type_without_preset():
    m = match_preset(HFConfig({"model_type": "t5"}), 2, Pool("mean"), LinearHead(2))
    assert m.preset is None and m.arch is None and m.weight_names == () and m.pool_mask == "attention_mask"


def test_pool_mask_checks():
    with pytest.raises(PoolMaskError, match="pool_mask must be one of"):
        match_preset(BERT, 3, Pool("mean"), LinearHead(3), "eos")
    check_pool_mask("non_pad_token", pad_token_id=0, eos_token_id=None, subject="m")
    with pytest.raises(PoolMaskError, match=r"pad_token_id.*pool_mask='attention_mask'"):
        check_pool_mask("non_pad_token", pad_token_id=None, eos_token_id=2, subject="m")
    with pytest.raises(PoolMaskError, match="eos_token_id"):
        check_pool_mask("eos_token", pad_token_id=0, eos_token_id=None, subject="m")
    with pytest.raises(KeyError):  # the caller's error type
        check_pool_mask("eos_token", pad_token_id=0, eos_token_id=None, subject="m", error=KeyError)
