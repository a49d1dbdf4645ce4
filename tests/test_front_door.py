"""The front door: ``import flaxheads as fh`` is cheap and reads nothing of the process, it has at most
50 names, each resolves on first use without a warning, and every top-level name of the release
before still resolves to the same object with a DeprecationWarning saying where it lives now."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import flaxheads as fh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The 92 top-level names of flaxheads 0.2 and the module each came from (frozen: the deprecation
#: promise is about these, whatever the front door becomes).
OLD_NAMES = {
    "flaxheads._version": "__version__",
    "flaxheads.errors": "FlaxheadsError",
    "flaxheads.run": "Run RunSpec train",
    "flaxheads.model.sequence": "LoadReport SequenceModel build_head",
    "flaxheads.backbones.registry": "load_backbone",
    "flaxheads.model.pretrained": "from_pretrained",
    "flaxheads.formats": "FORMATS export load",
    "flaxheads.predict": "Classifier Predictions",
    "flaxheads.heads.describe": "describe",
    "flaxheads.runtime": "ComputePlan",
    "flaxheads.interop": "ExportError ModelImportError export_head export_sentence_transformers export_transformers "
    "import_model load_head_export load_sentence_transformers load_transformers",
    "flaxheads.interop.cross_encoder": "export_cross_encoder",
    "flaxheads.interop.onnx": "export_onnx",
    "flaxheads.interop.peft": "export_peft load_peft",
    "flaxheads.interop.tokenizers": "Tokenizer TokenizerError load_tokenizer",
    "flaxheads.heads.poolers": "AttentionPool Concat DensePooler Pool Pooler SequenceSummary make_pooler",
    "flaxheads.heads.heads": "Head IdentityHead LinearHead MLPHead ProjectionHead SequenceHead make_head",
    "flaxheads.config": "from_dict from_json to_dict to_json",
    "flaxheads.heads.presets": "PRESETS PoolMaskError Preset PresetMatch match_preset preset_for",
    "flaxheads.model.lora": "LoraConfig merge_model",
    "flaxheads.training.memory_plan": "MemoryPlan plan_memory",
    "flaxheads.training.loop": "Callback TrainConfig Trainer fit",
    "flaxheads.training.optim": "OptimConfig",
    "flaxheads.tasks.task": "Classification Task",
    "flaxheads.tasks.ranking.task": "Ranking",
    "flaxheads.losses": "MULTI_LABEL REGRESSION SINGLE_LABEL infer_problem_type loss_fn mean_squared_error "
    "sigmoid_binary_cross_entropy softmax_cross_entropy validate_labels",
    "flaxheads.checkpoint": "CheckpointError CorruptCheckpointError HeadCheckpoint HeadMismatchError "
    "IncompatibleCheckpointError RunCheckpointer attach_head load_head save_head",
    "flaxheads.checkpoint.models": "model_from_checkpoint",
    "flaxheads.checkpoint.adapters": "load_adapters",
}
#: The old names that were submodules: still attributes, not deprecated.
OLD_MODULES = {"interop": "flaxheads.interop", "lora": "flaxheads.model.lora", "ranking": "flaxheads.tasks.ranking"}
SUBMODULES = {
    **OLD_MODULES,
    "checkpoint": "flaxheads.checkpoint",
    "losses": "flaxheads.losses",
    "nnx": "flaxheads.nnx",
    "runtime": "flaxheads.runtime",
    "formats": "flaxheads.formats",
}
OLD = {name: module for module, names in OLD_NAMES.items() for name in names.split()}
MOVED = sorted(set(OLD) - set(fh.__all__))


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )


def test_the_old_names_are_the_92_of_the_release_before():
    assert len(OLD) + len(OLD_MODULES) == 92


def test_import_flaxheads_imports_no_heavy_library_and_reads_no_argv():
    got = _python("""
        import signal, sys
        sys.argv[0] = "flaxheads"  # as the console script: still a library import, no handler installed
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        import flaxheads
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "numpy", "torch",
                                                                      "orbax", "optax", "transformers"))
        assert not heavy, heavy
        assert {s: signal.getsignal(s) for s in before} == before
        print(flaxheads.__version__)
    """)
    assert got.returncode == 0 and got.stdout.strip() == fh.__version__, got.stderr


def test_import_flaxheads_leaves_logging_alone():
    """The front door's set_verbosity is the logging module's; importing flaxheads adds no handler and sets no level."""
    got = _python("""
        import logging
        import flaxheads as fh
        logger = logging.getLogger("flaxheads")
        assert not logger.handlers and logger.level == logging.NOTSET and logger.propagate
        assert not logging.getLogger().handlers
        from flaxheads.runtime import logs
        assert fh.set_verbosity is logs.set_verbosity
        fh.set_verbosity("warning")
        assert logger.level == logging.WARNING and [type(h).__name__ for h in logger.handlers] == ["PlainHandler"]
    """)
    assert got.returncode == 0, got.stderr


def test_at_most_50_names_each_once():
    assert len(fh.__all__) <= 50 and len(set(fh.__all__)) == len(fh.__all__)


def test_every_name_resolves_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in fh.__all__:
            assert getattr(fh, name) is not None, name
        for name, module in SUBMODULES.items():
            assert getattr(fh, name) is importlib.import_module(module), name


def test_names_added_since_are_their_modules_objects():
    """Front-door names newer than 0.2 (not in OLD_NAMES) are the objects of the modules they come from."""
    from flaxheads.heads import heads

    assert fh.TokenLogits is heads.TokenLogits and "TokenLogits" in fh.__all__


def test_star_import_gives_the_front_door():
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from flaxheads import *", ns)
    assert set(fh.__all__) <= set(ns) and not set(MOVED) & set(ns)


def test_names_kept_are_the_objects_they_were():
    for name in sorted(set(OLD) & set(fh.__all__)):
        assert getattr(fh, name) is getattr(importlib.import_module(OLD[name]), name), name


@pytest.mark.parametrize("name", MOVED)
def test_an_old_name_still_resolves_and_warns(name):
    with pytest.warns(
        DeprecationWarning,
        match=rf"^fh\.{name} moved: use .*flaxheads\.[\w.]+\.{name}; "
        rf"fh\.{name} goes away in the next release$",
    ) as caught:
        value = getattr(fh, name)
    assert value is getattr(importlib.import_module(OLD[name]), name)
    # the module the message names holds the same object
    where = str(caught[0].message).split("; ")[0].rsplit(" ", 1)[-1].rsplit(".", 1)[0]
    assert getattr(importlib.import_module(where), name) is value
    assert caught[0].filename == __file__  # the warning points at the caller's line


def test_an_old_name_warns_on_every_use():
    for _ in range(2):
        with pytest.warns(DeprecationWarning, match="fh.export_onnx moved: use fh.export"):
            fh.export_onnx  # noqa: B018


def test_dir_lists_the_front_door_and_the_submodules_not_the_old_names():
    names = dir(fh)
    assert set(fh.__all__) <= set(names) and set(SUBMODULES) <= set(names)
    assert not set(MOVED) & set(names)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        fh.no_such_name  # noqa: B018
    assert not hasattr(fh, "no_such_name")
