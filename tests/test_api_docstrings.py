"""Every public callable's docstring names its parameters, and names no parameter it lacks.

The public callables are the functions and classes in the `__all__` of `fzero` and of its public
namespaces (`fzero.accounting`, `.checkpoint`, `.collectives`, `.layout`, `.optim`, `.testing`);
a class's parameters are its constructor's (a dataclass's or NamedTuple's fields).

fzero's docstrings follow Google style where they list parameters: a section header on a line of
its own ("Args:", "Attributes:", "Settings:", "Parameters:"; "Attributes (note):" too), then one
entry per line two spaces deeper, `name: text` or `a, b, c: text` for several, continued deeper.
Prose docstrings without such a section name each parameter in backticks (`world_size`). So:

- a parameter is *mentioned* where a section entry lists it or a backtick span holds it as a word;
- a name a section lists must be a parameter: every entry of "Args" / "Settings" / "Parameters",
  and of "Attributes" where the class's parameters are its attributes (a dataclass or NamedTuple;
  another class's "Attributes" describe state its constructor does not take).

Parameters whose name starts with "_" (private hooks such as `checkpoint.save`'s `_fail_at`),
`self` / `cls` and `*args` / `**kwargs` need no mention (an entry may still list `**kwargs` by its
name).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

NAMESPACES = ("fzero", "fzero.accounting", "fzero.checkpoint", "fzero.collectives", "fzero.layout", "fzero.optim",
              "fzero.testing")

_HEADER = re.compile(r"^(?P<indent> *)(?P<kind>Args|Arguments|Parameters|Attributes|Settings)\b[^:\n]*(\([^)]*\))?:\s*$")
_ENTRY = re.compile(r"^(?P<names>[A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?:\([^)]*\))?:(?:\s|$)")
_CHECKED_KINDS = {"Args", "Arguments", "Parameters", "Settings"}


def doc_sections(doc: str) -> dict[str, list[str]]:
    """`{section kind: the names its entries list}` of a cleaned docstring (`inspect.getdoc`)."""
    lines = doc.splitlines()
    out: dict[str, list[str]] = {}
    i = 0
    while i < len(lines):
        m = _HEADER.match(lines[i])
        if not m:
            i += 1
            continue
        indent, names = len(m.group("indent")), out.setdefault(m.group("kind"), [])
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            line = lines[i]
            entry = _ENTRY.match(line.strip())
            if line.strip() and len(line) - len(line.lstrip()) == indent + 2 and entry:
                names += [n.strip() for n in entry.group("names").split(",")]
            i += 1
    return out


def backticked(doc: str) -> set[str]:
    """The identifiers inside the docstring's backtick spans."""
    return {w for span in re.findall(r"`([^`]+)`", doc) for w in re.findall(r"[A-Za-z_]\w*", span)}


def parameters(obj: Any) -> list[str] | None:
    """The checked parameter names of `obj`'s signature, or None where it has none to read."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtin exception types
        return None
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in sig.parameters.values()
            if p.kind not in skip and p.name not in ("self", "cls") and not p.name.startswith("_")]


def _fields_are_parameters(obj: Any) -> bool:
    return inspect.isclass(obj) and (dataclasses.is_dataclass(obj) or hasattr(obj, "_fields"))


def problems(name: str, obj: Any) -> list[str]:
    """What is wrong with `obj`'s docstring, one line each (`[]`: nothing)."""
    params = parameters(obj)
    if params is None:
        return []
    doc = inspect.getdoc(obj) or ""
    sections = doc_sections(doc)
    listed = {n for names in sections.values() for n in names}
    mentioned = listed | backticked(doc)
    out = [f"{name}: parameter {p!r} is not mentioned in the docstring (list it under Args:, or name it in "
           f"backticks)" for p in params if p not in mentioned]
    every = set(inspect.signature(obj).parameters)  # `**step_kwargs: ...` may be listed by its name
    kinds = _CHECKED_KINDS | ({"Attributes"} if _fields_are_parameters(obj) else set())
    for kind in sorted(kinds & sections.keys()):
        out += [f"{name}: the docstring's {kind} section lists {n!r}, which is not a parameter "
                f"(parameters: {params})" for n in sections[kind] if n not in every]
    return out


def public_callables() -> Iterator[tuple[str, Any]]:
    seen: set[int] = set()
    for module_name in NAMESPACES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            yield f"{module_name}.{name}", obj


def test_every_public_parameter_is_documented_and_every_documented_one_exists():
    found = [p for name, obj in public_callables() for p in problems(name, obj)]
    assert not found, "\n".join(found)


def test_the_walk_reaches_the_api_and_reads_its_sections():
    """Not vacuous: the walk finds the entry points, and the parser reads the sections they have."""
    names = dict(public_callables())
    for name in ("fzero.init", "fzero.train_step", "fzero.gather", "fzero.SimMesh", "fzero.DistMesh",
                 "fzero.ParamGroup", "fzero.checkpoint.save", "fzero.checkpoint.load", "fzero.optim.adamw",
                 "fzero.optim.sgd", "fzero.optim.cosine", "fzero.testing.Pool"):
        assert name in names, name
    assert len(names) > 100, len(names)
    init = doc_sections(inspect.getdoc(names["fzero.init"]))["Args"]
    assert {"params", "optimizer", "stage", "mesh", "units", "groups", "align", "bucket_bytes"} <= set(init), init
    assert set(doc_sections(inspect.getdoc(names["fzero.ParamGroup"]))["Attributes"]) == set(
        parameters(names["fzero.ParamGroup"]))
    assert "window" in doc_sections(inspect.getdoc(names["fzero.DynamicLossScale"]))["Settings"]


def _ok(a: int, b: int = 1, *rest: Any, _hook: Any = None, **kw: Any) -> None:
    """Adds.

    Args:
      a, b: the terms.
    """


def _missing(a: int, b: int) -> None:
    """Adds `a` to something.

    Args:
      a: a term,
        b: a continuation line, not an entry.
    """


def _extra(a: int) -> None:
    """Adds.

    Args:
      a: the term.
      c: gone.
    """


class _Plain:
    """A class whose Attributes describe state the constructor does not take.

    Attributes:
      total: computed.
    """

    def __init__(self, n: int) -> None:
        """`n` things."""


@dataclasses.dataclass
class _Fields:
    """A dataclass, whose Attributes are its constructor's parameters.

    Attributes:
      n: a field.
      gone: not a field.
    """

    n: int


@pytest.mark.parametrize(("fn", "expected"), [
    (_ok, []),
    (_missing, ["'b' is not mentioned"]),
    (_extra, ["lists 'c'"]),
    (_Plain, ["'n' is not mentioned"]),
    (_Fields, ["lists 'gone'"]),
])
def test_the_check_fails_where_a_docstring_is_wrong(fn: Callable, expected: list[str]):
    found = problems(fn.__name__, fn)
    assert len(found) == len(expected), found
    for line, want in zip(found, expected):
        assert want in line, (line, want)
