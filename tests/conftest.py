import collections
import os
import re
from typing import Any, NamedTuple

# Before jax is imported anywhere: 4 fake CPU devices for the data-parallel tests
# (8 on 2 cores can time out in XLA's collectives under load), fail fast on a hang, and LLVM at -O1 for
# the programs compiled with optimizations on (test_train_steps.py: 78 s at the default -O2, 58 s at -O1).
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=4 --xla_cpu_collective_call_terminate_timeout_seconds=6"
    " --xla_backend_optimization_level=1",
)
# ...and most of XLA's optimizations off (LLVM at -O0, no expensive passes; processes the tests start
# inherit it): the suite's tiny programs compile for far longer than they run (the DeBERTa and checkpoint
# files: 288 s of test time at -O1, 212 s at -O0, 183 s with this). Tests marked `optimized` (real models
# whose run time outweighs their compiles) compile at the -O1 above.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# programs compare against float32 references on every CPU kind (auto would pick bfloat16 on AMX hosts)
os.environ.setdefault("FLAXHEADS_PRECISION", "float32")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import signal  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

from flaxheads.runtime.compile_cache import (
    CACHE_ENV,
    default_cache_dir,  # noqa: E402  (imports jax, starts no backend)
    enable_compile_cache,
)

# One persistent compilation cache for a test run: the test processes' own programs and the command-line
# programs (``flaxheads ...`` in the test's process or in a subprocess, which enable it through this
# variable). The tiny models' train and eval steps recur across files and processes, and each costs
# seconds to compile. It lives in the checkout's .pytest_cache, so a fresh clone starts it empty; the
# tests of the cache give their own folder.
os.environ.setdefault(
    CACHE_ENV,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "xla", default_cache_dir().name
    ),
)
enable_compile_cache()

warnings.filterwarnings("ignore", message=".*TensorFlow and JAX classes are deprecated.*")

# A test run started as a shell's background job inherits SIGINT ignored, as would every process it starts
# (and flaxheads rightly leaves an ignored SIGINT ignored): the Ctrl-C tests need Python's own handler, as
# in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: Per-test limits (pytest-timeout): a hang fails its test, not the run. Slow tests load real
#: models or start processes; on a busy 2-core machine they need minutes.
SLOW_TIMEOUT_S = 1800
#: Tiers are declared where the tests are: ``pytestmark = pytest.mark.full`` (left out of ``make
#: test-fast``: end to end through the command line, subprocesses, whole training runs and
#: checkpoints), ``serial`` (``make test`` runs them in a pass of their own after the main one, a file per
#: core, away from its compile-heavy tests: several processes, or 8 fake devices, in collectives whose
#: rendezvous needs each process on a core in time, and a page-fault count; their collective timeouts are
#: a minute; the kill and signal tests are not serial: they signal at a line the process prints) and ``legacy``
#: (also run by ``make test-legacy``: Python 3.11, jax 0.10, transformers 4.57). Two rules add to
#: them, for the backbone families' test files: the tests that
#: compare against HF's Flax models or 4.57's PyTorch classes (names containing one of
#: ``LEGACY_BACKBONE_TESTS``) are legacy, and every other test of a family (gradients, dropout, bf16,
#: remat, export round trips) is full.
LEGACY_BACKBONE_TESTS = ("hf_flax", "hidden_states", "logits_match", "forward_match")


@pytest.fixture(autouse=True)
def _optimized_programs(request):
    """Tests marked ``optimized`` compile their programs with XLA's optimizations on (the -O1 above)."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    import jax

    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


class TinyModel(NamedTuple):
    """What ``tiny_model`` gives: ``path, torch = tiny_model(family)``."""

    path: str  #: the saved HF folder (config.json, model.safetensors; the tokenizer if asked)
    torch: Any  #: the PyTorch classifier saved there, in eval mode


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(family, **config) -> TinyModel``: hf_tiny's tiny random PyTorch classifier of ``family``
    (:func:`hf_tiny.save_tiny`: every weight perturbed; ``config``: ``seed`` (default 1), ``num_labels``
    (3), ``layers`` and config fields; ``tokenizer=True`` adds train_helpers' word-level tokenizer), made
    once per test process for each distinct ``config``: the files that ask for the same model share its
    folder and its PyTorch model. Both are read-only: a test that changes the folder changes a copy
    (hf_tiny.edited_copy), one that changes the PyTorch model (its config, train mode) puts it back."""
    from hf_tiny import save_tiny
    from train_helpers import save_word_tokenizer

    made: dict[tuple, TinyModel] = {}

    def get(family: str, *, tokenizer: bool = False, **config) -> TinyModel:
        config = {"seed": 1, "num_labels": 3, **config}
        key = (family, tokenizer, repr(sorted(config.items())))
        if key not in made:
            path, pt = save_tiny(tmp_path_factory.mktemp(f"tiny_{family}") / family, family, **config)
            if tokenizer:
                save_word_tokenizer(path)
            made[key] = TinyModel(path, pt)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_bert(tiny_model) -> str:
    """The folder of the tiny BERT classifier (3 labels, no dropout, a word-level fast tokenizer) that the
    run, checkpoint and export tests share read-only: ``tiny_model("bert", **train_helpers.TINY_BERT)``."""
    from train_helpers import TINY_BERT

    return tiny_model("bert", **TINY_BERT).path


def _needs_hf_flax(item) -> bool:
    """Skipped without HF's Flax models (transformers < 5): only the legacy stack runs it."""
    return any("transformers < 5" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def _pass(config) -> str:
    """Which pass of ``make test`` / ``make test-legacy`` this is, from its ``-m`` expression: ``serial``,
    ``legacy`` or (every other expression) ``parallel``."""
    first = config.option.markexpr.split(" and ")[0].strip()
    return first if first in ("serial", "legacy") else "parallel"


def _may_hold(path, marker: str) -> bool:
    """Whether a test file can hold tests marked ``marker``: it names the marker, or (legacy) it is a
    family's file or skips without HF's Flax models (the rules of pytest_collection_modifyitems)."""
    text = path.read_text()
    if marker == "legacy":
        return "backbones" in path.parts or "legacy" in text or "transformers < 5" in text
    return f"mark.{marker}" in text  # not the word alone ("serialize", "deserialized")


def pytest_ignore_collect(collection_path, config):
    """The serial and legacy passes import only the test files that can hold their tests: collecting
    every file imports torch, transformers and sentence-transformers (~20 s in each worker)."""
    wanted = _pass(config)
    if (
        wanted != "parallel"
        and collection_path.name.startswith("test_")
        and collection_path.suffix == ".py"
        and not _may_hold(collection_path, wanted)
    ):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath) + os.sep
    # pytest-xdist hands out whole files in this order (`--dist loadfile --no-loadscope-reorder`): the files
    # with slow tests first, then the rest by their number of tests, so that the pass does not end with
    # one worker waiting on a long file that started last (xdist's own order, by number of tests alone,
    # left the one-test minute-long files to the end)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    per_file = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.path not in slow_files, -per_file[item.path], str(item.path)))
    for item in items:
        rel = str(item.path).replace(root, "").replace(os.sep, "/")
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        family = rel.startswith("tests/backbones/families/test_backbone_")
        parity = any(n in item.name for n in LEGACY_BACKBONE_TESTS)
        if _needs_hf_flax(item) or (rel.startswith("tests/backbones/") and parity):
            item.add_marker(pytest.mark.legacy)
        if family and not parity:
            item.add_marker(pytest.mark.full)


# ---- skips: on the newest stack a skip nobody expects fails the session -------------------------------
#: The skips ``make test`` and ``make test-fast`` may have on the newest stack (any ``-m`` but the legacy
#: pass's): a regular expression searched in the skip's reason -> why that skip is expected. Any other
#: skip (an ``importorskip`` of a missing extra, a version check, a missing tool) fails the session and
#: is listed at its end: the parity suite cannot pass by skipping. The legacy pass and the legacy stack
#: (transformers 4) skip what they lack, as before.
ALLOWED_SKIPS = {
    r"transformers < 5": "HF's Flax models (the references of these tests) are transformers 4's: "
    "the legacy pass (make test-legacy) runs them",
    r"^no headless Chromium": "a system package, not the project's: .ci/run installs it where apt can and says "
    "when it cannot; the page's HTML and numbers are tested without it",
    r"tmpfs": "mounting needs root with CAP_SYS_ADMIN, and quotas a kernel built with them (this machine's "
    "refuses usrquota): the machine decides, not the install",
    r"^root writes into a read-only": "root ignores permission bits; the path-under-a-file case covers root",
    r"only on CPUs with AMX$": "flaxheads gives oneDNN's flags to CPUs with AMX alone: elsewhere no run uses them",
    r"XLA:CPU's$": "checks of XLA:CPU's own arrangement: nothing to check on an accelerator",
}


def _newest_stack() -> bool:
    """The stack ``make setup`` installs (transformers 5); the legacy one has transformers 4.57."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0]) >= 5
    except PackageNotFoundError:
        return False


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


class UnexpectedSkips:
    """Collects the skips no :data:`ALLOWED_SKIPS` reason matches (tests and whole files, across
    pytest-xdist's workers: it runs in the controller) and fails the session on them."""

    def __init__(self):
        self.found: dict[str, str] = {}

    def _note(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _skip_reason(report)
            if not any(re.search(pattern, reason) for pattern in ALLOWED_SKIPS):
                self.found[report.nodeid] = reason

    def pytest_runtest_logreport(self, report):
        self._note(report)

    def pytest_collectreport(self, report):
        self._note(report)

    def pytest_sessionfinish(self, session):
        if self.found and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.found:
            terminalreporter.section("unexpected skips (tests/conftest.py ALLOWED_SKIPS)", red=True, bold=True)
            for nodeid, reason in sorted(self.found.items()):
                terminalreporter.line(f"{nodeid}: {reason}")
            terminalreporter.line(
                f"{len(self.found)} skipped for a reason the newest stack does not expect: the "
                "session fails (install what they need, or allow the reason, saying why)"
            )


def pytest_configure(config):
    if not hasattr(config, "workerinput") and _pass(config) != "legacy" and _newest_stack():
        config.pluginmanager.register(UnexpectedSkips(), "flaxheads-unexpected-skips")
