"""A model folder's tokenizer without transformers: ``tokenizer.json`` through the ``tokenizers`` library.

:func:`load_tokenizer` reads ``tokenizer.json`` plus the settings transformers keeps beside it
(``tokenizer_config.json`` / ``special_tokens_map.json``: pad token, padding and truncation
side, ``model_max_length``, which inputs the model takes, and the BERT normaliser's
``do_lower_case`` / ``strip_accents`` / ``tokenize_chinese_chars``), and gives the ids,
masks and token types transformers' ``AutoTokenizer`` gives for the same folder. Only a
folder without ``tokenizer.json`` goes through ``AutoTokenizer`` (transformers installed).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flaxheads.backbones.registry import family_for
from flaxheads.errors import FlaxheadsError
from flaxheads.interop.files import TOKENIZER_FILES

TOKENIZER_JSON = "tokenizer.json"
#: transformers' "no maximum length" (``model_max_length`` of a tokenizer config that sets none).
VERY_LARGE = int(1e30)
_LARGE = int(1e20)
#: A ``model_max_length`` at or above this says "no limit set" when asking how many tokens a model takes.
UNSET_MAX_LENGTH = 1_000_000
#: Tokenizer classes whose model takes no token types: their ``model_input_names`` are input_ids
#: and attention_mask only.
_NO_TOKEN_TYPES = frozenset(
    {
        "Bart",
        "Barthez",
        "BigBird",
        "Blenderbot",
        "Bloom",
        "Camembert",
        "CLIP",
        "CodeLlama",
        "CodeGen",
        "Cohere",
        "DistilBert",
        "Gemma",
        "GPT2",
        "GPTNeoX",
        "LED",
        "Llama",
        "Longformer",
        "MBart",
        "MBart50",
        "MPNet",
        "Mvp",
        "Nllb",
        "OpenAIGPT",
        "Pegasus",
        "Qwen2",
        "Reformer",
        "Roberta",
        "T5",
        "Whisper",
        "XGLM",
        "XLMRoberta",
    }
)
#: Model types without a native family whose tokenizer takes no token types (a native family says
#: it itself: :attr:`~flaxheads.backbones.base.Backbone.tokenizer_token_types`).
_NO_TOKEN_TYPES_MODEL_TYPES = frozenset({"big_bird", "bloom", "gpt_neox", "led", "longformer", "mbart", "mpnet", "t5"})
_PADDING = ("longest", "max_length", "do_not_pad")
_CONFIG_FILES = (TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


class TokenizerError(FlaxheadsError):
    """A folder without a usable tokenizer, or a tokenizer asked for what it cannot do."""


def _token_str(tok) -> str | None:
    """A special token as saved: a string, or an AddedToken dict (``{"content": ...}``)."""
    return tok.get("content") if isinstance(tok, Mapping) else tok


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{path}: not valid JSON ({e}); download it again, or re-save the tokenizer") from None


def _settings(folder: str) -> dict:
    """tokenizer_config.json with special_tokens_map.json, merged as transformers does: a config that
    lists its ``added_tokens_decoder`` (the current format) is complete; in older ones the map wins."""
    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    if "added_tokens_decoder" in config:
        return config
    return {**config, **_read_json(os.path.join(folder, "special_tokens_map.json"))}


def _takes_token_types(settings: Mapping, folder: str) -> bool:
    """Whether the model takes token types: ``model_input_names`` if saved, else its tokenizer class,
    else its model type's family (:attr:`~flaxheads.backbones.base.Backbone.tokenizer_token_types`)."""
    if settings.get("model_input_names"):
        return "token_type_ids" in settings["model_input_names"]
    cls = str(settings.get("tokenizer_class") or "")
    if cls:
        return cls.removesuffix("Fast").removesuffix("Tokenizer") not in _NO_TOKEN_TYPES
    model_type = _read_json(os.path.join(folder, "config.json")).get("model_type")
    fam = family_for(model_type)
    return fam.tokenizer_token_types if fam is not None else model_type not in _NO_TOKEN_TYPES_MODEL_TYPES


class Tokenizer:
    """Texts (and text pairs) -> ``input_ids`` / ``attention_mask`` (/ ``token_type_ids``) numpy arrays.

    ``tokenizer(texts, pairs=None, max_length=..., padding="longest")`` as transformers'
    ``tokenizer(texts, pairs, truncation=True, max_length=..., padding=True, return_tensors="np")``.
    ``token_type_ids`` come only for models that take them (as transformers does)."""

    def __init__(
        self,
        backend,
        *,
        pad_token: str | None = None,
        pad_token_type_id: int = 0,
        padding_side: str = "right",
        truncation_side: str = "right",
        model_max_length: int = VERY_LARGE,
        token_types: bool = True,
        name_or_path: str = "",
    ):
        for what, side in (("padding_side", padding_side), ("truncation_side", truncation_side)):
            if side not in ("left", "right"):
                raise TokenizerError(f"{name_or_path}: {what} must be 'left' or 'right', got {side!r}")
        self.backend = backend  # a tokenizers.Tokenizer; None for the AutoTokenizer fallback
        self.pad_token = pad_token
        self.pad_token_id = None if pad_token is None or backend is None else backend.token_to_id(pad_token)
        self.pad_token_type_id = int(pad_token_type_id)
        self.padding_side, self.truncation_side = padding_side, truncation_side
        self.model_max_length = int(model_max_length)
        self.model_input_names = (
            ("input_ids", "token_type_ids", "attention_mask") if token_types else ("input_ids", "attention_mask")
        )
        self.name_or_path = name_or_path
        # the backend's truncation and padding are settings of the object: one call at a time sets and uses them
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # copies (deepcopy, pickle) get a lock of their own
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> Tokenizer:
        """The tokenizer of a model folder with a ``tokenizer.json`` (see the module docstring)."""
        from tokenizers import Tokenizer as Backend

        folder = os.fspath(folder)
        settings = _settings(folder)
        path = os.path.join(folder, TOKENIZER_JSON)
        try:
            backend = Backend.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception for a damaged file
            raise TokenizerError(
                f"{path}: not a tokenizer the tokenizers library can read ({str(e)[:200]}); the "
                "file was cut or damaged: download tokenizer.json again"
            ) from None
        _apply_normalizer_settings(backend, settings)
        saved_pad, saved_trunc = backend.padding or {}, backend.truncation or {}
        return cls(
            backend,
            pad_token=_token_str(settings.get("pad_token")) or saved_pad.get("pad_token"),
            pad_token_type_id=saved_pad.get("pad_type_id", 0),
            padding_side=settings.get("padding_side") or saved_pad.get("direction") or "right",
            truncation_side=settings.get("truncation_side") or saved_trunc.get("direction") or "right",
            model_max_length=settings.get("model_max_length") or VERY_LARGE,
            token_types=_takes_token_types(settings, folder),
            name_or_path=folder,
        )

    def __call__(
        self,
        texts: str | Sequence[str],
        pairs: str | Sequence[str] | None = None,
        *,
        max_length: int | None = None,
        truncation: bool = True,
        padding: bool | str = "longest",
        truncation_side: str | None = None,
        add_special_tokens: bool = True,
    ) -> dict[str, Any]:
        """Encode a batch (a lone string is a batch of one), with special tokens (``add_special_tokens=False``:
        without, for texts that already hold them, such as a rendered chat template).

        ``truncation``: longest-first to ``max_length`` (default ``model_max_length``; no
        truncation when that is unset). ``padding``: ``"longest"`` (or True), ``"max_length"``,
        or ``False`` / ``"do_not_pad"``, which returns lists of 1-D arrays of each row's length.
        ``truncation_side``: ``"left"`` or ``"right"`` for this call (default :attr:`truncation_side`).
        Returns int64 arrays ``[batch, length]`` keyed by :attr:`model_input_names`."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if pairs is not None:
            pairs = [pairs] if isinstance(pairs, str) else list(pairs)
            if len(pairs) != len(texts):
                raise TokenizerError(f"{len(texts)} texts but {len(pairs)} text pairs; give one pair per text")
        pad = {True: "longest", False: "do_not_pad"}.get(padding, padding) if isinstance(padding, bool) else padding
        if pad not in _PADDING:
            raise TokenizerError(f"padding must be one of {_PADDING} (or True/False), got {padding!r}")
        if max_length is None and self.model_max_length < _LARGE:
            max_length = self.model_max_length
        if pad == "max_length" and max_length is None:
            raise TokenizerError(
                f"{self.name_or_path}: padding='max_length' needs max_length (the tokenizer "
                "config sets no model_max_length)"
            )
        if pad != "do_not_pad" and self.pad_token is None:
            raise TokenizerError(
                f"{self.name_or_path}: the tokenizer has no pad token, so a batch cannot be "
                "padded; set pad_token in tokenizer_config.json (e.g. to the eos token), or pass "
                "padding=False"
            )
        side = self.truncation_side if truncation_side is None else truncation_side
        if side not in ("left", "right"):
            raise TokenizerError(f"truncation_side must be 'left' or 'right', got {side!r}")
        with self._lock:
            out = self._encode(
                texts,
                pairs,
                max_length if truncation else None,
                None if pad == "do_not_pad" else max_length if pad == "max_length" else 0,
                side,
                add_special_tokens,
            )
        if pad == "do_not_pad":
            return {k: [np.asarray(r, np.int64) for r in out[k]] for k in self.model_input_names}
        return {k: np.asarray(out[k], np.int64) for k in self.model_input_names}

    def _encode(
        self,
        texts: list[str],
        pairs: list[str] | None,
        truncate_to: int | None,
        pad_to: int | None,
        side: str,
        add_special_tokens: bool = True,
    ) -> dict[str, list]:
        """Rows per input name; ``pad_to``: None (no padding), 0 (the longest row) or a length; ``side``:
        which end truncation cuts."""
        b = self.backend
        if truncate_to is None:
            b.no_truncation()
        else:
            b.enable_truncation(truncate_to, stride=0, strategy="longest_first", direction=side)
        if pad_to is None:
            b.no_padding()
        else:
            b.enable_padding(
                direction=self.padding_side,
                pad_id=self.pad_token_id,
                pad_type_id=self.pad_token_type_id,
                pad_token=self.pad_token,
                length=pad_to or None,
            )
        encs = b.encode_batch(
            texts if pairs is None else list(zip(texts, pairs)), add_special_tokens=add_special_tokens
        )
        return {
            "input_ids": [e.ids for e in encs],
            "attention_mask": [e.attention_mask for e in encs],
            "token_type_ids": [e.type_ids for e in encs],
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name_or_path!r}, inputs={list(self.model_input_names)}, "
            f"padding_side={self.padding_side!r}, model_max_length={self.model_max_length})"
        )


class TransformersTokenizer(Tokenizer):
    """The same calls through transformers' ``AutoTokenizer`` (folders without ``tokenizer.json``)."""

    def __init__(self, hf_tokenizer, name_or_path: str = ""):
        super().__init__(
            None,
            pad_token=hf_tokenizer.pad_token,
            padding_side=hf_tokenizer.padding_side,
            truncation_side=hf_tokenizer.truncation_side,
            model_max_length=hf_tokenizer.model_max_length,
            token_types="token_type_ids" in hf_tokenizer.model_input_names,
            name_or_path=name_or_path,
        )
        self.hf_tokenizer = hf_tokenizer
        self.pad_token_id = hf_tokenizer.pad_token_id
        self.model_input_names = tuple(
            n for n in hf_tokenizer.model_input_names if n in ("input_ids", "token_type_ids", "attention_mask")
        )

    def _encode(self, texts, pairs, truncate_to, pad_to, side, add_special_tokens=True):
        padding = False if pad_to is None else "max_length" if pad_to else "longest"
        saved, self.hf_tokenizer.truncation_side = self.hf_tokenizer.truncation_side, side
        try:
            return self.hf_tokenizer(
                texts,
                pairs,
                truncation=truncate_to is not None,
                max_length=truncate_to if truncate_to is not None else pad_to or None,
                padding=padding,
                return_token_type_ids=True,
                return_attention_mask=True,
                add_special_tokens=add_special_tokens,
            )
        finally:
            self.hf_tokenizer.truncation_side = saved


def _apply_normalizer_settings(backend, settings: Mapping) -> None:
    """The saved ``do_lower_case`` / ``strip_accents`` / ``tokenize_chinese_chars`` win over
    tokenizer.json's BERT normaliser, as transformers' BERT tokenizers apply them."""
    from tokenizers.normalizers import BertNormalizer

    norm = backend.normalizer
    if not isinstance(norm, BertNormalizer):
        return
    for key, attr in (
        ("do_lower_case", "lowercase"),
        ("strip_accents", "strip_accents"),
        ("tokenize_chinese_chars", "handle_chinese_chars"),
    ):
        if key in settings and getattr(norm, attr) != settings[key]:
            setattr(norm, attr, settings[key])


def model_max_positions(tokenizer, config) -> int | None:
    """The most tokens a model takes: the tokenizer's ``model_max_length`` when it sets one, else
    ``max_position_embeddings`` / ``n_positions`` of the model's config (None: no limit known)."""
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < UNSET_MAX_LENGTH:
        return limit
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(n) if n else None


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a local model folder: from ``tokenizer.json`` (no transformers needed), else
    through transformers' ``AutoTokenizer`` (vocabulary files only; transformers must be installed)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise TokenizerError(f"tokenizer folder {folder!r} does not exist (flaxheads loads local folders only)")
    if os.path.isfile(os.path.join(folder, TOKENIZER_JSON)):
        return Tokenizer.from_folder(folder)
    vocab_files = [f for f in TOKENIZER_FILES if f not in _CONFIG_FILES and os.path.isfile(os.path.join(folder, f))]
    if not vocab_files:
        raise TokenizerError(
            f"{folder}: no tokenizer: expected {TOKENIZER_JSON} or vocabulary files "
            f"({', '.join(f for f in TOKENIZER_FILES if f not in _CONFIG_FILES)}); pass the folder "
            "the tokenizer was saved to"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(
            f"{folder} has no {TOKENIZER_JSON}, and reading its other tokenizer files needs transformers, which "
            "is not installed. Install transformers, or save the tokenizer as tokenizer.json "
            "(`AutoTokenizer.from_pretrained(folder).save_pretrained(folder)` with transformers)."
        ) from None
    try:
        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        hf("a")  # an empty or cut vocabulary loads, and fails on the first text
    except Exception as e:  # OSError / ValueError, or the tokenizers library's bare Exception for a damaged file
        raise TokenizerError(
            f"{folder}: no tokenizer transformers can read ({str(e)[:200]}); its vocabulary files "
            f"({', '.join(vocab_files)}) may be cut or damaged: download them again. A model folder "
            f"needs {TOKENIZER_JSON}, or the vocabulary files of its tokenizer class."
        ) from None
    return TransformersTokenizer(hf, name_or_path=folder)
