"""``--chat-template`` on ``flaxheads predict`` and ``flaxheads serve`` (as on ``rank``; one flag and one
decision, :meth:`flaxheads.predict.Classifier.wants_chat_template`): a reward model's (prompt, response) pairs are
scored as the conversation transformers' ``apply_chat_template`` writes, tokenised as it is (no special
tokens added), by the command line, ``Classifier.predict`` and the server's ``/predict`` and ``/rerank``."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("jinja2")

# bos / eos variables, a default system turn, whitespace control, a generation prompt never asked for here
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|system|>w30{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
ROWS = [("w1 w2", "w3 w4 w5"), ("w7", " w8 "), ("w9 w10 w11", "w12")]


@pytest.fixture(scope="module")
def reward_model(tiny_model, tmp_path_factory):
    """A tiny one-output Qwen3 classifier with a word-level tokenizer that has a chat template."""
    from chat_helpers import word_tokenizer

    folder = str(tmp_path_factory.mktemp("reward_model") / "rm")
    shutil.copytree(tiny_model("qwen3", num_labels=1, layers=1).path, folder)
    words = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(40)]
    fast = word_tokenizer(words, TEMPLATE, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return folder


def _reference(folder: str) -> np.ndarray:
    """The model's output on each row's conversation as transformers writes and tokenises it."""
    from transformers import AutoTokenizer

    import flaxheads as fh

    tok, model = AutoTokenizer.from_pretrained(folder), fh.from_pretrained(folder)
    out = []
    for prompt, response in ROWS:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        text = tok.apply_chat_template(messages, tokenize=False)
        assert text.startswith("<s><|system|>w30</s>")  # the template ran
        ids = np.asarray([tok(text, add_special_tokens=False)["input_ids"]])
        out.append(float(np.asarray(model.apply(model.params, ids, np.ones_like(ids)))[0, 0]))
    return np.asarray(out)


def test_predict_chat_template(reward_model, tmp_path, capsys):
    from flaxheads.cli.main import main
    from flaxheads.predict import Classifier

    want = _reference(reward_model)
    table = tmp_path / "pairs.jsonl"
    table.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in ROWS))
    got = {}
    for mode in ("on", "auto"):
        out = tmp_path / f"{mode}.jsonl"
        argv = ["predict", reward_model, "--input", table, "--text-column", "prompt", "--text-pair-column", "response"]
        assert main([str(a) for a in argv + ["--chat-template", mode, "--output", out, "--no-progress"]]) == 0
        got[mode] = np.asarray([json.loads(line)["prediction"] for line in out.read_text().splitlines()])
    np.testing.assert_allclose(got["on"], want, atol=1e-5, rtol=0)
    assert np.abs(got["auto"] - want).max() > 1e-4  # auto: off for predict (the tokenizer's pair encoding)
    clf = Classifier.from_pretrained(reward_model)
    np.testing.assert_allclose(
        clf.predict([p for p, _ in ROWS], [r for _, r in ROWS], chat_template=True).logits[:, 0], want, atol=1e-5
    )
    capsys.readouterr()
    bare = tmp_path / "bare"
    shutil.copytree(reward_model, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["predict", bare, "--input", table, "--text-column", "prompt", "--text-pair-column", "response"]
    assert main([str(a) for a in argv + ["--chat-template", "on"]]) == 2
    err = capsys.readouterr().err.strip()
    assert "--chat-template on" in err and "no chat_template" in err and len(err.splitlines()) == 1


def test_serve_chat_template(reward_model):
    pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e .[serve])")
    import argparse
    import sys

    import httpx

    from flaxheads.cli import flags
    from flaxheads.cli.main import build_parser
    from flaxheads.predict import Classifier
    from flaxheads.serve import ServeSettings, create_app

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve"))
    from serve_helpers import serving

    want = _reference(reward_model)
    args = build_parser().parse_args(["serve", reward_model, "--chat-template", "on"])
    clf = Classifier.from_pretrained(reward_model)
    clf.chat_template = flags.chat_template_wanted(args, clf, reward_model=False)
    assert clf.chat_template and not flags.chat_template_wanted(
        argparse.Namespace(chat_template="auto"), clf, reward_model=False
    )
    with serving(create_app(clf, ServeSettings(max_batch_size=4, max_wait_ms=20))) as url:
        predicted = httpx.post(f"{url}/predict", json={"inputs": [list(r) for r in ROWS], "raw_scores": True}).json()
        query = ROWS[0][0]
        reranked = httpx.post(
            f"{url}/rerank", json={"query": query, "texts": [r for _, r in ROWS], "raw_scores": True}
        ).json()
    np.testing.assert_allclose([p[0]["score"] for p in predicted], want, atol=1e-5, rtol=0)
    same_query = Classifier.from_pretrained(reward_model).outputs(
        [query] * len(ROWS), [r for _, r in ROWS], chat_template=True
    )[0][:, 0]
    np.testing.assert_allclose(
        [d["score"] for d in sorted(reranked, key=lambda d: d["index"])], same_query, atol=1e-5, rtol=0
    )
    np.testing.assert_allclose(same_query[0], want[0], atol=1e-5, rtol=0)


def test_the_decision_from_python(reward_model):
    """``Classifier.wants_chat_template``: auto is on only for a reward model's scores; a bad choice is one line."""
    from flaxheads.errors import UsageError
    from flaxheads.predict import Classifier

    clf = Classifier.from_pretrained(reward_model)
    assert clf.has_chat_template
    assert clf.wants_chat_template("auto", reward_model=True) and not clf.wants_chat_template("auto")
    assert clf.wants_chat_template("on") and not clf.wants_chat_template("off", reward_model=True)
    with pytest.raises(UsageError, match="must be auto, on or off, got 'yes'"):
        clf.wants_chat_template("yes")
