"""fp16 loss scaling as pure `(init, update)` pairs, with DeepSpeed 0.19's semantics exactly.

A loss scaler is a frozen dataclass of settings with two pure methods:

  init() -> LossScaleState
  update(state, overflow) -> LossScaleState     never mutates `state`

The step multiplies the loss by `scale_of(state)`, reduces the gradients, decides from the
agreed overflow flag whether to skip the optimizer update, and calls `update` once per optimizer
step (after gradient accumulation), as DeepSpeed's ZeRO optimizers call
`loss_scaler.update_scale(overflow)` once per `step()`.

`DynamicLossScale` is DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed 0.19.8,
deepspeed/runtime/fp16/loss_scaler.py) as a function of the state; with H = `hysteresis`,
W = `window`, and the state (s, h, i, l) = (scale, hysteresis, iteration, last_overflow):

  overflow, and H == 1 or h == 1:   s' = max(s / 2, min_scale)    (or raise if s == min_scale
                                                                   and raise_at_min)
  overflow, otherwise:              h' = h - 1
  overflow:                         l' = i
  clean:                            h' = H if consecutive_hysteresis
                                    k = i - l - 1  (clean updates before this one since l)
                                    if k > 0 and k % W == 0:  s' = 2 s,  h' = H
  always:                           i' = i + 1

starting from (init_scale, H, 0, -1). proofs/loss_scale.md states it as a state machine;
tests/test_scale.py replays DeepSpeed's own traces (tests/golden/) through it, step by step.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple, Union

import torch

from .errors import ConfigError, LossScaleError, as_int, outside_stacklevel, refusing_unknown_keywords

FACTOR = 2.0
"""The growth and back-off factor: DeepSpeed's `scale_factor`, fixed at 2."""


LossScaleConfigError = ConfigError  # a loss scaler's setting, or the `overflow` given to `update`


class LossScaleAtFloor(UserWarning):
    """A step under a `DynamicLossScale` (`raise_at_min=False`) skipped an overflow with the scale
    at its floor, `min_scale`: where every step skips there, the scale the gradients need lies
    below the floor (docs/bad-input.md row 274)."""


class LossScaleState(NamedTuple):
    """A loss scaler's state: 0-d CPU tensors only, so a pytree map never sees a setting.

    Attributes:
      scale: `()` float64, the factor the loss is multiplied by. float64 because DeepSpeed's
        `cur_scale` is a Python float: halving, doubling and `max` are then the same IEEE
        double operations, exact for every setting (a `min_scale` of 0.1, which float32 cannot
        hold, or a scale past float32's 2**128 after long clean runs).
      hysteresis: `()` int64, overflows still absorbed before the scale halves (DeepSpeed's
        `cur_hysteresis`), in [1, settings' hysteresis].
      iteration: `()` int64, the number of `update`s so far (DeepSpeed's `cur_iter`).
      last_overflow: `()` int64, the iteration of the latest overflow, -1 before the first
        (DeepSpeed's `last_overflow_iter`).
    """

    scale: torch.Tensor
    hysteresis: torch.Tensor
    iteration: torch.Tensor
    last_overflow: torch.Tensor


def scale_of(state: LossScaleState) -> float:
    """The loss scale of `state` as a Python float (exact: the state holds a float64)."""
    return float(state.scale)


def _state(scale: float, hysteresis: int, iteration: int, last_overflow: int) -> LossScaleState:
    return LossScaleState(
        scale=torch.tensor(scale, dtype=torch.float64),
        hysteresis=torch.tensor(hysteresis, dtype=torch.int64),
        iteration=torch.tensor(iteration, dtype=torch.int64),
        last_overflow=torch.tensor(last_overflow, dtype=torch.int64),
    )


def _overflow(overflow: bool | torch.Tensor) -> bool:
    """`overflow` as a Python bool; a Python bool or a 0-d bool tensor, nothing else."""
    if isinstance(overflow, bool):
        return overflow
    if isinstance(overflow, torch.Tensor) and overflow.dim() == 0 and overflow.dtype == torch.bool:
        return bool(overflow)
    what = f"a {overflow.dtype} tensor of shape {list(overflow.shape)}" if isinstance(overflow, torch.Tensor) else repr(overflow)
    raise LossScaleConfigError(
        f"overflow must be a Python bool or a 0-d bool tensor, got {what}; pass the flag all ranks "
        f"agreed on, e.g. `found_inf > 0` for a float found-inf count"
    )


def _positive(name: str, value: float) -> float:
    """`value` as a float, or a `LossScaleConfigError` naming the setting."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossScaleConfigError(f"{name} must be a Python float, got {type(value).__name__} {value!r}")
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not (math.isfinite(as_float) and as_float > 0):
        raise LossScaleConfigError(f"{name} must be finite and > 0, got {value!r}")
    return as_float


SMALLEST = 2.0**-126  # float32's smallest normal number: 1 / scale is finite in float32 down to it


def _scale(name: str, value: float) -> float:
    """A loss scale: `_positive`, and at least float32's smallest normal number, else a
    `LossScaleConfigError` naming the setting (found in review: at 1e-39 the step's unscale
    factor 1/s overflowed float32, and the step blamed the optimizer's update for the NaN)."""
    as_float = _positive(name, value)
    if as_float < SMALLEST:
        raise LossScaleConfigError(
            f"{name} must be at least float32's smallest normal number 2**-126 ({SMALLEST!r}), got {value!r}: the "
            f"step unscales the gradients by 1 / scale in float32, which overflows below it (a loss scale is "
            f"normally 1 or more)")
    return as_float


def _count(name: str, value: int) -> int:
    value = as_int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LossScaleConfigError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    return value


def _flag(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise LossScaleConfigError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale, `scale` (DeepSpeed's `LossScaler`, fp16 `loss_scale > 0`).

    `update` returns its input: the scale never changes and no counter advances, as DeepSpeed's
    static scaler's `update_scale` does nothing. The step still skips an overflowing update.

    >>> scaler = StaticLossScale(1024.0)
    >>> scale_of(scaler.update(scaler.init(), True))
    1024.0
    """

    scale: float

    def __post_init__(self) -> None:
        _scale("StaticLossScale.scale", self.scale)

    def init(self) -> LossScaleState:
        """`(scale, 1, 0, -1)`."""
        return _state(float(self.scale), 1, 0, -1)

    def update(self, state: LossScaleState, overflow: bool | torch.Tensor) -> LossScaleState:
        """`state` itself, after checking `overflow`."""
        _overflow(overflow)
        return state


# the names torch's GradScaler and DeepSpeed's config and DynamicLossScaler give a dynamic scaler's settings:
# fzero's, or why none
_OTHER_NAMES = {
    "growth_interval": "window (GradScaler's growth_interval; hysteresis=1 for its halving at the first overflow)",
    "growth_factor": "none: the scale doubles, as DeepSpeed's does (GradScaler's default growth_factor=2.0)",
    "backoff_factor": "none: the scale halves, as DeepSpeed's does (GradScaler's default backoff_factor=0.5)",
    "enabled": "none: pass loss_scale=None to fzero.init for no scaling",
    "initial_scale_power": "init_scale=2.0**power",
    "loss_scale_window": "window",
    "min_loss_scale": "min_scale",
    "delayed_shift": "hysteresis",
    "scale_window": "window",
    "scale_factor": "none: the scale doubles and halves, as DeepSpeed's default scale_factor=2.0 does",
    "raise_error_at_min_scale": "raise_at_min",
}


def _unknown_scaler_settings(unknown: dict[str, Any]) -> str:
    """`DynamicLossScale`'s words for keywords it has no field for, with fzero's name for each
    one torch's `GradScaler` or DeepSpeed's config uses (found in review: Python's bare
    TypeError for GradScaler's `growth_interval`)."""
    named = "; ".join(f"{k} -> {_OTHER_NAMES[k]}" if k in _OTHER_NAMES else f"{k}: no such setting" for k in unknown)
    return (f"DynamicLossScale got {', '.join(repr(k) for k in unknown)} ({named}); its settings are init_scale, "
            f"window, hysteresis, consecutive_hysteresis, min_scale and raise_at_min (help(fzero.DynamicLossScale))")


@refusing_unknown_keywords(lambda given, unknown: LossScaleConfigError(_unknown_scaler_settings(unknown)))
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """DeepSpeed's dynamic loss scaler (fp16 `loss_scale: 0`) as a pure `(init, update)` pair.

    DeepSpeed's config names are in brackets; its ZeRO defaults are these, except for
    `raise_at_min`: DeepSpeed's `DynamicLossScaler` defaults `raise_error_at_min_scale=True`,
    and ZeRO never overrides it.

    Settings:
      init_scale: the first scale (`2**initial_scale_power`).
      window: W, clean updates between doublings (`loss_scale_window`).
      hysteresis: H, overflows absorbed before the scale halves (`hysteresis`, the scaler's
        `delayed_shift`). Refilled to H at each doubling, or at every clean update with
        `consecutive_hysteresis`.
      consecutive_hysteresis: refill the hysteresis at every clean update, so only H
        overflows in a row halve the scale (`consecutive_hysteresis`).
      min_scale: the floor of the scale (`min_loss_scale`); `min_scale <= init_scale`.
      raise_at_min: raise `LossScaleError` when the scale would halve at the floor, instead of
        staying there (the scaler's `raise_error_at_min_scale`).

    The update rule is in `fzero._src.scale`'s docstring. Without overflows the
    scale doubles on the (W+1)-th update and then every W updates: after n >= 1 clean updates it
    is `init_scale * 2**((n - 1) // W)`.

    >>> scaler = DynamicLossScale(init_scale=8.0, window=2, hysteresis=1)
    >>> state = scaler.init()
    >>> [scale_of(state := scaler.update(state, o)) for o in (True, False, False, False)]
    [4.0, 4.0, 4.0, 8.0]
    """

    init_scale: float = 2.0**16
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    raise_at_min: bool = False

    def __post_init__(self) -> None:
        init = _scale("DynamicLossScale.init_scale", self.init_scale)
        low = _scale("DynamicLossScale.min_scale", self.min_scale)
        for name in ("window", "hysteresis"):  # an np.int64 kept as the int: its repr is compared across ranks
            object.__setattr__(self, name, _count(f"DynamicLossScale.{name}", getattr(self, name)))
        _flag("DynamicLossScale.consecutive_hysteresis", self.consecutive_hysteresis)
        _flag("DynamicLossScale.raise_at_min", self.raise_at_min)
        if low > init:
            raise LossScaleConfigError(
                f"DynamicLossScale.min_scale={self.min_scale!r} is above init_scale={self.init_scale!r}; "
                f"lower min_scale or raise init_scale"
            )

    def init(self) -> LossScaleState:
        """`(init_scale, H, 0, -1)`: DeepSpeed's `cur_iter = 0`, `last_overflow_iter = -1`."""
        return _state(float(self.init_scale), self.hysteresis, 0, -1)

    def update(self, state: LossScaleState, overflow: bool | torch.Tensor) -> LossScaleState:
        """The state after one optimizer step whose gradients did (`overflow`) or did not
        overflow; the rule is in `fzero._src.scale`'s docstring. Raises `LossScaleError` where
        DeepSpeed raises (its state, like `state` here, then stays as it was)."""
        overflow = _overflow(overflow)
        scale, hyst = float(state.scale), int(state.hysteresis)
        i, last = int(state.iteration), int(state.last_overflow)
        if overflow:
            if self.hysteresis == 1 or hyst == 1:
                if scale == self.min_scale and self.raise_at_min:
                    raise LossScaleError(
                        f"the gradients overflowed at iteration {i} with the loss scale already at "
                        f"min_scale={self.min_scale!r} and no hysteresis left; lower min_scale, set "
                        f"raise_at_min=False to keep skipping steps at the minimum, or find what makes "
                        f"the gradients non-finite"
                    )
                scale = max(scale / FACTOR, float(self.min_scale))
            else:
                hyst -= 1
            last = i
        else:
            if self.consecutive_hysteresis:
                hyst = self.hysteresis
            stable = i - last - 1
            if stable > 0 and stable % self.window == 0:
                hyst = self.hysteresis  # DeepSpeed: "if not consecutive", a no-op otherwise
                scale *= FACTOR
        return _state(scale, hyst, i + 1, last)


def warn_at_floor(scaler: LossScale | None, scale: float, step: int, bad_losses: tuple[int, ...] = (),
                  bad_gradients: tuple[int, ...] = ()) -> None:
    """`LossScaleAtFloor` where a step under a dynamic `scaler` skipped an overflow with the scale
    at its floor and does not raise there (`raise_at_min=False`, the default): such a run otherwise
    skips every step with `metrics.skipped` the only sign (found in review: `normalize="tokens"`
    at 140,000 tokens a micro-batch under fp16). `bad_losses`: the ranks whose loss itself was
    non-finite, which no scale mends (found in review: the words blamed the gradients and sent
    the user to a lower floor, under which every step still skipped); `bad_gradients`: the other
    ranks found non-finite, whose gradients alone overflowed, which a lower floor may mend."""
    if isinstance(scaler, DynamicLossScale) and scale == scaler.min_scale and not scaler.raise_at_min:
        words = (_loss_at_floor_words(step, scale, bad_losses, bad_gradients) if bad_losses
                 else _at_floor_words(step, scale))
        warnings.warn(LossScaleAtFloor(words), stacklevel=outside_stacklevel())


def _loss_at_floor_words(step: int, floor: float, ranks: tuple[int, ...], gradients: tuple[int, ...] = ()) -> str:
    also = (f"; on rank(s) {list(gradients)} the gradients alone overflowed, which a lower floor may mend "
            f"(DynamicLossScale(min_scale=2.0**-k))" if gradients else "")
    return (f"step {step} (state.step, which a skipped step does not advance): the loss was non-finite on rank(s) "
            f"{list(ranks)}, with the loss scale at its floor, min_scale={floor!r}: the step is skipped and the scale "
            f"stays (DynamicLossScale(raise_at_min=False)). No loss scale makes a loss finite (the scale multiplies "
            f"the loss the function returns): an fp16 loss or token sum past 65504 is inf before it, so compute it "
            f"in float32 (loss.float(), F.cross_entropy(logits.float(), ...)); else find the NaN or inf in that "
            f"rank's batch or model (train_step(locate_nonfinite=True), raise_at_min=True to stop there){also}")


def _at_floor_words(step: int, floor: float) -> str:
    """`LossScaleAtFloor`'s message: a step skipped with the scale at its floor. The likely cause
    where every step skips: a loss whose gradients exceed fp16's range at the floor, as under
    `normalize="tokens"`, whose backward carries each micro-batch's scaled token sum (1/T comes
    after the reduction), so the scale it needs is about T times lower than a mean's, T the count
    of one micro-batch (found in review of precision: at 140,000 tokens a rank every step skipped
    at the default floor, silently)."""
    return (f"step {step} (state.step, which a skipped step does not advance): the gradients overflowed with the loss "
            f"scale at its floor, min_scale={floor!r}: the step is skipped and the scale stays "
            f"(DynamicLossScale(raise_at_min=False)). Where every step skips, the scale the gradients need lies below "
            f"the floor: lower min_scale (DynamicLossScale(min_scale=2.0**-k); under normalize='tokens' each "
            f"micro-batch's backward carries its scaled token sum, so the scale it needs is about T times lower than "
            f"a mean's, T the count the loss returns for one micro-batch), or set raise_at_min=True to stop there, "
            f"or find what makes the gradients non-finite")


LossScale = Union[StaticLossScale, DynamicLossScale]
"""Either loss scaler; both have `init()` and `update(state, overflow)`."""
