"""The generated pages of the documentation: the API reference and the command-line reference.

Both are made at build time from the code itself, so neither can miss a name:

* ``.. flaxheads-api::`` documents every name of ``flaxheads.__all__`` with autodoc, in the groups
  ``flaxheads/__init__.py`` lists them in (its comments above each group of ``_PUBLIC``);
* ``.. flaxheads-cli::`` documents every subcommand of ``flaxheads.cli.main.build_parser()``: what it
  does, its usage line and each option with its help and default.

The page text comes from :func:`api_rst` and :func:`cli_rst` (plain functions, which the tests call
without Sphinx); the directives parse it in place. The index's guides are listed in reading order
(:data:`GUIDE_ORDER`).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INIT = ROOT / "flaxheads" / "__init__.py"

#: Section titles of the API page, by the comment above each group of names in ``_PUBLIC``.
GROUP_TITLES = {
    "a run": "Runs",
    "models: make, load, export, describe, predict": "Models: make, load, export, describe, predict",
    "poolers, heads and adapters": "Poolers, heads and adapters",
    "training": "Training",
    "checkpoints": "Checkpoints",
    "memory plan": "Memory plan",
    "errors": "Errors",
}


def api_groups(source: str | None = None) -> list[tuple[str, list[str]]]:
    """``[(group title, [name, ...]), ...]``: the public names in the order and groups of
    ``flaxheads/__init__.py``'s ``_PUBLIC`` table (a comment line starts a group), then the version."""
    text = INIT.read_text() if source is None else source
    table = next(
        node
        for node in ast.parse(text).body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "_PUBLIC"
    )
    assert isinstance(table.value, ast.Dict)
    lines = text.splitlines()
    groups: list[tuple[str, list[str]]] = []
    # the comment lines between the table's opening and each key say where a group starts
    previous = table.value.lineno
    for key in table.value.keys:
        assert isinstance(key, ast.Constant) and isinstance(key.value, str)
        comments = [ln.strip()[1:].strip() for ln in lines[previous : key.lineno - 1] if ln.strip().startswith("#")]
        if comments or not groups:
            title = comments[-1] if comments else "Front door"
            groups.append((GROUP_TITLES.get(title, title[:1].upper() + title[1:]), []))
        groups[-1][1].append(key.value)
        previous = key.lineno
    groups.append(("Version", ["__version__"]))
    return groups


def object_kind(name: str) -> str:
    """The autodoc directive for ``flaxheads.<name>``: class, exception, function or data."""
    import flaxheads

    obj = getattr(flaxheads, name)
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    return "function" if callable(obj) else "data"


def api_rst(kind: Callable[[str], str] = object_kind) -> str:
    """The API page's reStructuredText: a section per group, an autodoc directive per name."""
    out: list[str] = []
    for title, names in api_groups():
        out += [title, "-" * len(title), ""]
        for name in names:
            how = kind(name)
            out.append(f".. auto{how}:: flaxheads.{name}")
            if how in ("class", "exception"):
                out.append("   :members:")
            out.append("")
    return "\n".join(out)


_SPECIAL = re.compile(r"([\\`*_|\[\]<>:])")


def escape(text: str) -> str:
    """``text`` as literal reStructuredText (inline markup characters escaped)."""
    return _SPECIAL.sub(r"\\\1", text)


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, one-line help, parser)`` of each subcommand, in the order ``--help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias maps to the same parser
                    seen.add(id(sub))
                    yield name, helps.get(name, ""), sub


def _option_term(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    return formatter._format_action_invocation(action)


def _option_help(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    text = formatter._expand_help(action) if action.help else ""
    default = action.default
    shown = (
        default is not None
        and default is not argparse.SUPPRESS
        and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))
        and action.option_strings
        and "default" not in text.lower()  # the help says it already
        and default != []
    )
    return " ".join(x for x in (text.strip(), f"Default: {default}." if shown else "") if x)


def _command_rst(prog: str, summary: str, parser: argparse.ArgumentParser, level: str) -> list[str]:
    formatter = parser._get_formatter()
    title = f"``{prog}``"
    out = [title, level * len(title), ""]
    out += _text_rst(parser, parser.description or summary)
    out += _literal(parser.format_usage())
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]
        actions = [a for a in actions if not isinstance(a, argparse._SubParsersAction)]
        if not actions:
            continue
        out += [f".. rubric:: {escape(group.title or 'options')}", ""]
        for action in actions:
            out.append(f"``{_option_term(action, formatter)}``")
            body = _option_help(action, formatter)
            out += ["   " + escape(" ".join(body.split())) if body else "   (no description)", ""]
    out += _text_rst(parser, parser.epilog)
    for name, help_text, sub in subcommands(parser):
        out += _command_rst(f"{prog} {name}", help_text, sub, "^")
    return out


def _literal(text: str) -> list[str]:
    return [".. code-block:: text", ""] + [f"   {line}".rstrip() for line in text.strip("\n").splitlines()] + [""]


def _text_rst(parser: argparse.ArgumentParser, text: str | None) -> list[str]:
    """A description or epilog: laid out by hand (a raw formatter keeps its lines and examples) as a
    literal block, else one paragraph."""
    if not text:
        return []
    if issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter) and "\n" in text.strip():
        return _literal(inspect.cleandoc(text))
    return [escape(" ".join(text.split())), ""]


def cli_rst(parser: argparse.ArgumentParser | None = None) -> str:
    """The command-line page's reStructuredText: a section per subcommand (nested ones inside),
    with its description, usage and options by group."""
    if parser is None:
        from flaxheads.cli.main import build_parser

        parser = build_parser()
    out = _text_rst(parser, parser.description) + _literal(parser.format_usage())
    for name, help_text, sub in subcommands(parser):
        out += _command_rst(f"{parser.prog} {name}", help_text, sub, "-")
    return "\n".join(out)


#: The guides in reading order; a guide not named here follows them, by name.
GUIDE_ORDER = (
    "backbones",
    "poolers-and-heads",
    "training",
    "predicting",
    "rerankers",
    "big-models",
    "sharding",
    "exporting",
    "serving",
    "reliability",
    "command-line",
)


def ordered_guides(folder: Path) -> list[str]:
    """The guides' document names (``guides/<stem>``) in reading order."""
    stems = [p.stem for p in folder.glob("*.md")]
    rank = {name: i for i, name in enumerate(GUIDE_ORDER)}
    return [f"guides/{s}" for s in sorted(stems, key=lambda s: (rank.get(s, len(rank)), s))]


def _order_guides(app, docname: str, source: list[str]) -> None:
    """The index's ``guides/*`` toctree entry becomes the guides in reading order (a glob sorts
    them by name)."""
    guides = ordered_guides(Path(app.srcdir) / "guides")
    if docname == "index" and guides:
        source[0] = source[0].replace("\nguides/*\n", "\n" + "\n".join(guides) + "\n")


def generated_directive(make: Callable[[], str]):
    """A directive that parses the reStructuredText ``make()`` returns in place, sections included.
    (Sphinx is imported here only: the tests call the generators without it.)"""
    from docutils import nodes
    from docutils.parsers.rst import Directive
    from docutils.statemachine import StringList
    from sphinx.util.nodes import nested_parse_with_titles

    class Generated(Directive):
        def run(self):
            holder = nodes.section()
            holder.document = self.state.document
            source = self.state.document.current_source or "<generated>"
            nested_parse_with_titles(self.state, StringList(make().splitlines(), source=source), holder)
            return holder.children

    return Generated


def setup(app):
    app.add_directive("flaxheads-api", generated_directive(api_rst))
    app.add_directive("flaxheads-cli", generated_directive(cli_rst))
    app.connect("source-read", _order_guides)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
