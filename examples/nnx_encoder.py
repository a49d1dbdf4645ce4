"""Your own Flax NNX encoder with a flaxheads pooler and head, trained with nnx.Optimizer, then the
head exported and read back on flaxheads' functional path.

    python examples/nnx_encoder.py [--out DIR]

The encoder is any ``nnx.Module`` that returns hidden states ``[B, T, H]`` and the mask to pool;
the head is ``flaxheads.nnx.SequenceHead`` built from a head config (any pooler, any head).
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flaxheads as fh
from flaxheads import nnx as fnnx
from flaxheads.heads import linen

VOCAB, WIDTH, LABELS = 50, 16, 3


class TinyEncoder(nnx.Module):
    """Token embeddings and one self-attention block: hidden states and the mask out."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=WIDTH, decode=False, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = self.embed(ids)
        x = self.norm(x + self.attn(x, mask=nnx.make_attention_mask(mask, mask)))
        return x, mask


class Classifier(nnx.Module):
    """The encoder, then a flaxheads pooler + head."""

    def __init__(self, head_config: fh.SequenceHead, *, rngs: nnx.Rngs):
        self.encoder = TinyEncoder(rngs=rngs)
        self.head = fnnx.SequenceHead(head_config, WIDTH, rngs=rngs)

    def __call__(self, ids, mask, train: bool = False):
        hidden, pool_mask = self.encoder(ids, mask)
        return self.head(hidden, pool_mask, deterministic=not train)


def toy_batch(seed: int = 0, rows: int = 32, length: int = 8):
    """Rows whose label is the first token mod 3, right-padded to ``length``."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(rows, length))
    mask = (np.arange(length)[None, :] < rng.integers(2, length + 1, size=(rows, 1))).astype(np.int32)
    return jnp.asarray(ids * mask), jnp.asarray(mask), jnp.asarray(ids[:, 0] % LABELS)


def main(out: str, steps: int = 30) -> dict:
    config = fh.SequenceHead(fh.make_pooler(["cls", "mean"]), fh.MLPHead(LABELS, dropout=0.1))
    model = Classifier(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ids, mask, labels = toy_batch()
    loss_fn = fh.losses.loss_fn("single_label_classification", LABELS)

    @nnx.jit
    def train_step(model, optimizer, ids, mask, labels):
        def loss(model):
            return loss_fn(model(ids, mask, train=True), labels, jnp.ones(labels.shape))

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    losses = [float(train_step(model, optimizer, ids, mask, labels)) for _ in range(steps)]
    # the head's params are a functional head tree: export it and read it back as Linen modules
    fh.interop.export_head(config, out, params=fnnx.head_params(model.head))
    seq, params, _ = fh.interop.load_head_export(out)
    hidden, pool_mask = model.encoder(ids, mask)
    functional = linen.module(seq).apply({"params": params}, hidden, pool_mask)
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; head exported to {out}; functional logits equal NNX logits: "
        f"{bool(jnp.array_equal(functional, model(ids, mask)))}"
    )
    return {"losses": losses, "nnx_logits": model(ids, mask), "functional_logits": functional}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for the head export (default: a temporary folder)")
    args = ap.parse_args()
    main(args.out or tempfile.mkdtemp(prefix="nnx-head-") + "/head")
