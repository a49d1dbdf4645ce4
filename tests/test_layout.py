"""The tree is the layering: the folder list at the top of docs/design.md, held against the code's own imports.

Every import counts, module level or inside a function: an import hidden in a function still ties the
two files together."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "flaxheads")
MAX_TOP_FILES = 6
MAX_LINES = 450


def _design_tree() -> list[list[str]]:
    """The layers of docs/design.md's first code block: one list of names (folders or top files) a line."""
    text = open(os.path.join(ROOT, "docs", "design.md")).read()
    block = re.search(r"```\n(.*?)```", text, re.S).group(1)
    layers = []
    for line in block.splitlines():
        names = [w for w in line.split() if w.endswith("/") or w.endswith(".py")]
        names = [n.rstrip("/").removesuffix(".py") for n in names if re.fullmatch(r"[\w]+(/|\.py)", n)]
        if names:
            layers.append(names)
    return layers


LAYERS = _design_tree()
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(mod: str, path: str) -> set[str]:
    """The flaxheads modules ``mod`` imports (``from flaxheads.x import y``: ``flaxheads.x.y`` where that
    is a module)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "flaxheads"}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: relative import (flaxheads imports absolutely)"
            if node.module and node.module.split(".")[0] == "flaxheads":
                subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
                out |= subs or {node.module}
    out.discard("flaxheads")
    return {m for m in out if m in MODULES}


GRAPH = {mod: _imports(mod, path) for mod, path in MODULES.items()}


def _top(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _folder(mod: str) -> str:
    return os.path.dirname(MODULES[mod])


def test_design_tree_names_every_folder_and_top_file():
    tops = {_top(m) for m in MODULES} - {"__init__", "__main__"}
    assert tops == set(LEVEL), (
        f"in the code, not in docs/design.md: {sorted(tops - set(LEVEL))}; "
        f"in docs/design.md, not in the code: {sorted(set(LEVEL) - tops)}"
    )


def test_no_import_runs_up():
    upward = []
    for mod, deps in GRAPH.items():
        if _top(mod) in ("__init__", "__main__"):
            continue  # the front door and the entry point sit above everything
        for dep in deps:
            if LEVEL[_top(dep)] > LEVEL[_top(mod)]:
                upward.append(
                    f"{mod} imports {dep} ({_top(mod)}/ may import only folders listed above it in docs/design.md)"
                )
    assert not upward, "\n".join(sorted(upward))


def _cycles() -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_loop_across_folders():
    across = [sorted(c) for c in _cycles() if len({_folder(m) for m in c}) > 1]
    assert not across, f"import loops across folders: {across}"


def test_few_files_at_the_top():
    top = [f for f in os.listdir(PKG) if f.endswith(".py") and f not in ("__init__.py", "__main__.py")]
    assert len(top) <= MAX_TOP_FILES, sorted(top)


def test_no_library_file_over_the_limit():
    long = {path: n for path in MODULES.values() if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split by concept): {long}"
