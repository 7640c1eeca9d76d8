"""The layer map of docs/design.md ("## Layers") is what the package's imports do: every
import in shardq/ (at module level, inside functions, under TYPE_CHECKING) points down the
map, never up or sideways, and every package is on the map. The tests keep a layout of
their own: one folder per package, shared code in tests/support/, and no test module
importing another."""
from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "shardq")
FACADE = {"shardq", "shardq.__main__"}
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
    """``shardq.client.router`` -> ``client``; a module directly in shardq/ -> ground."""
    sub = module.split(".")[1]
    return sub if os.path.isdir(os.path.join(PACKAGE, sub)) else GROUND


def _imports(path: str, module: str):
    """(line, imported module) of every shardq import in one file, relative ones resolved."""
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            if name == "shardq" or not node.module:
                for alias in node.names:
                    yield node.lineno, f"{name}.{alias.name}"
            elif name.startswith("shardq."):
                yield node.lineno, name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shardq."):
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


def test_imports_point_down_the_map():
    level = {name: i for i, layer in enumerate(_map()) for name in layer}
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
                wrong.append(f"{os.path.relpath(path, REPO)}:{line}: {src} imports {target} ({how})")
    assert not wrong, "imports against docs/design.md's layer map:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader resolves relative imports, including ones inside functions."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from ...service.supervisor import Supervisor\n")
    found = list(_imports(str(path), "shardq.client.sub.x"))
    assert found == [(2, "shardq.service.supervisor")]


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
