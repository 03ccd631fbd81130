"""Learning-rate schedules: pure functions `step -> float` (step 0 is the first update).

Each is a closed form in Python float math, the formula of the matching
`torch.optim.lr_scheduler` class's `_get_closed_form_lr`. torch's schedulers update
`group["lr"]` recursively (a chain of multiplications), which rounds differently from the
closed form; to reproduce a torch scheduler bit for bit, record its values and pass the
sequence (`sequence`, or a plain list as `lr`). That holds for the lr of the groups at
`lr_scale=1.0`; a group at another scale steps with `fl(fl(lr(t)) * lr_scale)`, where torch's
group at `lr * lr_scale` under `LambdaLR` steps with `fl(lr * lr_scale * f(t))`, rounded in
another order: one ulp of a Python float apart at some steps, which a float32 update rounded
away at each of 10,000 steps a review sampled (no test samples them), and a float64 update keeps
(found in review).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

from .base import OptimizerError, Schedule, as_schedule, check_hyper


def _check_steps(name: str, value: int, lo: int = 0) -> int:
    """`value` as a Python int: any integer but a bool (`numbers.Integral`: numpy's too), >= `lo`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise OptimizerError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


def constant(value: float) -> Schedule:
    r"""$\eta_t = \eta$ = `value` at every step."""
    value = check_hyper("value", value)
    return lambda step: value


def linear_warmup(peak: float, warmup_steps: int, start_factor: float = 0.0) -> Schedule:
    r"""$\eta_t = \eta\,(f_0 + (1 - f_0)\min(t, T)/T)$: from `start_factor * peak` to `peak` over
    `warmup_steps` steps, then constant (torch `LinearLR(start_factor, 1.0, T)` closed form)."""
    peak = check_hyper("peak", peak)
    total = _check_steps("warmup_steps", warmup_steps, 1)
    f0 = check_hyper("start_factor", start_factor, 0.0, 1.0)
    return lambda step: peak * (f0 + (1.0 - f0) * min(total, step) / total)


def cosine(peak: float, decay_steps: int, final: float = 0.0, warmup_steps: int = 0) -> Schedule:
    r"""Linear warmup from 0 to $\eta$ = `peak` over $W$ = `warmup_steps` steps (if any), then
    cosine decay to $\eta_{min}$ = `final` over $T$ = `decay_steps` steps:
    $\eta_t = \eta_{min} + (\eta - \eta_{min})(1 + \cos(\pi \min(t', T)/T))/2$, $t' = t - W$
    (torch `CosineAnnealingLR(T_max=T, eta_min)` closed form for $W = 0$, held at
    $\eta_{min}$ after $T$).

    `decay_steps` counts the steps *after* the warmup: the schedule reaches `final` at step
    $W + T$. DeepSpeed's `WarmupCosineLR(total_num_steps=...)` and transformers'
    `get_cosine_schedule_with_warmup(num_training_steps=...)` count the warmup in their total
    instead: a schedule of `total` steps in all is
    `cosine(peak, total - warmup_steps, warmup_steps=warmup_steps)`."""
    peak = check_hyper("peak", peak)
    final = check_hyper("final", final)
    total = _check_steps("decay_steps", decay_steps, 1)
    warm = _check_steps("warmup_steps", warmup_steps, 0)

    def fn(step: int) -> float:
        if step < warm:
            return peak * step / warm
        t = min(step - warm, total)
        return final + (peak - final) * (1 + math.cos(math.pi * t / total)) / 2

    return fn


def step_decay(init: float, step_size: int, gamma: float = 0.1) -> Schedule:
    r"""$\eta_t = \eta\,\gamma^{\lfloor t / s \rfloor}$, $\eta$ = `init`, $s$ = `step_size`,
    $\gamma$ = `gamma` (torch `StepLR` closed form). With
    $\gamma > 1$ the value grows; past float's range it is inf (Python's `**` raises there), which
    the optimizer refuses at that step (`as_schedule`), as it refuses a value past the range of the
    params' dtype (`base.check_fits`)."""
    init = check_hyper("init", init)
    size = _check_steps("step_size", step_size, 1)
    gamma = check_hyper("gamma", gamma)

    def fn(step: int) -> float:
        try:
            factor = gamma ** (step // size)
        except OverflowError:
            factor = math.inf
        return init * factor if init != 0 else 0.0

    return fn


def sequence(values: Sequence[float]) -> Schedule:
    """`step -> values[step]`: replay recorded values (e.g. a torch scheduler's
    `get_last_lr()[0]` -- `get_last_lr()` is a list, one lr per param group -- recorded before
    each `optimizer.step()`); asking past the end raises. `values` is any iterable of floats but
    a str (a list, a tuple, a numpy array); anything else (a list of lists too) is an
    `OptimizerError`."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):  # found in review: a bare float
        # gave Python's "'float' object is not iterable"
        raise OptimizerError(f"sequence takes the lr of each optimizer step (a list of floats), got "
                             f"{type(values).__name__} {values!r:.80}; for one lr at every step pass the float "
                             f"itself as lr, or fzero.optim.constant(value)")
    return as_schedule(list(values))
