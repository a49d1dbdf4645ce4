"""Every model variant through every export format: each cell either works, and the export loaded in its
own tool (transformers, peft, sentence-transformers, a CrossEncoder, onnxruntime) gives flaxheads'
logits within the tolerance the cell states, or is refused by a FlaxheadsError that says why and what
to do instead. Nothing else escapes (no TypeError, ValueError or KeyError from inside the library).

Variants: float32, a bfloat16 base, LoRA, QLoRA int8 / int4 / nf4 (a decoder: quantised bases are the
shared-matmul families'), NNX, a ranking (one-score) head, a custom pooler + head (custom code), a
multi-label head. Formats: transformers (the HF preset's class, or flaxheads' own code; LoRA merged),
PEFT (the adapters), sentence-transformers, CrossEncoder, head, ONNX. The library leg runs every cell
through ``fh.export``; the command's leg (``flaxheads export`` in this process, from each variant's run
folder) runs a subset that covers every format and every kind of source (test_command_matrix)."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("sentence_transformers")

from hf_tiny import padded_batch, save_tiny  # noqa: E402
from train_helpers import WORDS, save_word_tokenizer, tiny_bert_folder  # noqa: E402

import flaxheads as fh  # noqa: E402

pytestmark = pytest.mark.full

VARIANTS = [
    "float32",
    "bf16 base",
    "lora",
    "qlora int8",
    "qlora int4",
    "qlora nf4",
    "nnx",
    "ranking",
    "custom",
    "multi-label",
]
FORMATS = ["transformers", "peft", "sentence-transformers", "cross-encoder", "head", "onnx"]
_NO_ADAPTERS = "(writes LoRA adapters, and this model has none|has no LoRA adapters.*export the whole model)"
_LAST_TOKEN = "pools by 'non_pad_token', but sentence-transformers pools by the attention mask"
_ATTENTION_POOL = "pooler AttentionPool has no sentence-transformers equivalent"


def _cell(variant: str, fmt: str):
    """What the cell must do: ``("ok", atol)`` or ``("refused", regex of the message)``."""
    qlora, lora = variant.startswith("qlora"), variant in ("lora",) or variant.startswith("qlora")
    if fmt == "peft" and not lora:
        return "refused", _NO_ADAPTERS
    if fmt in ("sentence-transformers", "cross-encoder") and variant == "custom":
        return "refused", _ATTENTION_POOL
    if fmt == "sentence-transformers" and qlora:
        return "refused", _LAST_TOKEN  # the decoder's preset pools its last token; the transformers format has it
    if variant == "bf16 base":
        return "ok", 1e-3  # flaxheads runs the bfloat16 base's matmuls in bfloat16; the export holds float32 weights
    # a QLoRA model's export dequantises the base (merged: its own logits; PEFT: the adapters on the float base);
    # nf4 / int4 codes dequantised exactly, so float32 round-off is what remains
    return "ok", 1e-4 if not qlora else 2e-4


CELLS = [(v, f) for v in VARIANTS for f in FORMATS]


def _moved(tree, seed: int):
    """Every float leaf moved off its initial value, as training moves it (an export must write these)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: (
            (np.asarray(a) + 0.05 * rng.standard_normal(np.shape(a))).astype(np.asarray(a).dtype)
            if jnp.issubdtype(np.asarray(a).dtype, jnp.floating)
            else a
        ),
        tree,
    )


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One tiny BERT (one layer, a word-level tokenizer) and one tiny Qwen3 (with the same tokenizer)."""
    root = tmp_path_factory.mktemp("matrix")
    bert = tiny_bert_folder(root / "bert")
    qwen, _ = save_tiny(root / "qwen3", "qwen3", seed=3, layers=1, hidden_size=64, intermediate_size=128, head_dim=16)
    save_word_tokenizer(qwen)
    return {"bert": bert, "qwen3": qwen}


def _build(variant: str, sources) -> tuple:
    """``(the model as exported, the flaxheads model its PEFT export's logits are compared with, source folder)``."""
    bert = sources["bert"]
    if variant.startswith("qlora"):
        base = fh.from_pretrained(sources["qwen3"], num_labels=3, ignore_mismatched_sizes=True).with_lora(rank=4)
        base.params["lora"], base.params["head"] = _moved(base.params["lora"], 1), _moved(base.params["head"], 2)
        return base.with_quantized_base(variant.split()[1]), base, sources["qwen3"]
    options = {
        "float32": {},
        "bf16 base": {"base_dtype": jnp.bfloat16},
        "lora": {},
        "nnx": {},
        "ranking": {"num_labels": 1, "problem_type": "regression"},
        "custom": {"pooler": "attention", "head": "mlp", "head_options": {"hidden_dims": (8,)}},
        "multi-label": {"num_labels": 4, "problem_type": "multi_label_classification"},
    }[variant]
    model = fh.from_pretrained(bert, **{"num_labels": 3, **options}, ignore_mismatched_sizes=True)
    if variant == "lora":
        model = model.with_lora(rank=4)
        model.params["lora"] = _moved(model.params["lora"], 1)
    model.params["head"] = _moved(model.params["head"], 2)
    if variant == "nnx":
        from flaxheads.nnx.model import to_nnx

        return to_nnx(model), model, bert
    return model, model, bert


@pytest.fixture(scope="module")
def variants(sources):
    made: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in made:
            made[variant] = _build(variant, sources)
        return made[variant]

    return get


TEXTS = [" ".join(WORDS[i : i + n]) for i, n in ((0, 7), (9, 2), (20, 4), (30, 1))]
PAIRS = [(TEXTS[0], TEXTS[1]), (TEXTS[2], TEXTS[3]), (TEXTS[1], TEXTS[2])]


def _ours(model, ids, mask, **extra) -> np.ndarray:
    functional = model.to_functional() if hasattr(model, "to_functional") else model
    return np.asarray(jax.jit(lambda p, i, m: functional.apply(p, i, m, **extra))(functional.params, ids, mask))


def _batch(model, source: str):
    cfg = (model.to_functional() if hasattr(model, "to_functional") else model).backbone.config
    arch = "qwen3" if "qwen3" in source else "bert"
    return padded_batch(arch, cfg, "left" if arch == "qwen3" else "right")


def _theirs(fmt: str, out: str, model, reference, source: str) -> tuple[np.ndarray, np.ndarray]:
    """(the export's logits in its tool, flaxheads' logits of the same inputs)."""
    from transformers import AutoModelForSequenceClassification

    if fmt in ("transformers", "peft", "onnx"):
        ids, mask = _batch(model, source)
        if fmt == "onnx":
            import onnxruntime as ort

            sess = ort.InferenceSession(os.path.join(out, "model.onnx"), providers=["CPUExecutionProvider"])
            feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            return sess.run(["logits"], {i.name: feed[i.name] for i in sess.get_inputs()})[0], _ours(model, ids, mask)
        if fmt == "peft":
            from peft import PeftModel

            base = AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=reference.num_labels, ignore_mismatched_sizes=True
            )
            pt = PeftModel.from_pretrained(base, out).eval()
            want = _ours(reference, ids, mask)  # the adapters on the float base
        else:
            pt = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True).eval()
            want = _ours(model, ids, mask)
        with torch.no_grad():
            return pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy(), want
    if fmt == "sentence-transformers":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(out, device="cpu")
        enc = st.tokenizer(TEXTS, padding=True, return_tensors="np")
        got = st.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
        return got, _ours(model, enc["input_ids"], enc["attention_mask"])
    if fmt == "cross-encoder":
        from sentence_transformers import CrossEncoder

        ce = CrossEncoder(out, device="cpu")
        enc = ce.tokenizer([q for q, _ in PAIRS], [p for _, p in PAIRS], padding=True, return_tensors="np")
        functional = model.to_functional() if hasattr(model, "to_functional") else model
        takes = "token_type_ids" in functional.backbone.extra_inputs and "token_type_ids" in enc
        extra = {"token_type_ids": enc["token_type_ids"]} if takes else {}
        got = np.asarray(ce.predict(PAIRS, convert_to_numpy=True, batch_size=len(PAIRS)), np.float32)
        want = _ours(model, enc["input_ids"], enc["attention_mask"], **extra)
        return got.reshape(want.shape), want
    raise AssertionError(fmt)


def _head_round_trip(out: str, model) -> None:
    """A head file read back: the same head params (its tool is any safetensors reader; flaxheads' own here)."""
    from flaxheads.interop.head_files import load_head_export

    functional = model.to_functional() if hasattr(model, "to_functional") else model
    _, params, _ = load_head_export(out)
    want = jax.tree.leaves(jax.device_get(functional.params["head"]))
    got = jax.tree.leaves(params)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))


def _check_cell(variant: str, fmt: str, export, model, reference, source: str, out: str) -> None:
    """Run one cell: ``export()`` writes ``out``; then the cell's expectation holds."""
    want = _cell(variant, fmt)
    if want[0] == "refused":
        with pytest.raises(fh.FlaxheadsError) as e:
            export()
        assert re.search(want[1], str(e.value)), str(e.value)
        assert not os.path.exists(out)
        return
    export()
    if fmt == "head":
        return _head_round_trip(out, model)
    got, ours = _theirs(fmt, out, model, reference, source)
    assert got.shape == ours.shape, (got.shape, ours.shape)
    np.testing.assert_allclose(got, ours, atol=want[1], rtol=0)


def _options(fmt: str, source: str) -> dict:
    return {} if fmt in ("head", "peft") else {"tokenizer_from": source}


@pytest.mark.parametrize("variant,fmt", CELLS, ids=[f"{v}-{f}" for v, f in CELLS])
def test_library_matrix(variants, variant, fmt, tmp_path):
    model, reference, source = variants(variant)
    out = str(tmp_path / "out")
    _check_cell(
        variant, fmt, lambda: fh.export(model, out, fmt, **_options(fmt, source)), model, reference, source, out
    )


#: The command's leg: every format, and every kind of source a run folder holds (a float32 model, a bfloat16
#: base, LoRA adapters, a quantised base, an NNX model's, a one-score head, custom code, a multi-label head).
COMMAND_CELLS = [("float32", f) for f in FORMATS] + [
    ("bf16 base", "transformers"),
    ("lora", "transformers"),
    ("lora", "peft"),
    ("qlora nf4", "transformers"),
    ("nnx", "transformers"),
    ("qlora nf4", "peft"),
    ("ranking", "cross-encoder"),
    ("custom", "transformers"),
    ("custom", "sentence-transformers"),
    ("multi-label", "sentence-transformers"),
]


@pytest.fixture(scope="module")
def runs(variants, tmp_path_factory):
    """Each variant's model saved as a run's checkpoint, and the model that folder loads back."""
    made: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in made:
            model, reference, source = variants(variant)
            run = tmp_path_factory.mktemp("run")
            # as flaxheads train saves them: a LoRA run's frozen base is read again from its folder (an NNX
            # model is given as it is: the checkpointer records its functional form)
            params = model.params() if variant == "nnx" else model.params
            with fh.RunCheckpointer(run, model, save_backbone=reference.lora is None) as ckr:
                ckr.save(1, {"step": 1, "params": params, "opt_state": {}})
            made[variant] = (str(run), fh.load(run), source)
        return made[variant]

    return get


@pytest.mark.parametrize("variant,fmt", COMMAND_CELLS, ids=[f"{v}-{f}" for v, f in COMMAND_CELLS])
def test_command_matrix(runs, variants, variant, fmt, tmp_path, capsys):
    from flaxheads.cli.main import main

    run, loaded, source = runs(variant)
    _, reference, _ = variants(variant)
    out = str(tmp_path / "out")
    argv = [
        "export",
        "--from",
        run,
        "--format",
        "transformers" if fmt == "peft" else fmt,
        "--out",
        out,
        *(["--peft"] if fmt == "peft" else []),
        *(["--tokenizer", source] if fmt not in ("head", "peft") else []),
    ]

    def export():
        capsys.readouterr()
        code = main(argv)
        err = capsys.readouterr().err
        if code != 0:
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1, err  # refused: one line, the command's mistake
            raise fh.FlaxheadsError(lines[0])

    _check_cell(variant, fmt, export, loaded, reference, source, out)


def test_a_quantised_base_is_not_saved_in_a_checkpoint(variants, tmp_path):
    """A QLoRA base's codes are no checkpoint item: refused in one line (not a failed write), nothing saved."""
    model, _, _ = variants("qlora nf4")
    with fh.RunCheckpointer(tmp_path, model) as ckr:
        with pytest.raises(fh.CheckpointError, match="quantised base.*save_backbone=False"):
            ckr.save(1, {"step": 1, "params": model.params, "opt_state": {}})
    assert not os.path.isdir(tmp_path / "checkpoints" / "1")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_decoder_classifier_export_is_transformers_class(tiny_model, arch, side, tmp_path):
    """A tiny Qwen2 / Llama classifier, its head moved as training moves it, through ``fh.export``: transformers
    loads the folder as its own ``Qwen2ForSequenceClassification`` / ``LlamaForSequenceClassification``, with
    no missing or unexpected weights, and gives flaxheads' logits within 1e-5 on right- and left-padded rows
    (both pool the last non-pad token)."""
    from transformers import AutoModelForSequenceClassification

    path = tiny_model(arch).path
    model = fh.from_pretrained(path)
    model.params["head"] = _moved(model.params["head"], 3)
    out = fh.export(model, tmp_path / "out", format="transformers")
    pt, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert (
        type(pt).__name__
        == {"qwen2": "Qwen2ForSequenceClassification", "llama": "LlamaForSequenceClassification"}[arch]
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, mask = padded_batch(arch, pt.config, side)
    with torch.no_grad():
        theirs = pt.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(theirs, _ours(model, ids, mask), atol=1e-5, rtol=0)
