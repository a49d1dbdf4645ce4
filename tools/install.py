"""``pip install`` into a virtual environment, through uv where uv installs.

    python tools/install.py VENV [pip install arguments...]

uv installs the same wheels several times faster than pip (downloads and unpacking run in parallel:
the test stack's ~7 GB took 213 s with pip, 97 s with uv, on 2 cores, bytecode included).
uv does not read pip's configuration, so the index URLs, find-links and constraints pip is set up
with on this machine are handed to it, and uv picks the best version across all of them, as pip
does. Where uv cannot be installed (no registry, an unsupported platform), pip does the work.

uv writes no bytecode (``--compile-bytecode`` would compile all ~19k modules of the test stack,
most of the install's time, where a test process imports ~5k): Python writes it as each module is first
imported, which the Makefile allows even where ``PYTHONDONTWRITEBYTECODE`` is set.
"""

from __future__ import annotations

import os
import subprocess
import sys

#: pip settings uv takes as flags of the same meaning (pip's name -> uv's flag)
CARRIED = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_settings(python: str) -> list[str]:
    """pip's index URLs, find-links and constraints (its config files and PIP_* variables) as uv flags."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    pairs: dict[tuple[str, str], None] = {}  # ordered, once each: a setting can come from a file and a variable
    for line in out.splitlines():
        key, _, value = line.partition("=")
        flag = CARRIED.get(key.rsplit(".", 1)[-1])
        for item in value.strip().strip("'\"").split() if flag else []:  # pip lists several values in one
            pairs[(flag, item)] = None
    return [x for pair in pairs for x in pair]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    venv, args = argv[0], argv[1:]
    python, uv = os.path.join(venv, "bin", "python"), os.path.join(venv, "bin", "uv")
    if not os.path.exists(uv):
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "uv"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    if not os.path.exists(uv):
        return subprocess.run([python, "-m", "pip", "install", "-q", *args]).returncode
    return subprocess.run(
        [
            uv,
            "pip",
            "install",
            "-q",
            "--python",
            python,
            "--index-strategy",
            "unsafe-best-match",
            *pip_settings(python),
            *args,
        ]
    ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
