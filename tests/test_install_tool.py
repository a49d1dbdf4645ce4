"""tools/install.py hands uv what pip itself reports of its configuration (``pip config list``):
index URLs, find-links and constraints, each value once, nothing else."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("install_tool", os.path.join(ROOT, "tools", "install.py"))
install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install)


def test_pip_settings_become_uv_flags(monkeypatch, tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\nextra-index-url = file:///a file:///b\nfind-links = /wheels\ncert = /c.pem\ntimeout = 60\n"
    )
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_FIND_LINKS", "/wheels")  # the same value from a variable: passed once
    monkeypatch.setenv("PIP_CONSTRAINT", "/caps.txt")
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    assert "cert" in listed and "timeout" in listed  # pip reports them; they are not uv's to take
    flags = install.pip_settings(sys.executable)
    pairs = list(zip(flags[::2], flags[1::2]))
    want = {
        ("--extra-index-url", "file:///a"),
        ("--extra-index-url", "file:///b"),
        ("--find-links", "/wheels"),
        ("--constraint", "/caps.txt"),
    }
    assert want <= set(pairs) and len(pairs) == len(set(pairs))
    assert not {f for f, _ in pairs} - set(install.CARRIED.values())
    assert not any(v in ("/c.pem", "60") for _, v in pairs)


def test_usage_without_a_venv():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "install.py")], capture_output=True, text=True)
    assert p.returncode == 2 and "install.py VENV" in p.stderr
