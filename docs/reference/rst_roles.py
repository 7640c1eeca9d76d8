"""A griffe extension (mkdocs.yml loads it for mkdocstrings): shardq's docstrings are
reStructuredText; the site renders Markdown. Before the docstrings are rendered this turns

* a role (``:class:`~shardq.errors.LeaseLost```, ``:meth:`stop```, ``:mod:`.core```) into a
  link to the object's entry when the reference pages show it, and into its name in code
  otherwise (an autorefs reference marked optional);
* ``text::`` before a literal block into ``text:`` (the indented block below is code in
  Markdown as in reST) and a lone ``::`` line into nothing.

A role is resolved as Sphinx resolves it: a dotted path from ``shardq``; a name in the
scope of the docstring's object, then of each parent up to the package; ``.name`` also by
suffix anywhere in the package. A role that names nothing in the package, and is not a
builtin or a module outside it (``:mod:`sqlite3```, ``:func:`os.fsync```), is a warning,
so ``mkdocs build --strict`` fails on it: every docstring of the package is checked, not
only those the pages show.
"""
from __future__ import annotations

import builtins
import logging
import re
import sys
from typing import Any

from griffe import Alias, Extension, GriffeLoader, Module, Object

# Under "mkdocs", so that `mkdocs build --strict` counts the warnings.
log = logging.getLogger("mkdocs.plugins.shardq.rst_roles")

ROLE = re.compile(r":(?P<role>[a-z]+):`(?P<target>[^`<]+?)`")
LITERAL_LEAD = re.compile(r"(?<=\S)::[ \t]*$", re.MULTILINE)
LONE_LITERAL = re.compile(r"^[ \t]*::[ \t]*\n", re.MULTILINE)
#: Packages outside shardq that its docstrings name (besides the standard library).
THIRD_PARTY = {"msgpack", "psutil", "croniter", "psycopg", "sqlalchemy", "boto3", "botocore", "moto",
               "prometheus_client", "pytest"}
CALLABLE_ROLES = {"func", "meth"}


class RstRoles(Extension):
    def on_package(self, *, pkg: Module, loader: GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "shardq":
            return
        objects = list(_walk(pkg))
        #: every path a role may name (a class's inherited members under the class too)
        paths = {obj.path for obj in objects}
        paths |= {f"{obj.path}.{name}" for obj in objects if obj.is_class for name in obj.all_members}
        for obj in objects:
            if obj.docstring is not None:
                obj.docstring.value = _convert(obj, obj.docstring.value, pkg, paths)


def _walk(obj: Object):
    yield obj
    for member in obj.members.values():
        if not isinstance(member, Alias):
            yield from _walk(member)


def _convert(obj: Object, text: str, pkg: Module, paths: set[str]) -> str:
    def role(m: re.Match) -> str:
        kind, target = m["role"], m["target"].strip()
        short = target.startswith("~")
        target = target.lstrip("~")
        label = target.lstrip(".!").rsplit(".", 1)[-1] if short else target.lstrip("!")
        if kind in CALLABLE_ROLES:
            label += "()"
        if target.startswith("!"):  # Sphinx's "no link"
            return f"`{label}`"
        path = _resolve(obj, target, pkg, paths)
        if path is None:
            if not _external(target):
                where = f"{obj.relative_filepath}:{obj.docstring.lineno if obj.docstring else obj.lineno}"
                log.warning("%s: :%s:`%s` names nothing in shardq (docstring of %s)", where, kind, target,
                            obj.path)
            return f"`{label}`"
        return f'<autoref identifier="{path}" optional><code>{label}</code></autoref>'

    text = ROLE.sub(role, text)
    text = LONE_LITERAL.sub("", text)
    return LITERAL_LEAD.sub(":", text)


def _resolve(obj: Object, target: str, pkg: Module, paths: set[str]) -> str | None:
    """The path of the object ``target`` names, seen from ``obj``'s docstring, or None."""
    if target == "shardq" or target.startswith("shardq."):
        return _lookup(pkg, target.split(".")[1:])
    name = target.lstrip(".")
    scope: Object | None = obj
    while scope is not None:
        found = _lookup(scope, name.split("."))
        if found is not None:
            return found
        scope = scope.parent
    # A method or attribute named from its module's docstring (``:meth:`commit``` for the
    # module's one class with a commit), and ``.name`` anywhere in the package.
    within = obj.module.path + "."
    ends = [p for p in paths if p.endswith("." + name) and (target.startswith(".") or p.startswith(within))]
    return ends[0] if len(ends) == 1 else None


def _lookup(scope: Object, parts: list[str]) -> str | None:
    obj: Any = scope
    for part in parts:
        members = getattr(obj, "all_members", None)  # a class's inherited members too
        if members is None or part not in members:
            return None
        obj = members[part]
        if isinstance(obj, Alias):
            try:
                obj = obj.final_target
            except Exception:  # noqa: BLE001 - an import from outside shardq: named, not linked
                return obj.target_path
    return obj.path


def _external(target: str) -> bool:
    first = target.lstrip(".").split(".")[0]
    return (first in sys.stdlib_module_names or first in THIRD_PARTY
            or (not target.startswith(".") and "." not in target and hasattr(builtins, target)))
