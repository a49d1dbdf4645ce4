"""Big-model pieces measured on the CPU: device bytes of a frozen base (float32, bfloat16, int8,
int4, nf4: the arrays' own ``on_device_size_in_bytes``), the logits' quantisation error on tiny
random Llama and Qwen3 models, and QLoRA training against LoRA on the float32 and bfloat16 bases
(50 steps on random token data; the gap of the loss curves).

    python bench/big_models.py            # prints markdown tables (the CPU named)
"""
from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.quantize import device_bytes  # noqa: E402
from flaxheads.training.loop import TrainConfig, Trainer  # noqa: E402
from flaxheads.training.optim import OptimConfig  # noqa: E402
from hf_tiny import save_tiny  # noqa: E402

SCHEMES = (None, "int8", "int4", "nf4")


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


def base_bytes(tmp: str) -> None:
    """A Llama-shaped base of 29M params (hidden 512, 8 layers, vocab 4000: the embeddings 7% of the
    params, as in Llama-3.1-8B), the arrays' own bytes; then Llama-3.1-8B's shapes (bench/configs)."""
    path, _ = save_tiny(os.path.join(tmp, "bytes"), "llama", seed=0, hidden_size=512, num_hidden_layers=8,
                        intermediate_size=1536, vocab_size=4000, num_attention_heads=8, head_dim=64,
                        max_position_embeddings=512)
    f32 = fh.from_pretrained(path)
    ref = device_bytes(f32.params["backbone"])
    print("\n| frozen base (Llama-shaped, 29M params; arrays) | device MiB | x float32 |\n| --- | --- | --- |")
    print(f"| float32 | {ref / 2**20:.1f} | 1.00 |")
    for store in ("bfloat16",):
        b = device_bytes(f32.with_base_dtype(jnp.bfloat16).params["backbone"])
        print(f"| {store} | {b / 2**20:.1f} | {b / ref:.3f} |")
    for q in SCHEMES[1:]:
        for emb in (jnp.float32, jnp.bfloat16):
            m = f32.with_base_dtype(emb).with_quantized_base(q)
            b = device_bytes(m.params["backbone"])
            print(f"| {q} (layer kernels; embeddings, norms {jnp.dtype(emb).name}) | {b / 2**20:.1f} | {b / ref:.3f} |")
    from flaxheads.memory_plan import abstract_model
    from flaxheads.sharding import shard_bytes

    def shape_bytes(tree):
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return shard_bytes(tree, jax.tree.map(lambda _: one, tree))

    cfg = os.path.join(HERE, "configs", "llama-3.1-8b")
    ref = shape_bytes(abstract_model(cfg).params["backbone"])
    print(f"\n| Llama-3.1-8B base (shapes) | GiB | x float32 |\n| --- | --- | --- |\n| float32 | {ref / 2**30:.2f} | 1.00 |")
    for q in (None,) + SCHEMES[1:]:
        b = shape_bytes(abstract_model(cfg, base_dtype=jnp.bfloat16, quantize=q).params["backbone"])
        print(f"| {q or 'bfloat16'} (embeddings, norms bfloat16) | {b / 2**30:.2f} | {b / ref:.3f} |")


def logits_error(tmp: str) -> None:
    print("\n| family | int8 | int4 | nf4 | (max abs logit error / max abs float32 logit) |\n| --- | --- | --- | --- | --- |")
    ids = jnp.asarray(np.random.RandomState(0).randint(3, 99, (8, 24)))
    mask = jnp.ones_like(ids)
    for arch in ("llama", "qwen3"):
        path, _ = save_tiny(os.path.join(tmp, arch), arch, seed=1, hidden_size=256, intermediate_size=512,
                            head_dim=64, num_hidden_layers=2)
        base = fh.from_pretrained(path)
        ref = np.asarray(base.apply(base.params, ids, mask))
        errs = []
        for q in SCHEMES[1:]:
            m = base.with_quantized_base(q)
            errs.append(np.abs(np.asarray(jax.jit(m.apply)(m.params, ids, mask)) - ref).max() / np.abs(ref).max())
        print(f"| {arch} (hidden 256) | " + " | ".join(f"{e:.4f}" for e in errs) + " | |")
    print("| bert | refused: BERT fuses q/k/v kernels outside the shared matmul | | | |")


def qlora_curves(tmp: str, steps: int = 50) -> None:
    path, _ = save_tiny(os.path.join(tmp, "train"), "llama", seed=2, hidden_size=256, intermediate_size=512,
                        head_dim=64, num_hidden_layers=2, num_labels=2)
    rng = np.random.RandomState(0)
    ids = rng.randint(3, 99, (steps, 16, 32)).astype(np.int32)
    labels = (ids[:, :, :4].sum(-1) % 2).astype(np.int32)  # a learnable rule of the first tokens
    runs = {"LoRA, float32 base": dict(), "LoRA, bfloat16 base": dict(base_dtype=jnp.bfloat16),
            "QLoRA int8": dict(quantize="int8"), "QLoRA nf4": dict(quantize="nf4"),
            "QLoRA int4": dict(quantize="int4")}
    curves = {}
    for name, opts in runs.items():
        m = fh.from_pretrained(path, num_labels=2, **opts).with_lora(rank=8, targets=("q_proj", "v_proj", "o_proj"))
        tr = Trainer.build(m, OptimConfig(learning_rate=2e-3, warmup_steps=0, total_steps=steps), TrainConfig())
        state, losses = tr.init_state(), []
        for i in range(steps):
            state, met = tr.step(state, {"input_ids": ids[i], "attention_mask": np.ones_like(ids[i]),
                                         "labels": labels[i], "weights": np.ones(16, np.float32)})
            losses.append(met["loss"])
        curves[name] = np.asarray(losses)
    ref = curves["LoRA, float32 base"]
    print(f"\n| {steps} steps, lr 2e-3, rank 8 | mean loss, last 10 | max abs gap to LoRA on float32 | mean abs gap |"
          "\n| --- | --- | --- | --- |")
    for name, c in curves.items():
        print(f"| {name} | {c[-10:].mean():.4f} | {np.abs(c - ref).max():.4f} | {np.abs(c - ref).mean():.4f} |")


def main() -> None:
    print(f"CPU: {cpu_name()}; jax {jax.__version__}")
    parts = sys.argv[1:] or ["bytes", "error", "qlora"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, part in (("bytes", base_bytes), ("error", logits_error), ("qlora", qlora_curves)):
            if name in parts:
                part(tmp)


if __name__ == "__main__":
    main()
