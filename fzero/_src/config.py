"""`StepConfig`: the settings of one `train_step`, validated once, when the step is built.

`train_step` turns its keywords into this one frozen value, which the step's parts read
(`step`, `norms`, `agreement`); each setting is checked here on its own, before any step runs
(`ConfigError`; what depends on the state, the step checks). The settings every rank's step must
share (`StepConfig.shared`) travel in the agreement's row as one fingerprint
(`StepConfig.fingerprint`, `agreement.Row`), so ranks whose steps differ raise on every rank.
The lowest of the step's modules: it imports none of the others.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .casting import CastAhead
from .eager import compiled, uncompiled
from .errors import ConfigError, as_int, outside_stacklevel
from .gathering import GATHERS, check_prefetch
from .mesh import settings_crc
from .originals import Once
from .unit import HostBuffers

ENGINES = ("autograd", "func")
NONFINITE = ("raise", "skip")
ACCUMULATE = ("each", "once")
NORMALIZE = ("mean", "tokens")


def _clip_norm(c: Any) -> float:
    """`clip_norm` as a Python float: any real number but a bool (numpy's scalars too, as the
    optimizers' hyper-parameters), finite and > 0, else a `ConfigError` (found in review: an int
    past float's range was Python's `OverflowError`, a numpy float32 refused where float64 was
    taken)."""
    what = f"clip_norm must be None or a finite float > 0 (the max global 2-norm), got {type(c).__name__} {c!r:.80}"
    if isinstance(c, bool) or not isinstance(c, numbers.Real):
        raise ConfigError(what)
    try:
        value = float(c)
    except OverflowError:  # an int (or Fraction) past float's range
        raise ConfigError(what) from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(what)
    return value


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The settings of one `train_step` (see its docstring); validated on construction.

    Fields: `train_step`'s arguments, each as documented there (`loss_fn`, `engine`,
    `on_nonfinite`, `gather`, `micro_batches`, `accumulate`, `accum_dtype`, `normalize`,
    `clip_norm`, `donate`, `persist_bytes`, `max_live_bytes`, `prefetch`, `cast_ahead`,
    `locate_nonfinite`), and what the step learns as it runs, compared neither by `==` nor
    between ranks: `ahead` (`CastAhead`, what `cast_ahead` learned), `buffers` (`HostBuffers`,
    the CPU buffers a donating stage-0 step assembles local gradients into) and `checked`
    (`originals.Once`: whether this thread's first loss was checked for reads of a module given
    to `from_module`).
    """

    loss_fn: Callable[[Any, Any], Any]
    engine: str = "autograd"
    on_nonfinite: str = "raise"
    gather: str = "on_use"
    micro_batches: int = 1
    accumulate: str = "each"
    accum_dtype: torch.dtype | None = None
    normalize: str = "mean"
    clip_norm: float | None = None
    donate: bool = False
    persist_bytes: int = 0
    max_live_bytes: int | None = None
    prefetch: int | None = None
    cast_ahead: bool = False
    locate_nonfinite: bool = False
    ahead: CastAhead = dataclasses.field(default_factory=CastAhead, compare=False, repr=False)
    buffers: HostBuffers = dataclasses.field(default_factory=HostBuffers, compare=False, repr=False)
    checked: Once = dataclasses.field(default_factory=Once, compare=False, repr=False)

    @property
    def shared(self) -> dict[str, Any]:
        """The settings every rank's step must share, each a plain value (str, int, float, bool,
        None or a dtype: their reprs hold no address): all but `loss_fn`, which is compared by
        nothing (each rank's closure may hold its own data), and what the step learns (`ahead`,
        `buffers`). The step's agreement row carries their fingerprint (`fingerprint`), and ranks
        that differ raise `ConfigError` on every rank (`_check_same_steps`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare and f.name != "loss_fn"}

    @functools.cached_property
    def loss_compiled(self) -> bool:
        """Whether `loss_fn` runs torch.compile'd code (`eager.compiled`), read once."""
        return compiled(self.loss_fn)

    @functools.cached_property
    def call(self) -> Callable[[Any, Any], Any]:
        """What the step calls: `loss_fn`, uncompiled under engine "func" (see `__post_init__`)."""
        return uncompiled(self.loss_fn) if self.engine == "func" else self.loss_fn

    @functools.cached_property
    def fingerprint(self) -> int:
        """`shared`'s CRC-32 (31 bits: exact in the agreement's float64 row)."""
        return settings_crc(self.shared)

    def __post_init__(self) -> None:
        if not callable(self.loss_fn):
            raise ConfigError(f"loss_fn must be a callable (params, batch) -> 0-d loss, got {self.loss_fn!r}")
        if self.engine == "func" and self.loss_compiled:
            # found in review: dynamo does not trace a compiled function under torch.func.grad called
            # from eager code (pytorch#128711), so such a loss silently ran eager; and then, called
            # through dynamo, it failed under backend="eager" and made dynamo skip the loss's code
            # for the rest of the process: the step calls the function torch.compile wrapped (`call`)
            how = ("the step calls the function torch.compile wrapped, eager" if self.call is not self.loss_fn else
                   "it runs eager through a wrapper around the compiled function (backend=\"eager\": an "
                   "AssertionError)")
            warnings.warn(f"train_step(torch.compile(loss_fn), engine=\"func\"): the loss is not compiled; {how} "
                          f"(dynamo does not trace a compiled function under torch.func.grad called from eager code), "
                          f"with the uncompiled loss's bits. Compile with engine=\"autograd\", or pass the loss "
                          f"uncompiled (docs/compile.md)", UserWarning, stacklevel=outside_stacklevel())
        for name, value, choices in (("engine", self.engine, ENGINES), ("on_nonfinite", self.on_nonfinite, NONFINITE),
                                     ("gather", self.gather, GATHERS), ("accumulate", self.accumulate, ACCUMULATE),
                                     ("normalize", self.normalize, NORMALIZE)):
            if value not in choices:
                raise ConfigError(f"{name} must be one of {choices}, got {value!r}")
        for name in ("micro_batches", "persist_bytes", "max_live_bytes", "prefetch"):  # np.int64 too: plain ints,
            object.__setattr__(self, name, as_int(getattr(self, name)))  # so the fingerprint is of the value
        k = self.micro_batches
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"micro_batches must be an int >= 1 (micro-batches per optimizer step), got {k!r}")
        a = self.accum_dtype
        if a is not None and (not isinstance(a, torch.dtype) or not a.is_floating_point):
            raise ConfigError(f"accum_dtype must be None (float32, or the gradient's dtype where wider) or a floating "
                              f"torch.dtype, got {a!r}")
        if a is not None and a.itemsize < 2:  # found in review: one micro-batch's gradient silently rounded to fp8,
            # two torch's NotImplementedError for their sum
            raise ConfigError(f"accum_dtype {a} is narrower than 16 bits: gradients are added and handed to the "
                              f"optimizer in it, and torch's 8-bit floats have no addition; use None (float32) or "
                              f"torch.bfloat16 / torch.float16")
        if self.clip_norm is not None:  # 1, 1.0, np.float32(1.0) alike: the fingerprint ranks compare is of the value
            object.__setattr__(self, "clip_norm", _clip_norm(self.clip_norm))
        if not isinstance(self.donate, bool):
            raise ConfigError(f"donate must be a bool, got {self.donate!r}")
        for name in ("cast_ahead", "locate_nonfinite"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        p, cap = self.persist_bytes, self.max_live_bytes
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ConfigError(f"persist_bytes must be an int >= 0 (units of at most this many gathered bytes stay "
                              f"gathered for the step), got {p!r}")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ConfigError(f"max_live_bytes must be None or an int >= 1 (a cap on gathered bytes), got {cap!r}")
        check_prefetch(self.prefetch)
