"""The documentation site's generated pages and table of contents, without building it (`make docs`
builds it, notebooks executed): the API page documents every name of ``flaxheads.__all__``, the
command-line page every subcommand and option ``--help`` lists, and every notebook is in a toctree."""

import fnmatch
import re
import sys
from pathlib import Path

import flaxheads

DOCS = Path(__file__).resolve().parents[1] / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import flaxheads_docs  # noqa: E402


def test_api_page_documents_every_public_name_once():
    text = flaxheads_docs.api_rst(kind=lambda name: "function")
    documented = re.findall(r"^\.\. autofunction:: flaxheads\.(\S+)$", text, re.M)
    assert sorted(documented) == sorted(flaxheads.__all__)


def test_api_page_groups_follow_the_package():
    # the groups are the comments of flaxheads/__init__.py's table: each name sits under the comment above it
    source = Path(flaxheads.__file__).read_text()
    groups = dict(flaxheads_docs.api_groups(source))
    where = {name: title for title, names in groups.items() for name in names}
    assert where["train"] == where["RunSpec"] == "Runs"
    assert where["Trainer"] == where["fit"] == "Training"
    assert where["FlaxheadsError"] == "Errors"
    assert "Front door" not in groups  # the table's first name has a comment above it


def test_api_page_directive_kinds():
    assert flaxheads_docs.object_kind("FlaxheadsError") == "exception"
    assert flaxheads_docs.object_kind("__version__") == "data"


def _usage_options(parser) -> set[str]:
    """The option strings argparse's own usage line shows (each option's first)."""
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", parser.format_usage()))


def test_cli_page_documents_every_subcommand_and_option():
    from flaxheads.cli.main import build_parser

    parser = build_parser()
    text = flaxheads_docs.cli_rst(parser)
    listed = parser._subparsers._group_actions[0].choices
    assert listed, "the parser has no subcommands"
    titles = re.findall(r"^``flaxheads (\w[\w-]*)``$", text, re.M)
    assert titles == list(dict.fromkeys(listed))
    sections = re.split(r"^``flaxheads \w[\w-]*``$", text, flags=re.M)[1:]
    for name, section in zip(titles, sections):
        terms = set(re.findall(r"^``(.*)``$", section, re.M))
        shown = {opt for term in terms for opt in re.findall(r"--?[A-Za-z][\w-]*", term)}
        assert _usage_options(listed[name]) <= shown, name


def _toctree_entries(page: Path) -> list[str]:
    """The entries of every ``{toctree}`` block of a MyST page (options and blank lines left out)."""
    entries = []
    for block in re.findall(r"^```\{toctree\}\n(.*?)^```", page.read_text(), re.M | re.S):
        entries += [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.startswith(":")]
    return entries


def test_every_notebook_and_reference_page_is_in_a_toctree():
    entries = _toctree_entries(DOCS / "index.md")
    docs = [str(p.relative_to(DOCS).with_suffix("")) for p in DOCS.rglob("*") if p.suffix in (".md", ".rst")]
    listed = {d for d in docs if any(fnmatch.fnmatch(d, e) for e in entries)}
    notebooks = [d for d in docs if d.startswith("notebooks/")]
    assert len(notebooks) >= 2
    for page in [*notebooks, "reference/api", "reference/cli", "performance", "design", "changelog"]:
        assert page in listed, f"{page} is in no toctree of docs/index.md"


def test_guides_in_reading_order(tmp_path):
    for name in ("serving", "zeta", "poolers-and-heads", "alpha", "training"):
        (tmp_path / f"{name}.md").write_text("# x\n")
    assert flaxheads_docs.ordered_guides(tmp_path) == [
        "guides/poolers-and-heads",
        "guides/training",
        "guides/serving",
        "guides/alpha",
        "guides/zeta",
    ]
