"""The batcher's choice of the next batch (flaxheads.serve.batcher.pick) on random queues: the oldest
text always goes, texts go oldest first, every text goes exactly once, and a batch never pads to
more tokens per text than padding every text to the longest (the rule before)."""

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed (pip install -e .[serve])")

from flaxheads.serve.batcher import Shapes, pick  # noqa: E402

SHAPES = Shapes((8, 16, 32, 64), max_batch_tokens=1024, max_batch_size=32)


def _tokens_per_text_padding_to_the_longest(lengths: list[int]) -> float:
    """Oldest first, each text while the batch stays within the cap of its longest length."""
    n, longest = 0, 0
    for x in lengths:
        if n < SHAPES.cap(max(longest, x)):
            n, longest = n + 1, max(longest, x)
    return SHAPES.rows(n, longest) * longest / n


def test_short_texts_do_not_pad_to_a_long_one():
    queue = [16, 32, 16, 16, 16, 16, 16, 16, 16, 32]
    assert pick(queue, SHAPES) == (16, {0, 2, 3, 4, 5, 6, 7, 8})  # 8 texts, 8 rows of 16, no padding row
    assert pick([32] + queue, SHAPES) == (32, set(range(11)))  # a long oldest text: everything fits with it


def test_random_queues_are_drained_oldest_first_exactly_once():
    rng = np.random.default_rng(0)
    for _ in range(300):
        queue = list(enumerate(rng.choice(SHAPES.buckets, size=int(rng.integers(1, 80)), p=[0.3, 0.4, 0.2, 0.1])))
        seen = []
        while queue:
            lengths = [int(x) for _, x in queue]
            length, take = pick(lengths, SHAPES)
            assert 0 in take and len(take) <= SHAPES.cap(length)
            assert all(lengths[i] <= length for i in take)
            # no text that fits is passed over for a younger one
            left = [i for i in range(len(lengths)) if i not in take and lengths[i] <= length]
            assert not left or len(take) == SHAPES.cap(length) and min(left) > max(take)
            assert (
                SHAPES.rows(len(take), length) * length / len(take)
                <= _tokens_per_text_padding_to_the_longest(lengths) + 1e-9
            )
            seen += [queue[i][0] for i in sorted(take)]
            queue = [q for i, q in enumerate(queue) if i not in take]
        assert sorted(seen) == list(range(len(seen)))
