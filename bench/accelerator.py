"""One accelerator check: correctness on the device, train-step speed and MFU, prediction throughput.

    PYTHONPATH=. python bench/accelerator.py OUT_DIR [--smoke] [--budget-s 420]

Made for a GPU machine lent for minutes with no network (one H100 or H200; < 8 minutes in all,
compiles included); ``--smoke`` runs the same code on CPU in seconds with tiny sizes (a test runs
it, so it never rots). Every model is a random-init ``transformers`` config saved to a temporary
folder (no download). Writes ``OUT_DIR/accelerator.json`` and prints a table last.

1. Correctness on the device (each check guarded: a failure is a row with its error). BERT,
   DeBERTa-v3 (relative attention, log buckets, shared keys, LayerNorm'd table), ModernBERT (local
   window 8 < T=32, a global layer every 2nd) and a Llama decoder with LEFT padding; tiny
   configs, every weight perturbed. flaxheads (``fh.from_pretrained``, the HF preset head) against
   PyTorch on the same weights and padded batch, on the device (``cuda`` if any, else cpu):

   * ``f32 logits``: float32 at the highest matmul precision (JAX ``default_matmul_precision
     ("highest")``, torch TF32 off): max |diff| <= 1e-4;
   * ``f32 grads``: gradients of ``sum(hidden * fixed random weights * mask)`` w.r.t. every backbone
     param, mapped to PyTorch names by the backbone's ``state_from_params`` (as tests/hf_tiny.py's
     ``check_gradients``): the worst per-tensor relative diff (max |diff| / max |ref|, with the
     tensor scale floored at 1e-3 of the largest gradient, so softmax-cancelled key biases, 0 here
     and rounding noise in PyTorch, do not count) <= 1e-3;
   * ``bf16 logits``: flaxheads ``dtype=bfloat16`` against torch autocast bf16: max |diff| <= 5e-2;
   * ``fused == plain``: ``plan=ComputePlan.for_host(attention="fused")`` against ``"plain"``,
     float32: max |diff| <= 1e-4.

2. Train-step speed: BERT-base at 128 and 512 tokens, ModernBERT-base at 1024, a ~1.1B Llama
   (TinyLlama shape) with LoRA rank 8 on q_proj/v_proj (PEFT on the PyTorch side). flaxheads' own bf16
   step (``make_train_step`` + ``make_optimizer`` + ``bench.common.jit_train_step``) against the HF
   model (``attn_implementation="sdpa"``, float32 params, bf16 autocast, AdamW) eager and
   ``torch.compile`` (CUDA only), the same batch, interleaved (``bench.common.run_interleaved``),
   medians. Model FLOPs per step: 6 x N_linear x tokens (4 x with LoRA: no weight gradients of the
   frozen base) + 12 x L x T^2 x H x B (attention, every layer full length); MFU against a bf16
   matmul measured in the same run.

3. Prediction: ``fh.Classifier.from_pretrained(folder).predict(texts)`` against
   ``pipeline("text-classification")`` on a BERT-base classifier with a WordPiece tokenizer, the
   same texts and batch size; texts/s and the max score difference.

Order and time: correctness, prediction, then the train benches in priority order (BERT-base 128,
Llama LoRA, ModernBERT 1024, BERT-base 512). A bench not started by ``--budget-s`` (default 360 s)
is a ``skipped`` row, and no ``torch.compile`` starts after 300 s, so a run ends in about 8 minutes
whatever the compiles cost; the JSON is rewritten after every section and bench, so a run cut off
by an outer time limit keeps what it finished. Not compared: flaxheads' step clips the gradient
norm at 1.0 (its optimizer's default), PyTorch's does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# JAX and PyTorch share the GPU: JAX must not take 75% of its memory up front
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench import common  # noqa: E402

LOGITS_TOL, GRAD_RTOL, BF16_TOL, FUSED_TOL = 1e-4, 1e-3, 5e-2, 1e-4
FAMILIES = ("bert", "deberta-v3", "modernbert", "llama")


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the accelerator run and ``--smoke``."""

    smoke: bool
    check_len: int = 32  # correctness batch length (ModernBERT's window is 8)
    check_layers: int = 2  # correctness models' layers (ModernBERT keeps 2: a global and a local one)
    bert: tuple = (768, 12, 12, 3072)  # hidden, layers, heads, ffn
    modernbert: tuple = (768, 22, 12, 1152)
    llama: tuple = (2048, 22, 32, 4, 5632)  # hidden, layers, heads, kv heads, ffn (TinyLlama 1.1B)
    # name, tokens, batch; in order of priority (past the time budget the rest is skipped)
    runs: tuple = (
        ("bert-base", 128, 32),
        ("llama-1b+lora", 512, 4),
        ("modernbert-base", 1024, 8),
        ("bert-base", 512, 8),
    )
    vocab: int = 30522
    repeats: int = 10
    warmup: int = 3
    matmul_n: int = 8192
    texts: int = 1024
    predict_repeats: int = 5
    compile_until: float = 300.0  # no torch.compile started after this many seconds of the run
    predict_batch: int = 64
    predict_len: int = 128
    settle: float = 0.0


def sizes_for(smoke: bool) -> Sizes:
    if not smoke:
        return Sizes(smoke=False)
    # one layer where a second adds only compile time; ModernBERT keeps two (a global and a local one)
    return Sizes(
        smoke=True,
        check_layers=1,
        bert=(32, 1, 4, 37),
        modernbert=(32, 2, 4, 48),
        llama=(32, 1, 4, 2, 48),
        vocab=512,
        runs=(("bert-base", 16, 2), ("llama-1b+lora", 16, 2), ("modernbert-base", 32, 2)),
        repeats=3,
        warmup=1,
        matmul_n=256,
        texts=24,
        predict_repeats=2,
        predict_batch=8,
        predict_len=32,
        settle=0.02,
    )


# ---- device and timing ---------------------------------------------------------------------------
def torch_device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(systems: dict, sz: Sizes, flops: float = 0.0, examples: int = 1, repeats: int | None = None) -> dict:
    """The one timing helper: ``bench.common.run_interleaved`` (first call apart, warm-up, medians)."""
    return common.run_interleaved(
        systems, repeats=repeats or sz.repeats, warmup=sz.warmup, examples=examples, flops=flops, settle=sz.settle
    )


def matmul_peak(sz: Sizes) -> float:
    """Best measured FLOP/s of a bf16 ``jnp.dot`` (n x n x n) on JAX's default device."""
    import jax
    import jax.numpy as jnp

    n = sz.matmul_n
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: jnp.dot(x, x))
    r = timed({"mm": lambda: mm(a).block_until_ready()}, sz, flops=2.0 * n**3)["mm"]
    return max(r.flops / t for t in r.times)


def header() -> dict:
    import jax
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "jax_devices": [str(d) for d in jax.devices()],
        "jax_backend": jax.default_backend(),
        "torch_device": str(torch_device()),
        "torch_gpu": gpu,
        "jax": jax.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }


# ---- models ---------------------------------------------------------------------------------------
def hf_config(family: str, dims: tuple, vocab: int, max_len: int, **over):
    """A ``transformers`` config of ``family`` (bert, deberta-v3, modernbert, llama) of ``dims``."""
    import transformers as tf

    common_kw = dict(vocab_size=vocab, num_labels=2, **over)
    if family == "llama":
        h, n, heads, kv, ffn = dims
        return tf.LlamaConfig(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=ffn,
            max_position_embeddings=max(max_len, 64),
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
            **common_kw,
        )
    h, n, heads, ffn = dims
    size = dict(
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=max(max_len, 64),
    )
    if family == "bert":
        return tf.BertConfig(**size, attention_probs_dropout_prob=0.0, **common_kw)
    if family == "deberta-v3":
        size["max_position_embeddings"] = max(max_len, 512)  # as v3: 256 log buckets need 128 < 511 distances
        return tf.DebertaV2Config(
            **size,
            relative_attention=True,
            position_buckets=256,
            norm_rel_ebd="layer_norm",
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            max_relative_positions=-1,
            position_biased_input=False,
            pooler_hidden_act="gelu",
            **common_kw,
        )
    if family == "modernbert":  # a global layer every 2nd (layer_types, and the older name for older transformers)
        kinds = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(n)]
        return tf.ModernBertConfig(
            **size,
            layer_types=kinds,
            global_attn_every_n_layers=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            **common_kw,
        )
    raise KeyError(family)


def torch_classifier(cfg, attn: str, perturb: float = 0.0, device=None):
    """A random ``AutoModelForSequenceClassification`` of ``cfg`` (weights perturbed by ``perturb``
    x normal noise so that zero biases cannot hide a mapping error), built on ``device``."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg._attn_implementation = attn
    with torch.device(device or "cpu"):
        m = AutoModelForSequenceClassification.from_config(cfg, attn_implementation=attn)
    if perturb:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(perturb * torch.randn_like(p))
    return m


def padded_batch(t: int, vocab: int, left: bool, batch: int = 3, seed: int = 0):
    """ids/mask ``[batch, t]`` with rows of different lengths (full, ~2/3, ~1/4), padded with id 0."""
    rng = np.random.default_rng(seed)
    lengths = [t, max(2, 2 * t // 3), max(2, t // 4)][:batch] + [t] * max(0, batch - 3)
    ids, mask = np.zeros((batch, t), np.int64), np.zeros((batch, t), np.int64)
    for i, n in enumerate(lengths):
        sl = slice(t - n, t) if left else slice(0, n)
        ids[i, sl], mask[i, sl] = rng.integers(3, vocab, n), 1
    return ids, mask


# ---- 1. correctness -------------------------------------------------------------------------------
def guarded(rows: list, name: str, fn, **info) -> object:
    """Run ``fn()`` -> (metrics dict, passed); a row either way (an exception is a failed row)."""
    t0 = time.perf_counter()
    try:
        metrics, ok = fn()
        row = {"name": name, "status": "pass" if ok else "fail", **info, **metrics}
    except Exception as e:  # noqa: BLE001 - one check's failure must not stop the rest
        row = {
            "name": name,
            "status": "error",
            **info,
            "error": f"{type(e).__name__}: {e}"[:400],
            "traceback": traceback.format_exc()[-2000:],
        }
    row["seconds"] = round(time.perf_counter() - t0, 2)
    rows.append(row)
    print(
        f"# {name}: {row['status']} { ({k: v for k, v in row.items() if k not in ('name', 'traceback')}) }", flush=True
    )
    return row


def torch_logits(pt, ids, mask, bf16: bool = False):
    import torch

    dev = next(pt.parameters()).device
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        out = pt(input_ids=torch.tensor(ids, device=dev), attention_mask=torch.tensor(mask, device=dev)).logits
    return out.float().cpu().numpy()


def torch_grads(pt, ids, mask, w) -> dict:
    """Gradients of ``sum(hidden * w * mask)`` of the base model, by PyTorch name."""
    import torch

    dev = next(pt.parameters()).device
    base = pt.base_model
    base.zero_grad()
    m = torch.tensor(mask, device=dev)
    hidden = base(torch.tensor(ids, device=dev), attention_mask=m).last_hidden_state
    (hidden * torch.tensor(w, device=dev) * m[..., None]).sum().backward()
    return {k: p.grad.cpu().numpy() for k, p in base.named_parameters() if p.grad is not None}


def fh_logits(model, ids, mask):
    import jax

    return np.asarray(jax.jit(lambda p, i, m: model.apply(p, i, m))(model.params, ids, mask), np.float32)


def grad_diff(ours: dict, ref: dict) -> tuple[float, str, int]:
    """Worst relative diff over the tensors both name: (value, its name, tensors compared)."""
    names = sorted(set(ours) & set(ref))
    if not names:
        raise RuntimeError(f"no parameter names in common (ours: {sorted(ours)[:3]}, PyTorch: {sorted(ref)[:3]})")
    floor = 1e-3 * max(float(np.abs(ref[k]).max()) for k in names)
    worst = max(
        (float(np.abs(np.asarray(ours[k]) - ref[k]).max()) / max(float(np.abs(ref[k]).max()), floor), k) for k in names
    )
    return worst[0], worst[1], len(names)


def check_family(family: str, sz: Sizes, tmp: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch

    import flaxheads as fh
    from flaxheads.backbones.registry import load_backbone

    rows: list[dict] = []
    dev = torch_device()
    t, vocab = sz.check_len, 99
    layers = 2 if family == "modernbert" else sz.check_layers
    dims = (32, layers, 4, 2, 37) if family == "llama" else (32, layers, 4, 37)  # hidden 32, 4 heads (d=8)
    over = {"local_attention": 8} if family == "modernbert" else {}
    box: dict = {}

    def setup():
        cfg = hf_config(family, dims, vocab, t, **over)
        pt = torch_classifier(cfg, "eager", perturb=0.05)
        folder = os.path.join(tmp, f"check-{family}")
        pt.save_pretrained(folder, safe_serialization=True)
        box.update(pt=pt.to(dev).eval(), folder=folder, batch=padded_batch(t, vocab, left=family == "llama"))
        return {"device": str(dev), "T": t}, True

    if guarded(rows, f"{family}: build", setup)["status"] != "pass":
        return rows
    rows.pop()  # the build is not a check of its own when it works
    pt, folder, (ids, mask) = box["pt"], box["folder"], box["batch"]

    def f32_logits():
        with jax.default_matmul_precision("highest"):
            ours = fh_logits(fh.from_pretrained(folder), ids, mask)
        ref = torch_logits(pt, ids, mask)
        d = float(np.abs(ours - ref).max())
        return {"max_abs_diff": d, "tol": LOGITS_TOL, "ref_scale": float(np.abs(ref).max())}, d <= LOGITS_TOL

    def f32_grads():
        bb = load_backbone(folder, implementation="native")
        w = np.random.default_rng(1).normal(size=ids.shape + (bb.hidden_size,)).astype(np.float32)
        with jax.default_matmul_precision("highest"):
            g = jax.jit(jax.grad(lambda p: jnp.sum(bb.encode(p, ids, mask) * w * mask[..., None])))(bb.params)
        d, worst, n = grad_diff(bb.state_from_params(g), torch_grads(pt, ids, mask, w))
        return {"max_rel_diff": d, "worst_param": worst, "params_compared": n, "tol": GRAD_RTOL}, d <= GRAD_RTOL

    def bf16_logits():
        ours = fh_logits(fh.from_pretrained(folder, dtype=jnp.bfloat16), ids, mask)
        ref = torch_logits(pt, ids, mask, bf16=True)
        d = float(np.abs(ours - ref).max())
        return {"max_abs_diff": d, "tol": BF16_TOL, "vs": "torch autocast bf16"}, d <= BF16_TOL

    def fused_plain(dtype, tol):
        def run():
            with jax.default_matmul_precision("highest"):
                plans = {a: fh.runtime.ComputePlan.for_host(attention=a) for a in ("fused", "plain")}
                out = {
                    a: fh_logits(fh.from_pretrained(folder, dtype=dtype, plan=plan), ids, mask)
                    for a, plan in plans.items()
                }
            d = float(np.abs(out["fused"] - out["plain"]).max())
            return {"max_abs_diff": d, "tol": tol, "vs": "itself, attention plain"}, d <= tol

        return run

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        # on GPU the bf16 checks run cuDNN's fused attention (flaxheads' default plan there; head dim 8)
        for name, fn in (
            ("f32 logits", f32_logits),
            ("f32 grads", f32_grads),
            ("bf16 logits", bf16_logits),
            ("fused == plain", fused_plain(jnp.float32, FUSED_TOL)),
            ("bf16 fused == plain", fused_plain(jnp.bfloat16, BF16_TOL)),
        ):
            guarded(rows, f"{family}: {name}", fn, family=family, check=name)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    return rows


# ---- 2. train-step speed --------------------------------------------------------------------------
def run_spec(name: str, sz: Sizes):
    """(family, dims, lora) of a speed run."""
    if name == "bert-base":
        return "bert", sz.bert, False
    if name == "modernbert-base":
        return "modernbert", sz.modernbert, False
    return "llama", sz.llama, True


def model_flops(pt, family: str, dims: tuple, batch: int, seq: int, lora: bool) -> float:
    """6 (4 with LoRA) x N_linear x tokens + 12 x L x T^2 x H x B (attention scores and context)."""
    import torch

    n_linear = sum(
        m.weight.numel()
        for m in pt.modules()
        if isinstance(m, torch.nn.Linear) and "lora" not in type(m).__name__.lower()
    )
    h, layers = dims[0], dims[1]
    return (4.0 if lora else 6.0) * n_linear * batch * seq + 12.0 * layers * seq * seq * h * batch


def flaxheads_step(folder: str, batch: dict, lora: bool):
    """A blocking callable: one donated bf16 train step of flaxheads' own step."""
    import jax
    import jax.numpy as jnp

    import flaxheads as fh
    from flaxheads.training.optim import OptimConfig, make_optimizer
    from flaxheads.training.steps import create_state, make_train_step

    model = fh.from_pretrained(folder, dtype=jnp.bfloat16)
    if lora:
        model = model.with_lora(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    tx = make_optimizer(
        OptimConfig(learning_rate=1e-5, warmup_steps=0, total_steps=10_000), fold_reductions=model.plan.fold_reductions
    )
    box = {"s": create_state(model.params, tx)}
    step = common.jit_train_step(make_train_step(model, tx), model.plan)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}

    def run():
        box["s"], met = step(box["s"], jb)
        jax.block_until_ready(met["loss"])

    return run


def torch_bf16(dev) -> bool:
    """PyTorch trains in bf16 autocast on CUDA and on CPUs with bf16 instructions (elsewhere its bf16
    matmul is a reference kernel ~100x slower than float32: the smoke run would pay seconds for nothing)."""
    return dev.type == "cuda" or common.bf16_hardware()


def torch_step(pt, batch: dict, compiled: bool):
    """A blocking callable: one AdamW train step of the PyTorch model ``pt`` (bf16 autocast: :func:`torch_bf16`)."""
    import torch

    dev = next(pt.parameters()).device
    bf16 = torch_bf16(dev)
    pt.train()
    fwd = torch.compile(pt) if compiled else pt
    opt = torch.optim.AdamW([p for p in pt.parameters() if p.requires_grad], lr=1e-5)
    tb = {
        "input_ids": torch.tensor(batch["input_ids"], device=dev),
        "attention_mask": torch.tensor(batch["attention_mask"], device=dev),
        "labels": torch.tensor(batch["labels"], device=dev).long(),
    }

    def run():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = fwd(**tb).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    return run


def bench_train(
    name: str, seq: int, batch_size: int, sz: Sizes, peak: float, tmp: str, allow_compile: bool = True
) -> list[dict]:
    import torch

    family, dims, lora = run_spec(name, sz)
    dev = torch_device()
    cfg = hf_config(family, dims, sz.vocab, seq)
    pt = torch_classifier(cfg, "sdpa", device=dev)
    folder = os.path.join(tmp, f"train-{name}-{seq}")
    pt.save_pretrained(folder, safe_serialization=True)
    if lora:
        import peft

        pt = peft.get_peft_model(
            pt,
            peft.LoraConfig(
                r=8, lora_alpha=16, lora_dropout=0.0, task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"]
            ),
        )
    ids, _, rng = common.token_batch(batch_size, seq)
    ids = 3 + ids % (sz.vocab - 3)  # no pad id (0) inside the rows
    ids[:, 0] = 1 if family in ("llama", "modernbert") else 2
    batch = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "labels": rng.integers(0, 2, batch_size).astype(np.int32),
        "weights": np.ones(batch_size, np.float32),
    }
    flops = model_flops(pt, family, dims, batch_size, seq, lora)
    systems = {"flaxheads": flaxheads_step(folder, batch, lora), "torch eager": torch_step(pt, batch, False)}
    note = "" if torch_bf16(dev) else "torch float32 (no bf16 matmul on this CPU)"
    why_not = "not on CUDA" if dev.type != "cuda" else None if allow_compile else "time budget"
    if why_not is None:
        try:  # compiled apart: a failure drops this system only
            t0 = time.perf_counter()
            systems["torch.compile"] = torch_step(pt, batch, True)
            systems["torch.compile"]()
            note = f"torch.compile's first step (compile) {time.perf_counter() - t0:.1f} s"
        except Exception as e:  # noqa: BLE001
            systems.pop("torch.compile", None)
            why_not = f"failed: {type(e).__name__}: {str(e)[:120]}"
    if why_not:
        note = "; ".join(x for x in (note, f"torch.compile skipped ({why_not})") if x)
    res = timed(systems, sz, flops=flops, examples=batch_size)
    del pt, systems
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    ours = res["flaxheads"].median
    rows = []
    for sys_name, r in res.items():
        rows.append(
            {
                "name": f"train {name} T={seq} B={batch_size}",
                "system": sys_name,
                "status": "ok",
                "median_ms": r.median * 1e3,
                "min_ms": min(r.times) * 1e3,
                "max_ms": max(r.times) * 1e3,
                "first_s": r.first,
                "model_tflop_per_step": flops / 1e12,
                "mfu": flops / r.median / peak if peak else None,
                "flaxheads_speedup": r.median / ours,
                "layers": dims[1],
                "hidden": dims[0],
                "lora": lora,
                "note": note,
            }
        )
    return rows


# ---- 3. prediction ---------------------------------------------------------------------------------
def predict_folder(tmp: str, sz: Sizes) -> tuple[str, list[str]]:
    """A random BERT-base classifier with a WordPiece vocabulary of ``sz.vocab`` words, and texts."""
    from transformers import BertTokenizerFast

    folder = os.path.join(tmp, "predict-bert")
    words = [f"w{i}" for i in range(sz.vocab - 5)]
    cfg = hf_config("bert", sz.bert, sz.vocab, sz.predict_len)
    torch_classifier(cfg, "sdpa").save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    tok = BertTokenizerFast(os.path.join(folder, "vocab.txt"), do_lower_case=True)
    tok.model_max_length = sz.predict_len
    tok.save_pretrained(folder)
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, int(rng.integers(4, 2 * sz.predict_len)))) for _ in range(sz.texts)]
    return folder, texts


def bench_predict(sz: Sizes, tmp: str) -> list[dict]:
    import torch
    from transformers import pipeline

    import flaxheads as fh

    folder, texts = predict_folder(tmp, sz)
    b, L = sz.predict_batch, sz.predict_len
    clf = fh.Classifier.from_pretrained(folder, max_length=L)
    dev = 0 if torch.cuda.is_available() else "cpu"
    pipe = pipeline("text-classification", model=folder, tokenizer=folder, top_k=None, device=dev)
    ours = clf.predict(texts, batch_size=b, progress=False).scores
    ref = np.zeros_like(ours)
    order = {v: k for k, v in clf.id2label.items()}
    for i, row in enumerate(pipe(texts, batch_size=b, truncation=True, max_length=L)):
        for d in row:
            ref[i, order[d["label"]]] = d["score"]
    res = timed(
        {
            "flaxheads": lambda: clf.predict(texts, batch_size=b, progress=False),
            "pipeline": lambda: (pipe(texts, batch_size=b, truncation=True, max_length=L), sync()),
        },
        sz,
        examples=len(texts),
        repeats=sz.predict_repeats,
    )
    diff = float(np.abs(ours - ref).max())
    return [
        {
            "name": f"predict bert-base {len(texts)} texts B={b} L={L}",
            "system": k,
            "status": "ok",
            "texts_per_s": r.eps,
            "median_s": r.median,
            "first_s": r.first,
            "flaxheads_speedup": res["pipeline"].median / res["flaxheads"].median if k == "flaxheads" else 1.0,
            "max_score_diff": diff,
        }
        for k, r in res.items()
    ]


# ---- driver -----------------------------------------------------------------------------------------
def guarded_bench(out: list, name: str, fn, start: float, budget: float) -> None:
    """``fn()`` -> rows, appended; skipped past the budget, an error row if it raises."""
    if time.perf_counter() - start > budget:
        out.append({"name": name, "status": "skipped", "note": f"time budget {budget:.0f} s spent"})
        print(f"# {name}: skipped (budget)", flush=True)
        return
    t0 = time.perf_counter()
    try:
        rows = fn()
    except Exception as e:  # noqa: BLE001
        rows = [
            {
                "name": name,
                "status": "error",
                "error": f"{type(e).__name__}: {e}"[:400],
                "traceback": traceback.format_exc()[-2000:],
            }
        ]
    for r in rows:
        r["seconds"] = round(time.perf_counter() - t0, 1)
        print(
            f"# {r['name']} {r.get('system', '')}: {r['status']} "
            f"{r.get('median_ms', r.get('texts_per_s', r.get('error', '')))}",
            flush=True,
        )
    out.extend(rows)


def fmt(v, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def table(report: dict) -> str:
    lines = ["| section | check / bench | system | result | status / ratio |", "| --- | --- | --- | --- | --- |"]
    for r in report["correctness"]:
        if r["status"] == "error":
            res = r["error"][:90]
        elif "max_rel_diff" in r:
            res = f"max rel diff {r['max_rel_diff']:.2e} <= {r['tol']:g} ({r['params_compared']} tensors)"
        else:
            res = f"max abs diff {r['max_abs_diff']:.2e} <= {r['tol']:g}"
        lines.append(
            f"| correctness | {r['name']} | flaxheads vs {r.get('vs', 'torch f32')} | {res} | {r['status'].upper()} |"
        )
    for r in report["train"]:
        if r["status"] != "ok":
            lines.append(f"| train | {r['name']} | - | {r.get('error', r.get('note', ''))[:90]} | {r['status']} |")
            continue
        mfu = f"MFU {100 * r['mfu']:.1f}%" if r["mfu"] else "MFU -"
        note = f"; {r['note']}" if r["note"] else ""
        lines.append(
            f"| train | {r['name']} | {r['system']} | {r['median_ms']:.2f} ms/step "
            f"({r['min_ms']:.2f}..{r['max_ms']:.2f}), first {r['first_s']:.1f} s, {mfu}{note} | "
            f"flaxheads {r['flaxheads_speedup']:.2f}x |"
        )
    for r in report["predict"]:
        if r["status"] != "ok":
            lines.append(f"| predict | {r['name']} | - | {r.get('error', r.get('note', ''))[:90]} | {r['status']} |")
            continue
        speedup = f"flaxheads {r['flaxheads_speedup']:.2f}x" if r["system"] == "flaxheads" else "1.00x"
        lines.append(
            f"| predict | {r['name']} | {r['system']} | {r['texts_per_s']:.1f} texts/s, first "
            f"{r['first_s']:.1f} s, max score diff {r['max_score_diff']:.1e} | {speedup} |"
        )
    return "\n".join(lines)


def save(report: dict, out_dir: str) -> None:
    """Write the JSON (after every section and bench: a run cut off by its time limit keeps what it did)."""
    with open(os.path.join(out_dir, "accelerator.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU, seconds")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="benches not started after this many seconds are skipped (default 360; smoke 600)",
    )
    ap.add_argument("--only", default="correctness,train,predict", help="sections to run")
    a = ap.parse_args(argv)
    start = time.perf_counter()
    budget = a.budget_s or (600.0 if a.smoke else 360.0)
    sz = sizes_for(a.smoke)
    common.configure_xla()
    import jax  # after the XLA flags

    jax.devices()  # JAX's backend (and its CUDA libraries) up before PyTorch loads its own
    if a.smoke:  # tiny CPU steps: PyTorch's spinning OpenMP threads against XLA's cost 5-500 ms a step on 2 cores
        import torch

        torch.set_num_threads(1)

    os.makedirs(a.out_dir, exist_ok=True)
    head = header()
    print(
        f"# flaxheads accelerator check ({'smoke' if a.smoke else 'full'}): jax {head['jax']} "
        f"{head['jax_devices']}; torch {head['torch']} on {head['torch_device']} ({head['torch_gpu'] or 'no GPU'}); "
        f"transformers {head['transformers']}; python {head['python']}",
        flush=True,
    )
    sections = set(a.only.split(","))
    report = {
        "header": head,
        "smoke": a.smoke,
        "sizes": {k: v for k, v in sz.__dict__.items()},
        "correctness": [],
        "train": [],
        "predict": [],
    }
    with tempfile.TemporaryDirectory(prefix="fh-accel-") as tmp:
        if "correctness" in sections:
            for family in FAMILIES:
                report["correctness"] += check_family(family, sz, tmp)
                save(report, a.out_dir)
        if "predict" in sections:  # before the train benches: short, and bounded
            guarded_bench(report["predict"], "predict", lambda: bench_predict(sz, tmp), start, budget)
            save(report, a.out_dir)
        peak = 0.0
        if "train" in sections:
            try:
                peak = matmul_peak(sz)
            except Exception as e:  # noqa: BLE001
                print(f"# matmul peak failed: {e}")
            report["peak_bf16_tflops"] = peak / 1e12
            print(f"# measured bf16 matmul peak ({sz.matmul_n}^3): {peak / 1e12:.3f} TFLOP/s", flush=True)
            for name, seq, b in sz.runs:
                guarded_bench(
                    report["train"],
                    f"train {name} T={seq} B={b}",
                    lambda n=name, s=seq, bb=b: bench_train(
                        n, s, bb, sz, peak, tmp, time.perf_counter() - start < sz.compile_until
                    ),
                    start,
                    budget,
                )
                save(report, a.out_dir)
    report["total_s"] = time.perf_counter() - start
    save(report, a.out_dir)
    print(
        f"\n# peak bf16 matmul {report.get('peak_bf16_tflops', 0):.3f} TFLOP/s; total {report['total_s']:.0f} s; "
        f"ratio column: flaxheads time advantage (peer median / flaxheads median)"
    )
    print(table(report), flush=True)
    return report


if __name__ == "__main__":
    main()
