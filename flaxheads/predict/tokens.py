"""Tokens one at a time and outputs at every token: what a server's ``/tokenize``, ``/decode``
and ``/embed_all`` answer.

:class:`TokenView`: a text's tokens, each with its id, its text, whether it is special and where
it sits in the text (byte offsets, as text-embeddings-inference gives them); ids back to text;
and the tokenizer's vocabulary size, which token ids sent by a client are checked against.

:class:`TokenOutputs`: the backbone's last hidden state at every token of each text (no pooling,
no head), compiled once per padded shape it meets.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.data.batching import bucket_length, extra_inputs, token_batch


class TokenView:
    """Token-level reads of a :class:`~flaxheads.interop.tokenizers.Tokenizer`, on a copy of its
    backend with neither truncation nor padding (the tokenizer's own backend changes those
    settings per call; this copy never does, so it needs no lock of its own for them)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend", None)
        hf = getattr(tokenizer, "hf_tokenizer", None)
        if backend is None and hf is not None and getattr(hf, "is_fast", False):
            backend = hf.backend_tokenizer
        self.hf = hf if backend is None else None  # a slow transformers tokenizer: no offsets
        self.backend = None
        if backend is not None:
            from tokenizers import Tokenizer as Backend

            self.backend = Backend.from_str(backend.to_str())
            self.backend.no_truncation()
            self.backend.no_padding()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        """How many token ids the tokenizer knows (added tokens included): ids go from 0 to this minus one."""
        if self.backend is not None:
            return int(self.backend.get_vocab_size(with_added_tokens=True))
        return len(self.hf)

    def check_ids(self, ids: Sequence[int] | np.ndarray) -> str | None:
        """None when every id is a token of the vocabulary, else what is wrong (the first bad one)."""
        n = self.vocab_size
        for i, x in enumerate(ids):
            if not 0 <= int(x) < n:
                return f"[{i}] = {x} is not a token id of this tokenizer (ids go from 0 to {n - 1})"
        return None

    def tokens(self, text: str, *, add_special_tokens: bool = True) -> list[dict]:
        """``[{"id", "text", "special", "start", "stop"}]``: a special token's text is the token
        itself and its offsets are None; another token's text is its span of ``text``, ``start`` /
        ``stop`` its byte offsets in ``text``'s UTF-8."""
        if self.backend is None:
            return self._slow_tokens(text, add_special_tokens)
        with self._lock:
            enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        out = []
        for tid, token, special, (start, stop) in zip(enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets):
            if special:
                out.append({"id": int(tid), "text": token, "special": True, "start": None, "stop": None})
            else:
                b0 = len(text[:start].encode("utf-8"))
                out.append(
                    {
                        "id": int(tid),
                        "text": text[start:stop],
                        "special": False,
                        "start": b0,
                        "stop": b0 + len(text[start:stop].encode("utf-8")),
                    }
                )
        return out

    def _slow_tokens(self, text: str, add_special_tokens: bool) -> list[dict]:
        enc = self.hf(text, add_special_tokens=add_special_tokens, return_special_tokens_mask=True)
        ids = enc["input_ids"]
        names = self.hf.convert_ids_to_tokens(ids)
        special = enc.get("special_tokens_mask") or [0] * len(ids)
        return [
            {"id": int(i), "text": t, "special": bool(s), "start": None, "stop": None}
            for i, t, s in zip(ids, names, special)
        ]

    def ids(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``."""
        if self.backend is None:
            return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])
        with self._lock:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        """``ids`` as text (check them first with :meth:`check_ids`)."""
        ids = [int(x) for x in ids]
        if self.backend is None:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        with self._lock:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


class TokenOutputs:
    """``model``'s backbone on ``params``: the last hidden state ``[T_i, H]`` float32 at each
    text's ``T_i`` tokens. Texts run in batches of one padded length (the smallest of ``buckets``
    that holds them) and a power-of-two row count at most ``max_rows``; each such shape compiles
    once, the first time it is met (:attr:`compiles` counts them)."""

    def __init__(
        self, model, params, *, buckets: Sequence[int], pad_id: int, max_rows: int = 32, max_tokens: int | None = None
    ):
        self.model = model
        self.params = jax.device_put(params)
        self.buckets = tuple(int(b) for b in buckets)
        self.pad_id = int(pad_id)
        self.max_rows, self.max_tokens = max(1, int(max_rows)), max_tokens

        def hidden(p, batch):
            h, _ = model.features(
                model.backbone_params(p), batch["input_ids"], batch["attention_mask"], **extra_inputs(batch)
            )
            return h.astype(jnp.float32)

        self.program = jax.jit(hidden)

    @property
    def compiles(self) -> int:
        size = getattr(self.program, "_cache_size", None)
        return int(size()) if callable(size) else -1

    def _rows_cap(self, length: int) -> int:
        cap = self.max_rows if self.max_tokens is None else min(self.max_rows, max(1, self.max_tokens // length))
        return 1 << (cap.bit_length() - 1)

    def __call__(
        self, input_ids: Sequence[np.ndarray], token_type_ids: Sequence[np.ndarray] | None = None
    ) -> list[np.ndarray]:
        """One ``[len(input_ids[i]), H]`` array per text, in order."""
        out: list[np.ndarray | None] = [None] * len(input_ids)
        lengths = [bucket_length(len(x), self.buckets) for x in input_ids]
        for length in sorted(set(lengths)):
            idx = [i for i, n in enumerate(lengths) if n == length]
            cap = self._rows_cap(length)
            for k in range(0, len(idx), cap):
                chunk = idx[k : k + cap]
                rows = min(cap, 1 << (len(chunk) - 1).bit_length())
                batch = token_batch(input_ids, token_type_ids, chunk, rows, length, self.pad_id)
                hidden = np.asarray(self.program(self.params, batch))
                for r, i in enumerate(chunk):
                    out[i] = hidden[r, : len(input_ids[i])].copy()
        return out  # type: ignore[return-value]
