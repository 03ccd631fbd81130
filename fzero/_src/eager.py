"""`eager(fn)`: `fn`, never traced by dynamo, at the cost of a plain call where dynamo is absent.

`torch.compiler.disable(fn)` makes dynamo run `fn` eager (a graph break at the call, no tracing
inside), but its wrapper switches dynamo's frame callback off and back on around every call,
compiled or not: about a microsecond of host time per call on the CPU this was measured on
(benchmarks/host_profile.py), and a step's forward makes several such calls per unit (a read,
its collectives, their waits). `eager(fn)` calls `fn` directly where dynamo can see nothing --
not tracing (`torch.compiler.is_compiling()`, which dynamo folds to True while it traces) and no
frame callback installed on this thread (no compiled code is running: a compiled function sets
one for the frames it calls; a disabled region clears it) -- and through
`torch.compiler.disable(fn)` otherwise: traced, the same graph break as the decorator; called
by compiled code at run time, the callback is switched off for `fn` and all it calls.

The callback is read with `torch._C._dynamo.eval_frame.get_eval_frame_callback` (private, in
torch since 2.1; where it is missing every call goes through `torch.compiler.disable`).
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_compiling = torch.compiler.is_compiling
_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_callback = getattr(_eval_frame, "get_eval_frame_callback", None)
_state = threading.local()


def compiled(fn: Any) -> bool:
    """Whether `fn` runs `torch.compile`d code: a compiled function or module (`_compile_wrapper`),
    bare, inside `functools.partial`s, bound as a method, or under decorators that name it as
    `__wrapped__` (`functools.wraps`, `torch.autocast(...)(compiled)`); not a
    `torch.compiler.disable`d function (found in review: it carries the same attribute and was
    warned of as compiled). A compiled function called inside another cannot be seen."""
    for _ in range(64):  # (a chain of wrappers, bounded: a __wrapped__ cycle ends it)
        while isinstance(fn, functools.partial):
            fn = fn.func
        fn = getattr(fn, "__func__", fn)  # a bound method: its function
        if _compile_wrapper(fn):
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


def uncompiled(fn: Any) -> Any:
    """`fn` with `torch.compile`'s own wrappers taken off (`_compile_wrapper`; inside
    `functools.partial`s and bound methods too, which are rebuilt around what they wrap, or
    returned as they are where nothing was taken off): the function, or for a compiled module
    its `_orig_mod`. A decorator around a compiled function is kept (`functools.wraps` copies the
    compiled function's attributes onto it: `torch.autocast(...)(compiled)`, a user's wrapper),
    whose own work must run (found in review: taken off with the wrapper, the loss lost its
    autocast, silently; a method compiled in its class lost its `self`)."""
    if isinstance(fn, functools.partial):
        inner = uncompiled(fn.func)
        return fn if inner is fn.func else functools.partial(inner, *fn.args, **fn.keywords)
    if isinstance(fn, types.MethodType):
        inner = uncompiled(fn.__func__)
        return fn if inner is fn.__func__ else types.MethodType(inner, fn.__self__)
    while _compile_wrapper(fn):
        fn = fn._orig_mod if isinstance(fn, torch.nn.Module) else fn._torchdynamo_orig_callable
    return fn


def _compile_wrapper(fn: Any) -> bool:
    """Whether `fn` is what `torch.compile` returns: an `OptimizedModule`, or a function whose
    code is that of the closure `torch.compile(f)` returns for every `f` (a decorator carrying the
    attributes `functools.wraps` copied has its own code; `torch.compiler.disable`'s, another)."""
    if not hasattr(fn, "_torchdynamo_orig_callable") and not hasattr(fn, "_orig_mod"):
        return False  # (dynamo need not be imported for anything else)
    optimized = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "OptimizedModule", None)
    return (optimized is not None and isinstance(fn, optimized)) or (
        hasattr(fn, "_torchdynamo_orig_callable") and getattr(fn, "__code__", None) is _compile_wrapper_code())


@functools.cache
def _compile_wrapper_code() -> Any:
    """The code of the function `torch.compile(fn)` returns (one closure's code for every `fn`);
    read where a compiled function was met, so dynamo is imported already."""
    return torch.compile(lambda: None).__code__


def note_fullgraph(e: BaseException, gather: str) -> None:
    """A note on dynamo's `Unsupported` where a `fullgraph=True` function met one of fzero's
    `eager` functions while reading params on use (`Gathering.read`, `apply`'s bookkeeping):
    dynamo's hint, to remove the `torch.compiler.disable`, cannot be taken; `gather="eager"` hands
    the function plain leaves (found in review of torch.compile: dynamo's words alone)."""
    unsupported = getattr(getattr(getattr(torch, "_dynamo", None), "exc", None), "Unsupported", None)
    if (gather == "on_use" and unsupported is not None and isinstance(e, unsupported)
            and "torch.compiler.disable" in str(e) and "fzero" in str(e)):
        e.add_note("fzero: a torch.compile(..., fullgraph=True) function read params on use (gather='on_use'), "
                   "which fzero gathers at the first read, outside dynamo: a graph break by design. Ignore dynamo's "
                   "hint to remove torch.compiler.disable; pass gather='eager' to train_step / fzero.evaluate, or "
                   "read the leaves outside the compiled function (docs/compile.md)")


def from_compiled() -> bool:
    """Whether the `eager` function running now was called by compiled code or while dynamo
    traces (False where this torch lacks the callback's reader: unknown)."""
    return getattr(_state, "compiled", False)


def eager(fn: F) -> F:
    """`fn` run eager: directly where dynamo is neither tracing nor installed on this thread,
    else through `torch.compiler.disable(fn)`. For functions and methods (decorate the `def`)."""
    disabled = torch.compiler.disable(fn)
    if _callback is None:
        return disabled

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _compiling() or _callback() is not None:
            outer, _state.compiled = from_compiled(), True
            try:
                return disabled(*args, **kwargs)
            finally:
                _state.compiled = outer
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
