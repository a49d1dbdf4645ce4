"""``flaxheads export``: from a model folder, a head checkpoint (frozen backbone) and a run
folder whose checkpoints saved a trained backbone, to each format; errors exit 2 with one line
and write nothing."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from cli_helpers import SMALL, assert_one_line_error, run_cli, write_csv  # noqa: E402
from hf_tiny import padded_batch, tiny_torch_model  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.cli.main import build_parser, main  # noqa: E402

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "electra"
    tiny_torch_model("electra", seed=5).save_pretrained(d, safe_serialization=True)
    return d


def _pt_logits(folder, ids, mask):
    pt, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        return pt.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def _shifted(tree, by):
    return jax.tree.map(lambda x: x + by, tree)


def test_parser_has_export_subcommand():
    args = build_parser().parse_args(["export", "--from", "a", "--format", "head", "--out", "b"])
    assert args.command == "export" and args.func.__name__ == "run_export"


def test_export_from_model_folder(src, tmp_path, capsys):
    assert main(["export", "--from", str(src), "--format", "transformers", "--out", str(tmp_path / "pt")]) == 0
    assert "wrote transformers export" in capsys.readouterr().out
    model = fh.interop.load_transformers(src)
    ids, mask = padded_batch("electra", model.backbone.config)
    np.testing.assert_allclose(
        _pt_logits(tmp_path / "pt", ids, mask),
        np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))),
        atol=1e-4,
        rtol=0,
    )


def test_export_from_head_checkpoint(src, tmp_path):
    """A head-only checkpoint (frozen backbone, referenced by path in meta)."""
    model = fh.interop.load_transformers(src)
    params = {"backbone": model.params["backbone"], "head": _shifted(model.params["head"], 0.05)}
    fh.save_head(tmp_path / "ckpt", model, params, step=7)
    ids, mask = padded_batch("electra", model.backbone.config)
    want = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))

    assert (
        main(["export", "--from", str(tmp_path / "ckpt"), "--format", "transformers", "--out", str(tmp_path / "pt")])
        == 0
    )
    np.testing.assert_allclose(_pt_logits(tmp_path / "pt", ids, mask), want, atol=1e-4, rtol=0)

    assert main(["export", "--from", str(tmp_path / "ckpt"), "--format", "head", "--out", str(tmp_path / "h")]) == 0
    head, hp, cfg = fh.interop.load_head_export(tmp_path / "h")
    assert cfg["arch"] == "electra" and cfg["num_labels"] == 3
    from safetensors.numpy import load_file

    assert sorted(load_file(tmp_path / "h" / "head.safetensors")) == [
        "classifier.dense.bias",
        "classifier.dense.weight",
        "classifier.out_proj.bias",
        "classifier.out_proj.weight",
    ]
    for a, b in zip(jax.tree.leaves(params["head"]), jax.tree.leaves(hp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_from_run_folder_with_trained_backbone(src, tmp_path):
    model = fh.interop.load_transformers(src)
    params = {"backbone": _shifted(model.params["backbone"], 0.01), "head": _shifted(model.params["head"], -0.02)}
    with fh.RunCheckpointer(tmp_path / "run", model, save_backbone=True) as ck:
        ck.save(3, {"step": 3, "params": params, "opt_state": {}})
    (tmp_path / "run" / "config.json").write_text('{"model": "x", "lr": 0.001}')  # a run's training config
    ids, mask = padded_batch("electra", model.backbone.config)
    want = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))
    before = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(want - before).max() > 1e-3  # the trained backbone matters
    assert (
        main(["export", "--from", str(tmp_path / "run"), "--format", "transformers", "--out", str(tmp_path / "pt")])
        == 0
    )
    np.testing.assert_allclose(_pt_logits(tmp_path / "pt", ids, mask), want, atol=1e-4, rtol=0)


def test_errors_exit_2_and_write_nothing(src, tmp_path, capsys):
    model = fh.from_pretrained(src, pooler="mean", head="mlp", num_labels=3)
    fh.interop.export_head(model, tmp_path / "head")
    out = tmp_path / "pt"
    code, _, err = run_cli(capsys, "export", "--from", tmp_path / "head", "--format", "transformers", "--out", out)
    assert_one_line_error(code, err, "head-only export", "--format head")
    assert not out.exists()
    code, _, err = run_cli(capsys, "export", "--from", tmp_path / "nope", "--format", "head", "--out", out)
    assert_one_line_error(code, err, "--from", "does not exist")
    assert not out.exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    code, _, err = run_cli(capsys, "export", "--from", src, "--format", "transformers", "--out", tmp_path / "full")
    assert_one_line_error(code, err, "already exists and is not empty", "--overwrite")
    assert (tmp_path / "full" / "x").read_text() == "keep"
    code, _, err = run_cli(capsys, "export", "--from", src, "--format", "tflite", "--out", out)
    assert_one_line_error(code, err, "--format: invalid choice: 'tflite'")


def test_checkpoint_whose_backbone_folder_moved_needs_backbone_option(src, tmp_path, capsys):
    import shutil

    moved = shutil.copytree(src, tmp_path / "bb")
    model = fh.interop.load_transformers(moved)
    fh.save_head(tmp_path / "ckpt", model)
    shutil.rmtree(moved)
    out = tmp_path / "pt"
    code, _, err = run_cli(capsys, "export", "--from", tmp_path / "ckpt", "--format", "transformers", "--out", out)
    assert_one_line_error(code, err, "--backbone")
    assert not out.exists()
    assert (
        main(
            [
                "export",
                "--from",
                str(tmp_path / "ckpt"),
                "--format",
                "transformers",
                "--out",
                str(out),
                "--backbone",
                str(src),
            ]
        )
        == 0
    )
    ids, mask = padded_batch("electra", model.backbone.config)
    np.testing.assert_allclose(
        _pt_logits(out, ids, mask), np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))), atol=1e-4, rtol=0
    )


def test_sentence_transformers_export_of_a_trained_run(bert_folder, tmp_path, capsys):
    """A run of `flaxheads train` (mean pooling, linear head) exported with --format
    sentence-transformers: sentence-transformers' own encode gives the run's logits."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    data = write_csv(tmp_path / "d.csv", 30)
    assert (
        main(
            [
                "train",
                "--model",
                bert_folder,
                "--data",
                data,
                "--output-dir",
                str(run),
                *SMALL,
                "--max-steps",
                "2",
                "--batch-size",
                "6",
                "--lr",
                "1e-2",
                "--pooler",
                "mean",
                "--head",
                "linear",
            ]
        )
        == 0
    )
    code, out, _ = run_cli(
        capsys,
        "export",
        "--from",
        run,
        "--format",
        "sentence-transformers",
        "--out",
        tmp_path / "st",
        "--max-seq-length",
        "16",
    )
    assert code == 0 and "wrote sentence-transformers export" in out
    texts = ["stock market bank", "goal match team player", "vote"]
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    assert st.max_seq_length == 16
    got = st.encode(texts, convert_to_numpy=True)
    model = fh.checkpoint.model_from_checkpoint(run)
    enc = AutoTokenizer.from_pretrained(bert_folder)(texts, padding=True, return_tensors="np")
    want = np.asarray(
        model(
            jnp.asarray(enc["input_ids"]),
            jnp.asarray(enc["attention_mask"]),
            token_type_ids=jnp.asarray(enc["token_type_ids"]),
        )
    )
    assert got.shape == (3, 3)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    untrained = np.asarray(
        fh.from_pretrained(bert_folder, pooler="mean", head="linear", num_labels=3, ignore_mismatched_sizes=True)(
            jnp.asarray(enc["input_ids"]), jnp.asarray(enc["attention_mask"])
        )
    )
    assert np.abs(untrained - want).max() > 1e-3  # the export carries the trained run, not a fresh head


def test_default_run_exports_to_a_transformers_pipeline(bert_folder, tmp_path, capsys):
    """`flaxheads train` with default flags (mean pooler + linear head), then `flaxheads export --format
    transformers` with no other flag: transformers' pipeline loads the folder (trust_remote_code) and
    labels texts as flaxheads' Classifier does, with the same scores."""
    from transformers import pipeline

    run = tmp_path / "run"
    data = write_csv(tmp_path / "d.csv", 30)
    assert (
        main(
            [
                "train",
                "--model",
                bert_folder,
                "--data",
                data,
                "--output-dir",
                str(run),
                *SMALL,
                "--max-steps",
                "3",
                "--batch-size",
                "6",
                "--lr",
                "1e-2",
            ]
        )
        == 0
    )
    code, out, err = run_cli(capsys, "export", "--from", run, "--format", "transformers", "--out", tmp_path / "pt")
    assert code == 0, err
    texts = ["stock market bank", "goal match team player", "vote", "bank goal vote match"]
    clf = fh.Classifier.from_pretrained(run)
    want = clf.predict(texts)
    pipe = pipeline("text-classification", model=str(tmp_path / "pt"), trust_remote_code=True, device="cpu")
    got = pipe(texts)
    assert [g["label"] for g in got] == list(want.labels)
    np.testing.assert_allclose([g["score"] for g in got], want.scores.max(axis=1), atol=1e-5, rtol=0)
    assert sorted(pipe.model.config.id2label.values()) == sorted(clf.id2label.values())
    # and the exported folder predicts the same through flaxheads (config + weights, no Python run)
    again = fh.Classifier.from_pretrained(tmp_path / "pt").predict(texts)
    assert list(again.labels) == list(want.labels)


def test_onnx_export_of_a_run(bert_folder, tmp_path, capsys):
    """`flaxheads export --format onnx` of a run with a custom head: onnxruntime gives the Classifier's logits
    on the tokenizer's padded batch, and the folder carries the labels and the tokenizer."""
    ort = pytest.importorskip("onnxruntime")
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    data = write_csv(tmp_path / "d.csv", 30)
    assert (
        main(
            [
                "train",
                "--model",
                bert_folder,
                "--data",
                data,
                "--output-dir",
                str(run),
                *SMALL,
                "--max-steps",
                "2",
                "--batch-size",
                "6",
                "--pooler",
                "cls,max",
                "--head",
                "mlp",
            ]
        )
        == 0
    )
    code, out, err = run_cli(capsys, "export", "--from", run, "--format", "onnx", "--out", tmp_path / "onnx")
    assert code == 0 and "wrote onnx export" in out, err
    texts = ["stock market bank", "goal match team player player goal", "vote"]
    clf = fh.Classifier.from_pretrained(run)
    enc = AutoTokenizer.from_pretrained(tmp_path / "onnx")(texts, padding=True, return_tensors="np")
    sess = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {i.name: enc[i.name].astype(np.int64) for i in sess.get_inputs()})[0]
    np.testing.assert_allclose(got, clf.predict(texts).logits, atol=1e-4, rtol=0)
    import json

    cfg = json.loads((tmp_path / "onnx" / "config.json").read_text())
    assert [cfg["id2label"][str(i)] for i in range(3)] == [clf.id2label[i] for i in range(3)]
