"""Model folders broken the way a download that stopped or a hand edit breaks them: weights cut at
several offsets or overwritten in the header, ``config.json`` invalid or missing any one key, damaged
tokenizer files. Every one either still loads (a key with a default) or raises a ``FlaxheadsError``
naming the file and what to do; no other exception, and ``flaxheads train`` says it in one line."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from hf_tiny import tiny_torch_model

from flaxheads import from_pretrained
from flaxheads.errors import FlaxheadsError
from flaxheads.interop.tokenizers import load_tokenizer

pytestmark = pytest.mark.full

FAMILIES = ("bert", "roberta", "distilbert", "albert", "electra", "gpt2", "bart", "deberta-v2", "modernbert", "llama")
#: Keys without which a family's weights cannot be laid out (the error names the key; where a family has
#: transformers' defaults for a key, the weights' shapes then disagree with config.json, and it says so).
NEEDED = {"bert": ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")}


def _copy(src, dst):
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return str(dst)


def _fails_cleanly(load, path, *names) -> str:
    """``load(path)`` raises a FlaxheadsError with a one-line message that names ``names``."""
    with pytest.raises(FlaxheadsError) as e:
        load(path)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    return msg


def _load(path):
    return from_pretrained(path, num_labels=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_broken_model_folder(tmp_path, family):
    good = str(tmp_path / "good")
    tiny_torch_model(family).save_pretrained(good, safe_serialization=True)
    weights = os.path.join(good, "model.safetensors")
    size = os.path.getsize(weights)
    for cut in (0, 5, size // 2, size - 1):  # empty, inside the length, inside the tensors, one byte short
        d = _copy(good, tmp_path / "cut")
        os.truncate(os.path.join(d, "model.safetensors"), cut)
        _fails_cleanly(_load, d, os.path.join(d, "model.safetensors"), "download the model again")
    for at in (0, 8, 40):  # the header's length, its first bytes, inside its JSON
        d = _copy(good, tmp_path / "damaged")
        with open(os.path.join(d, "model.safetensors"), "r+b") as f:
            f.seek(at)
            f.write(b"\xff\x00{garbage")
        _fails_cleanly(_load, d, os.path.join(d, "model.safetensors"), "download the model again")
    for text in ('{"model_type": "bert", ', "[1, 2]"):
        d = _copy(good, tmp_path / "json")
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write(text)
        _fails_cleanly(_load, d, os.path.join(d, "config.json"), "download config.json again")
    config = json.load(open(os.path.join(good, "config.json")))
    for key in sorted(config):
        d = _copy(good, tmp_path / "drop")
        json.dump({k: v for k, v in config.items() if k != key}, open(os.path.join(d, "config.json"), "w"))
        try:
            _load(d)
        except FlaxheadsError as e:
            assert "\n" not in str(e) and d in str(e), str(e)
            if key in NEEDED.get(family, ()) or key == "model_type":
                assert f"config.json has no '{key}'" in str(e), str(e)
        else:
            assert key not in NEEDED.get(family, ()) and key != "model_type", f"loaded without {key}"


@pytest.fixture(scope="module")
def tokenizer_folder(tiny_bert):  # each test breaks a copy
    return tiny_bert


@pytest.mark.parametrize(
    "case",
    [
        "tokenizer.json cut",
        "tokenizer.json garbage",
        "tokenizer_config.json invalid",
        "vocab.txt garbage",
        "vocab.txt empty",
    ],
)
def test_broken_tokenizer_files(tmp_path, tokenizer_folder, case):
    d = _copy(tokenizer_folder, tmp_path / "tok")
    name = case.split()[0]
    path = os.path.join(d, name)
    if case.endswith("cut"):
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    else:
        open(path, "wb").write(
            {"garbage": b"\xff\xfe\x00\x01" * 50, "invalid": b"{ bad", "empty": b""}[case.split()[1]]
        )
    if name == "vocab.txt":  # read only when there is no tokenizer.json
        os.remove(os.path.join(d, "tokenizer.json"))
    _fails_cleanly(lambda p: load_tokenizer(p)("hello world"), d, name if name != "vocab.txt" else d, "again")


def test_train_on_a_cut_download_is_one_line(tmp_path, tokenizer_folder, capfd):
    from flaxheads.cli.main import main

    d = _copy(tokenizer_folder, tmp_path / "cut")
    os.truncate(os.path.join(d, "model.safetensors"), 1000)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "".join(f"w{i} w{i + 1},c{i % 2}\n" for i in range(20)))
    code = main(["train", "--model", d, "--data", str(data), "--output-dir", str(tmp_path / "run"), "--no-progress"])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {d}/model.safetensors: ") and "download the model again" in err[0]
