"""Every ```python block of README.md and of each guide (docs/guides/*.md) runs as written.

How the blocks run: each page's blocks in order, in a fresh temporary working folder per page. A block that begins with
``import flaxheads as fh`` starts a new namespace; any other block continues the one before it
(the page says so above each such block). A block whose first line is ``# not run: <why>`` is
shown, not run (what needs several hosts or an accelerator). The model paths a block names are placeholders, and
only these are replaced, each by a tiny random model of that kind (tests/hf_tiny.py) or by a
folder an earlier block wrote:

    path/to/bert-folder, path/to/other-bert-folder, a/BertForSequenceClassification/folder
                                   -> a tiny BERT classifier with its tokenizer
    path/to/qwen2-folder           -> a tiny Qwen2 classifier
    path/to/encoder-folder         -> that BERT's encoder alone (no classifier), with its tokenizer
    a/sentence-transformers/folder, path/to/sentence-transformers
                                   -> that BERT, mean-pooled with a dense layer, exported as sentence-transformers
    runs/news-classifier           -> a run of that BERT on 60 BBC News articles, 4 steps
    runs/my-run                    -> (not replaced) the run folder a block's RunCheckpointer wrote there
"""

from __future__ import annotations

import os
import re

import pytest

pytestmark = [pytest.mark.full, pytest.mark.slow]  # every README and guide example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
GUIDES = os.path.join(ROOT, "docs", "guides")
PAGES = ["README.md"] + sorted(
    f"docs/guides/{name}" for name in (os.listdir(GUIDES) if os.path.isdir(GUIDES) else ()) if name.endswith(".md")
)
NEW_NAMESPACE = "import flaxheads as fh"
NOT_RUN = "# not run:"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory):
    from hf_tiny import tiny_torch_model
    from train_helpers import tiny_bert_folder

    root = tmp_path_factory.mktemp("readme-models")
    bert = tiny_bert_folder(root / "bert", num_labels=5)
    qwen = str(root / "qwen2")
    tiny_torch_model("qwen2").save_pretrained(qwen, safe_serialization=True)
    import shutil

    import flaxheads as fh

    encoder = str(root / "encoder")
    tiny_torch_model("bert", num_labels=5).bert.save_pretrained(encoder, safe_serialization=True)
    for name in os.listdir(bert):
        if name.startswith(("vocab", "tokenizer", "special_tokens")):
            shutil.copy(os.path.join(bert, name), encoder)
    st = fh.interop.export_sentence_transformers(
        fh.from_pretrained(bert, pooler="mean", head="linear", num_labels=5), root / "st"
    )
    run = fh.train(
        model=bert, data="bbc_news", limit=60, max_steps=4, max_length=32, output_dir=str(root / "run"), progress=False
    )
    return {
        "runs/news-classifier": str(run.folder),
        "path/to/encoder-folder": encoder,
        "path/to/bert-folder": bert,
        "path/to/other-bert-folder": bert,
        "a/BertForSequenceClassification/folder": bert,
        "path/to/qwen2-folder": qwen,
        "a/sentence-transformers/folder": st,
        "path/to/sentence-transformers": st,
    }


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, tmp_path, monkeypatch, placeholders):
    blocks = python_blocks(open(os.path.join(ROOT, page)).read())
    if page == "README.md":
        assert len(blocks) >= 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        if code.lstrip().startswith(NOT_RUN):
            continue
        if code.lstrip().startswith(NEW_NAMESPACE):
            namespace = {"__name__": f"block_{i}"}
        for name, path in placeholders.items():
            code = code.replace(f'"{name}"', repr(path))
        try:
            exec(compile(code, f"{page} python block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page} python block {i + 1} fails: {type(e).__name__}: {e}\n{code}") from e
