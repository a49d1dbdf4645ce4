"""Sphinx configuration of the flaxheads documentation (``make docs``: ``build/docs``).

Pages are Markdown (MyST); the notebooks in ``notebooks/`` are MyST text notebooks that myst-nb
executes on every build, so what they show is what this checkout does. The API and command-line
references are generated from the code by the local extension ``_ext/flaxheads_docs.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

# The notebooks' kernels inherit these: no model hub, no advisory noise, the same heap settings the
# Makefile gives the flaxheads command, and a fixed width for the usage lines of the CLI reference.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bar
os.environ["COLUMNS"] = "88"  # the page's code width

from flaxheads import __version__  # noqa: E402

project = "flaxheads"
author = "flaxheads contributors"
copyright = "flaxheads contributors"
release = __version__
version = ".".join(__version__.split(".")[:2])

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "flaxheads_docs",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}
exclude_patterns = ["_build", "jupyter_execute", ".jupyter_cache", "**.ipynb_checkpoints"]
root_doc = "index"

# MyST: `#anchor` links of the guides resolve to their headings; $math$ and ::: fences read.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]

# Notebooks: executed on every build, in a scratch folder (runs write run folders there), and a cell
# that raises fails the build.
nb_execution_mode = "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_in_temp = True
nb_execution_show_tb = True
nb_merge_streams = True

# autodoc: docstrings are reStructuredText with Google-style sections here and there; signatures carry
# the type hints, so the descriptions do not repeat them.
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# a cross-reference to a name outside the reference pages (a submodule's helper) stays plain text
nitpicky = False

html_theme = "furo"
html_title = f"flaxheads {release}"
html_static_path: list[str] = []
