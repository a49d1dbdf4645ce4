"""The model-FLOP count of a run's MFU (``flaxheads.training.flops``) against hand counts for BERT-base
and a grouped-query, gated decoder, with the matmul weights counted from transformers' own modules
(built on the meta device: no memory, no weights); the peak table's lookups."""

from __future__ import annotations

import pytest

from flaxheads.training.flops import Dims, StepFlops, forward_flops, peak_flops

BERT_BASE = {
    "model_type": "bert",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
}
#: A Llama-style decoder with 4 key/value heads of 32 query heads and a gated FFN.
DECODER = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
}


def _torch_matmul_weights(cfg: dict) -> int:
    """Weights of the nn.Linear layers inside transformers' encoder/decoder layers (the reference)."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    with torch.device("meta"):
        if cfg["model_type"] == "bert":
            model = tf.BertModel(
                tf.BertConfig(**{k: v for k, v in cfg.items() if k != "model_type"}), add_pooling_layer=False
            )
            layers = model.encoder.layer
        else:
            model = tf.LlamaModel(tf.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}, vocab_size=128))
            layers = model.layers
    return sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))


def test_bert_base_train_step_equals_the_hand_count():
    h, L, ffn, B, T, labels = 768, 12, 3072, 32, 128, 2
    n_matmul = L * (4 * h * h + 2 * h * ffn)  # q, k, v, output, two FFN matrices
    assert n_matmul == 84_934_656 == _torch_matmul_weights(BERT_BASE)
    hand = 6 * n_matmul * B * T + 12 * L * T * T * h * B + 6 * (h * h + h * labels) * B
    count = StepFlops(Dims.of(BERT_BASE), head_params=h * h + h * labels)
    assert count(B, T) == pytest.approx(hand, rel=1e-12)
    assert 3 * forward_flops(Dims.of(BERT_BASE), B, T, h * h + h * labels) == pytest.approx(hand, rel=1e-12)


def test_a_gated_grouped_query_decoder_equals_the_hand_count():
    h, L, heads, kv, ffn, B, T = 2048, 4, 32, 4, 5632, 2, 512
    hd = h // heads
    per_layer = h * h + 2 * h * kv * hd + h * h + 3 * h * ffn  # q, k, v (4 of 32 heads), o; gate, up, down
    assert L * per_layer == _torch_matmul_weights(DECODER)
    dims = Dims.of(DECODER)
    assert dims.gated and dims.kv == kv * hd and dims.layer_matmul_params == per_layer
    head = h * 1  # a one-output score head
    hand = 6 * L * per_layer * B * T + 12 * L * T * T * h * B + 6 * head * B
    assert StepFlops(dims, head)(B, T) == pytest.approx(hand, rel=1e-12)
    lora = 4 * L * per_layer * B * T + 12 * L * T * T * h * B + 6 * head * B  # no weight gradients in the base
    assert StepFlops(dims, head, per_param=4.0)(B, T) == pytest.approx(lora, rel=1e-12)
    frozen = 2 * L * per_layer * B * T + 4 * L * T * T * h * B + 6 * head * B  # the base runs forward only
    assert StepFlops(dims, head, per_param=2.0)(B, T) == pytest.approx(frozen, rel=1e-12)


def test_a_batch_is_counted_by_its_token_slots():
    import numpy as np

    count = StepFlops(Dims.of(BERT_BASE), 0)
    assert count.of_batch({"input_ids": np.zeros((8, 64))}) == count(8, 64)
    assert count.of_batch({"input_ids": np.zeros((4, 3, 64))}) == count(12, 64)  # ranking groups: 12 rows


def test_peak_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12  # the longer name wins
    assert peak_flops("NVIDIA H100 80GB HBM3", "float32") == pytest.approx(494.7e12)
    assert peak_flops("TPU v5 lite", "bfloat16") == 197e12
    assert peak_flops("TPU v4") == 275e12
    assert peak_flops("cpu") is None and peak_flops("AMD EPYC 7B13") is None
