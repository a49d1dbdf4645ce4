"""Chat-template pairs (issue 58, item 3): flaxheads' rendering equals transformers' apply_chat_template."""

from __future__ import annotations

import os
import shutil

import pytest

# bos / eos variables, a system turn read apart, loop.last, a tojson of non-ASCII text, whitespace control,
# {% generation %}, raise_exception on a role the template does not know
TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}{% set messages = messages[1:] %}
{%- else %}{% set system = 'You are a judge.' %}{% endif %}
<|system|>{{ system }}{{ eos_token }}
{% for m in messages %}
  {% if m['role'] not in ('user', 'assistant') %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}
  <|{{ m['role'] }}|>
  {%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}
  {%- else %}{{ m['content'] }} {{ m['content'] | tojson }}{% endif %}{{ eos_token }}
  {% if loop.last and add_generation_prompt %}<|assistant|>{% endif %}
{% endfor %}"""

PAIRS = [("What is 2 + 2?", " 4 "), ("Écris « bonjour »", "bonjour\nau revoir")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from chat_helpers import word_tokenizer

    words = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(40)]
    fast = word_tokenizer(words, TEMPLATE, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    path = tmp_path_factory.mktemp("chat_tokenizer")
    fast.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("system", [None, "Rate the answer."])
def test_chat_pairs_equal_apply_chat_template(folder, system):
    from transformers import AutoTokenizer

    from flaxheads.data.chat import chat_pairs, has_chat_template

    tok = AutoTokenizer.from_pretrained(folder)
    head = [{"role": "system", "content": system}] if system is not None else []
    want = [
        tok.apply_chat_template(
            head + [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
        )
        for p, r in PAIRS
    ]
    assert has_chat_template(folder)
    assert chat_pairs(folder, PAIRS, system=system) == want
    assert "<s><|system|>" in want[0] and "\\u00c9" not in want[1]  # the template ran, tojson kept the accent


def test_render_chat_generation_prompt_and_errors(folder, tmp_path):
    from transformers import AutoTokenizer

    from flaxheads.data.chat import ChatTemplateError, chat_pairs, read_chat_template, render_chat

    template, special = read_chat_template(folder)
    messages = [{"role": "user", "content": "hi"}]
    want = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert render_chat(messages, template, special, add_generation_prompt=True) == want
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        render_chat([{"role": "tool", "content": "x"}], template, special)
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        chat_pairs(tmp_path, PAIRS)


def test_rank_preference_writes_pairs_in_the_chat_template(folder, tmp_path, capsys):
    """``flaxheads rank --preference`` on a reward model whose tokenizer has a chat template: each (prompt,
    response) scored as the conversation transformers' apply_chat_template writes (auto: on), tokenised as it is."""
    import json

    import numpy as np
    from hf_tiny import save_tiny
    from transformers import AutoTokenizer

    import flaxheads as fh
    from flaxheads.cli.main import main

    rm, _ = save_tiny(tmp_path / "rm", "qwen3", num_labels=1, layers=1)
    for name in os.listdir(folder):
        shutil.copy(os.path.join(folder, name), rm)
    rows = [
        {"prompt": "w1 w2", "chosen": "w3 w4 w5", "rejected": "w6"},
        {"prompt": "w7", "chosen": "w8", "rejected": "w9 w10"},
    ]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scored = {}
    for mode in ("auto", "off"):
        out = tmp_path / f"{mode}.jsonl"
        code = main(
            [
                "rank",
                rm,
                "--input",
                str(prefs),
                "--preference",
                "--chat-template",
                mode,
                "--output",
                str(out),
                "--no-progress",
            ]
        )
        assert code == 0, capsys.readouterr().err
        scored[mode] = [json.loads(line) for line in out.read_text().splitlines()]
    tok, model = AutoTokenizer.from_pretrained(rm), fh.from_pretrained(rm)
    for r, got in zip(rows, scored["auto"]):
        for key in ("chosen", "rejected"):
            text = tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[key]}], tokenize=False
            )
            ids = np.asarray([tok(text, add_special_tokens=False)["input_ids"]])
            ref = float(np.asarray(model.apply(model.params, ids, np.ones_like(ids)))[0, 0])
            assert abs(got[f"{key}_score"] - ref) < 1e-5
    assert any(abs(a["chosen_score"] - b["chosen_score"]) > 1e-4 for a, b in zip(scored["auto"], scored["off"]))
