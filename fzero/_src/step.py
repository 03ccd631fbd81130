"""`train_step`: a loss -> a pure `step(state, batch) -> (state, metrics)`.

One step on one rank, each part a short function over the frozen `StepConfig`:

1. `backward`: each unit's leaves come out of the per-unit Function (gathered where the stage
   shards params), `loss_fn(params, batch)` gives this rank's mean loss, and its gradient is
   taken (`torch.autograd.grad`, or `torch.func.grad_and_value` with `engine="func"`); stages
   that shard gradients reduce-scatter each unit inside its backward (with the autograd engine
   started there and waited for when the backward is done, `unit.Inflight`). The units' probes report
   which leaves got a gradient and which local gradients were non-finite;
2. `reduce`: the stage's `after_backward` per bucket, every bucket's collectives started before
   any is waited for; the reduced gradient is `Σ_r fl(1/N) g_r`;
3. `agree`: one all-gather of a small float64 vector agrees on what every rank saw: its loss,
   which leaves it used, which local gradients were non-finite, and its part of `‖g‖²`;
4. a non-finite step raises on every rank or is skipped (`on_nonfinite`), leaving the state as
   it was; otherwise `update` applies the optimizer to what the rank owns and the stage's
   `finish` (stages 1-2: all-gather the new params, each bucket's started as its update ends).

At N = 1 nothing is moved: reductions and gathers of gradients and updated params are recorded
and return their input (`Mesh.solo`), except stage 3's gathers, which copy.

The input state is never modified. The new state's updated tensors are fresh; what a step does
not touch (frozen buckets' params) is shared with the input state, as in JAX: treat states as
immutable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from .collectives import all_gather, all_reduce, func_level
from .errors import ConfigError, NonFiniteError
from .gathering import GATHERS, Gathering, check_prefetch, is_flat_dict, same_paths
from .offload import HostUpdate, differentiated
from .optim.base import UpdateContext
from .state import ZeroState, check_state, consume
from .unit import Inflight, Probe, nonfinite, unit_programs

ENGINES = ("autograd", "func")
NONFINITE = ("raise", "skip")
ACCUMULATE = ("each", "once")
NORMALIZE = ("mean", "tokens")
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (norm + 1e-6)


class Metrics(NamedTuple):
    """What a step reports, the same on every rank.

    Attributes:
      loss: float64 0-d, the mean over ranks of each rank's loss (summed in rank order, / N).
      grad_norm: float64 0-d, `‖Σ_r fl(1/N) g_r‖₂` over all trainable leaves: a float32 norm per
        bucket shard, their squares summed in float64, over ranks in rank order (the same bits
        in every stage; relative error at most γ_{S+1} + 2u, proofs/stages.md §3).
      step: the index of this update (0 for the first): the input state's step count.
      skipped: True if the step was non-finite and left the state as it was (`on_nonfinite="skip"`,
        or an overflow under a loss scaler, which then only updates the scaler's state).
      loss_scale: the loss scale this step used, or None without a loss scaler. `loss` and
        `grad_norm` are unscaled (divided by it).
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor
    step: int
    skipped: bool
    loss_scale: float | None = None


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The settings of one `train_step` (see its docstring); validated on construction."""

    loss_fn: Callable[[Any, Any], Any]
    engine: str = "autograd"
    on_nonfinite: str = "raise"
    gather: str = "on_use"
    micro_batches: int = 1
    accumulate: str = "each"
    accum_dtype: torch.dtype = torch.float32
    normalize: str = "mean"
    clip_norm: float | None = None
    donate: bool = False
    persist_bytes: int = 0
    max_live_bytes: int | None = None
    prefetch: int = 0

    def __post_init__(self) -> None:
        if not callable(self.loss_fn):
            raise ConfigError(f"loss_fn must be a callable (params, batch) -> 0-d loss, got {self.loss_fn!r}")
        for name, value, choices in (("engine", self.engine, ENGINES), ("on_nonfinite", self.on_nonfinite, NONFINITE),
                                     ("gather", self.gather, GATHERS), ("accumulate", self.accumulate, ACCUMULATE),
                                     ("normalize", self.normalize, NORMALIZE)):
            if value not in choices:
                raise ConfigError(f"{name} must be one of {choices}, got {value!r}")
        k = self.micro_batches
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"micro_batches must be an int >= 1 (micro-batches per optimizer step), got {k!r}")
        if not isinstance(self.accum_dtype, torch.dtype) or not self.accum_dtype.is_floating_point:
            raise ConfigError(f"accum_dtype must be a floating torch.dtype, got {self.accum_dtype!r}")
        c = self.clip_norm
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0):
            raise ConfigError(f"clip_norm must be None or a finite float > 0 (the max global 2-norm), got {c!r}")
        if not isinstance(self.donate, bool):
            raise ConfigError(f"donate must be a bool, got {self.donate!r}")
        p, cap = self.persist_bytes, self.max_live_bytes
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ConfigError(f"persist_bytes must be an int >= 0 (units of at most this many gathered bytes stay "
                              f"gathered for the step), got {p!r}")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ConfigError(f"max_live_bytes must be None or an int >= 1 (a cap on gathered bytes), got {cap!r}")
        check_prefetch(self.prefetch)


class Report(NamedTuple):
    """What the units' backward saw on this rank: `used[L]` (CPU float32, 1 where the leaf got a
    gradient) and `bad[B]` (float32 on the mesh device, 1 where a bucket's local gradient held a
    NaN or inf)."""

    used: torch.Tensor
    bad: torch.Tensor


class Verdict(NamedTuple):
    """What every rank agreed on: used leaves, ranks with non-finite values, the loss (summed over
    ranks in rank order), ‖g‖² and the total token count (`normalize="tokens"`)."""

    used: list[bool]
    bad_ranks: dict[int, list[str]]
    loss: float
    norm_sq: float
    count: float

    @property
    def finite(self) -> bool:
        return not self.bad_ranks and math.isfinite(self.norm_sq)


def train_step(
    loss_fn: Callable[[Any, Any], Any],
    *,
    engine: str = "autograd",
    on_nonfinite: str = "raise",
    gather: str = "on_use",
    micro_batches: int = 1,
    accumulate: str = "each",
    accum_dtype: torch.dtype = torch.float32,
    normalize: str = "mean",
    clip_norm: float | None = None,
    donate: bool = False,
    persist_bytes: int = 0,
    max_live_bytes: int | None = None,
    prefetch: int = 0,
) -> Callable[[ZeroState, Any], tuple[ZeroState, Metrics]]:
    """Build `step(state, batch) -> (state, metrics)` for one rank (see the module docstring).

    The stage, the mesh and the optimizer are the state's (`fzero.init`'s).

    Args:
      loss_fn: `(params, batch) -> 0-d loss`, this rank's mean loss on its micro-batch; with
        `normalize="tokens"`, `(params, batch) -> (loss_sum, count)`.
      engine: "autograd" (`torch.autograd.grad` over the unit Functions; lower peak memory:
        `torch.func.grad` held 11-15 GiB more at peak on a 1.34B GPT, proofs/memory.md) or "func"
        (`torch.func.grad_and_value`; composes with other transforms).
      on_nonfinite: "raise" (NonFiniteError on every rank, naming ranks and leaves) or "skip".
      gather: "on_use" (default: each unit is gathered when the loss first uses it, its
        gradient reduced as soon as its backward is done, and, in stage 3 with the autograd
        engine and flat-dict params, freed after use and gathered again in backward) or "eager"
        (every unit before the loss; same bits, but stage 2 then holds every unit's full
        gradient at peak and stage 3 every gathered unit until backward). See
        `fzero._src.gathering`.
      micro_batches: k; with k > 1, `step(state, batches)` takes a sequence of k micro-batches
        and makes one optimizer step. Each micro-batch's loss is divided by k before its backward
        (as DDP users write `(loss / k).backward()`).
      accumulate: "each" (every stage: each micro-batch's gradient is reduced as it is made and
        the reduced parts are added, so stages 2-3 keep only an accumulation shard) or "once"
        (stages 0-1: local gradients are added in micro-batch order and reduced once after the
        last, as DDP's `no_sync`). The two round differently; within a mode all stages agree
        bit for bit (proofs/accumulation.md).
      accum_dtype: the dtype gradients are added in (fp32 by default, whatever the params' dtype);
        the sum is cast to the params' dtype for the reduction ("once") or the optimizer.
      normalize: "mean" (loss_fn returns this rank's mean loss) or "tokens" (loss_fn returns
        `(loss_sum, count)`; the step divides the gradient and the loss by the total count over
        all micro-batches and ranks, agreed in the step's one agreement collective).
      clip_norm: None, or clip by the global 2-norm with `torch.nn.utils.clip_grad_norm_`'s
        coefficient `min(1, clip_norm / (norm + 1e-6))`; the norm is `Metrics.grad_norm`
        (before clipping), computed from shards the same way in every stage.
      donate: the step may consume its input state (JAX's `donate_argnums`): the optimizer
        updates the state's params and optimizer state in place (`Optimizer.update_`), so a step
        does not hold a second copy of them; the same bits as the pure step. The input state is
        then marked consumed and raises if used again. A step skipped for a non-finite gradient
        leaves it intact; an update that itself makes params non-finite cannot be undone in
        place: it raises `NonFiniteError` (whatever `on_nonfinite` says) with the state consumed.
      persist_bytes: where stage 3 frees units after use (see `gather`), a unit whose gathered
        bytes (`Σ N * S * itemsize` over its buckets) are at most this stays gathered for the
        micro-batch's forward and backward: no backward re-gather (DeepSpeed's
        `stage3_param_persistence_threshold`). 0 (default): every unit is freed. Same bits.
      max_live_bytes: None, or a cap on the gathered bytes live at once where stage 3 frees units
        after use: persisting units are freed early to make room; a unit larger than the cap, or
        units in use that leave no room, raise `ConfigError`. Same bits (proofs/stage3.md).
      prefetch: stage 3, on use: how many units ahead to start gathering (forward: the layout's
        unit order; backward: the reverse of the forward's read order), through `Mesh.start`
        (asynchronous on DistMesh). 0 (default): gather when read. Same bits; prefetched units
        count against `max_live_bytes` (see `fzero._src.gathering`).
    """
    config = StepConfig(loss_fn, engine, on_nonfinite, gather, micro_batches, accumulate, accum_dtype, normalize,
                        clip_norm, donate, persist_bytes, max_live_bytes, prefetch)

    def step(state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        return eager_step(config, state, batch)

    return step


@torch.compiler.disable  # under torch.compile(step) fzero runs eager; compile the loss instead (docs/compile.md)
def eager_step(config: StepConfig, state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
    check_state(state)
    with state.mesh.guard(), same_paths(state.layout), _no_vmap_over_steps():
        return run_step(config, state, batch)


@contextlib.contextmanager
def _no_vmap_over_steps() -> Iterator[None]:
    """torch's `.item()` / data-dependent-control-flow error under vmap, as what it means for a step
    (docs/func.md)."""
    try:
        yield
    except RuntimeError as e:
        if "vmap" not in str(e) or (".item()" not in str(e) and "data-dependent control flow" not in str(e)):
            raise
        raise ConfigError("vmap over a step: the step decides on Python numbers that every rank agrees on (the "
                          "loss, the gradient norm, whether to skip a non-finite step), which vmap cannot batch. "
                          "vmap inside the loss instead (per-example gradients: examples/dp_sgd.py), or loop over "
                          "states (docs/func.md)") from e


def run_step(config: StepConfig, state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
    reduced, loss, report, count = accumulate(config, state, micro_batches_of(config, state, batch))
    verdict = agree(state, loss, report, reduced, count)
    step, s = int(state.step), loss_scale_of(state)
    scale = _normalizer(config, state, verdict)
    norm = math.sqrt(verdict.norm_sq) * scale / s if math.isfinite(verdict.norm_sq) else verdict.norm_sq
    mean_loss = verdict.loss / (verdict.count if config.normalize == "tokens" else state.mesh.world_size) / s
    metrics = Metrics(torch.tensor(mean_loss, dtype=torch.float64), torch.tensor(norm, dtype=torch.float64), step,
                      not verdict.finite, s if state.info.scaler is not None else None)
    scaler = state.info.scaler
    next_scale = None if scaler is None else scaler.update(state.loss_scale, not verdict.finite)
    if not verdict.finite:
        if scaler is not None:  # an overflow: skip the update, back off the scale (DeepSpeed)
            return state.replace(loss_scale=next_scale), metrics
        if config.on_nonfinite == "raise":
            raise NonFiniteError(_nonfinite_message(step, verdict, nonfinite_leaves(state, reduced)))
        return state, metrics
    reduced = _rescale(reduced, scale * _clip_coefficient(config, norm) / s)
    new, broken = update(state, reduced, verdict.used, config.donate)
    if config.donate:
        consume(state)
    if not broken:
        return (new if scaler is None else new.replace(loss_scale=next_scale)), metrics
    if config.on_nonfinite == "raise" or config.donate:
        named = ", ".join(repr(p) for p in broken[:8]) + (" ..." if len(broken) > 8 else "")
        fate = ("the donated state was written in place and is lost: restore it from a checkpoint" if config.donate
                else "the state is unchanged")
        raise NonFiniteError(f"step {step}: the gradients are finite but the optimizer's update made the params "
                             f"NaN or inf in {named} ({state.mesh!r}, {len(broken)} leaves); {fate}. Lower the "
                             f"learning rate, keep params in a wider dtype, or use on_nonfinite='skip' (without "
                             f"donate)")
    return state, metrics._replace(skipped=True)


def micro_batches_of(config: StepConfig, state: ZeroState, batch: Any) -> list[Any]:
    """The step's micro-batches: `[batch]`, or the k entries of a sequence when k > 1."""
    k = config.micro_batches
    if config.accumulate == "once" and state.stage.sharded("grads"):
        raise ConfigError(f"accumulate='once' adds full local gradients and reduces them once, but stage "
                          f"{state.stage.level} shards gradients (it keeps only a shard); use accumulate='each', "
                          f"or stage 0 or 1")
    if k == 1:
        return [batch]
    if not isinstance(batch, (list, tuple)) or len(batch) != k:
        got = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) else (
            f"a {type(batch).__name__}")
        raise ConfigError(f"micro_batches={k}: step(state, batches) needs a list or tuple of {k} micro-batches, "
                          f"got {got}")
    return list(batch)


def accumulate(config: StepConfig, state: ZeroState, micro: list[Any]
               ) -> tuple[dict[int, torch.Tensor], torch.Tensor, Report, torch.Tensor]:
    """Backward over every micro-batch: `(reduced gradient per trainable bucket, this rank's loss
    summed over micro-batches, Report (OR over micro-batches), token count summed)`.

    "each": `Σ_i reduce(g_i)` (added in `accum_dtype`); "once": `reduce(Σ_i g_i)`. The sums run
    in micro-batch order, `((x_1 + x_2) + x_3) + ...`, and are cast back to each bucket's dtype.
    """
    once = config.accumulate == "once"
    acc: dict[int, torch.Tensor | None] = {b: None for b in _trainable(state)}
    loss = count = None
    used = bad = None
    for mb in micro:
        grads, l_i, report, c_i = backward(config, state, mb)
        parts = grads if once else reduce(state, grads)
        for b in acc:
            acc[b] = _add(acc[b], parts[b], config.accum_dtype)
        loss = l_i if loss is None else loss + l_i
        count = c_i if count is None else count + c_i
        used = report.used if used is None else torch.maximum(used, report.used)
        bad = report.bad if bad is None else torch.maximum(bad, report.bad)
    dtypes = {b: state.layout.buckets[b].dtype for b in acc}
    summed = {b: None if g is None else g.to(dtypes[b]) for b, g in acc.items()}
    return (reduce(state, summed) if once else summed), loss, Report(used, bad), count


def _add(acc: torch.Tensor | None, part: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if part is None:
        return acc
    part = part.to(dtype)
    return part if acc is None else acc + part


def loss_scale_of(state: ZeroState) -> float:
    """The loss is multiplied by this before backward and the gradient divided by it after the
    reduction: the scaler's current scale (a Python float), or 1."""
    return 1.0 if state.loss_scale is None else float(state.loss_scale.scale)


def _normalizer(config: StepConfig, state: ZeroState, verdict: Verdict) -> float:
    """The factor the reduced gradient `Σ_r fl(1/N) g_r` is multiplied by: 1, or N / T with T the
    agreed token count (`normalize="tokens"`), so that the gradient is that of `Σ loss_sum / T`."""
    if config.normalize == "mean":
        return 1.0
    if not verdict.count > 0:
        raise ConfigError(f"normalize='tokens': the total token count over all ranks and micro-batches is "
                          f"{verdict.count}; every step needs at least one token (the state is unchanged)")
    return state.mesh.world_size / verdict.count


def _clip_coefficient(config: StepConfig, norm: float) -> float:
    """`min(1, clip_norm / (norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_` (1 without clipping)."""
    if config.clip_norm is None:
        return 1.0
    return min(1.0, config.clip_norm / (norm + CLIP_EPS))


def _rescale(reduced: dict[int, torch.Tensor], factor: float) -> dict[int, torch.Tensor]:
    """Each reduced gradient times `factor` (element-wise, rounded to the gradient's dtype: the same
    bits for a shard and for the full buffer), or unchanged where the factor is 1."""
    if factor == 1.0:
        return reduced
    return {b: g * factor for b, g in reduced.items()}


# -- 1. forward and backward -----------------------------------------------------------------


def _trainable(state: ZeroState) -> list[int]:
    return [b.index for b in state.layout.buckets if not b.group.frozen]


def backward(config: StepConfig, state: ZeroState, batch: Any
             ) -> tuple[dict[int, torch.Tensor | None], torch.Tensor, Report, torch.Tensor]:
    """One micro-batch: `({bucket: gradient of its differentiated tensor, or None}, detached loss
    as differentiated, Report, token count (float64; 0 in "mean" mode))`."""
    layout, stage, mesh, rank = state.layout, state.stage, state.mesh, state.rank
    inflight = Inflight() if config.engine == "autograd" else None  # func: every reduction waited in place
    programs = unit_programs(layout, mesh, stage, state.precision, inflight)
    pairs = [differentiated(state.info, b, p, m, mesh.device) for b, (p, m) in enumerate(zip(state.params, state.master))]
    xs, fulls = [x for x, _ in pairs], [full for _, full in pairs]
    trainable = _trainable(state)
    s = loss_scale_of(state)
    probes = {p.name: Probe.of(p, xs[p.buckets[0].index].device) for p in programs}
    releasable = (config.gather == "on_use" and config.engine == "autograd" and stage.sharded("params")
                  and is_flat_dict(layout))

    def loss_of(train: tuple[torch.Tensor, ...], probes: dict[str, Probe]) -> tuple[torch.Tensor, torch.Tensor]:
        merged = list(xs)
        for b, x in zip(trainable, train):
            merged[b] = x
        counts: list[torch.Tensor] = []

        def objective(params: Any, mb: Any) -> torch.Tensor:
            loss, count = _objective(config, config.loss_fn(params, mb))
            counts.append(count)
            return loss * s if s != 1.0 and isinstance(loss, torch.Tensor) else loss

        loss = Gathering(layout, programs, merged, fulls, probes, config.gather, releasable, config.persist_bytes,
                         config.max_live_bytes, config.prefetch).loss(objective, batch)
        return loss, counts[0]

    train = tuple(xs[b] for b in trainable)
    if config.engine == "func":
        (g_train, g_probes), (loss, count) = torch.func.grad_and_value(loss_of, argnums=(0, 1), has_aux=True)(
            train, probes)
    else:
        g_train, g_probes, loss, count = _autograd(loss_of, train, probes)
        inflight.wait()  # the reductions the units' backward started: done before any gradient is read
    return dict(zip(trainable, g_train)), loss.detach(), _report(state, programs, g_probes), count


def _objective(config: StepConfig, out: Any) -> tuple[Any, torch.Tensor]:
    """What is differentiated, and the micro-batch's token count: `loss / k` and 0 ("mean"), or
    `loss_sum` and `count` ("tokens")."""
    if config.normalize == "mean":
        k = config.micro_batches
        if isinstance(out, tuple):
            raise ConfigError(f"loss_fn returned a tuple of {len(out)}; with normalize='mean' it must return one 0-d "
                              f"loss (return (loss_sum, count) with normalize='tokens')")
        return (out / k if k > 1 and isinstance(out, torch.Tensor) else out), torch.zeros((), dtype=torch.float64)
    if not isinstance(out, tuple) or len(out) != 2:
        raise ConfigError(f"normalize='tokens' needs loss_fn to return (loss_sum, count), got "
                          f"{type(out).__name__} {getattr(out, 'shape', '')}")
    loss_sum, count = out
    count = torch.as_tensor(count).detach()
    if count.numel() != 1 or count.is_floating_point() and not bool(torch.isfinite(count)) or bool(count < 0):
        raise ConfigError(f"normalize='tokens': the count loss_fn returned must be one finite number >= 0, got {count}")
    return loss_sum, count.to(device="cpu", dtype=torch.float64).reshape(())


def _autograd(loss_of: Callable, train: tuple, probes: dict[str, Probe]):
    train = tuple(x.detach().requires_grad_() for x in train)
    probes = {u: Probe(*(t.requires_grad_() for t in p)) for u, p in probes.items()}
    with torch.enable_grad():
        loss, count = loss_of(train, probes)
    inputs = [*train, *(t for p in probes.values() for t in p)]
    if not loss.requires_grad:
        grads = [None] * len(inputs)
    else:
        grads = list(torch.autograd.grad(loss, inputs, allow_unused=True))
    g_probes = {u: Probe(*grads[len(train) + 2 * k : len(train) + 2 * k + 2]) for k, u in enumerate(probes)}
    return grads[: len(train)], g_probes, loss, count


def _report(state: ZeroState, programs: list, g_probes: dict[str, Probe]) -> Report:
    """The probes' gradients as one `Report`. `bad` is assembled on the device from 0-d views
    (`torch.stack`): indexing a device tensor with a Python list copies the index host-to-device,
    and a blocking copy synchronises the stream, once per unit."""
    layout, dev = state.layout, state.mesh.device
    used = torch.zeros(len(layout.leaves))
    bad: list[torch.Tensor | None] = [None] * len(layout.buckets)
    for program in programs:
        g = g_probes[program.name]
        if g.used is not None:
            used[list(program.leaves)] = g.used
        for k, b in enumerate(program.buckets):
            bad[b.index] = g.bad[k].to(dev) if g.bad is not None else None
    zero = torch.zeros((), device=dev)
    return Report(used, torch.stack([zero if x is None else x for x in bad]) if bad else zero.new_zeros(0))


# -- 2. reduce ---------------------------------------------------------------------------------


def reduce(state: ZeroState, grads: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor]:
    """Per trainable bucket, the reduced gradient the optimizer reads (`Stage.after_backward`);
    a bucket no gradient reached on this rank contributes zeros, as every rank must reduce.
    Every bucket's collectives are started before the first is waited for (`Stage` pieces'
    `start`): on DistMesh they run concurrently; the calls and their order per bucket are those of
    the blocking form, so the bits are too."""
    layout, stage, mesh, rank = state.layout, state.stage, state.mesh, state.rank
    grads = {b: g if g is not None else
             torch.zeros_like(differentiated(state.info, b, state.params[b], state.master[b], mesh.device)[0])
             for b, g in grads.items()}
    wires = {b: state.precision.wire(layout.buckets[b]) for b in grads}
    if not overlaps(grads.values()):  # differentiated through: the blocking, differentiable form
        return {b: stage.after_backward.run(mesh, wires[b], g) for b, g in grads.items()}
    flights = {b: stage.after_backward.start(mesh, wires[b], g) for b, g in grads.items()}
    flights = {b: f.advance() for b, f in flights.items()}  # stage 0: each all-gather as its reduce-scatter ends
    return {b: f.wait() for b, f in flights.items()}


def overlaps(tensors: Any) -> bool:
    """Whether the step may issue collectives without waiting (`Piece.start`: detached, outside
    autograd): only where nothing differentiates through the step -- no torch.func transform is
    active and no tensor requires grad. Otherwise the blocking, differentiable `Piece.run`."""
    return func_level() is None and not any(t.requires_grad for t in tensors)


# -- 3. agree ---------------------------------------------------------------------------------


def agree(state: ZeroState, loss: torch.Tensor, report: Report, reduced: dict[int, torch.Tensor],
          count: torch.Tensor) -> Verdict:
    """The one agreement collective: `[loss, used[L], bad[B], ‖g_shard‖², count]` from every rank.

    `‖g_shard‖²` is `sum_of_squares` of the rank's shard of the *reduced* gradient (stage 0
    takes its rank's shard of the full buffer, so every stage computes it from the same tensor
    values); ranks' parts and losses are then summed in rank order. Where some rank's part is not
    finite -- a NaN or inf, or a float32 norm that overflowed -- every rank (all see the same rows)
    recomputes its part exactly in float64 (`exact_sum_of_squares`) and the parts are gathered
    again: the rare path decides finiteness exactly. At N = 1 the units skip their local
    non-finite check (`bad` is 0): a non-finite `‖g‖²` then names the buckets from the reduced
    gradient, which is the local one.
    """
    layout, stage, mesh, rank = state.layout, state.stage, state.mesh, state.rank
    n, dev = mesh.world_size, mesh.device
    num, nb = len(layout.leaves), len(layout.buckets)
    shards = [stage.grad_shard(layout, b, g, rank) for b, g in reduced.items()]
    sq = sum_of_squares(shards, dev)
    host = torch.cat([report.used.to(torch.float64), count.to(torch.float64).reshape(1)])  # one copy to the device
    host = (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
    row = torch.cat([loss.to(device=dev, dtype=torch.float64).reshape(1), host[:num],
                     report.bad.to(dev, torch.float64), sq.reshape(1), host[num:]])
    rows = all_gather(row, mesh, tag="fzero.step/agree").view(n, num + nb + 3).cpu()
    losses, used_rows, bad_rows = rows[:, 0], rows[:, 1 : 1 + num], rows[:, 1 + num : 1 + num + nb]
    sqs, counts = rows[:, -2], rows[:, -1]
    if not bool(torch.isfinite(sqs).all()):  # the rare path: decide exactly
        exact = exact_sum_of_squares(shards, dev).reshape(1)
        sqs = all_gather(exact, mesh, tag="fzero.step/agree_exact").cpu()
    bad_ranks = {r: [layout.buckets[b].tag for b in (bad_rows[r] > 0).nonzero().flatten().tolist()]
                 for r in range(n) if not math.isfinite(losses[r].item()) or bool((bad_rows[r] > 0).any())}
    if n == 1 and not math.isfinite(sqs[0].item()):  # the rare path of the skipped local check (unit.py)
        bad_ranks[0] = _nonfinite_buckets(state, reduced)
    total_loss, total_sq, total_count = 0.0, 0.0, 0.0
    for r in range(n):  # rank order
        total_loss += losses[r].item()
        total_sq += sqs[r].item()
        total_count += counts[r].item()
    return Verdict((used_rows > 0).any(dim=0).tolist(), bad_ranks, total_loss, total_sq, total_count)


def sum_of_squares(shards: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`Σ_k ν_k²` in float64 (0-d, on `device`), `ν_k = ‖x_k‖₂` of shard k by one
    `torch.linalg.vector_norm` (a single read, no transient; accumulated in float32, or float64 for
    float64 shards; 16-bit shards are widened to float32 first), added in shard order. `ν_k²` is
    exact in float64. The value depends only on the shard's values and length: the kernel's
    order of additions does not depend on where the shard sits in memory (a slice of stage 0's
    full buffer or a tensor of its own: `tests/test_speed.py`), so every stage gets the same bits.
    Relative error against the exact `Σ x²`: at most `γ_{S+1} + 2u` (u = 2^-24, S the shard's
    length: S squares and additions in any order, one square root and its rounding to float32),
    the same kind of error torch's `clip_grad_norm_` has (proofs/stages.md §3). NaN and inf
    propagate; a float32 norm of finite values may overflow to inf, which `agree` resolves exactly.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    for x in shards:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        nu = torch.linalg.vector_norm(x.reshape(-1), 2, dtype=None if x.dtype == acc else acc)
        total = total + nu.to(device=device, dtype=torch.float64).square()
    return total


SQ_CHUNK = 1 << 22  # elements per float64 chunk of `exact_sum_of_squares`: a 32 MiB scratch buffer


def exact_sum_of_squares(shards: list[torch.Tensor], device: torch.device, chunk: int = SQ_CHUNK) -> torch.Tensor:
    """The rare path's `‖g‖²`: `Σ_k s_k` in float64 (0-d, on `device`), `s_k = Σ_i x_i²` over
    chunk k of at most `chunk` elements: each shard `[S]` is cut into chunks from its start, in
    shard order.

    Each chunk is copied into one reused float64 scratch buffer, squared there and summed into
    `parts[k]`; then `parts` is summed. So no float64 copy of a whole shard exists (the transient
    is `8 * min(chunk, max S)` bytes, not `16 * S`), and the order of additions depends only on
    the shards' lengths and values: every stage sums the same shard the same way (stage 0 reads its
    rank's slice of the full buffer; the copy into the scratch makes where the slice sits in
    memory irrelevant). A float32, bfloat16 or float16 value squares exactly in float64, so the
    only roundings are the float64 additions; NaN and inf survive them (squares are >= 0: no
    inf - inf), so `‖g‖²` is non-finite iff some element is.
    """
    counts = [-(-x.numel() // chunk) for x in shards]
    parts = torch.zeros(sum(counts), dtype=torch.float64, device=device)
    widest = max((min(x.numel(), chunk) for x in shards), default=0)
    scratch = torch.empty(widest, dtype=torch.float64, device=device)
    k = 0
    for x in shards:
        flat = x.reshape(-1)
        for start in range(0, flat.numel(), chunk):
            piece = flat[start : start + chunk]
            buf = scratch[: piece.numel()]
            buf.copy_(piece)
            buf.square_()
            torch.sum(buf, dim=0, out=parts[k])
            k += 1
    return parts.sum()


def _nonfinite_buckets(state: ZeroState, reduced: dict[int, torch.Tensor]) -> list[str]:
    """At N = 1: the tags of the buckets whose reduced gradient -- there the local gradient, summed
    over micro-batches -- holds a NaN or inf (one check per bucket, only on a non-finite step)."""
    return [state.layout.buckets[b].tag for b, g in reduced.items() if not bool(torch.isfinite(g).all())]


# -- 4. update ---------------------------------------------------------------------------------


def update(state: ZeroState, reduced: dict[int, torch.Tensor], used: list[bool], donate: bool = False
           ) -> tuple[ZeroState, list[str]]:
    """The optimizer over what this rank owns, then the stage's `finish`: `(new state, [])`; or
    `(state, leaves)` -- the input state and the leaves the update would have made NaN or inf,
    agreed by every rank (one all-reduce of a flag), so a state is never corrupted silently.
    With `donate`, the optimizer writes the state's own tensors (`Optimizer.update_`).

    Each bucket's `finish` (stages 1-2: the all-gather of its new params) starts as soon as its
    update is done, so it runs while the next bucket is updated; all are waited for after the
    finite check (and discarded if it fails). Nothing writes an updated shard before its wait."""
    layout, stage, mesh, rank, optimizer = state.layout, state.stage, state.mesh, state.rank, state.optimizer
    if donate and optimizer.update_ is None:
        raise ConfigError("donate=True needs an optimizer with an in-place form (Optimizer.update_); this one has "
                          "none: use donate=False")
    step = int(state.step)
    new_params, new_opt, new_master = list(state.params), list(state.opt_state), list(state.master)
    updated: dict[int, torch.Tensor] = {}
    flights, back = {}, {}
    overlap = overlaps([*reduced.values(), *(p for p in state.params if p is not None)])
    host = HostUpdate(state.info, reduced, donate)  # offloaded buckets: gradients start for the host now
    for b, g in reduced.items():
        spec = layout.buckets[b]
        g, opt, leaf_sum = host.inputs(b, g, state.opt_state[b], stage.leaf_sum(mesh, spec.tag))
        ctx = UpdateContext(step, spec.group, stage.segments(layout, b, rank), spec.leaves,
                            tuple(used[i] for i in spec.leaves), leaf_sum,
                            tuple(layout.leaves[i].numel for i in spec.leaves),
                            tuple(layout.leaves[i].shape for i in spec.leaves))
        p = stage.optimizer_params(layout, b, state.params[b], rank, state.master[b])  # offloaded: the host master
        g = g.to(p.dtype)  # the reduce dtype -> the master's (a no-op without a precision policy)
        if donate:
            updated[b], new_opt[b] = p, optimizer.update_(g, opt, p, ctx)
        else:
            updated[b], new_opt[b] = optimizer.update(g, opt, p, ctx)
        back[b], new_opt[b] = host.outputs(b, updated[b], new_opt[b], state.params[b].dtype)
        if overlap:
            flights[b] = stage.finish.start(mesh, state.precision.wire(spec), back[b])  # overlaps the next update
    host.done()
    broken = _any_nonfinite(state, updated)
    gathered = {b: f.wait() for b, f in flights.items()}  # every rank started them: wait, even to discard
    if broken:
        return state, nonfinite_leaves(state, updated, mine=lambda b, p: p, where=stage.segments)
    if not overlap:  # differentiated through: the blocking, differentiable finish
        gathered = {b: stage.finish.run(mesh, state.precision.wire(layout.buckets[b]), p) for b, p in back.items()}
    for b, p_new in updated.items():
        new_params[b] = gathered[b]
        if state.master[b] is not None:
            new_master[b] = p_new
    return state.replace(params=tuple(new_params), opt_state=tuple(new_opt), master=tuple(new_master),
                         step=state.step + 1), []


def _any_nonfinite(state: ZeroState, updated: dict[int, torch.Tensor]) -> bool:
    """Whether any rank's updated params hold a NaN or inf: one float64 flag, all-reduced (max),
    tag "fzero.step/update" (a control collective); none where nothing is trainable."""
    if not updated:
        return False
    mesh = state.mesh
    flag = torch.zeros((), dtype=torch.float64, device=mesh.device)
    for p in updated.values():
        flag = torch.maximum(flag, nonfinite(p).to(flag))
    return bool(all_reduce(flag.reshape(1), mesh, "max", tag="fzero.step/update").item() > 0)


# -- the rare path: a non-finite step ----------------------------------------------------------


def nonfinite_leaves(state: ZeroState, tensors: dict[int, torch.Tensor], mine: Callable | None = None,
                     where: Callable | None = None) -> list[str]:
    """Taken by every rank together: the leaves whose values in `tensors` (per bucket; by default
    the *reduced* gradients, of which each rank reads its shard) hold a NaN or inf, by one
    all-reduce. `mine(b, t)` picks what this rank checks, `where(layout, b, rank)` its segments."""
    layout, stage, mesh, rank = state.layout, state.stage, state.mesh, state.rank
    mine = mine or (lambda b, g: stage.grad_shard(layout, b, g, rank))
    where = where or (lambda layout, b, rank: layout.segments(b, rank))
    flags = torch.zeros(len(layout.leaves), dtype=torch.float64, device=mesh.device)
    for b, g in tensors.items():
        local = mine(b, g)
        for seg in where(layout, b, rank):
            if not bool(torch.isfinite(local[seg.start : seg.stop]).all()):
                flags[seg.leaf] = 1.0
    flags = all_reduce(flags, mesh, "max", tag="fzero.step/nonfinite")
    return [layout.leaves[i].path for i in (flags > 0).nonzero().flatten().tolist()]


def _nonfinite_message(step: int, verdict: Verdict, leaves: list[str]) -> str:
    named = ", ".join(repr(p) for p in leaves[:8]) + (" ..." if len(leaves) > 8 else "")
    where = f"; the reduced gradient is non-finite in {named}" if leaves else ""
    if not verdict.bad_ranks:
        return (f"step {step}: every rank's loss and local gradient are finite but the reduced gradient is not "
                f"(sum of squares {verdict.norm_sq}{where}): the sum over ranks overflowed. The state is unchanged; "
                f"lower the learning rate or loss scale, or use on_nonfinite='skip'")
    parts = [f"rank {r}: non-finite " + (f"local gradient in bucket(s) {tags}" if tags else "loss")
             for r, tags in verdict.bad_ranks.items()]
    return (f"step {step}: non-finite values on rank(s) {list(verdict.bad_ranks)} ({'; '.join(parts)}){where}. "
            f"The state is unchanged; use on_nonfinite='skip' to skip such steps")
