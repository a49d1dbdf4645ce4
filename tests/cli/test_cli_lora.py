"""``flaxheads train --lora-*`` and ``flaxheads export [--peft]``: a LoRA run saves adapters (not the
base), resumes where it stopped with the same result, exports merged weights PyTorch transformers
loads and a PEFT folder peft loads, both with the run's logits; bad flags are one-line errors."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from cli_helpers import assert_one_line_error, run_cli, train_args, write_csv  # noqa: E402
from hf_tiny import padded_batch  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.cli.main import main  # noqa: E402

pytestmark = pytest.mark.full

# the HF head (BERT's pooler + classifier), so the run exports to transformers and PEFT
LORA = [
    "--pooler",
    "preset",
    "--head",
    "preset",
    "--lora-rank",
    "4",
    "--lora-alpha",
    "8",
    "--lora-targets",
    "query,value",
    "--batch-size",
    "8",
    "--schedule",
    "constant",
    "--warmup-ratio",
    "0",
    "--lr",
    "5e-3",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("lora_data") / "d.csv", 30)


@pytest.fixture(scope="module")
def run(bert_folder, data, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("lora_run") / "run"
    assert main(train_args(bert_folder, data, out, *LORA, "--max-steps", "4")) == 0
    return out


def _logits(m, ids, mask):
    with torch.no_grad():
        return m.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def test_run_saves_adapters_not_the_base(run):
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["query", "value"]}
    assert 0 < cfg["params"]["lora"] < cfg["params"]["backbone"] / 10
    step = run / "checkpoints" / "4"
    assert (step / "lora").is_dir() and (step / "head").is_dir() and not (step / "backbone").exists()


@pytest.mark.slow  # two more runs (~60 s on 2 shared cores)
def test_resumed_run_repeats_the_uninterrupted_one(bert_folder, data, run, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert run_cli(capsys, *train_args(bert_folder, data, out, *LORA, "--max-steps", "2"))[0] == 0
    code, stdout, _ = run_cli(capsys, *train_args(bert_folder, data, out, *LORA, "--max-steps", "4"))
    assert code == 0 and "resuming from step 2" in stdout
    np.testing.assert_array_equal(
        np.load(out / "predictions.npz")["test_logits"], np.load(run / "predictions.npz")["test_logits"]
    )


def test_export_merged_and_peft(bert_folder, run, tmp_path, capsys):  # noqa: F811
    model = fh.checkpoint.model_from_checkpoint(run)
    assert model.lora is not None
    ids, mask = padded_batch("bert", model.backbone.config)
    ours = np.asarray(model(ids, mask))
    base_model = fh.from_pretrained(bert_folder, num_labels=3, ignore_mismatched_sizes=True)
    assert np.abs(ours - np.asarray(base_model(ids, mask))).max() > 1e-3  # the adapters and head trained

    code, _, err = run_cli(capsys, "export", "--from", run, "--format", "transformers", "--out", tmp_path / "pt")
    assert code == 0, err
    np.testing.assert_allclose(
        _logits(AutoModelForSequenceClassification.from_pretrained(tmp_path / "pt"), ids, mask),
        ours,
        atol=1e-5,
        rtol=1e-4,
    )

    code, stdout, _ = run_cli(
        capsys, "export", "--from", run, "--format", "transformers", "--peft", "--out", tmp_path / "peft"
    )
    assert code == 0 and "PEFT adapter" in stdout
    base = AutoModelForSequenceClassification.from_pretrained(bert_folder, num_labels=3, ignore_mismatched_sizes=True)
    np.testing.assert_allclose(
        _logits(peft.PeftModel.from_pretrained(base, tmp_path / "peft"), ids, mask), ours, atol=1e-5, rtol=1e-4
    )


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--lora-rank", "0"], ["--lora-rank", "positive integer"]),
        (["--lora-rank", "4", "--lora-targets", "q_proj,v_proj"], ["'q_proj' matches no kernel", "query", "value"]),
        (["--lora-rank", "4", "--lora-dropout", "0.1"], ["dropout 0.1 is not supported"]),
        (["--lora-alpha", "16"], ["--lora-alpha", "needs --lora-rank"]),
        (["--lora-rank", "4", "--freeze-backbone"], ["--lora-rank", "--freeze-backbone"]),
    ],
)
def test_bad_lora_flags_are_one_line_errors(bert_folder, data, tmp_path, capsys, flags, needles):  # noqa: F811
    code, _, err = run_cli(capsys, *train_args(bert_folder, data, tmp_path / "r", *flags))
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_peft_export_needs_adapters(bert_folder, run, tmp_path, capsys):  # noqa: F811
    code, _, err = run_cli(
        capsys, "export", "--from", bert_folder, "--format", "transformers", "--peft", "--out", tmp_path / "x"
    )
    assert_one_line_error(code, err, "--peft", "no LoRA adapters")
    code, _, err = run_cli(capsys, "export", "--from", run, "--format", "head", "--peft", "--out", tmp_path / "y")
    assert_one_line_error(code, err, "--peft", "--format transformers")


@pytest.fixture(scope="module")
def peft_adapter(bert_folder, tmp_path_factory):  # noqa: F811
    """A LoRA SEQ_CLS adapter saved by peft (classifier through modules_to_save) on the tiny BERT:
    ``(folder, PeftModel)``."""
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(bert_folder, num_labels=3, ignore_mismatched_sizes=True)
    pm = peft.get_peft_model(
        base, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"])
    )
    with torch.no_grad():
        for _, p in pm.named_parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("peft") / "adapter"
    pm.save_pretrained(out)
    return out, pm.eval()


def test_predict_from_a_peft_adapter(peft_adapter, tmp_path, capsys, monkeypatch):
    import io
    import sys

    from transformers import AutoTokenizer

    folder, pm = peft_adapter
    texts = ["stock market bank", "goal match team player", "vote"]
    clf = fh.Classifier.from_pretrained(folder)
    enc = AutoTokenizer.from_pretrained(clf.model.name_or_path)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = pm(**enc).logits.numpy()
    pred = clf.predict(texts)
    np.testing.assert_allclose(pred.logits, ref, atol=1e-5, rtol=0)
    code, _, err = run_cli(capsys, "export", "--from", folder, "--format", "transformers", "--out", tmp_path / "pt")
    assert code == 0, err  # the adapter merged into its base, as the HF class
    with torch.no_grad():
        merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "pt").eval()(**enc).logits.numpy()
    np.testing.assert_allclose(merged, ref, atol=1e-5, rtol=0)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(texts) + "\n").encode())))
    code, stdout, err = run_cli(capsys, "predict", folder, "--input", "-")
    assert code == 0, err
    assert [json.loads(x)["prediction"] for x in stdout.strip().splitlines()] == pred.labels


def test_adapter_whose_base_is_missing_is_one_line(peft_adapter, tmp_path, capsys):
    import shutil

    moved = shutil.copytree(peft_adapter[0], tmp_path / "adapter")
    cfg = json.loads((moved / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "no-such-base")
    (moved / "adapter_config.json").write_text(json.dumps(cfg))
    (tmp_path / "t.txt").write_text("vote\n")
    code, _, err = run_cli(capsys, "predict", moved, "--input", tmp_path / "t.txt")
    assert_one_line_error(code, err, "PEFT adapter", "no-such-base", "missing", "--backbone")


def test_train_continues_a_peft_adapter(bert_folder, data, peft_adapter, tmp_path, capsys):  # noqa: F811
    """`flaxheads train --lora-from`: the adapter's rank and targets, its adapters and head as the start,
    trained further, and exported back to PEFT with the run's logits."""
    folder, pm = peft_adapter
    start = fh.interop.load_peft(folder)
    out = tmp_path / "run"
    code, _, err = run_cli(
        capsys,
        *train_args(
            bert_folder, data, out, "--lora-from", folder, "--max-steps", "3", "--batch-size", "8", "--lr", "5e-3"
        ),
    )
    assert code == 0, err
    model = fh.checkpoint.model_from_checkpoint(out)
    assert model.lora == start.lora
    ids, mask = padded_batch("bert", model.backbone.config)
    assert np.abs(np.asarray(model(ids, mask)) - np.asarray(start(ids, mask))).max() > 1e-3  # it trained
    code, _, err = run_cli(
        capsys, "export", "--from", out, "--format", "transformers", "--peft", "--out", tmp_path / "peft"
    )
    assert code == 0, err
    base = AutoModelForSequenceClassification.from_pretrained(bert_folder, num_labels=3, ignore_mismatched_sizes=True)
    np.testing.assert_allclose(
        _logits(peft.PeftModel.from_pretrained(base, tmp_path / "peft"), ids, mask),
        np.asarray(model(ids, mask)),
        atol=1e-5,
        rtol=0,
    )
    code, _, err = run_cli(
        capsys, *train_args(bert_folder, data, tmp_path / "r2", "--lora-from", folder, "--lora-rank", "4")
    )
    assert_one_line_error(code, err, "--lora-rank", "--lora-from")
