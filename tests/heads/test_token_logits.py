"""LLM rerankers scored from two tokens' logits (TokenLogits): a tiny random Qwen3 causal LM built with
transformers' Qwen3ForCausalLM is the reference; its seq-cls export loads in Qwen3ForSequenceClassification."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")

WORDS = [
    "<pad>",
    "<bos>",
    "<eos>",
    "<unk>",
    "no",
    "yes",
    "maybe",
    "<|im_start|>",
    "<|im_end|>",
    "system",
    "user",
    "assistant",
    "<think>",
    "</think>",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _save_tokenizer(path: str) -> None:
    """A word-level fast tokenizer of hf_tiny's vocabulary size (:data:`WORDS`, then ``w<i>``), with a chat template."""
    from chat_helpers import word_tokenizer
    from hf_tiny import V

    fast = word_tokenizer(
        WORDS + [f"w{i}" for i in range(V - len(WORDS))], CHAT_TEMPLATE, pad_token="<pad>", eos_token="<eos>"
    )
    fast.save_pretrained(path)


def _causal_lm(path, tied: bool):
    import torch
    from hf_tiny import tiny_config
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(3)
    cfg = tiny_config("qwen3", num_labels=2, layers=1)
    cfg.tie_word_embeddings = tied
    pt = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in pt.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pt.eval().save_pretrained(path, safe_serialization=True)
    _save_tokenizer(str(path))
    return str(path), pt


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    """``lms(tied) -> (folder, Qwen3ForCausalLM)``, each made once."""
    made = {}

    def get(tied: bool):
        if tied not in made:
            made[tied] = _causal_lm(tmp_path_factory.mktemp(f"qwen3_lm_{'tied' if tied else 'untied'}"), tied)
        return made[tied]

    return get


@pytest.fixture(params=["untied", "tied"])
def lm(request, lms):
    return lms(request.param == "tied")


@pytest.fixture
def untied(lms):
    return lms(False)


def _batch(side: str):
    from hf_tiny import padded_batch, tiny_config

    return padded_batch("qwen3", tiny_config("qwen3"), side)


def _torch_last_logits(pt, ids, mask):
    import torch

    with torch.no_grad():
        logits = pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    last = np.where(mask.astype(bool), np.arange(mask.shape[1]), -1).max(axis=1)  # the last non-pad position
    return logits[np.arange(len(ids)), last]


@pytest.mark.parametrize("side", ["right", "left"])
def test_scores_are_the_two_tokens_logit_difference(lm, side):
    import flaxheads as fh

    path, pt = lm
    model = fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "yes")))
    assert model.num_labels == 1 and model.arch == "qwen3" and model.report.new == []
    assert model.report.pretrained == [("head/classifier", "lm_head['yes'] - lm_head['no']")]
    ids, mask = _batch(side)
    ref = _torch_last_logits(pt, ids, mask)
    yes, no = WORDS.index("yes"), WORDS.index("no")
    ours = np.asarray(model.apply(model.params, ids, mask))[:, 0]
    np.testing.assert_allclose(ours, ref[:, yes] - ref[:, no], atol=1e-5, rtol=0)
    # sigmoid(score) is the 2-way softmax's "yes" (log-softmax difference of the same two logits)
    two = ref[:, [no, yes]] - ref[:, [no, yes]].max(axis=1, keepdims=True)
    p_yes = np.exp(two[:, 1]) / np.exp(two).sum(axis=1)
    np.testing.assert_allclose(1 / (1 + np.exp(-ours)), p_yes, atol=1e-6, rtol=0)
    assert np.abs(ours).max() > 1e-2


def test_n_tokens_give_their_logits(untied):
    import flaxheads as fh

    path, pt = untied
    head = fh.heads.TokenLogits(tokens=("no", "yes", WORDS.index("maybe")), two_way=False)
    model = fh.from_pretrained(path, head=head)
    ids, mask = _batch("left")
    ref = _torch_last_logits(pt, ids, mask)[:, [WORDS.index(w) for w in ("no", "yes", "maybe")]]
    np.testing.assert_allclose(np.asarray(model.apply(model.params, ids, mask)), ref, atol=1e-5, rtol=0)


def test_seq_cls_export_loads_in_transformers_with_the_same_scores(lm, tmp_path):
    import torch
    from transformers import Qwen3ForSequenceClassification

    import flaxheads as fh
    from flaxheads.interop.transformers import export_transformers

    path, _ = lm
    model = fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "yes")))
    out = export_transformers(model, tmp_path / "seq_cls")
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"] and cfg["num_labels"] == 1
    pt, info = Qwen3ForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids, mask = _batch("right")
    with torch.no_grad():
        ref = pt.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.apply(model.params, ids, mask)), ref, atol=1e-5, rtol=0)
    back = fh.load(out)  # flaxheads reads it back as the qwen3 preset
    assert back.arch == "qwen3" and back.num_labels == 1
    np.testing.assert_allclose(np.asarray(back.apply(back.params, ids, mask)), ref, atol=1e-5, rtol=0)


def test_config_json_round_trip_and_refusals(untied, tiny_model):
    import flaxheads as fh
    from flaxheads import config
    from flaxheads.errors import ConfigError, FlaxheadsError
    from flaxheads.heads.token_logits import TokenLogitsError

    head = fh.heads.TokenLogits(tokens=("0", "1"), template="qwen3-reranker")
    assert config.from_json(config.to_json(head)) == head and head.num_labels == 1
    assert config.from_json(config.to_json(fh.heads.TokenLogits(tokens=(3, 4, 5), two_way=False))).num_labels == 3
    with pytest.raises(ConfigError, match="two tokens"):
        fh.heads.TokenLogits(tokens=("a", "b", "c"))
    with pytest.raises(ConfigError, match="unknown prompt template"):
        fh.heads.TokenLogits(template="nope")
    path, _ = untied
    with pytest.raises(TokenLogitsError, match="not one token"):
        fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "yes no")))
    with pytest.raises(TokenLogitsError, match="not in this tokenizer's vocabulary"):
        fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "zebra")))
    with pytest.raises(TokenLogitsError, match="outside the LM head"):
        fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=(0, 10_000)))
    bert = tiny_model("bert").path
    with pytest.raises(TokenLogitsError, match="not a decoder LM") as e:
        fh.from_pretrained(bert, head=fh.heads.TokenLogits(tokens=(4, 5)))
    assert isinstance(e.value, FlaxheadsError)
    seq_cls = tiny_model("qwen3", layers=1).path
    with pytest.raises(TokenLogitsError, match="sequence classifier"):
        fh.from_pretrained(seq_cls, head=fh.heads.TokenLogits(tokens=(4, 5)))


def test_qwen3_reranker_template():
    from flaxheads.heads.templates import get_template, render_pairs

    t = get_template("qwen3-reranker")
    [text] = render_pairs("qwen3-reranker", [("what is {query}?", "a {document}")])
    assert text.startswith("<|im_start|>system\nJudge whether the Document meets the requirements")
    assert f"<Instruct>: {t.instruction}\n<Query>: what is {{query}}?\n<Document>: a {{document}}<|im_end|>" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<Instruct>: Find code\n" in t.render("q", "d", instruction="Find code") and t.tokens == ("no", "yes")


def test_mxbai_rerank_v2_template():
    """mxbai-rerank-v2's prompt as its own package (mxbai_rerank 0.1.6, MxbaiRerankV2) joins it: chat prefix,
    ``query: q``, separator, ``document: d``, separator, the task prompt, chat suffix; answers "0" / "1"."""
    from flaxheads.heads.templates import get_template, render_pairs
    from flaxheads.heads.token_logits import reranker_head

    prefix = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    prefix += "<|im_start|>user\n"
    task = (
        "You are a search relevance expert who evaluates how well documents match search queries. For each "
        "query-document pair, carefully analyze the semantic relationship between them, then provide your "
        "binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"
    )
    pairs = [("Who wrote {query}?", "Harper Lee, in 1960"), ("q", "")]
    want = [
        prefix + f"query: {q}" + "\n" + f"document: {d}" + "\n" + task + "<|im_end|>\n<|im_start|>assistant\n"
        for q, d in pairs
    ]
    assert render_pairs("mxbai-rerank-v2", pairs) == want
    head = reranker_head("mxbai-rerank-v2")
    assert head.tokens == ("0", "1") and head.two_way and head.template == get_template("mxbai-rerank-v2").name


def test_classifier_scores_pairs_in_the_heads_template(untied):
    import flaxheads as fh
    from flaxheads.heads.templates import render_pairs
    from flaxheads.predict import Classifier

    path, _ = untied
    model = fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "yes"), template="qwen3-reranker"))
    clf = Classifier.from_model(model, path, max_length=64, buckets=(64,))
    pairs = [("w10 w11", "w12 w13 w14"), ("w20", "yes no w21")]
    scores = clf.outputs([q for q, _ in pairs], [d for _, d in pairs])[0][:, 0]
    texts = render_pairs("qwen3-reranker", pairs)
    assert np.array_equal(clf.outputs(texts)[0][:, 0], scores)  # the pair is scored as its prompt's one text
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(os.path.join(path, "tokenizer.json")).encode(texts[1], add_special_tokens=False).ids
    ref = np.asarray(model.apply(model.params, np.asarray([ids]), np.ones((1, len(ids)), np.int32)))[0, 0]
    np.testing.assert_allclose(scores[1], ref, atol=1e-5, rtol=0)


def test_serve_rerank_answers_with_the_rerankers_scores(untied):
    pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e .[serve])")
    import httpx

    import flaxheads as fh
    from flaxheads.predict import Classifier
    from flaxheads.serve import ServeSettings, create_app

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve"))
    from serve_helpers import serving

    path, _ = untied
    model = fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "yes"), template="qwen3-reranker"))
    clf = Classifier.from_model(model, path, max_length=64, buckets=(64,))
    query, docs = "w10 w11", ["w12 w13", "yes", "no w14 w15"]
    ranked = clf.rank(query, docs)
    with serving(create_app(clf, ServeSettings(max_batch_size=4, max_wait_ms=20))) as url:
        got = httpx.post(f"{url}/rerank", json={"query": query, "texts": docs, "raw_scores": True}).json()
    assert [d["index"] for d in got] == [d["index"] for d in ranked]
    np.testing.assert_allclose([d["score"] for d in got], [d["score"] for d in ranked], atol=1e-5)


def test_lora_trains_the_reranker_as_the_preset(untied):
    import jax
    import jax.numpy as jnp

    import flaxheads as fh

    path, _ = untied
    model = fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "yes"))).with_lora(rank=2)
    ids, mask = _batch("left")
    base = np.asarray(model.apply(model.params, ids, mask))  # LoRA's B starts at zero: the base's scores
    plain = fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "yes")))
    np.testing.assert_allclose(base, np.asarray(plain.apply(plain.params, ids, mask)), atol=1e-6, rtol=0)
    g = jax.grad(lambda p: jnp.sum(model.apply(p, ids, mask)))(model.params)
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g["lora"]))
    assert float(jnp.abs(g["head"]["head"]["classifier"]["kernel"]).max()) > 0


def test_a_long_document_is_cut_so_the_prompt_keeps_its_end(untied):
    import flaxheads as fh
    from flaxheads.heads.templates import get_template
    from flaxheads.predict import Classifier
    from flaxheads.predict.batches import TruncationWarning

    path, _ = untied
    model = fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "yes"), template="qwen3-reranker"))
    clf = Classifier.from_model(model, path, max_length=64, buckets=(64,))
    query, doc = "w10 w11", " ".join(f"w{20 + i % 50}" for i in range(100))
    with pytest.warns(TruncationWarning, match="1 of 1 documents were cut at their end"):
        [text] = clf.prompts_of([query], [doc])
    n = len(clf.tokenizer([text], None, truncation=False, padding=False)["input_ids"][0])
    assert 55 < n <= 64 and text.endswith(get_template("qwen3-reranker").text.split("{document}")[1])
    with pytest.warns(TruncationWarning):
        score = clf.outputs([query], [doc])[0]
    np.testing.assert_array_equal(score, clf.outputs([text])[0])


# ---- training a token-logit reranker (flaxheads train --head token-logits) -------------------------------
def _preferences(path, n: int, seed: int) -> str:
    """prompt / chosen / rejected rows of the tokenizer's words: the chosen response shares the prompt's words."""
    import csv

    rng = np.random.default_rng(seed)
    topics = [[f"w{i}" for i in range(10 + 6 * t, 16 + 6 * t)] for t in range(4)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "chosen", "rejected"])
        w.writeheader()
        for _ in range(n):
            a, b = rng.choice(len(topics), 2, replace=False)
            words = lambda t, k: " ".join(rng.choice(topics[t], k))  # noqa: E731
            w.writerow({"prompt": words(a, 3), "chosen": words(a, 4), "rejected": words(b, 4)})
    return str(path)


@pytest.mark.full
def test_train_token_logits_reranker_from_the_command_line(untied, tmp_path, capsys):
    """``flaxheads train --head token-logits`` fine-tunes a causal LM as a Qwen3-Reranker-style reranker: the
    run trains on each (query, document) written in the qwen3-reranker prompt, and what it saved scores
    pairs as PyTorch's ``Qwen3ForSequenceClassification`` of its transformers export does on those prompts'
    tokens (1e-5); the run's own test scores (training's evaluation) are ``flaxheads rank``'s (serving's)."""
    import csv

    import torch
    from transformers import AutoTokenizer, Qwen3ForSequenceClassification

    import flaxheads as fh
    from flaxheads.cli.main import main
    from flaxheads.heads.templates import render_pairs
    from flaxheads.predict import Classifier

    path, _ = untied
    files = {n: _preferences(tmp_path / f"{n}.csv", k, s) for n, k, s in (("train", 8, 0), ("test", 4, 1))}
    out = tmp_path / "run"
    argv = ["train", "--model", path, "--head", "token-logits", "--objective", "pairwise"]
    argv += ["--train-file", files["train"], "--test-file", files["test"], "--batch-size", "4", "--max-steps", "2"]
    argv += ["--lr", "1e-3", "--max-length", "64", "--bucket-step", "64", "--no-progress", "--output-dir", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    model = fh.load(out)
    head = model.head.head
    assert isinstance(head, fh.TokenLogits) and head.template == "qwen3-reranker" and head.tokens == ("no", "yes")
    with open(files["test"]) as f:
        pairs = [(r["prompt"], r[k]) for r in csv.DictReader(f) for k in ("chosen", "rejected")]
    scores = Classifier.from_pretrained(str(out)).score(pairs)
    np.testing.assert_allclose(np.load(out / "predictions.npz")["test_scores"], scores, atol=1e-5)
    flat = tmp_path / "pairs.csv"
    flat.write_text("query,passage\n" + "".join(f"{q},{p}\n" for q, p in pairs))
    assert (
        main(["rank", str(out), "--input", str(flat), "--output", str(tmp_path / "ranked.csv"), "--no-progress"]) == 0
    )
    with open(tmp_path / "ranked.csv") as f:
        np.testing.assert_allclose([float(r["score"]) for r in csv.DictReader(f)], scores, atol=1e-5)
    exported = fh.export(model, tmp_path / "seq_cls", tokenizer_from=path)
    pt = Qwen3ForSequenceClassification.from_pretrained(exported).eval()
    tok = AutoTokenizer.from_pretrained(path)
    start = fh.from_pretrained(path, head=fh.heads.TokenLogits(tokens=("no", "yes")))
    moved = []
    for text, score in zip(render_pairs("qwen3-reranker", pairs), scores):
        ids = np.asarray([tok(text)["input_ids"]])
        with torch.no_grad():
            ref = pt(input_ids=torch.tensor(ids), attention_mask=torch.ones_like(torch.tensor(ids))).logits[0, 0]
        np.testing.assert_allclose(score, float(ref), atol=1e-5)
        moved.append(abs(score - float(np.asarray(start.apply(start.params, ids, np.ones_like(ids)))[0, 0])))
    assert max(moved) > 1e-4  # the saved model is the trained one, not the causal LM it started from
    with pytest.raises(fh.FlaxheadsError, match="ranking --objective"):
        fh.train(model=path, head="token-logits", train_file=files["train"], output_dir=str(tmp_path / "no"))
