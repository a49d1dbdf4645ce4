"""tests/conftest.py's skip rule: on the newest stack a skip whose reason ALLOWED_SKIPS does not match fails
the session. Each case runs pytest in a process of its own on tiny test files beside a copy of the real
conftest.py."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.full  # pytest in subprocesses

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")

SKIPS = """
import pytest

def test_passes():
    pass

def test_allowed():
    pytest.skip("HF Flax models need transformers < 5")

@pytest.mark.xfail(reason="an expected failure is no skip", strict=True)
def test_expected_failure():
    assert False
"""
UNEXPECTED = """
import pytest

def test_unexpected():
    pytest.skip("the frobnicator is not installed")
"""
MISSING_EXTRA = """
import pytest

pytest.importorskip("a_module_nobody_installed")

def test_never_runs():
    pass
"""


def _pytest(tmp_path, files: dict, *args) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -ra\n")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's xdist worker
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_an_unexpected_skip_fails_the_session_and_is_listed(tmp_path):
    """Through pytest-xdist's controller, as `make test` runs: the skipped test and the file skipped by
    its importorskip are listed with their reasons, the allowed skip and the expected failure are not,
    and the session fails although no test failed."""
    got = _pytest(
        tmp_path,
        {"test_skips.py": SKIPS, "test_unexpected.py": UNEXPECTED, "test_missing_extra.py": MISSING_EXTRA},
        "-n",
        "1",
    )
    out = got.stdout + got.stderr
    assert got.returncode == 1, out
    assert "1 passed, 3 skipped, 1 xfailed in" in out, out  # no test failed
    section = out[out.index("unexpected skips") : out.index("short test summary info")]  # then pytest's -ra list
    assert "test_unexpected.py::test_unexpected: the frobnicator is not installed" in section, out
    assert "test_missing_extra.py: could not import 'a_module_nobody_installed'" in section, out
    assert "2 skipped for a reason the newest stack does not expect" in section, out
    assert "test_allowed" not in section and "test_expected_failure" not in section, out


def test_allowed_skips_pass(tmp_path):
    got = _pytest(tmp_path, {"test_skips.py": SKIPS}, "-n", "0")
    out = got.stdout + got.stderr
    assert got.returncode == 0 and "1 passed, 1 skipped, 1 xfailed" in out, out
    assert "unexpected skips" not in out, out


def test_the_legacy_pass_skips_what_its_stack_lacks(tmp_path):
    """`make test-legacy`'s pass (``-m "legacy and ..."``) keeps pytest's own rule: a skip is no failure."""
    legacy = "pytestmark = pytest.mark.legacy\n"
    got = _pytest(
        tmp_path,
        {"test_unexpected.py": UNEXPECTED.replace("\ndef", legacy + "\ndef", 1)},
        "-n",
        "0",
        "-m",
        "legacy and not slow",
    )
    out = got.stdout + got.stderr
    assert got.returncode == 0 and "1 skipped" in out and "unexpected skips" not in out, out
