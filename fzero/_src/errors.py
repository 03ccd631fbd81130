"""fzero's exceptions. Each message names the pytree path, shapes, world size and the way out."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

import torch


class FzeroError(Exception):
    """Base class of every error fzero raises on purpose."""


class ConfigError(FzeroError, ValueError):
    """A setting (a stage, a count, a dtype, an option) is not one fzero accepts."""


class LayoutError(FzeroError, ValueError):
    """A params pytree, a plan or a buffer does not fit the layout."""


class MeshError(FzeroError, RuntimeError):
    """A collective could not run: ranks disagree, a rank failed or returned early."""


class CollectiveMismatch(MeshError):
    """Ranks called different collectives (op, dtype, shape or tag) at the same point."""


class RankFailed(MeshError):
    """Another rank raised; this rank stops instead of waiting for it forever."""


class NonFiniteError(FzeroError, FloatingPointError):
    """A loss or gradient was NaN or inf on some rank (see `on_nonfinite`)."""


class LossScaleError(FzeroError, FloatingPointError):
    """The gradients overflowed with the loss scale already at `min_scale` (`raise_at_min`)."""


class OffloadError(FzeroError, OSError):
    """Offloaded state cannot be kept: an NVMe path is missing, unwritable or full, or its I/O failed."""


def as_int(value: Any) -> Any:
    """`value` as a Python int where it is an integer of another type (`np.int64(4096)`: any
    `numbers.Integral` but a bool), else as it is, for the caller's check to refuse (found in
    review: numpy ints were refused where bad-input.md says they are taken)."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)) else value


def said(e: BaseException) -> str:
    """`str(e)`, or `""` where the error's own `__str__` raises: the error paths that read torch's
    words to explain them (`"nference tensor" in said(e)`) never put the `str()`'s error in place
    of the error they explain (found in review: a user's exception whose `__str__` raised left a
    step as that `__str__`'s error)."""
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - any error of a user's __str__
        return ""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # fzero/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep  # torch/
_WRAPPERS = frozenset({functools.__file__, dataclasses.__file__})  # cached_property, dataclasses.replace


def outside_stacklevel() -> int:
    """The `stacklevel` at which `warnings.warn`, called by this function's caller, names the first
    frame outside fzero and torch (the user's line), however many of fzero's own calls lie between,
    and torch's wrappers of them (`torch.compiler.disable` around the step), a dataclass's
    generated `__init__` (whose file is "<string>") calling fzero's `__post_init__`, and the
    standard library's `functools` and `dataclasses` frames between (a `cached_property`,
    `dataclasses.replace`: found in review)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith((_PACKAGE, _TORCH))
                                 or frame.f_code.co_filename in _WRAPPERS
                                 or frame.f_code.co_filename == "<string>" and frame.f_code.co_name == "__init__"):
        frame, level = frame.f_back, level + 1
    return level


def refusing_unknown_keywords(words: Callable[[dict[str, Any], dict[str, Any]], FzeroError]) -> Callable[[type], type]:
    """A dataclass decorator (applied above `@dataclasses.dataclass`): its `__init__` raises
    `words(given, unknown)` -- `given` the known settings by name, positional ones too, `unknown`
    the keywords it has no field for -- where Python raised its bare `TypeError` ("unexpected
    keyword argument"): torch's or DeepSpeed's name for a setting fzero calls otherwise (found in
    review). The dataclass's own `__init__` does the rest."""

    def wrap(cls: type) -> type:
        init = cls.__init__
        names = [f.name for f in dataclasses.fields(cls)]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            unknown = {k: v for k, v in kwargs.items() if k not in names}
            if unknown:
                raise words({**dict(zip(names, args)), **kwargs}, unknown)
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return wrap
