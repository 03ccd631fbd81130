"""Pytree helpers: one flattening rule for all of fzero.

fzero flattens with optree in its own namespace ("fzero"), `None` is an empty subtree (not a
leaf), and dict entries come out in sorted-key order (optree's rule); `unflatten` restores the
original key order. Leaf paths are dotted strings built from dict keys, sequence indices and
NamedTuple fields (`{"h": [{"w": ...}]}` -> `"h.0.w"`), the same form as
`nn.Module.named_parameters()`, so one predicate reads both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree

NAMESPACE = "fzero"


def _entry_name(entry: Any) -> str:
    for attr in ("key", "field", "name", "index"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten_with_paths(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """`tree -> (paths, leaves, spec)`; paths are dotted strings, in leaf order."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(
        tree, none_is_leaf=False, namespace=NAMESPACE
    )
    paths = [".".join(_entry_name(e) for e in acc) or "<root>" for acc in accessors]
    return paths, leaves, spec


def flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    return optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, leaves: Any) -> Any:
    return optree.tree_unflatten(spec, list(leaves))


def tree_map(fn: Any, tree: Any, *rest: Any) -> Any:
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False, namespace=NAMESPACE)


def named_paths(paths: Sequence[str], limit: int = 8) -> str:
    """The first `limit` of `paths` in a message, quoted, then " ..." where there are more."""
    return ", ".join(repr(p) for p in paths[:limit]) + (" ..." if len(paths) > limit else "")
