"""`Watched`: a unit leaf whose every torch read is reported (`fzero._src.casting.Reads`).

A tensor subclass whose `__torch_function__` hands each call that takes it -- a torch function,
a tensor method, an attribute read -- to the callback its owner set (`reader(tensor, func)`,
which may raise), then runs the call as on a plain tensor: the results are plain tensors, so
nothing downstream pays for the watch. Only the calls that take a watched leaf go through Python
(a function mode would take every call of the loss). A call that another tensor subclass among
its arguments takes part in is reported as `with_another_subclass` and left to that subclass
(`NotImplemented`: torch then asks the other's `__torch_function__`), so the watch never changes
what another subclass does. Under dynamo (a compiled function reading a watched leaf) it raises
`ConfigError`: the subclass cannot be compiled through.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .errors import ConfigError


def with_another_subclass() -> None:
    """What a read is reported as where another tensor subclass takes part in the call."""


class Watched(torch.Tensor):
    """A unit leaf made by the unit Function's forward (`unit.gather_leaves`), its reads reported
    to `reader` while one is set."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if torch.compiler.is_compiling():
            raise ConfigError("cast_ahead=True: a compiled function (torch.compile) reads a param fzero watches; "
                              "use train_step(cast_ahead=False) with compiled code in the loss (docs/compile.md)")
        kwargs = kwargs or {}
        others = any(t is not Watched and t is not torch.Tensor for t in types)
        with torch._C.DisableTorchFunctionSubclass():  # the reader reads the tensor as a plain one
            for t in tensors_in(args, kwargs):
                reader = getattr(t, "reader", None) if type(t) is Watched else None
                if reader is not None:
                    reader(t, with_another_subclass if others else func)
            if not others:
                return func(*args, **kwargs)
        return NotImplemented


def tensors_in(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, inside lists, tuples and dicts too."""
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
