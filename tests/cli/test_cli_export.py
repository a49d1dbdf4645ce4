"""``flaxheads export``: from a model folder, a head checkpoint (frozen backbone) and a run
folder whose checkpoints saved a trained backbone; errors exit 2 and write nothing."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.cli.main import build_parser, main  # noqa: E402
from hf_tiny import padded_batch, tiny_torch_model  # noqa: E402


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
    model = fh.load_transformers(src)
    ids, mask = padded_batch("electra", model.backbone.config)
    np.testing.assert_allclose(_pt_logits(tmp_path / "pt", ids, mask),
                               np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))), atol=1e-4, rtol=0)


def test_export_from_head_checkpoint(src, tmp_path):
    """A head-only checkpoint (frozen backbone, referenced by path in meta)."""
    model = fh.load_transformers(src)
    params = {"backbone": model.params["backbone"], "head": _shifted(model.params["head"], 0.05)}
    fh.save_head(tmp_path / "ckpt", model, params, step=7)
    ids, mask = padded_batch("electra", model.backbone.config)
    want = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))

    assert main(["export", "--from", str(tmp_path / "ckpt"), "--format", "transformers",
                 "--out", str(tmp_path / "pt")]) == 0
    np.testing.assert_allclose(_pt_logits(tmp_path / "pt", ids, mask), want, atol=1e-4, rtol=0)

    assert main(["export", "--from", str(tmp_path / "ckpt"), "--format", "head", "--out", str(tmp_path / "h")]) == 0
    head, hp, cfg = fh.load_head_export(tmp_path / "h")
    assert cfg["arch"] == "electra" and cfg["num_labels"] == 3
    from safetensors.numpy import load_file

    assert sorted(load_file(tmp_path / "h" / "head.safetensors")) == [
        "classifier.dense.bias", "classifier.dense.weight", "classifier.out_proj.bias", "classifier.out_proj.weight"]
    for a, b in zip(jax.tree.leaves(params["head"]), jax.tree.leaves(hp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_from_run_folder_with_trained_backbone(src, tmp_path):
    model = fh.load_transformers(src)
    params = {"backbone": _shifted(model.params["backbone"], 0.01), "head": _shifted(model.params["head"], -0.02)}
    with fh.RunCheckpointer(tmp_path / "run", model, save_backbone=True) as ck:
        ck.save(3, {"step": 3, "params": params, "opt_state": {}})
    (tmp_path / "run" / "config.json").write_text('{"model": "x", "lr": 0.001}')  # a run's training config
    ids, mask = padded_batch("electra", model.backbone.config)
    want = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))
    before = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(want - before).max() > 1e-3  # the trained backbone matters
    assert main(["export", "--from", str(tmp_path / "run"), "--format", "transformers",
                 "--out", str(tmp_path / "pt")]) == 0
    np.testing.assert_allclose(_pt_logits(tmp_path / "pt", ids, mask), want, atol=1e-4, rtol=0)


def test_errors_exit_2_and_write_nothing(src, tmp_path, capsys):
    model = fh.from_pretrained(src, pooler="mean", head="mlp", num_labels=3)
    fh.save_head(tmp_path / "ckpt", model)
    out = tmp_path / "pt"
    assert main(["export", "--from", str(tmp_path / "ckpt"), "--format", "transformers", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "flaxheads export: error:" in err and "format='head'" in err
    assert not out.exists()
    assert main(["export", "--from", str(tmp_path / "nope"), "--format", "head", "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()


def test_checkpoint_whose_backbone_folder_moved_needs_backbone_option(src, tmp_path, capsys):
    import shutil

    moved = shutil.copytree(src, tmp_path / "bb")
    model = fh.load_transformers(moved)
    fh.save_head(tmp_path / "ckpt", model)
    shutil.rmtree(moved)
    out = tmp_path / "pt"
    assert main(["export", "--from", str(tmp_path / "ckpt"), "--format", "transformers", "--out", str(out)]) == 2
    assert "--backbone" in capsys.readouterr().err and not out.exists()
    assert main(["export", "--from", str(tmp_path / "ckpt"), "--format", "transformers", "--out", str(out),
                 "--backbone", str(src)]) == 0
    ids, mask = padded_batch("electra", model.backbone.config)
    np.testing.assert_allclose(_pt_logits(out, ids, mask), np.asarray(model(jnp.asarray(ids), jnp.asarray(mask))),
                               atol=1e-4, rtol=0)
