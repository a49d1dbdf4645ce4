"""Tiny random PyTorch sequence classifiers for parity tests (nobody here wrote their code)."""
from __future__ import annotations

import numpy as np

V, H, L, NH, FF, P = 99, 32, 2, 4, 37, 64


def tiny_config(arch: str, num_labels: int = 3, **over):
    import transformers as tf

    common = dict(num_labels=num_labels, attn_implementation="eager")
    if arch == "bert":
        c = tf.BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                          intermediate_size=FF, max_position_embeddings=P, **common)
    elif arch in ("roberta", "xlm-roberta"):
        cls = tf.RobertaConfig if arch == "roberta" else tf.XLMRobertaConfig
        c = cls(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=FF,
                max_position_embeddings=P, pad_token_id=1, bos_token_id=0, eos_token_id=2, **common)
    elif arch == "distilbert":
        c = tf.DistilBertConfig(vocab_size=V, dim=H, n_layers=L, n_heads=NH, hidden_dim=FF,
                                max_position_embeddings=P, **common)
    elif arch == "albert":
        c = tf.AlbertConfig(vocab_size=V, embedding_size=16, hidden_size=H, num_hidden_layers=L,
                            num_attention_heads=NH, intermediate_size=FF, max_position_embeddings=P, **common)
    elif arch == "electra":
        c = tf.ElectraConfig(vocab_size=V, embedding_size=16, hidden_size=H, num_hidden_layers=L,
                             num_attention_heads=NH, intermediate_size=FF, max_position_embeddings=P, **common)
    elif arch == "gpt2":
        c = tf.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=P, pad_token_id=0, **common)
    elif arch == "bart":
        c = tf.BartConfig(vocab_size=V, d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=NH,
                          decoder_attention_heads=NH, encoder_ffn_dim=FF, decoder_ffn_dim=FF,
                          max_position_embeddings=P, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                          decoder_start_token_id=2, **common)
    elif arch == "xlnet":
        c = tf.XLNetConfig(vocab_size=V, d_model=H, n_layer=L, n_head=NH, d_inner=FF, **common)
    elif arch == "deberta-v2":
        c = tf.DebertaV2Config(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                               intermediate_size=FF, max_position_embeddings=P, pooler_hidden_act="gelu", **common)
    elif arch == "modernbert":
        c = tf.ModernBertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                intermediate_size=FF, max_position_embeddings=P, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, **common)
    else:
        raise KeyError(arch)
    for k, v in over.items():
        setattr(c, k, v)
    return c


def tiny_torch_model(arch: str, num_labels: int = 3, seed: int = 0, **over):
    """A random ``AutoModelForSequenceClassification`` in eval mode, every weight perturbed so
    that zero-initialised biases cannot hide a mapping error."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(tiny_config(arch, num_labels, **over))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def padded_batch(arch: str, cfg, side: str = "right", seed: int = 0):
    """ids [3, 9] and mask with different lengths; BART rows end with one <eos>."""
    rng = np.random.default_rng(seed)
    lengths = [9, 6, 3]
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    ids = np.full((3, 9), pad, dtype=np.int64)
    mask = np.zeros((3, 9), dtype=np.int64)
    for i, n in enumerate(lengths):
        row = rng.integers(3, V, size=n)
        if arch == "bart":
            row[-1] = cfg.eos_token_id
        sl = slice(0, n) if side == "right" else slice(9 - n, 9)
        ids[i, sl], mask[i, sl] = row, 1
    return ids, mask
