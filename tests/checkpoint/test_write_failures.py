"""A checkpoint save that the disk refuses (read-only, full) fails at once with one
:class:`CheckpointWriteError` naming the step, the OS's reason and the step that is kept; the
previous step stays the latest and restores."""

from __future__ import annotations

import errno
import os
import time

import jax
import numpy as np
import pytest
from test_checkpoint import _state, _stub_model

from flaxheads.checkpoint import CheckpointWriteError, RunCheckpointer


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_refused_step_folder_fails_that_save_at_once(tmp_path, monkeypatch, code):
    model = _stub_model()
    st = _state(model)
    ckr = RunCheckpointer(tmp_path, model)
    ckr.save(1, st)
    ckr.wait_until_finished()
    real_mkdir = os.mkdir

    def refuse(path, *a, **k):  # what a disk that went read-only (or full) answers
        if ".orbax-checkpoint-tmp" in os.fspath(path):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", refuse)
    t = time.monotonic()
    with pytest.raises(CheckpointWriteError) as e:
        ckr.save(2, st)
        ckr.wait_until_finished()
    assert time.monotonic() - t < 30  # no wait on Orbax's timeouts (5 minutes and more)
    root = os.path.join(tmp_path, "checkpoints")
    assert str(e.value).startswith(
        f"could not write checkpoint {root}/2: {os.strerror(code)}; the latest complete "
        f"checkpoint is step 1 ({root}/1), intact"
    )
    monkeypatch.undo()
    ckr.close()
    again = RunCheckpointer(tmp_path, model)
    assert again.all_steps() == [1]
    got = again.restore(target_state=_state(model, seed=9))
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(st.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again.close()
