"""The layer map of docs/design.md ("## Layers") is what the package's imports do: every
import in shardq/ (at module level, inside functions, under TYPE_CHECKING) points down the
map, never up or sideways, and every package is on the map. The tests keep a layout of
their own: one folder per package, shared code in tests/support/, and no test module
importing another."""
from __future__ import annotations

import ast
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "shardq")
FACADE = {"shardq", "shardq.__main__", "shardq.aio"}  # shardq.aio: `import shardq.aio`, the client's aio
FACADE_UNIT = "facade"   # shardq/__init__.py: above every layer, imported by nothing inside
GROUND = "ground"


def _map() -> list[list[str]]:
    """The layers, top first: each a list of the package names on one line."""
    text = open(os.path.join(REPO, "docs", "design.md")).read()
    section = text.split("\n## Layers\n", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    layers = []
    for line in block.splitlines():
        names = line.split("  ", 1)[0].strip()
        layers.append([n.strip() for n in names.split("|")])
    return layers


def _unit(module: str) -> str:
    """``shardq.client.router`` -> ``client``; a module directly in shardq/ -> ground; the
    package itself (``import shardq``, ``from shardq import open``) -> the facade."""
    if module == "shardq":
        return FACADE_UNIT
    sub = module.split(".")[1]
    return sub if os.path.isdir(os.path.join(PACKAGE, sub)) else GROUND


def _is_module(name: str, root: str = REPO) -> bool:
    path = os.path.join(root, *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (never run: not a runtime import)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                ids.update(id(n) for n in ast.walk(child))
    return ids


def _imports(path: str, module: str, runtime_only: bool = False, root: str = REPO):
    """(line, imported module) of every shardq import in one file, at module level and
    inside functions, relative ones resolved. A name imported from a package that is not
    a module of it stands for the package (``from shardq import open`` -> ``shardq``, the
    facade). ``runtime_only``: leave out the imports under ``if TYPE_CHECKING:``."""
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    tree = ast.parse(open(path).read(), path)
    skip = _type_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            if name != "shardq" and not name.startswith("shardq."):
                continue
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                yield node.lineno, sub if _is_module(sub, root) else name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "shardq" or alias.name.startswith("shardq."):
                    yield node.lineno, alias.name


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                parts = os.path.relpath(path[:-3], REPO).split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                yield path, ".".join(parts)


def test_every_package_is_on_the_map():
    on_map = {name for layer in _map() for name in layer}
    packages = {d for d in os.listdir(PACKAGE)
                if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))}
    assert packages | {GROUND} == on_map, "docs/design.md's layer map and shardq/'s packages differ"


def _facade_reach() -> str:
    """The highest line of the map that the facade (shardq/__init__.py) imports from, at
    once or lazily (its ``_LAZY`` table): importing the facade is importing that line."""
    level = {name: i for i, layer in enumerate(_map()) for name in layer}
    path = os.path.join(PACKAGE, "__init__.py")
    targets = {target for _, target in _imports(path, "shardq")}
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            targets |= {"shardq" + module for module, _ in ast.literal_eval(node.value).values()}
    return min((_unit(t) for t in targets if t != "shardq"), key=level.__getitem__)


def test_imports_point_down_the_map():
    level = {name: i for i, layer in enumerate(_map()) for name in layer}
    reach = _facade_reach()
    level[FACADE_UNIT] = level[reach]
    wrong = []
    for path, module in _modules():
        if module in FACADE:
            continue
        src = _unit(module)
        for line, target in _imports(path, module):
            dst = _unit(target)
            if dst == src:
                continue
            if level[dst] <= level[src]:
                how = "sideways" if level[dst] == level[src] else "up"
                what = f"the shardq facade, which reaches {reach}" if dst == FACADE_UNIT else target
                wrong.append(f"{os.path.relpath(path, REPO)}:{line}: {src} imports {what} ({how})")
    assert not wrong, "imports against docs/design.md's layer map:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader resolves relative imports, including ones inside functions."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from ...service.supervisor import Supervisor\n")
    found = list(_imports(str(path), "shardq.client.sub.x"))
    assert found == [(2, "shardq.service.supervisor")]


def test_the_check_sees_an_import_of_the_facade(tmp_path):
    """``import shardq``, ``from shardq import open`` and ``from .. import open`` (in a
    module of a package of shardq/) all import the facade; ``from .. import limits``
    imports the module shardq.limits."""
    path = tmp_path / "x.py"
    path.write_text("import shardq\nfrom shardq import open\ndef f():\n    from .. import connect, limits\n")
    found = sorted(_imports(str(path), "shardq.tasks.x"))
    assert found == [(1, "shardq"), (2, "shardq"), (4, "shardq"), (4, "shardq.limits")]
    assert {_unit(target) for _, target in found} == {FACADE_UNIT, GROUND}
    assert _facade_reach() == "service"  # shardq.open and shardq.App start a service: only cli and verify may


def test_the_layer_check_fails_on_an_import_of_the_facade_from_below_it(tmp_path, monkeypatch):
    pkg = tmp_path / "shardq" / "tasks"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    import shardq\n")
    monkeypatch.setattr(sys.modules[__name__], "_modules", lambda: iter([(str(pkg / "x.py"), "shardq.tasks.x")]))
    try:
        test_imports_point_down_the_map()
    except AssertionError as e:
        assert "shardq/tasks/x.py:2: tasks imports the shardq facade, which reaches service (up)" in str(e)
    else:
        raise AssertionError("an import of the facade from tasks passed the layer check")


def _graph(modules, root: str = REPO) -> dict[str, set[str]]:
    """module -> the shardq modules it imports when it runs (module level and inside
    functions; a name imported from a package that is not a module counts as the package)."""
    graph: dict[str, set[str]] = {}
    for path, module in modules:
        graph[module] = {target for _, target in _imports(path, module, runtime_only=True, root=root)
                         if target != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one
    module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycles_hidden_or_not():
    """No module imports, directly or through others, one that imports it back: neither
    at module level nor through an import inside a function (which only hides the cycle
    until the function runs). Imports under ``if TYPE_CHECKING:`` never run and are left
    out (a mixin and the class it serves name each other's types that way)."""
    cycles = _cycles(_graph(_modules()))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle_behind_a_function_level_import(tmp_path):
    pkg = tmp_path / "shardq" / "p"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
                              "def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from .b import f\n")
    modules = [(str(pkg / f"{m}.py"), f"shardq.p.{m}") for m in "abc"]
    graph = _graph(modules, root=str(tmp_path))
    assert graph["shardq.p.b"] == {"shardq.p.a"}   # the TYPE_CHECKING import of c is left out
    assert _cycles(graph) == [["shardq.p.a", "shardq.p.b"]]


TESTS = os.path.join(REPO, "tests")


def test_tests_mirror_the_packages_and_share_code_only_through_support():
    """Every test module sits in a folder named after a package of shardq/ (or one of
    ``project``, ``ground``, ``bench``, and ``sqs_clients``: clients that no one here wrote,
    against ``sqs_api``) and imports no other test module."""
    packages = {d for d in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))}
    folders = packages | {"project", "ground", "bench", "sqs_clients"}
    wrong = []
    for root, _, files in os.walk(TESTS):
        rel = os.path.relpath(root, TESTS)
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            if f.startswith("test_") and rel not in folders:
                wrong.append(f"{os.path.relpath(path, REPO)}: not in a folder of a package")
            for node in ast.walk(ast.parse(open(path).read(), path)):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                for name in names:
                    if name.split(".")[-1].startswith("test_") or name.startswith("test_"):
                        wrong.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: imports the test module {name}")
    assert not wrong, "\n".join(wrong)
