"""Big-model pieces measured on the CPU: device bytes of a frozen base (float32, bfloat16, int8,
int4, nf4: the arrays' own ``on_device_size_in_bytes``), the logits' quantisation error on tiny
random Llama and Qwen3 models, and QLoRA training against LoRA on the float32 and bfloat16 bases
(50 steps on random token data; the gap of the loss curves).

``load`` (not in the default run: it writes 6.6 GB to the temporary folder and the eager rows need
~11 GiB of memory): a random ~1.1B-parameter Llama (hidden 2048, 16 layers, vocabulary 32000) saved
in 4 safetensors shards, in bfloat16 and in float32, then loaded in fresh processes: onto an
``fsdp=8`` mesh of 8 forced CPU devices (peak RSS against the stored bytes; the eager load for
comparison), by two processes over loopback with 4 devices each (the bytes each reads, ``rchar``),
and quantised to nf4 while reading.

    python bench/big_models.py            # prints markdown tables (the CPU named)
    python bench/big_models.py load       # the loading tables only
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hf_tiny import save_tiny  # noqa: E402

import flaxheads as fh  # noqa: E402
from bench import common  # noqa: E402
from flaxheads.model.quantize import device_bytes  # noqa: E402
from flaxheads.training.loop import TrainConfig, Trainer  # noqa: E402
from flaxheads.training.optim import OptimConfig  # noqa: E402

SCHEMES = (None, "int8", "int4", "nf4")


def base_bytes(tmp: str) -> None:
    """A Llama-shaped base of 26M params (hidden 512, 8 layers, 2 key/value heads, vocab 4000: the
    embeddings 7.8% of the params, 6.5% in Llama-3.1-8B), the arrays' own bytes; then Llama-3.1-8B's
    shapes (bench/configs)."""
    path, _ = save_tiny(
        os.path.join(tmp, "bytes"),
        "llama",
        seed=0,
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1536,
        vocab_size=4000,
        num_attention_heads=8,
        head_dim=64,
        max_position_embeddings=512,
    )
    f32 = fh.from_pretrained(path)
    ref = device_bytes(f32.params["backbone"])
    print("\n| frozen base (Llama-shaped, 26M params; arrays) | device MiB | x float32 |\n| --- | --- | --- |")
    print(f"| float32 | {ref / 2**20:.1f} | 1.00 |")
    for store in ("bfloat16",):
        b = device_bytes(f32.with_base_dtype(jnp.bfloat16).params["backbone"])
        print(f"| {store} | {b / 2**20:.1f} | {b / ref:.3f} |")
    for q in SCHEMES[1:]:
        for emb in (jnp.float32, jnp.bfloat16):
            m = f32.with_base_dtype(emb).with_quantized_base(q)
            b = device_bytes(m.params["backbone"])
            print(f"| {q} (layer kernels; embeddings, norms {jnp.dtype(emb).name}) | {b / 2**20:.1f} | {b / ref:.3f} |")
    from flaxheads.model.abstract import abstract_model
    from flaxheads.runtime.sharding import shard_bytes

    def shape_bytes(tree):
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return shard_bytes(tree, jax.tree.map(lambda _: one, tree))

    cfg = os.path.join(HERE, "configs", "llama-3.1-8b")
    ref = shape_bytes(abstract_model(cfg).params["backbone"])
    print("\n| Llama-3.1-8B base (shapes) | GiB | x float32 |\n| --- | --- | --- |")
    print(f"| float32 | {ref / 2**30:.2f} | 1.00 |")
    for q in (None,) + SCHEMES[1:]:
        b = shape_bytes(abstract_model(cfg, base_dtype=jnp.bfloat16, quantize=q).params["backbone"])
        print(f"| {q or 'bfloat16'} (embeddings, norms bfloat16) | {b / 2**30:.2f} | {b / ref:.3f} |")


def logits_error(tmp: str) -> None:
    print("\n| family | int8 | int4 | nf4 | (max abs logit error / max abs float32 logit) |")
    print("| --- | --- | --- | --- | --- |")
    ids = jnp.asarray(np.random.RandomState(0).randint(3, 99, (8, 24)))
    mask = jnp.ones_like(ids)
    for arch in ("llama", "qwen3"):
        path, _ = save_tiny(
            os.path.join(tmp, arch),
            arch,
            seed=1,
            hidden_size=256,
            intermediate_size=512,
            head_dim=64,
            num_hidden_layers=2,
        )
        base = fh.from_pretrained(path)
        ref = np.asarray(base.apply(base.params, ids, mask))
        errs = []
        for q in SCHEMES[1:]:
            m = base.with_quantized_base(q)
            errs.append(np.abs(np.asarray(jax.jit(m.apply)(m.params, ids, mask)) - ref).max() / np.abs(ref).max())
        print(f"| {arch} (hidden 256) | " + " | ".join(f"{e:.4f}" for e in errs) + " | |")
    print("| bert | refused: BERT fuses q/k/v kernels outside the shared matmul | | | |")


def qlora_curves(tmp: str, steps: int = 50) -> None:
    path, _ = save_tiny(
        os.path.join(tmp, "train"),
        "llama",
        seed=2,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        num_hidden_layers=2,
        num_labels=2,
    )
    rng = np.random.RandomState(0)
    ids = rng.randint(3, 99, (steps, 16, 32)).astype(np.int32)
    labels = (ids[:, :, :4].sum(-1) % 2).astype(np.int32)  # a learnable rule of the first tokens
    runs = {
        "LoRA, float32 base": dict(),
        "LoRA, bfloat16 base": dict(base_dtype=jnp.bfloat16),
        "QLoRA int8": dict(quantize="int8"),
        "QLoRA nf4": dict(quantize="nf4"),
        "QLoRA int4": dict(quantize="int4"),
    }
    curves = {}
    for name, opts in runs.items():
        m = fh.from_pretrained(path, num_labels=2, **opts).with_lora(rank=8, targets=("q_proj", "v_proj", "o_proj"))
        tr = Trainer.build(m, OptimConfig(learning_rate=2e-3, warmup_steps=0, total_steps=steps), TrainConfig())
        state, losses = tr.init_state(), []
        for i in range(steps):
            state, met = tr.step(
                state,
                {
                    "input_ids": ids[i],
                    "attention_mask": np.ones_like(ids[i]),
                    "labels": labels[i],
                    "weights": np.ones(16, np.float32),
                },
            )
            losses.append(met["loss"])
        curves[name] = np.asarray(losses)
    ref = curves["LoRA, float32 base"]
    print(
        f"\n| {steps} steps, lr 2e-3, rank 8 | mean loss, last 10 | max abs gap to LoRA on float32 | mean abs gap |"
        "\n| --- | --- | --- | --- |"
    )
    for name, c in curves.items():
        print(f"| {name} | {c[-10:].mean():.4f} | {np.abs(c - ref).max():.4f} | {np.abs(c - ref).mean():.4f} |")


#: Llama-shaped, ~1.1B parameters with the LM head (Llama-3.2-1B's widths, Llama-2's vocabulary)
BIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHARDS = 4


def big_tensors(c: dict) -> list[list[tuple[str, tuple[int, ...]]]]:
    """HF Llama names and shapes, in :data:`SHARDS` groups of about equal size (whole layers)."""
    h, f, v, kv = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_key_value_heads"] * c["head_dim"]
    layers = [
        [
            (f"model.layers.{i}.{n}", s)
            for n, s in (
                ("self_attn.q_proj.weight", (h, h)),
                ("self_attn.k_proj.weight", (kv, h)),
                ("self_attn.v_proj.weight", (kv, h)),
                ("self_attn.o_proj.weight", (h, h)),
                ("mlp.gate_proj.weight", (f, h)),
                ("mlp.up_proj.weight", (f, h)),
                ("mlp.down_proj.weight", (h, f)),
                ("input_layernorm.weight", (h,)),
                ("post_attention_layernorm.weight", (h,)),
            )
        ]
        for i in range(c["num_hidden_layers"])
    ]
    per = len(layers) // SHARDS
    groups = [sum(layers[i * per : (i + 1) * per], []) for i in range(SHARDS)]
    groups[0].insert(0, ("model.embed_tokens.weight", (v, h)))
    groups[-1] += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return groups


def write_big(root: str) -> dict[str, str]:
    """The random model (std 0.02) in ``root/bfloat16`` and ``root/float32`` (the same values, rounded
    in the first), each 4 shards with an index and a config.json; ``{dtype name: folder}``."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    kinds = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
    folders = {k: os.path.join(root, k) for k in kinds}
    groups = big_tensors(BIG)
    maps: dict[str, dict] = {k: {} for k in kinds}
    sizes = dict.fromkeys(kinds, 0)
    for i, group in enumerate(groups):
        values = {n: (rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)) for n, s in group}
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        for kind, dt in kinds.items():
            os.makedirs(folders[kind], exist_ok=True)
            save_file(
                {n: x.astype(dt) for n, x in values.items()},
                os.path.join(folders[kind], file),
                metadata={"format": "pt"},
            )
            maps[kind].update(dict.fromkeys(values, file))
            sizes[kind] += sum(x.size * np.dtype(dt).itemsize for x in values.values())
        del values
    for kind in kinds:
        with open(os.path.join(folders[kind], "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sizes[kind]}, "weight_map": maps[kind]}, f)
        with open(os.path.join(folders[kind], "config.json"), "w") as f:
            json.dump({**BIG, "torch_dtype": kind}, f)
    return folders


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def load_worker(args: dict) -> None:
    """One load in this (fresh) process; prints a JSON line of what it measured."""
    import gc
    import resource

    if args.get("process_id") is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args['port']}", num_processes=2, process_id=args["process_id"]
        )
    # the loader's own modules imported before the measure, so that rchar counts the weights' bytes
    import qwix  # noqa: F401

    import flaxheads.backbones.lazy  # noqa: F401
    import flaxheads.model.quantize  # noqa: F401
    import flaxheads.training.memory_plan  # noqa: F401

    jax.devices()
    gc.collect()
    rss0, read0, t0 = common.proc_status_bytes("VmRSS"), _rchar(), time.perf_counter()
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args["dtype"]]
    model = fh.from_pretrained(args["folder"], mesh=args.get("mesh"), base_dtype=dtype, quantize=args.get("quantize"))
    jax.block_until_ready(model.params)
    seconds, read = time.perf_counter() - t0, _rchar() - read0
    held = sum(
        s.data.on_device_size_in_bytes()
        for x in jax.tree.leaves(model.params["backbone"])
        for s in x.addressable_shards
    )
    # VmHWM, this process's own high-water mark: ru_maxrss of a process that subprocess started (vfork, then
    # exec) starts at its parent's peak, here the one that wrote the files
    print(
        json.dumps(
            {
                "rss_before": rss0,
                "peak_rss": common.proc_status_bytes("VmHWM"),
                "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10,
                "read": read,
                "seconds": seconds,
                "device_bytes": held,
                "processes": jax.process_count(),
                "devices": jax.local_device_count(),
            }
        ),
        flush=True,
    )
    if args.get("process_id") is not None:
        jax.distributed.shutdown()


def _workers(runs: list[dict], devices: int) -> list[dict]:
    """Each of ``runs`` in a fresh process with ``devices`` forced CPU devices, all at once; their JSON lines."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "_load-worker", json.dumps(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in runs
    ]
    out = []
    for p in procs:
        log = p.communicate(timeout=1800)[0]
        if p.returncode:
            raise RuntimeError(f"load worker failed:\n{log[-3000:]}")
        out.append(json.loads(log.strip().splitlines()[-1]))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def big_loading(tmp: str) -> None:
    """The three loading tables: one process on 8 devices (the lazy and the eager load, each stored dtype),
    two processes on 4 each (bytes read), and the nf4 base quantised while reading (and eagerly)."""
    t0 = time.perf_counter()
    folders = write_big(os.path.join(tmp, "big"))
    files = {
        k: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
        for k, d in folders.items()
    }
    params = sum(np.prod(s) for g in big_tensors(BIG) for _, s in g)
    largest = {
        k: max(np.prod(s) for g in big_tensors(BIG) for _, s in g) * (2 if k == "bfloat16" else 4) for k in folders
    }
    print(
        f"\nA random Llama-shaped model: {params / 1e9:.3f}B parameters (LM head included), {SHARDS} shards; "
        f"written in {time.perf_counter() - t0:.0f} s"
    )
    gib = 2**30
    print(
        "\n| 8 CPU devices, one process | stored GiB | before load (RSS GiB) | peak RSS GiB | peak / stored | "
        "(peak - before) / stored | devices hold GiB | load s |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for kind, folder in folders.items():
        for label, mesh in ((f"fsdp=8, {kind}", "fsdp=8"), (f"eager (no mesh), {kind}", None)):
            (r,) = _workers([{"folder": folder, "dtype": kind, "mesh": mesh}], 8)
            print(
                f"| {label} | {files[kind] / gib:.2f} | {r['rss_before'] / gib:.2f} | {r['peak_rss'] / gib:.2f} | "
                f"{r['peak_rss'] / files[kind]:.2f} | {(r['peak_rss'] - r['rss_before']) / files[kind]:.2f} | "
                f"{r['device_bytes'] / gib:.2f} | {r['seconds']:.1f} |",
                flush=True,
            )
    print(
        "\n| two processes, 4 CPU devices each, fsdp=8 | process | read GiB | read / file bytes | peak RSS GiB | "
        "devices hold GiB | load s |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    for kind, folder in folders.items():
        port = _free_port()
        runs = [{"folder": folder, "dtype": kind, "mesh": "fsdp=8", "port": port, "process_id": i} for i in range(2)]
        for i, r in enumerate(_workers(runs, 4)):
            print(
                f"| {kind} | {i} | {r['read'] / gib:.2f} | {r['read'] / files[kind]:.2f} | "
                f"{r['peak_rss'] / gib:.2f} | {r['device_bytes'] / gib:.2f} | {r['seconds']:.1f} |",
                flush=True,
            )
    print(
        "\n| nf4 base from the bfloat16 folder, 8 CPU devices | before load (RSS GiB) | peak RSS GiB | devices hold "
        "GiB | largest tensor GiB | (peak - before) / (devices + largest) | load s |"
        "\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    for label, mesh in (("fsdp=8, quantised while reading", "fsdp=8"), ("eager (no mesh), then quantised", None)):
        (r,) = _workers([{"folder": folders["bfloat16"], "dtype": "bfloat16", "mesh": mesh, "quantize": "nf4"}], 8)
        budget = r["device_bytes"] + largest["bfloat16"]
        print(
            f"| {label} | {r['rss_before'] / gib:.2f} | {r['peak_rss'] / gib:.2f} | "
            f"{r['device_bytes'] / gib:.2f} | {largest['bfloat16'] / gib:.2f} | "
            f"{(r['peak_rss'] - r['rss_before']) / budget:.2f} | {r['seconds']:.1f} |",
            flush=True,
        )


def main() -> None:
    if sys.argv[1:2] == ["_load-worker"]:
        return load_worker(json.loads(sys.argv[2]))
    print(f"CPU: {common.cpu_name()}; jax {jax.__version__}")
    parts = sys.argv[1:] or ["bytes", "error", "qlora"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, part in (
            ("bytes", base_bytes),
            ("error", logits_error),
            ("qlora", qlora_curves),
            ("load", big_loading),
        ):
            if name in parts:
                part(tmp)


if __name__ == "__main__":
    main()
