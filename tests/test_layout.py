"""The layout's promises: no import cycle inside veomni_lite, no library module imports the top-level examples/ (which
the wheel leaves out), and the data side loads without the loss module or the distributed pieces; docs/architecture.md's
import picture is the code's (`python -m tests.test_layout` redraws it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "veomni_lite"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every veomni_lite module `path` imports anywhere (TYPE_CHECKING blocks and function bodies included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    graph = {name: imports_of(path, modules) - {name} for name, path in paths.items()}
    for name in modules:  # importing a.b.c runs a/__init__ and a/b/__init__ first
        parent = name.rpartition(".")[0]
        if parent and parent != "veomni_lite" and parent in modules and parent != name:
            graph[name] = graph[name]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_inside_the_package():
    assert find_cycle(import_graph()) is None, find_cycle(import_graph())


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def imported_names(source: str) -> set[str]:
    """Every module name an `import` or `from ... import` in `source` names (relative imports left out)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def imports_an_example(source: str) -> bool:
    return any(name == "examples" or name.startswith("examples.") for name in imported_names(source))


def test_the_library_never_imports_an_example():
    offenders = sorted(str(p) for p in PACKAGE.rglob("*.py") if imports_an_example(p.read_text()))
    assert not offenders
    # negative control: the check sees both import forms, at top level and inside a function
    assert imports_an_example("from examples.tiny_lm import TinyLMConfig")
    assert imports_an_example("def f():\n    import examples.sft_demo")
    assert not imports_an_example("from veomni_lite.data import examples_of")


def test_the_examples_live_outside_the_package_and_the_wheel_leaves_them_out():
    """setup.cfg's package list (what `pip install .` ships) holds the library and not the top-level examples/."""
    import configparser

    from setuptools import find_packages

    assert not (PACKAGE / "examples").exists()
    assert (PACKAGE.parent / "examples" / "__init__.py").is_file()
    setup = configparser.ConfigParser()
    setup.read(PACKAGE.parent / "setup.cfg")
    include = setup["options.packages.find"]["include"].split()
    shipped = find_packages(where=str(PACKAGE.parent), include=include)
    assert "veomni_lite" in shipped and "veomni_lite.trainer" in shipped
    assert not [name for name in shipped if name.split(".")[0] in {"examples", "tests", "benchmarks", "trainers"}]
    # negative control: without the include filter the same search does find the examples
    assert "examples" in find_packages(where=str(PACKAGE.parent))


def test_the_data_side_loads_without_the_loss_module_or_distributed_pieces():
    code = (
        "import sys, veomni_lite.data.collator, veomni_lite.data.loader, examples.synthetic_data;"
        "print(sorted(m for m in sys.modules if m.startswith('veomni_lite')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, check=True
    ).stdout
    assert "veomni_lite.loss_keys" in loaded
    for heavy in ("veomni_lite.utils.loss_utils", "veomni_lite.distributed", "veomni_lite.trainer"):
        assert heavy not in loaded, loaded


POST_TRAINING_ROOMS = ("veomni_lite.rl", "veomni_lite.preference", "veomni_lite.engines")


def room_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer's room, imported room) for every import between different post-training rooms."""

    def room(module: str) -> str | None:
        return next((r for r in POST_TRAINING_ROOMS if module == r or module.startswith(r + ".")), None)

    return {(room(a), room(b)) for a, deps in graph.items() for b in deps if room(a) and room(b) and room(a) != room(b)}


def test_post_training_rooms_share_one_base_and_never_import_each_other():
    """RL uses the engines; preference training and the engines import no other room; both trainers import the one
    shared module (docs/architecture.md's picture)."""
    graph = import_graph()
    assert room_edges(graph) == {("veomni_lite.rl", "veomni_lite.engines")}
    assert "veomni_lite.post_training" in graph["veomni_lite.rl.trainer"]
    assert "veomni_lite.post_training" in graph["veomni_lite.preference.trainer"]


def test_room_edges_see_a_cross_import():
    """Negative control: an import from preference into rl is an edge the test above refuses."""
    graph = {"veomni_lite.preference.trainer": {"veomni_lite.rl.policy_loss"}, "veomni_lite.rl.policy_loss": set()}
    assert room_edges(graph) == {("veomni_lite.preference", "veomni_lite.rl")}


def test_no_merge_conflict_markers_in_tracked_text():
    """A merge left no `<<<<<<<` / `>>>>>>>` lines in the code, docs or configs."""
    files = subprocess.run(["git", "ls-files"], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)
    found = []
    for name in files.stdout.split():
        path = PACKAGE.parent / name
        if path.suffix in (".py", ".md", ".yaml", ".cfg", ".toml") or path.name == "Makefile":
            text = path.read_text(errors="replace")
            found += [name for line in text.splitlines() if line.startswith(("<<<<<<< ", ">>>>>>> "))]
    assert not found, sorted(set(found))


MAX_CLASS_LINES = 300
SPLIT_ROOMS = ("rl", "preference", "engines")  # the post-training rooms, split a responsibility a module


def long_classes(source: str, limit: int = MAX_CLASS_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every class in `source`, nested ones included, spanning more than `limit` lines."""
    spans = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None
    ]
    return [(name, lines) for name, lines in spans if lines > limit]


def test_no_post_training_class_spans_more_than_300_lines():
    """A class over ~300 lines holds several responsibilities (issue 49: the vLLM engine was split for it)."""
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{name}": lines
        for room in SPLIT_ROOMS
        for path in sorted((PACKAGE / room).rglob("*.py"))
        for name, lines in long_classes(path.read_text())
    }
    assert not found, found


def test_long_classes_sees_a_long_class():
    """Negative control: a synthetic 301-line class is found, a 300-line one and a long function are not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(300))
    assert long_classes("class Long:\n" + body) == [("Long", 301)]
    assert long_classes("class Fits:\n" + body[: -len("    x299 = 299\n")]) == []
    assert long_classes("def f():\n" + body) == []


def test_the_config_module_stays_under_800_lines():
    lines = len((PACKAGE / "config.py").read_text().splitlines())
    assert lines <= 800, f"veomni_lite/config.py has {lines} lines (at most 800)"


# ---------------------------------------------------------------- the import picture (docs/architecture.md)

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
PICTURE_START = "<!-- import picture: generated by `python -m tests.test_layout`; tests/test_layout.py checks it -->"
PICTURE_END = "<!-- end of the import picture -->"


def loaded_imports_of(path: Path, modules: set[str]) -> set[str]:
    """The veomni_lite modules importing `path` loads: its module-level imports (inside `if`/`try` and class bodies
    too), not those inside functions (run on a call) or `if TYPE_CHECKING:` blocks (never run)."""
    found: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                walk(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
            for field in ("body", "orelse", "finalbody", "handlers"):
                walk([child for child in getattr(node, field, []) if isinstance(child, ast.AST)])

    walk(ast.parse(path.read_text()).body)
    return found & modules


def room(module: str) -> str:
    """A module's room: its subpackage or top-level module (`veomni_lite.rl.trainer` -> `rl`)."""
    return module.split(".")[1]


def room_graph(imports: Callable[[Path, set[str]], set[str]]) -> dict[str, set[str]]:
    """Room -> the other rooms its modules import (by `imports`); the package's own `__init__` left out."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        if name == "veomni_lite":
            continue
        deps = {room(dep) for dep in imports(path, modules) if dep != "veomni_lite"}
        graph.setdefault(room(name), set()).update(deps - {room(name)})
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str, without: tuple[str, str] | None = None) -> bool:
    """Whether a path of `graph`'s arrows leads from `start` to `goal` (not using the arrow `without`)."""
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, ()):
            if (node, nxt) != without and nxt not in seen:
                if nxt == goal:
                    return True
                seen.add(nxt)
                todo.append(nxt)
    return False


def without_implied_arrows(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` less every arrow another path of it implies (in sorted order, so the result is one graph): the same
    nodes reach the same nodes."""
    reduced = {node: set(deps) for node, deps in graph.items()}
    for node in sorted(reduced):
        for dep in sorted(reduced[node]):
            if reaches(reduced, node, dep, without=(node, dep)):
                reduced[node].discard(dep)
    return reduced


def import_picture() -> str:
    """docs/architecture.md's import picture, between its markers: a mermaid flowchart of the rooms, an arrow from
    importer to imported where loading the one loads the other (arrows a longer path implies left out), a dotted one
    where only an import loading does not run reaches it (inside a function, or `if TYPE_CHECKING:`); then each room's
    direct imports as a table."""
    loaded = room_graph(loaded_imports_of)
    every = room_graph(imports_of)
    lines = [PICTURE_START, "", "```mermaid", "flowchart TD"]
    reduced = without_implied_arrows(loaded)
    lines += [f"    {node} --> {dep}" for node in sorted(reduced) for dep in sorted(reduced[node])]
    lazy = {node: every[node] - loaded[node] for node in every}
    lines += [
        f"    {node} -.-> {dep}"
        for node in sorted(lazy)
        for dep in sorted(lazy[node])
        if not reaches(loaded, node, dep) and not any(reaches(loaded, other, dep) for other in lazy[node] - {dep})
    ]
    lines += ["```", "", "| room | imports when loaded | imports only in functions or for annotations |"]
    lines += ["| --- | --- | --- |"]
    for node in sorted(every):
        direct = ", ".join(sorted(loaded[node])) or "-"
        late = ", ".join(sorted(lazy[node])) or "-"
        lines.append(f"| {node} | {direct} | {late} |")
    return "\n".join([*lines, "", PICTURE_END])


def drawn_picture(text: str) -> str:
    """The import picture a page holds, markers included ("" without one)."""
    if PICTURE_START not in text or PICTURE_END not in text:
        return ""
    return text[text.index(PICTURE_START) : text.index(PICTURE_END) + len(PICTURE_END)]


def test_the_architecture_page_draws_the_codes_import_picture():
    """docs/architecture.md's picture is the code's (`python -m tests.test_layout` rewrites it)."""
    drawn = drawn_picture(ARCHITECTURE.read_text())
    assert drawn == import_picture(), "docs/architecture.md's import picture is stale: python -m tests.test_layout"


def test_the_picture_leaves_out_only_implied_arrows():
    """Negative controls: an implied arrow is dropped and reachability kept; a cycle keeps its arrows; a page whose
    picture lacks a line differs from the code's."""
    graph = {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    assert without_implied_arrows(graph) == {"a": {"b"}, "b": {"c"}, "c": set()}
    assert without_implied_arrows({"a": {"b"}, "b": {"a"}}) == {"a": {"b"}, "b": {"a"}}
    picture = import_picture()
    stale = picture.replace("\n    trainer --> ", "\n    trainer -.-> ", 1)
    assert stale != picture and drawn_picture(f"text\n{stale}\nmore") == stale != picture


def redraw_architecture_picture() -> None:
    """Rewrite docs/architecture.md's import picture from the code."""
    text = ARCHITECTURE.read_text()
    drawn = drawn_picture(text)
    if not drawn:
        raise SystemExit(f"{ARCHITECTURE}: no import picture markers ({PICTURE_START!r} ... {PICTURE_END!r})")
    ARCHITECTURE.write_text(text.replace(drawn, import_picture()))


if __name__ == "__main__":
    redraw_architecture_picture()
