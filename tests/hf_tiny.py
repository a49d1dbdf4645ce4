"""Tiny random PyTorch sequence classifiers for parity tests (nobody here wrote their code)."""

from __future__ import annotations

import numpy as np

V, H, NH, FF, P = 99, 32, 4, 37, 64
#: the families whose tiny models keep a second layer: a pattern over the layers (ModernBERT's global and
#: local attention, Gemma 2/3's and Qwen2/3's sliding windows) and ALBERT's shared layer group. The others
#: have one (compiling is most of these tests' time); DeBERTa's convolution variant asks for two.
TWO_LAYERS = ("modernbert", "gemma2", "gemma3_text", "qwen2", "qwen3", "albert", "modernbert-decoder")
#: decoder-only LLM families served by one native backbone (``model_type`` values)
DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
#: post-LayerNorm BERT encoders with rotary positions (transformers 5 only; ``model_type`` values)
ROTARY_ENCODERS = ("nomic_bert", "gte", "jina_embeddings_v3")


def tiny_config(arch: str, num_labels: int = 3, layers: int | None = None, **over):
    """``layers``: the encoder's (and BART's decoder's) layers; default 2 for :data:`TWO_LAYERS`, else 1."""
    import transformers as tf

    common = dict(num_labels=num_labels, attn_implementation="eager")
    L = layers or (2 if arch in TWO_LAYERS else 1)
    if arch == "bert":
        c = tf.BertConfig(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            **common,
        )
    elif arch in ("roberta", "xlm-roberta"):
        cls = tf.RobertaConfig if arch == "roberta" else tf.XLMRobertaConfig
        c = cls(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **common,
        )
    elif arch == "camembert":
        c = tf.CamembertConfig(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **common,
        )
    elif arch == "distilbert":
        c = tf.DistilBertConfig(
            vocab_size=V, dim=H, n_layers=L, n_heads=NH, hidden_dim=FF, max_position_embeddings=P, **common
        )
    elif arch == "albert":
        c = tf.AlbertConfig(
            vocab_size=V,
            embedding_size=16,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            **common,
        )
    elif arch == "electra":
        c = tf.ElectraConfig(
            vocab_size=V,
            embedding_size=16,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            **common,
        )
    elif arch == "gpt2":
        c = tf.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=P, pad_token_id=0, **common)
    elif arch == "bart":
        c = tf.BartConfig(
            vocab_size=V,
            d_model=H,
            encoder_layers=L,
            decoder_layers=L,
            encoder_attention_heads=NH,
            decoder_attention_heads=NH,
            encoder_ffn_dim=FF,
            decoder_ffn_dim=FF,
            max_position_embeddings=P,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            **common,
        )
    elif arch == "xlnet":
        c = tf.XLNetConfig(vocab_size=V, d_model=H, n_layer=L, n_head=NH, d_inner=FF, **common)
    elif arch == "deberta-v2":
        c = tf.DebertaV2Config(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            pooler_hidden_act="gelu",
            **common,
        )
    elif arch == "modernbert":
        c = tf.ModernBertConfig(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            **common,
        )
    elif arch in ROTARY_ENCODERS:
        # transformers 5's rotary BERT encoders; their pad / bos / eos ids as the config classes set them
        ids = {
            "nomic_bert": dict(pad_token_id=0),
            "gte": dict(pad_token_id=1),
            "jina_embeddings_v3": dict(pad_token_id=1, bos_token_id=0, eos_token_id=2),
        }[arch]
        try:
            tf.AutoConfig.for_model(arch)
        except ValueError:
            raise KeyError(f"transformers {tf.__version__} has no {arch} (added in transformers 5)") from None
        c = tf.AutoConfig.for_model(
            arch,
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            **ids,
            **common,
        )
    elif arch in DECODERS:
        # Gemma 3's bidirectional switch converts sliding_window when the config is built: both go in then
        at_init = (
            {k: over.pop(k) for k in ("use_bidirectional_attention", "sliding_window") if k in over}
            if over.get("use_bidirectional_attention")
            else {}
        )
        # grouped-query attention (2 key/value heads for 4 query heads) so every family runs it
        c = tf.AutoConfig.for_model(
            arch,
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            num_key_value_heads=2,
            head_dim=H // NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
            **at_init,
            **common,
        )
    elif arch == "eurobert":
        if not hasattr(tf, "EuroBertConfig"):
            raise KeyError(f"transformers {tf.__version__} has no EuroBERT (added in transformers 5)")
        c = tf.EuroBertConfig(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            num_key_value_heads=2,
            intermediate_size=FF,
            max_position_embeddings=P,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            mask_token_id=3,
            **common,
        )
    elif arch == "modernbert-decoder":
        # the config derives its window from local_attention when it is built (default here: 4, a window of 2)
        c = tf.ModernBertDecoderConfig(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=L,
            num_attention_heads=NH,
            intermediate_size=FF,
            max_position_embeddings=P,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            local_attention=over.pop("local_attention", 4),
            **common,
        )
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


# ---- parity helpers for native backbones (PyTorch is the reference) -------------------------------------
def torch_hidden_grads(base, ids, mask, weights, **inputs):
    """PyTorch ``base`` model's last hidden state and the gradient of ``sum(hidden * weights * mask)``
    with respect to every parameter, by PyTorch name: ``(hidden, {name: grad})``."""
    import torch

    base.zero_grad()
    hidden = base(
        torch.tensor(ids), attention_mask=torch.tensor(mask), **{k: torch.tensor(v) for k, v in inputs.items()}
    ).last_hidden_state
    (hidden * torch.tensor(np.asarray(weights)) * torch.tensor(mask)[..., None]).sum().backward()
    grads = {k: p.grad.numpy().copy() for k, p in base.named_parameters() if p.grad is not None}
    return hidden.detach().numpy(), grads


def assert_grads_match(ours, ref, *, rtol: float = 1e-4, softmax_cancelled=lambda name: False):
    """Same names; each gradient within ``rtol`` of the tensor's largest reference entry. Tensors
    ``softmax_cancelled(name)`` names (attention key biases: softmax removes them) must be exactly 0
    in ``ours`` and rounding noise in ``ref``."""
    assert sorted(ours) == sorted(ref)
    scale = max(float(np.abs(g).max()) for g in ref.values())
    for k in ref:
        got, want = np.asarray(ours[k]), ref[k]
        assert got.shape == want.shape, k
        if softmax_cancelled(k):
            assert not got.any(), k
            assert np.abs(want).max() < 1e-5 * scale, k
            continue
        tol = rtol * float(np.abs(want).max())
        np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=k)


def dropout_spread_torch(base, ids, mask, copies: int = 32, seed: int = 0) -> float:
    """Mean squared change of the valid hidden states in train mode against eval mode, over
    ``copies`` stacked copies of the batch (each copy draws its own dropout masks)."""
    import torch

    rep_ids, rep_mask = np.tile(ids, (copies, 1)), np.tile(mask, (copies, 1))
    with torch.no_grad():
        base.eval()
        ref = base(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
        base.train()
        torch.manual_seed(seed)
        out = base(torch.tensor(rep_ids), attention_mask=torch.tensor(rep_mask)).last_hidden_state.numpy()
        base.eval()
    return _spread(out, ref, mask, copies)


def last_hidden(backbone, ids, mask, dropout_rng=None, **inputs) -> np.ndarray:
    """``backbone(ids, mask, **inputs)[0]`` as one compiled program; with a ``dropout_rng``, in train
    mode. Called eagerly, each operation compiles on its own (a hundred programs, seconds, for a
    model whose shapes no other test shares, such as a 32-copy batch)."""
    import jax

    train = dropout_rng is not None
    forward = jax.jit(lambda i, m, rng, extra: backbone(i, m, train=train, dropout_rng=rng, **extra)[0])
    return np.asarray(forward(ids, mask, dropout_rng, inputs))


def dropout_spread_flax(backbone, ids, mask, copies: int = 32, seed: int = 0) -> float:
    """:func:`dropout_spread_torch` for a flaxheads backbone (``train=True`` with a dropout key)."""
    import jax

    rep_ids, rep_mask = np.tile(ids, (copies, 1)), np.tile(mask, (copies, 1))
    ref = last_hidden(backbone, ids, mask)
    out = last_hidden(backbone, rep_ids, rep_mask, jax.random.PRNGKey(seed))
    return _spread(out, ref, mask, copies)


def _spread(out, ref, mask, copies):
    valid = np.tile(mask, (copies, 1)).astype(bool)
    return float(((out - np.tile(ref, (copies, 1, 1))) ** 2)[valid].mean())


# ---- dropout placement and export helpers for native backbones -------------------------------------------
def reweight(model, zero: str, scale: str = "", factor: float = 30.0):
    """Zero every parameter whose PyTorch name matches the regex ``zero`` and multiply those matching
    ``scale`` by ``factor``, in place (returns ``model``). Silencing one residual branch and making
    the other dominate lets the dropout spread tell which dropout sites a backbone has."""
    import re

    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(zero, name):
                p.zero_()
            elif scale and re.search(scale, name):
                p.mul_(factor)
    return model


def zero_fraction(out, ref, mask, rate: float) -> float:
    """Fraction of the valid entries of train-mode ``out`` that dropout zeroed, after checking that
    every other entry is the eval-mode ``ref`` scaled by ``1 / (1 - rate)`` (inverted dropout).
    ``out`` stacks copies of the batch (as :func:`dropout_spread_torch` runs it)."""
    copies = out.shape[0] // ref.shape[0]
    valid = np.tile(mask, (copies, 1)).astype(bool)
    got, want = out[valid], np.tile(ref, (copies, 1, 1))[valid] / (1.0 - rate)
    dropped = got == 0
    np.testing.assert_allclose(got[~dropped], want[~dropped], rtol=1e-5, atol=1e-6)
    return float(dropped.mean())


def torch_train_outputs(base, ids, mask, copies: int = 32, seed: int = 0):
    """``(eval hidden, train hidden of copies stacked batches)`` of a PyTorch base model."""
    import torch

    with torch.no_grad():
        base.eval()
        ref = base(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
        base.train()
        torch.manual_seed(seed)
        out = base(
            torch.tensor(np.tile(ids, (copies, 1))), attention_mask=torch.tensor(np.tile(mask, (copies, 1)))
        ).last_hidden_state.numpy()
        base.eval()
    return ref, out


def flax_train_outputs(backbone, ids, mask, copies: int = 32, seed: int = 0):
    """:func:`torch_train_outputs` for a flaxheads backbone."""
    import jax

    ref = last_hidden(backbone, ids, mask)
    out = last_hidden(backbone, np.tile(ids, (copies, 1)), np.tile(mask, (copies, 1)), jax.random.PRNGKey(seed))
    return ref, out


def perturbed(tree, scale: float, seed: int = 0):
    """``tree`` with every floating leaf moved by its own ``scale``-sized normal noise (integer leaves kept)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            x + scale * jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
            for x, k in zip(leaves, keys)
        ],
    )


def perturb_and_export(src, out, ids, mask, scale: float = 0.01):
    """``fh.from_pretrained(src)`` (HF preset head) with every parameter moved by its own random
    amount, then ``fh.interop.export_transformers`` to ``out`` and loaded back by PyTorch. (Each family's
    gradients and train steps are tested on their own; moving every leaf, not only those a few
    steps move, is what shows that each reaches its PyTorch name, without a train step to compile.)

    Returns ``(model, changed params, flaxheads logits, PyTorch logits of the export, loading info)``."""
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForSequenceClassification

    import flaxheads as fh

    model = fh.from_pretrained(src)
    params = perturbed(model.params, scale)
    fh.interop.export_transformers(model, out, params=params)
    pt, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    with torch.no_grad():
        pt_logits = pt.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    forward = jax.jit(model.apply)
    return model, params, np.asarray(forward(params, jnp.asarray(ids), jnp.asarray(mask))), pt_logits, info


def assert_remat_same_gradients(plain, remat, ids, mask):
    """``remat`` (gradient checkpointing per layer) gives ``plain``'s parameter gradients. (Dropout
    under remat is the shared layer stack's, tested with BERT; off here, it doubles the compile time.)"""
    import jax
    import jax.numpy as jnp

    assert remat.remat and not plain.remat
    w = jax.random.normal(jax.random.PRNGKey(0), np.shape(ids) + (plain.hidden_size,))

    def grads(bb):
        return jax.jit(jax.grad(lambda p: jnp.sum(bb.encode(p, ids, mask) * w)))

    g_plain, g_remat = grads(plain)(plain.params), grads(remat)(remat.params)
    program = str(jax.make_jaxpr(grads(remat))(remat.params))
    assert "remat" in program or "checkpoint" in program  # the layers really are checkpointed
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        # the two programs sum in different orders (fusions differ by CPU: YNNPACK's dots on AVX-512
        # gave 2.3e-5 on a leaf whose gradients reach 150): float32 rounding relative to the leaf's scale
        scale = max(1.0, float(np.abs(np.asarray(a)).max()))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6 * scale, rtol=1e-5)


# ---- whole checks, one per property, for the native backbone tests (tests/backbones/) ---------------------
def save_tiny(folder, arch: str, edit=None, seed: int = 1, **over):
    """A tiny PyTorch classifier (``edit(model)`` applied if given) saved as safetensors in ``folder``:
    ``(str(folder), model)``."""
    pt = tiny_torch_model(arch, seed=seed, **over)
    if edit is not None:
        edit(pt)
    pt.save_pretrained(folder, safe_serialization=True)
    return str(folder), pt


def check_hidden_states(path, pt, arch: str, side: str = "right", atol: float = 1e-4, **inputs):
    """The native backbone of ``path`` gives PyTorch's base-model last hidden state on the real
    tokens of a padded batch (extra ``inputs`` given to both); returns the backbone."""
    import torch

    from flaxheads.backbones.registry import load_backbone

    bb = load_backbone(path, implementation="native")
    ids, mask = padded_batch(arch, pt.config, side)
    with torch.no_grad():
        ref = pt.base_model(
            torch.tensor(ids), attention_mask=torch.tensor(mask), **{k: torch.tensor(v) for k, v in inputs.items()}
        ).last_hidden_state.numpy()
    ours = np.asarray(bb(ids, mask, **inputs)[0])  # eagerly: its operations' programs serve every family
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=atol, rtol=0)
    return bb


def check_logits(path, pt, arch: str, backbone_type) -> None:
    """``fh.from_pretrained(path)``: the native backbone, the HF preset head with every weight from
    the checkpoint, and PyTorch's logits."""
    import torch

    import flaxheads as fh

    model = fh.from_pretrained(path)
    assert isinstance(model.backbone, backbone_type) and model.arch == arch and model.report.new == []
    ids, mask = padded_batch(arch, pt.config)
    with torch.no_grad():
        ref = pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.apply(model.params, ids, mask)), ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 1e-2  # not two near-zero outputs


def check_gradients(path, pt, arch: str, softmax_cancelled, skip=()) -> None:
    """Parameter gradients of ``sum(hidden * fixed random weights * mask)`` equal torch autograd's,
    compared by PyTorch name through the backbone's ``state_from_params`` (``skip``: names to leave out)."""
    import jax
    import jax.numpy as jnp

    from flaxheads.backbones.registry import load_backbone

    bb = load_backbone(path, implementation="native")
    ids, mask = padded_batch(arch, pt.config)
    w = np.random.default_rng(0).normal(size=ids.shape + (bb.hidden_size,)).astype(np.float32)
    _, ref = torch_hidden_grads(pt.base_model, ids, mask, w)
    g = jax.jit(jax.grad(lambda p: jnp.sum(bb.encode(p, ids, mask) * w * mask[..., None])))(bb.params)
    ours = {k: v for k, v in bb.state_from_params(g).items() if k not in skip}
    assert_grads_match(ours, {k: v for k, v in ref.items() if k not in skip}, softmax_cancelled=softmax_cancelled)


def check_keep_rate(path, pt, arch: str, rate: float) -> None:
    """For a model without layers (its output is the embedding dropout): PyTorch and the native
    backbone both drop ``rate`` of the entries and scale the rest by ``1 / (1 - rate)``."""
    from flaxheads.backbones.registry import load_backbone

    ids, mask = padded_batch(arch, pt.config)
    bb = load_backbone(path, implementation="native")
    for ref, out in (torch_train_outputs(pt.base_model, ids, mask), flax_train_outputs(bb, ids, mask)):
        assert abs(zero_fraction(out, ref, mask, rate) - rate) < 0.04


def check_dropout_spread(path, pt, arch: str, low: float = 0.8, high: float = 1.25) -> float:
    """The spread of train-mode hidden states around eval mode (:func:`dropout_spread_torch`) is
    PyTorch's within ``[low, high]``; returns the ratio."""
    from flaxheads.backbones.registry import load_backbone

    ids, mask = padded_batch(arch, pt.config)
    ratio = dropout_spread_flax(load_backbone(path, implementation="native"), ids, mask) / dropout_spread_torch(
        pt.base_model, ids, mask
    )
    assert low < ratio < high, ratio
    return ratio


def check_train_needs_key(path, pt, arch: str) -> None:
    import pytest

    from flaxheads.backbones.registry import load_backbone

    bb = load_backbone(path, implementation="native")
    ids, mask = padded_batch(arch, pt.config)
    with pytest.raises(ValueError, match="dropout_rng"):
        bb(ids, mask, train=True)
    with pytest.raises(ValueError, match="dropout_rng"):
        bb.encode(bb.params, ids, mask, train=True)


def check_export(path, pt, arch: str, out) -> None:
    """The export of changed weights (:func:`perturb_and_export`) loads into PyTorch with no missing,
    unexpected or mismatched keys and gives flaxheads' logits of those weights (not the original ones)."""
    import torch

    ids, mask = padded_batch(arch, pt.config)
    model, params, ours, exported, info = perturb_and_export(path, out, ids, mask)
    # transformers 4 reports lists, 5 sets
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    np.testing.assert_allclose(exported, ours, atol=1e-4, rtol=0)
    with torch.no_grad():
        before = pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert np.abs(exported - before).max() > 1e-3  # the export carries the changed weights


def check_lora_matches_peft(
    path, pt, arch: str, targets=None, rank: int = 4, alpha: float = 8.0, seed: int = 0
) -> None:
    """LoRA adapters on ``targets`` (default: the family's) with random A and B give the logits of
    PEFT's LoRA on the PyTorch classifier with the same adapter weights (copied by module name)."""
    import copy

    import jax
    import peft
    import torch

    import flaxheads as fh
    from flaxheads.model.lora import adapter_modules

    kw = {} if targets is None else {"targets": tuple(targets)}
    model = fh.from_pretrained(path).with_lora(rank=rank, alpha=alpha, **kw)
    rng = np.random.default_rng(seed)
    lora = jax.tree.map(lambda x: np.asarray(0.3 * rng.normal(size=x.shape), np.float32), model.params["lora"])
    modules = adapter_modules(lora)
    assert modules, "no adapted module"
    names = {m: f"{pt.base_model_prefix}." + ".".join(m) for m in modules}
    pm = peft.get_peft_model(
        copy.deepcopy(pt),
        peft.LoraConfig(
            task_type="SEQ_CLS", r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(names.values())
        ),
    )
    with torch.no_grad():
        for m, ab in modules.items():
            mod = pm.base_model.model.get_submodule(names[m])
            mod.lora_A["default"].weight.copy_(torch.tensor(np.asarray(ab["lora_A"]).T))
            mod.lora_B["default"].weight.copy_(torch.tensor(np.asarray(ab["lora_B"]).T))
    ids, mask = padded_batch(arch, pt.config)
    with torch.no_grad():
        want = pm.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        base = pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = np.asarray(jax.jit(model.apply)({**model.params, "lora": lora}, ids, mask))
    assert np.abs(want - base).max() > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(ours, want, atol=1e-5, rtol=1e-4)


def check_bf16_and_remat(path, pt, arch: str, atol: float = 0.05) -> None:
    """bfloat16 activations (float32 params) give logits within ``atol`` of float32; remat the same gradients."""
    import jax
    import jax.numpy as jnp

    import flaxheads as fh

    ids, mask = padded_batch(arch, pt.config)
    f32, bf16 = fh.from_pretrained(path), fh.from_pretrained(path, dtype=jnp.bfloat16)
    assert jax.jit(lambda p: bf16.backbone.encode(p, ids, mask))(bf16.params["backbone"]).dtype == jnp.bfloat16
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16.params))

    def logits(m):
        return np.asarray(jax.jit(lambda p: m.apply(p, ids, mask))(m.params))

    np.testing.assert_allclose(logits(bf16), logits(f32), atol=atol, rtol=0)
    assert_remat_same_gradients(f32.backbone, fh.from_pretrained(path, remat=True).backbone, ids, mask)


def edited_copy(path, dest, **changes) -> str:
    """A copy of the model folder ``path`` at ``dest`` with ``changes`` written into its config.json."""
    import json
    import os
    import shutil

    shutil.copytree(path, dest)
    with open(os.path.join(dest, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dest)


def check_hf_flax_tree(backbone, flax_class: str, **kwargs) -> None:
    """The backbone's params tree has exactly the names and shapes of transformers 4's Flax model
    ``flax_class`` for the same config (checkpoints written through HF's Flax models load unchanged)."""
    import warnings

    import jax
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(**backbone.config.to_dict())
        model = getattr(transformers, flax_class)(config, _do_init=False, **kwargs)
        ref = jax.eval_shape(lambda: model.init_weights(jax.random.PRNGKey(0), (1, 4)))

    def shapes(tree):
        return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(tree)}

    assert shapes(backbone.params) == shapes(ref)


def restore_sinusoidal_positions(model):
    """Put transformers' own sinusoidal table back into a DistilBERT model's position embeddings
    (:func:`tiny_torch_model` perturbs every weight, that table included); returns ``model``."""
    import torch
    from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings

    weight = model.base_model.embeddings.position_embeddings.weight
    table = torch.empty(weight.shape)
    create_sinusoidal_embeddings(weight.shape[0], weight.shape[1], table)
    with torch.no_grad():
        weight.copy_(table)
    return model


def scale_matrices(model, factor: float, skip: str = "embeddings"):
    """Multiply every 2-D weight (but those whose name contains ``skip``) by ``factor``, in place: with
    the tiny models' small random weights some sublayers barely move the residual stream, and a
    dropout test could not see whether dropout acts there."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and skip not in name:
                p.mul_(factor)
    return model


#: The dropout sites of a BERT-like layer that :func:`check_dropout_site` isolates one at a time.
DROPOUT_SITES = ("attention output", "feed-forward output", "attention probabilities")


def check_dropout_site(
    folder,
    arch: str,
    site: str,
    *,
    attn_out: str,
    ffn: str,
    ffn_out: str,
    hidden_rate: str = "hidden_dropout_prob",
    attn_rate: str = "attention_probs_dropout_prob",
):
    """One residual branch dominant, the other silenced (weights matched by the regexes
    ``attn_out``/``ffn``/``ffn_out``): a missing or extra dropout site at ``site`` moves the
    spread ratio against PyTorch 3x or more (measured), the right ones keep it near 1."""
    hidden = {hidden_rate: 0.3, attn_rate: 0.0}
    cases = {
        "attention output": (lambda m: reweight(m, ffn, attn_out), hidden),
        "feed-forward output": (lambda m: reweight(m, attn_out, ffn_out), hidden),
        "attention probabilities": (None, {hidden_rate: 0.0, attn_rate: 0.5}),
    }
    edit, over = cases[site]
    return check_dropout_spread(*save_tiny(folder, arch, edit=edit, **over), arch)


def pooler_specs() -> list:
    """Every pooler form (the 12 names and two concatenations), as ``fh.make_pooler`` takes them."""
    return [
        "cls",
        "first_non_pad",
        "last",
        "mean",
        "max",
        "mean_sqrt_len",
        "weighted_mean",
        "attention",
        "bert",
        "albert",
        "deberta",
        "xlnet",
        ["cls", "mean", "max"],
        ["attention", "bert"],
    ]


def head_specs() -> list:
    """Every head form, with the options that change its parameters (bias, norm, hidden widths)."""
    import flaxheads as fh

    return [
        fh.LinearHead(3),
        fh.LinearHead(3, dropout=0.0, use_bias=False),
        fh.MLPHead(3, hidden_dims=(16, 8), activation="relu", layer_norm=True, norm_bias=False),
        fh.ProjectionHead(features=(12, 6), activation="tanh", normalize=True),
        fh.ProjectionHead(features=5),
        fh.IdentityHead(),
    ]
