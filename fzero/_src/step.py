"""`train_step`: a loss -> a pure `step(state, batch) -> (state, metrics)`.

One step on one rank, each part a short function over the frozen `StepConfig`:

1. `backward`: each unit's leaves come out of the per-unit Function (gathered where the stage
   shards params), `loss_fn(params, batch)` gives this rank's mean loss, and its gradient is
   taken (`torch.autograd.grad`, or `torch.func.grad_and_value` with `engine="func"`); stages
   that shard gradients reduce-scatter each unit inside its backward (with the autograd engine
   started there and waited for when the backward is done, `unit.Inflight`). The units' probes report
   which leaves got a gradient and (`locate_nonfinite`) which local gradients were non-finite;
2. `reduce`: the stage's `after_backward` per bucket, every bucket's collectives started before
   any is waited for -- with the autograd engine and `accumulate="each"`, stages 0-1 start theirs
   in the unit's backward, as DDP overlaps its all-reduce with backward (stage 0's reduction is
   one all-reduce where the mesh's has the bits of reduce-scatter + all-gather,
   `Mesh.all_reduce_is_reduce_scatter_gather`; elsewhere each bucket's all-gather starts once the
   next bucket's reduction has, `Chained`); the reduced gradient
   is `Σ_r fl(1/N) g_r`;
3. `agree`: one all-gather of a small float64 vector agrees on what every rank saw: its loss,
   which leaves it used, which local gradients were non-finite (`locate_nonfinite`; else 0: its
   part of `‖g‖²` finds them), and its part of `‖g‖²`
   (`agreement` gathers it on the device; a donating step's update is prepared on the host --
   `prepare`, the optimizer's checks, views and step counts -- before `agree` reads it, so the
   host does that while the device still runs the backward; where the verdict can decide only
   whether the update runs, its fused kernels are launched before the read too, skipped on the
   device where the gathered rows are not finite, `agree_launching`);
4. a non-finite step raises on every rank or is skipped (`on_nonfinite`), leaving the state as
   it was; otherwise `update` applies the optimizer to what the rank owns and the stage's
   `finish` (stages 1-2: all-gather the new params, each bucket's started as its update ends).

The agreement is the step's one host synchronisation where the step donates its input: the
donating update's finite flag stays on the device, in the new state (`ZeroState.pending`), and
the next step's agreement carries it (see `train_step`'s `donate`). The pure step reads its
update's flag on the host at once (a second synchronisation), so that it can return its input
unchanged.

At N = 1 nothing is moved: reductions and gathers of gradients and updated params are recorded
and return their input (`Mesh.solo`), except stage 3's gathers, which copy.

The input state is never modified. The new state's updated tensors are fresh; what a step does
not touch (frozen buckets' params) is shared with the input state, as in JAX: treat states as
immutable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.profiler import record_function

from .casting import CastAhead, Reads, Slot
from .collectives import all_gather, all_reduce, func_level
from .errors import ConfigError, LossScaleError, NonFiniteError
from .gathering import GATHERS, Gathering, check_prefetch, held_tensor, in_micro_batch, is_flat_dict, same_paths
from .layout import ParamGroup, Segment
from .mesh import settings_crc
from .offload import HostUpdate, differentiated, early_copies, early_norms, readable
from .optim.base import UpdateContext, block_sums
from .precision import added_in, at_least_float32
from .stages import Flight, Wire
from .state import (StateInfo, ZeroState, broken_update, check_same_settings, checked, consume, range_words,
                    nonfinite_leaves, updated_nonfinite_leaves)
from .tree import flatten
from .unit import (Assembly, HostBuffers, Inflight, Probe, UnitProgram, finite_witness, remembered, shared_zeros,
                   unit_programs)

ENGINES = ("autograd", "func")
NONFINITE = ("raise", "skip")
ACCUMULATE = ("each", "once")
NORMALIZE = ("mean", "tokens")
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (norm + 1e-6)


class Metrics(NamedTuple):
    """What a step reports, the same on every rank.

    Attributes:
      loss: float64 0-d, the mean over ranks of each rank's loss (summed in rank order, / N; a
        rank's loss is its micro-batches' `loss / k` summed); with `normalize="tokens"`,
        `Σ_r loss_sum_r / T`, T the agreed token count.
      grad_norm: float64 0-d, `‖Σ_r fl(1/N) g_r‖₂` over all trainable leaves: a float32 norm per
        bucket shard, their squares summed in float64, over ranks in rank order (the same bits
        in every stage; relative error at most γ_{S+1} + 2u, proofs/stages.md §3); times N / T
        with `normalize="tokens"`; before clipping.
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

    @property
    def shared(self) -> dict[str, Any]:
        """The settings every rank's step must share, each a plain value (str, int, float, bool,
        None or a dtype: their reprs hold no address): all but `loss_fn`, which is compared by
        nothing (each rank's closure may hold its own data), and what the step learns (`ahead`,
        `buffers`). The step's agreement row carries their fingerprint (`fingerprint`), and ranks
        that differ raise `ConfigError` on every rank (`_check_same_steps`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare and f.name != "loss_fn"}

    @functools.cached_property
    def fingerprint(self) -> int:
        """`shared`'s CRC-32 (31 bits: exact in the agreement's float64 row)."""
        return settings_crc(self.shared)

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
        a = self.accum_dtype
        if a is not None and (not isinstance(a, torch.dtype) or not a.is_floating_point):
            raise ConfigError(f"accum_dtype must be None (float32, or the gradient's dtype where wider) or a floating "
                              f"torch.dtype, got {a!r}")
        if a is not None and a.itemsize < 2:  # found in review: one micro-batch's gradient silently rounded to fp8,
            # two torch's NotImplementedError for their sum
            raise ConfigError(f"accum_dtype {a} is narrower than 16 bits: gradients are added and handed to the "
                              f"optimizer in it, and torch's 8-bit floats have no addition; use None (float32) or "
                              f"torch.bfloat16 / torch.float16")
        c = self.clip_norm
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0):
            raise ConfigError(f"clip_norm must be None or a finite float > 0 (the max global 2-norm), got {c!r}")
        if c is not None:  # 1, 1.0 and np.float64(1.0) alike: the fingerprint ranks compare is of the value
            object.__setattr__(self, "clip_norm", float(c))
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


class Report(NamedTuple):
    """What the units' backward saw on this rank: `used[L]` (CPU float32, 1 where the leaf got a
    gradient) and `bad[B]` (float32 on the mesh device, 1 where a bucket's local gradient held a
    NaN or inf; zeros where the units did not check, `locate_nonfinite` off or N = 1)."""

    used: torch.Tensor
    bad: torch.Tensor


class Verdict(NamedTuple):
    """What every rank agreed on: used leaves, ranks with non-finite values, the loss (summed over
    ranks in rank order), ‖g‖², the total token count (`normalize="tokens"`), the ranks whose
    previous, donating update left a NaN or inf in the state (`ZeroState.pending`), and whether
    `bad_ranks` names the ranks of non-finite local gradients (`located`: at N = 1, or with
    `locate_nonfinite`), or only those of non-finite losses."""

    used: list[bool]
    bad_ranks: dict[int, list[str]]
    loss: float
    norm_sq: float
    count: float
    broken_ranks: tuple[int, ...] = ()
    located: bool = True

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
    accum_dtype: torch.dtype | None = None,
    normalize: str = "mean",
    clip_norm: float | None = None,
    donate: bool = False,
    persist_bytes: int = 0,
    max_live_bytes: int | None = None,
    prefetch: int | None = None,
    cast_ahead: bool = False,
    locate_nonfinite: bool = False,
) -> Callable[[ZeroState, Any], tuple[ZeroState, Metrics]]:
    """Build `step(state, batch) -> (state, metrics)` for one rank (see the module docstring);
    `step.config` is its `StepConfig` (with what `cast_ahead` learned, `config.ahead`).

    The stage, the mesh and the optimizer are the state's (`fzero.init`'s).

    Args:
      loss_fn: `(params, batch) -> 0-d loss`, this rank's mean loss on its micro-batch; with
        `normalize="tokens"`, `(params, batch) -> (loss_sum, count)`.
      engine: "autograd" (`torch.autograd.grad` over the unit Functions; lower peak memory:
        `torch.func.grad` held 11-15 GiB more at peak on a 1.34B GPT, proofs/memory.md) or "func"
        (`torch.func.grad_and_value`; composes with other transforms).
      on_nonfinite: "raise" (NonFiniteError on every rank, naming the leaves, and the ranks whose
        loss -- or, with `locate_nonfinite`, local gradient -- is non-finite) or "skip". Under a
        loss scaler a NaN or inf loss or gradient is an overflow whatever this says: the step is
        skipped and the scale backs off (DeepSpeed's rule), and a NaN that comes back every step
        skips every step; `DynamicLossScale(raise_at_min=True)` raises `LossScaleError`, naming
        what was non-finite, once the scale is at its floor. An update that makes the state
        NaN or inf (or past the compute dtype's range) follows this setting with a scaler too.
      gather: "on_use" (default: each unit is gathered when the loss first uses it, its
        gradient reduced as soon as its backward is done, and, in stage 3 with the autograd
        engine and flat-dict params, freed after use and gathered again in backward) or "eager"
        (every unit before the loss; same bits, but stage 2 then holds every unit's full
        gradient at peak and stage 3 every gathered unit until backward). See
        `fzero._src.gathering`.
      micro_batches: k; with k > 1, `step(state, batches)` takes a sequence of k micro-batches
        (`[(x0, y0), (x1, y1)]`, not one batch `(x, y)`: micro-batches whose tensors differ in
        dtype at one place are refused) and makes one optimizer step. Each micro-batch's loss is divided by k before its backward
        (as DDP users write `(loss / k).backward()`). With `gather="on_use"` at stages 2-3 every
        rank's loss must read the same units in each micro-batch: on an empty one, run the model
        and return a zero that depends on its output (`out.sum() * 0.0`); a rank that reads none
        there raises `DivergentPaths`, naming the micro-batches.
      accumulate: "each" (every stage: each micro-batch's gradient is reduced as it is made and
        the reduced parts are added, so stages 2-3 keep only an accumulation shard) or "once"
        (stages 0-1: local gradients are added in micro-batch order and reduced once after the
        last, as DDP's `no_sync`). The two round differently; within a mode all stages agree
        bit for bit (proofs/accumulation.md).
      accum_dtype: the dtype gradients are added in; None (the default): float32, or the
        gradient's own dtype where that is wider (float64 params: float64); a dtype given is used
        as it is. The sum is cast to the params' dtype for the reduction ("once") or the optimizer
        ("each", whose reduced parts are each cast to the params' dtype before they are added).
      normalize: "mean" (loss_fn returns this rank's mean loss) or "tokens" (loss_fn returns
        `(loss_sum, count)`; the step divides the gradient and the loss by the total count over
        all micro-batches and ranks, agreed in the step's one agreement collective).
      clip_norm: None, or clip by the global 2-norm with `torch.nn.utils.clip_grad_norm_`'s
        coefficient `min(1, clip_norm / (norm + 1e-6))`; the norm is `Metrics.grad_norm`
        (before clipping), computed from shards the same way in every stage.
      donate: the step may consume its input state (JAX's `donate_argnums`): the optimizer
        updates the state's params and optimizer state in place (`Optimizer.update_`; stages 1-2
        all-gather the new params into the params buffer the input held), so a step does not hold
        a second copy of them; the same bits as the pure step. The input state is
        then marked consumed and raises if used again. A step skipped for a non-finite gradient
        leaves it intact. The step's only host synchronisation is its agreement: whether the
        update itself made params NaN or inf (which cannot be undone in place) is computed on the
        device and kept in the new state (`ZeroState.pending`), and the next step's agreement
        row carries it; so the step that breaks the state returns, and the next step -- or any
        other reader first (`fzero.gather`, `fzero.checkpoint.save`, `fzero.evaluate`) --
        raises `NonFiniteError` on every rank, naming that step and the leaves, whatever
        `on_nonfinite` says: restore from a checkpoint (`fzero.checkpoint.load` into the broken
        state works). `donate=False` checks each update at once (one all-reduce of a flag, read
        on the host): its promise is the input state unchanged, so an update that would break
        it raises or is skipped (`on_nonfinite`) before anything is kept.
      persist_bytes: where stage 3 frees units after use (see `gather`), a unit whose gathered
        bytes (`Σ N * S * itemsize` over its buckets) are at most this stays gathered for the
        micro-batch's forward and backward: no backward re-gather (DeepSpeed's
        `stage3_param_persistence_threshold`). 0 (default): every unit is freed. Same bits.
      max_live_bytes: None, or a cap on the gathered bytes live at once where stage 3 frees units
        after use: persisting units are freed early to make room; a unit larger than the cap, or
        units in use that leave no room, raise `ConfigError`. Same bits (proofs/stage3.md).
      prefetch: stage 3, on use: how many units ahead to start gathering (forward: the layout's
        unit order; backward: the reverse of the forward's read order), through `Mesh.start`
        (asynchronous on DistMesh). 0: gather when read. None (default): 1 where the mesh
        overlaps a started gather with compute (`Mesh.asynchronous`: DistMesh over N > 1, as
        DeepSpeed and FSDP2 prefetch by default), else 0. Same bits; prefetched units count
        against `max_live_bytes` (see `fzero._src.gathering`).
      cast_ahead: for a loss under `torch.autocast` at N = 1: hand it, already cast to the
        autocast dtype, each param the first step saw read exactly once, by a matrix product under
        autocast (a layer's weight), and widen its gradient into the fp32 bucket in the unit's
        backward -- the same bits, without torch's per-leaf casts (on CUDA its backward cast is an
        unvectorised kernel per leaf). Later steps watch those params' reads and raise
        `ConfigError` at any other (proofs/precision.md, "Casting ahead"). Only with the autograd
        engine, where nothing is freed and gathered again and nothing is offloaded; elsewhere it
        casts nothing. Default False.
      locate_nonfinite: at N > 1, also check each rank's local gradient for a NaN or inf before
        it is reduced (one more read of it per step), so that a non-finite step's `NonFiniteError`
        names the ranks it came from. Without it (default) the step finds every NaN or inf all the
        same, in the *reduced* gradient's `‖g‖²` (a sum with a NaN or inf term is not finite:
        proofs/stages.md §1, step 3, "Finding a non-finite gradient"), and the error names the leaves and
        the ranks whose loss is non-finite; the verdict, and so what is updated or skipped, is
        the same either way.
    """
    config = StepConfig(loss_fn, engine, on_nonfinite, gather, micro_batches, accumulate, accum_dtype, normalize,
                        clip_norm, donate, persist_bytes, max_live_bytes, prefetch, cast_ahead, locate_nonfinite)

    def step(state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        return eager_step(config, state, batch)

    step.config = config  # type: ignore[attr-defined]  # its settings, and what `cast_ahead` learned
    return step


@torch.compiler.disable  # under torch.compile(step) fzero runs eager; compile the loss instead (docs/compile.md)
def eager_step(config: StepConfig, state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
    with checked(state, pending=False):  # the step's agreement carries the pending flag
        _check_in_place_tiers(config, state)
        _check_no_transform_over_offload(state)
        with same_paths(state.layout), _no_vmap_over_steps():
            return run_step(config, state, batch)


def _check_in_place_tiers(config: StepConfig, state: ZeroState) -> None:
    """A tier that writes the optimizer state in place (NVMe's swap files) needs a donating step:
    refused before the step's work."""
    tier = state.info.tier
    if tier is not None and tier.in_place and not config.donate:
        raise ConfigError(f"Offload(optimizer={state.info.offload.optimizer!r}) writes the optimizer state's swap "
                          f"files in place, so a step consumes its input state: use train_step(..., donate=True) "
                          f"(got donate=False)")


def _check_no_transform_over_offload(state: ZeroState) -> None:
    """A step inside a `torch.func` transform (a meta-gradient, an HVP through the step) with
    buckets updated on a host tier: the update runs on the host master, which the transform does
    not see (found in review: "Cannot access storage of TensorWrapper" at the first host copy,
    and past it a derivative missing its identity term, or zero). Refused before the step."""
    if func_level() is not None and step_plan(state.info).offloaded:
        raise ConfigError(f"a step inside a torch.func transform (a derivative through the step: meta-gradients, "
                          f"HVPs) with {state.info.offload!r}: the update runs on the host copy of the master, "
                          f"which the transform does not see; differentiate through steps of a state made with "
                          f"offload=None")


@contextlib.contextmanager
def _no_vmap_over_steps() -> Iterator[None]:
    """torch's `.item()` / data-dependent-control-flow error under vmap, or its error for the
    agreement's host read (`tolist`) of a batched tensor, which has no storage (only vmap batches:
    under the other transforms the read works), as what it means for a step (docs/func.md)."""
    try:
        yield
    except RuntimeError as e:
        msg = str(e)
        batched = "doesn't have storage" in msg and func_level() is not None
        if not batched and ("vmap" not in msg or (".item()" not in msg and "data-dependent control flow" not in msg)):
            raise
        raise ConfigError("vmap over a step: the step decides on Python numbers that every rank agrees on (the "
                          "loss, the gradient norm, whether to skip a non-finite step), which vmap cannot batch. "
                          "vmap inside the loss instead (per-example gradients: examples/dp_sgd.py), or loop over "
                          "states (docs/func.md)") from e


def run_step(config: StepConfig, state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
    """One step (the module docstring), assembling its gradients into `config.buffers` where it
    donates on the CPU (`_lends`): given back when it returns, let go when it raises."""
    lends = _lends(config, state) and config.buffers.open()
    try:
        out = _run_step(config, state, batch, config.buffers if lends else None)
    except BaseException:
        if lends:
            config.buffers.close(kept=False)
        raise
    if lends:
        new = out[0]
        config.buffers.close(kept=True, holding=flatten((new.params, new.opt_state, new.master))[0])
    return out


def _lends(config: StepConfig, state: ZeroState) -> bool:
    """Whether a step keeps its gradient buffers for the next (`unit.HostBuffers`): a donating
    step, whose results hold no gradient, of a stage that shards nothing (stage 0 holds every
    unit's full gradient until its update, so the buffers it keeps between steps are those it
    held in the step, as DDP keeps its buckets; stages 1-3 hold one or two at a time, and keeping
    every unit's would hold a full gradient they never hold), on a CPU mesh (CUDA's caching
    allocator keeps freed memory), with the autograd engine, not offloaded, under no torch.func
    transform."""
    return (config.donate and not state.stage.shards and state.mesh.device.type == "cpu"
            and config.engine == "autograd" and not step_plan(state.info).offloaded and func_level() is None)


def _run_step(config: StepConfig, state: ZeroState, batch: Any, buffers: HostBuffers | None
              ) -> tuple[ZeroState, Metrics]:
    """What the update needs but the agreed values is prepared before the agreement's read
    (`prepare`); after it the host does only what decides the update before launching it
    (`update`); the metrics' tensors are made after it."""
    norms = EarlyNorms.of(config, state)
    with _named("fzero.step/backward"):
        reduced, loss, report, count = accumulate(config, state, micro_batches_of(config, state, batch), norms,
                                                  buffers)
    with _named("fzero.step/agree"):
        rows, shards = agreement(state, loss, report, reduced, count, norms, config.fingerprint)
        ready = prepare(state, reduced, config.donate)  # host work while the device still runs the backward
        verdict, ready, launched = agree_launching(config, state, rows, shards, reduced, report, ready)
    if verdict.broken_ranks:  # the donating step before this one broke the state in place
        raise broken_update(state, verdict.broken_ranks)
    _check_some_leaf_used(state, verdict)
    step, s, scaler, finite = int(state.step), loss_scale_of(state), state.info.scaler, verdict.finite
    scale = _normalizer(config, state, verdict)
    norm = math.sqrt(verdict.norm_sq) * scale / s if math.isfinite(verdict.norm_sq) else verdict.norm_sq
    mean_loss = verdict.loss / (verdict.count if config.normalize == "tokens" else state.mesh.world_size) / s
    seen = (mean_loss, norm, step, s if scaler is not None else None)
    next_scale = None if scaler is None else _scaler_update(scaler, state, verdict, step)
    if not finite:
        if scaler is not None:  # an overflow: skip the update, back off the scale (DeepSpeed)
            if config.donate:  # the new state shares every buffer: the next donating step writes them for
                consume(state)  # both (found in review: the old one then read, and saved, the next step's values)
            return state.replace(loss_scale=next_scale), _metrics(*seen, skipped=True)
        if config.on_nonfinite == "raise":
            leaves = nonfinite_leaves(state, readable(state.info, reduced))  # shed shards: their host copies
            raise NonFiniteError(_nonfinite_message(step, verdict, leaves))
        return state, _metrics(*seen, skipped=True)
    factor = scale * _clip_coefficient(config, norm) / s
    reduced = _rescale(reduced, factor, keep=step_plan(state.info).on_host)  # offloaded buckets: rescaled on the host, in `update`
    with _named("fzero.step/update"):
        new, broken = update(state, reduced, verdict.used, config.donate, host_factor=factor, ready=ready,
                             launched=launched)
    if config.donate:
        consume(state)
    if not broken:  # with donate, `broken` is always empty: `new.pending` carries the verdict
        return (new if scaler is None else new.replace(loss_scale=next_scale)), _metrics(*seen, skipped=False)
    if config.on_nonfinite == "raise":
        named = ", ".join(repr(p) for p in broken[:8]) + (" ..." if len(broken) > 8 else "")
        raise NonFiniteError(f"step {step}: the gradients are finite but the optimizer's update made the params "
                             f"NaN or inf{range_words(state)} in {named} ({state.mesh!r}, {len(broken)} leaves); the "
                             f"state is unchanged. "
                             f"Lower the learning rate, keep params in a wider dtype, or use on_nonfinite='skip'")
    return state, _metrics(*seen, skipped=True)


def _scaler_update(scaler: Any, state: ZeroState, verdict: Verdict, step: int) -> Any:
    """The scaler's next state after this step (`update`); its `LossScaleError` at the floor
    (`raise_at_min`) said only "the gradients overflowed": it now says what was non-finite, on
    which ranks (a NaN loss on rank 1 every step, in review, read as an overflow)."""
    try:
        return scaler.update(state.loss_scale, not verdict.finite)
    except LossScaleError as e:
        raise LossScaleError(f"step {step}: {e}. What was non-finite: {_culprits(verdict)}") from None


def _named(name: str) -> contextlib.AbstractContextManager:
    """A named range for profiles (`record_function`; benchmarks/gaps.py reads them) while a torch
    profiler runs, else nothing: entering and leaving one costs a dozen Python calls, on the
    host path between the agreement and the first update kernel too."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _metrics(loss: float, norm: float, step: int, loss_scale: float | None, skipped: bool) -> Metrics:
    return Metrics(torch.tensor(loss, dtype=torch.float64), torch.tensor(norm, dtype=torch.float64), step, skipped,
                   loss_scale)


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
    _check_alike(batch)
    return list(batch)


def _check_alike(micro: Sequence[Any]) -> None:
    """Micro-batches of one structure hold tensors of one dtype at each place (shapes may differ: a
    shorter last micro-batch, another sequence length, an image beside a video), and micro-batches
    that are bare tensors one number of dimensions, else `ConfigError`: what a batch `(x, y)` passed
    with `micro_batches=2` looks like, read as the two micro-batches `x` and `y` (targets of x's
    dtype, a float regression's, have fewer dimensions)."""
    first, spec = flatten(micro[0])
    bare = all(isinstance(mb, torch.Tensor) for mb in micro)
    for i, mb in enumerate(micro[1:], 1):
        leaves, other = flatten(mb)
        if other != spec:
            continue  # micro-batches of other structures (an optional key) are the loss's business
        for j, (a, b) in enumerate(zip(first, leaves)):
            if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and (a.dtype != b.dtype or bare and a.dim() != b.dim())):
                raise ConfigError(
                    f"micro_batches={len(micro)}: micro-batch {i}'s tensor #{j} is {_shown(b)} but micro-batch "
                    f"0's is {_shown(a)}; step(state, batches) takes a list of {len(micro)} micro-batches, each "
                    f"what the loss takes ([(x0, y0), (x1, y1), ...]): a batch (x, y) passed as it is reads as the "
                    f"micro-batches x and y")


def _shown(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def accumulate(config: StepConfig, state: ZeroState, micro: list[Any], norms: EarlyNorms | None = None,
               buffers: HostBuffers | None = None) -> tuple[dict[int, torch.Tensor], torch.Tensor, Report, torch.Tensor]:
    """Backward over every micro-batch: `(reduced gradient per trainable bucket, this rank's loss
    summed over micro-batches in float32 or wider, Report (OR over micro-batches), token count
    summed)`.

    "each": `Σ_i fl_b(reduce(g_i))` (added in `accum_dtype`; by default float32 or the gradient's
    dtype where wider, `added_in`), each reduced part first cast to its bucket's dtype `b`, as
    stages 2-3 get it (the gradient of the bucket's tensor, which autograd casts to its dtype:
    a reduce dtype wider than the params', bf16 params reduced in fp32, is rounded per
    micro-batch in every stage, so every stage adds the same parts; found in review: stages 0-1
    added the fp32 parts, and differed from stages 2-3);
    "once": `reduce(Σ_i g_i)`. The sums run
    in micro-batch order, `((x_1 + x_2) + x_3) + ...`, and are cast back to each bucket's dtype.
    `norms`, `buffers`: `backward`'s. With k > 1 each micro-batch's collectives carry its index
    (`gathering.in_micro_batch`): where stages 2-3 gather and reduce only the units a loss reads
    (`gather="on_use"`), a rank whose loss read no unit in micro-batch 0 would otherwise pair its
    micro-batch 1 with the others' micro-batch 0 (a complete sum in another order, no error);
    it raises `DivergentPaths` on every rank, naming the micro-batches.
    """
    once = config.accumulate == "once"
    acc: dict[int, torch.Tensor | None] = {b: None for b in _trainable(state)}
    dtypes = {b: state.layout.buckets[b].dtype for b in acc}
    loss = count = None
    used = bad = None
    for i, mb in enumerate(micro):
        with in_micro_batch(state.mesh, i, len(micro)):  # ranks in different micro-batches: a mismatch
            grads, l_i, report, c_i, started = backward(config, state, mb, norms, buffers)
            parts = grads if once else {b: g.to(dtypes[b]) for b, g in reduce(state, grads, started).items()}
        for b in acc:
            acc[b] = _add(acc[b], parts[b], config.accum_dtype)
        l_i = l_i.to(at_least_float32(l_i.dtype))  # 2 fp16 losses of 40000 sum to inf in fp16 (review)
        loss = l_i if loss is None else loss + l_i
        count = c_i if count is None else count + c_i
        used = report.used if used is None else torch.maximum(used, report.used)
        bad = report.bad if bad is None else torch.maximum(bad, report.bad)
    summed = {b: None if g is None else g.to(dtypes[b]) for b, g in acc.items()}
    return (reduce(state, summed) if once else summed), loss, Report(used, bad), count


def _add(acc: torch.Tensor | None, part: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """`acc + part` in `added_in(dtype, part.dtype)`."""
    if part is None:
        return acc
    part = part.to(added_in(dtype, part.dtype))
    return part if acc is None else acc + part


def _scaled(loss: torch.Tensor, s: float) -> torch.Tensor:
    """`loss * s` in float32 or wider, as DeepSpeed's ZeRO optimizers scale `loss.float()`: an
    fp16 loss times the scale overflows where its gradients do not (5.6 * 2^15 > 65504), and
    the step then skipped for the loss alone (found in review: every step under a
    `StaticLossScale(2^14)`). The gradient reaching the loss is `s` cast to its dtype, the same
    value as the narrow product's."""
    return loss.to(at_least_float32(loss.dtype)) * s


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


def _rescale(reduced: dict[int, torch.Tensor], factor: float, keep: frozenset[int] = frozenset()
             ) -> dict[int, torch.Tensor]:
    """Each reduced gradient times `factor` (element-wise, rounded to the gradient's dtype: the same
    bits for a shard and for the full buffer), or unchanged where the factor is 1 or the bucket is
    in `keep` (offloaded: `update` multiplies its host copy, `HostUpdate`'s `factor`)."""
    if factor == 1.0:
        return reduced
    return {b: g if b in keep else g * factor for b, g in reduced.items()}


# -- 1. forward and backward -----------------------------------------------------------------


def _trainable(state: ZeroState) -> list[int]:
    return list(step_plan(state.info).trainable)


class StepPlan(NamedTuple):
    """What `backward` and `_report` read of a state's `StateInfo` that never changes between
    steps, built once per `StateInfo` (`step_plan`): a step's prologue reads it, so the per-step
    setup is the step's own (its `Inflight`, handed to the units at call time, and the tensors).

    Attributes:
      programs: the units' `UnitProgram`s, in the layout's unit order.
      trainable: the trainable buckets, in layout order.
      trained_leaves: the trainable leaves with elements, in layout order: some rank's loss must
        reach one (`_check_some_leaf_used`).
      flat: whether the params pytree is a flat `{path: tensor}` dict (`gathering.is_flat_dict`).
      leaf_order: where the units' `used[L_u]`, concatenated in unit order, go in `used[L]`:
        None where that order is the layout's, else a CPU index `[Σ L_u]`.
      bucket_at: the same for `bad[B_u]` into `bad[B]`: None, or per bucket its place in the
        concatenated `bad` (None: no unit holds it, it reports 0).
      unused: per unit, the zeros a unit whose probe got no gradient reports (`[L_u]`, CPU).
      on_host: the trainable buckets whose update runs on a host tier (`HostUpdate`).
      held: per bucket, whether the step differentiates the held tensor itself, with no full
        buffer beside it (`offload.differentiated` is then `(held, None)`: no offload of the
        bucket, and a stage that does not differentiate a shard of the full buffer).
      beside: per bucket, whether, where a master is kept, the step differentiates it with the
        held buffer beside it (`offload.differentiated` is then `(master, held)`: no offload of
        the bucket, and a stage that says so -- stage 2 -- asked once with stand-ins).
    """

    programs: tuple[UnitProgram, ...]
    trainable: tuple[int, ...]
    trained_leaves: tuple[int, ...]
    flat: bool
    leaf_order: torch.Tensor | None
    bucket_at: tuple[int | None, ...] | None
    unused: dict[str, torch.Tensor]
    on_host: frozenset[int]
    held: tuple[bool, ...]
    beside: tuple[bool, ...]

    @property
    def offloaded(self) -> bool:
        """Whether some trainable bucket's update runs on a host tier."""
        return bool(self.on_host)


_STEP_PLANS: dict = {}


def step_plan(info: StateInfo) -> StepPlan:
    """`StepPlan` of `info`, built once per `StateInfo` (`unit.remembered`)."""
    return remembered(_STEP_PLANS, info, None, lambda: _step_plan(info))


def _step_plan(info: StateInfo) -> StepPlan:
    layout = info.layout
    programs = tuple(unit_programs(layout, info.mesh, info.stage, info.precision))
    leaves = [i for p in programs for i in p.leaves]
    buckets = [b.index for p in programs for b in p.buckets]
    trainable = tuple(b.index for b in layout.buckets if not b.group.frozen)

    def on_device(b: int) -> bool:  # neither the params nor the bucket's master and state offloaded
        return info.offload.params is None and info.host_tier(b) is None

    trained_leaves = tuple(ls.index for ls in layout.leaves if not ls.group.frozen and ls.numel > 0)
    return StepPlan(programs, trainable, trained_leaves, is_flat_dict(layout),
                    None if leaves == list(range(len(layout.leaves))) else torch.tensor(leaves, dtype=torch.long),
                    None if buckets == list(range(len(layout.buckets))) else
                    tuple({b: k for k, b in enumerate(buckets)}.get(b) for b in range(len(layout.buckets))),
                    {p.name: torch.zeros(len(p.leaves)) for p in programs},
                    frozenset(b for b in trainable if info.host_tier(b) is not None),
                    tuple(on_device(b.index) and not (info.stage.sharded("grads") and not info.stage.sharded("params"))
                          for b in layout.buckets),
                    tuple(on_device(b.index) and _beside(info, b.index) for b in layout.buckets))


def _beside(info: StateInfo, b: int) -> bool:
    """Whether the stage differentiates bucket b's master with its held buffer beside it: its
    `differentiated` asked with stand-ins (no tensor is read where a master is given)."""
    held, master = object(), object()
    x, full = info.stage.differentiated(info.layout, b, held, info.rank, master)
    return x is master and full is held


_PROBES: dict = {}


def _probes(info: StateInfo, programs: list, devices: tuple[torch.device, ...], grad: bool, locate: bool
            ) -> dict[str, Probe]:
    """Each unit's `Probe` (zeros on the device of its first bucket's differentiated tensor; leaves
    that require grad for the autograd engine, `grad`; `locate`: the units check each local
    gradient), built once per `StateInfo`, devices, engine and `locate`: no step writes them, and
    `torch.autograd.grad` returns their gradients without accumulating any."""
    def build() -> dict[str, Probe]:
        probes = {p.name: Probe.of(p, d, locate) for p, d in zip(programs, devices)}
        return {u: Probe(*(t.requires_grad_() for t in p)) for u, p in probes.items()} if grad else probes

    return remembered(_PROBES, info, (devices, grad, locate), build)


class BucketPlan(NamedTuple):
    """What a step needs of one trainable bucket that never changes for a state's `StateInfo`
    (layout, stage, mesh, rank, precision): how it travels, and the optimizer's context but for
    the step index and the used flags (`context`)."""

    index: int
    wire: Wire
    group: ParamGroup
    segments: tuple[Segment, ...]  # `Stage.segments`: the leaf pieces of what the optimizer updates
    leaves: tuple[int, ...]
    leaf_sum: Callable[[torch.Tensor], torch.Tensor]
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    within: torch.dtype | None  # `precision.narrower_range`: the compute dtype the finite check reads in

    def context(self, step: int, used: list[bool] | None, leaf_sum: Callable | None = None) -> UpdateContext:
        """`used`: the step's used flags over all leaves (None: every leaf used); `leaf_sum`: where
        the optimizer's per-leaf sums run elsewhere (an offloaded bucket's, on the host)."""
        mine = (True,) * len(self.leaves) if used is None else tuple(map(used.__getitem__, self.leaves))
        return UpdateContext(step, self.group, self.segments, self.leaves, mine, leaf_sum or self.leaf_sum,
                             self.numels, self.shapes)


_PLANS: dict = {}


def plan_of(info: StateInfo) -> dict[int, BucketPlan]:
    """`{bucket: BucketPlan}` over the trainable buckets, built once per `StateInfo` (every state a
    step returns shares its input's; `unit.remembered`)."""
    layout, stage, mesh, rank = info.layout, info.stage, info.mesh, info.rank
    return remembered(_PLANS, info, None, lambda: {
        spec.index: BucketPlan(spec.index, info.precision.wire(spec), spec.group,
                               stage.segments(layout, spec.index, rank), spec.leaves,
                               stage.leaf_sum(mesh, spec.tag), tuple(layout.leaves[i].numel for i in spec.leaves),
                               tuple(layout.leaves[i].shape for i in spec.leaves),
                               info.precision.within(spec))
        for spec in layout.buckets if not spec.group.frozen})


def backward(config: StepConfig, state: ZeroState, batch: Any, norms: EarlyNorms | None = None,
             buffers: HostBuffers | None = None
             ) -> tuple[dict[int, torch.Tensor | None], torch.Tensor, Report, torch.Tensor, dict[int, Flight]]:
    """One micro-batch: `({bucket: gradient of its differentiated tensor, or None}, detached loss
    as differentiated, Report, token count (float64; 0 in "mean" mode), {bucket: its reduction in
    flight})`. With the autograd engine and `accumulate="each"`, stages 0-1 start each bucket's
    reduction (`Stage.after_backward`) in its unit's backward, as stages 2-3 start theirs: the
    bucket's gradient is then None and `reduce` finishes the flight (the same calls on the same
    tensor, so the same bits). `norms` (`EarlyNorms`) takes the norm of each reduction's result
    that exists in the unit's backward (N = 1); `buffers` (`HostBuffers`) where the units assemble
    their gradients (`Inflight.buffers`)."""
    layout, stage, mesh, rank = state.layout, state.stage, state.mesh, state.rank
    plan = step_plan(state.info)
    trainable = plan.trainable
    # func: every reduction waited in place; "once": stages 0-1 reduce the sum of the micro-batches
    early = trainable if config.accumulate == "each" and stage.reduces_after_leave else ()
    # offload: gradient shards to the host in the backward, shed where nothing reads them after
    copies = early_copies(state.info, config.micro_batches, shard_norm, config.accum_dtype) if plan.offloaded else None
    side = (norms.assembly(state) if norms is not None  # else k > 1 micro-batches: the assembly beside alone
            else side_assembly(Side(mesh.device), state) if beside_backward(config, state) else None)
    inflight = (Chained(early=early, host=copies, done=None if norms is None else norms.take, side=side,
                        buffers=buffers) if config.engine == "autograd" else None)
    programs = plan.programs
    if all(plan.held):
        xs, fulls = list(state.params), [None] * len(state.params)
    else:
        pairs = [(p, None) if held else (m, p) if beside and m is not None else
                 differentiated(state.info, b, p, m, mesh.device)
                 for b, (p, m, held, beside) in enumerate(zip(state.params, state.master, plan.held, plan.beside))]
        xs, fulls = [x for x, _ in pairs], [full for _, full in pairs]
    s = loss_scale_of(state)
    probes = _probes(state.info, programs, tuple([xs[p.buckets[0].index].device for p in programs]),
                     config.engine == "autograd", config.locate_nonfinite and mesh.world_size > 1)
    releasable = (config.gather == "on_use" and config.engine == "autograd" and stage.sharded("params")
                  and plan.flat and not (config.max_live_bytes is None and _reads_held(state, xs, fulls)))
    casting = (config.cast_ahead and mesh.world_size == 1 and config.engine == "autograd" and func_level() is None
               and not releasable and not plan.offloaded)

    roots: dict[str, torch.Tensor] = {}  # the loss's placeholder roots (`gathering.FirstUse`), where it has them

    def loss_of(train: tuple[torch.Tensor, ...], probes: dict[str, Probe], casts: dict[str, tuple] | None = None,
                reads: Reads | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        merged = list(xs)
        for b, x in zip(trainable, train):
            merged[b] = x
        counts: list[torch.Tensor] = []

        def objective(params: Any, mb: Any) -> torch.Tensor:
            loss, count = _objective(config, config.loss_fn(params, mb))
            counts.append(count)
            # a loss the check refuses goes to it as returned (scaled, it was named float32)
            scalable = s != 1.0 and isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()
            return _scaled(loss, s) if scalable else loss

        gathering = Gathering(layout, programs, merged, fulls, probes, config.gather, releasable,
                              config.persist_bytes, config.max_live_bytes, config.prefetch, inflight, casts, reads)
        loss = gathering.loss(objective, batch)
        roots.update(gathering.roots)
        return loss, counts[0]

    train = tuple([xs[b] for b in trainable])
    if config.engine == "func":
        (g_train, g_probes), (loss, count) = torch.func.grad_and_value(loss_of, argnums=(0, 1), has_aux=True)(
            train, probes)
    else:
        g_train, g_probes, loss, count, g_roots = _autograd(
            loss_of, train, probes, config.ahead.of(state.info) if casting else None, state.step, roots)
        inflight.wait()  # the reductions the units' backward started: done before any gradient is read
        if inflight.side is not None:  # the gradients assembled beside the backward: before any is read
            inflight.side.join()
        refuse_placeholder_gradients(g_roots)
    started = inflight.rest(lambda b: _zeros_reduction(state, b)) if inflight is not None else {}
    return dict(zip(trainable, g_train)), loss.detach(), _report(state, programs, g_probes), count, started


def _reads_held(state: ZeroState, xs: list[torch.Tensor], fulls: list[torch.Tensor | None]) -> bool:
    """Whether every unit reads its held tensors themselves, so that no gathered storage exists
    to free and gather again (`Gathering`'s `releasable` would do nothing but run a saved-tensor
    hook per saved tensor): at N = 1 with the params on the device (the enter's gather is then
    `Mesh.solo`'s, which returns its input), each bucket's held tensor -- what the unit enters:
    the full buffer beside the differentiated tensor where there is one (`fulls[b]`, an
    offloaded master's stand-in beside it), else that tensor -- already in its compute dtype
    (the enter's cast returns it too)."""
    if state.mesh.world_size != 1 or state.info.offload.params is not None:
        return False
    return all([held_tensor(xs, fulls, b.index).dtype == b.wire.compute
                for p in step_plan(state.info).programs for b in p.buckets])


class Chained(Inflight):
    """`unit.Inflight` where a bucket's reduction is more than one collective (stage 0: the
    reduce-scatter, then the all-gather of the reduced shard): each bucket's next collective
    starts as soon as the next bucket's reduction has started -- it waits for the bucket's own
    reduce-scatter (`Flight.advance`), which has had a unit's backward to run -- so the gradient
    all-gathers run during the rest of the backward, not after it; `step.reduce` advances the
    last one. Which flight is advanced depends only on the order the flights start in, which
    `Inflight` fixes (`early`, from the last bucket): every rank issues
    `RS(k_1), RS(k_2), AG(k_1), RS(k_3), AG(k_2), ...`, the same calls on the same tensors as
    `reduce`'s (the same bits). A one-collective reduction that holds its input (stage 1's
    reduce-scatter, not stage 0's all-reduce in place) is waited for there instead (`Flight.advance`
    of its last phase): stage 1's local gradient
    `flat[N * S]` is then released one bucket after its reduction
    starts, not all together after the backward -- a step that holds one or two of them at a
    time instead of every unit's reuses freed memory instead of asking the system for fresh pages."""

    # how many flights start after a bucket's before its next collective does (a wait for its
    # reduce-scatter that stalls the backward is less likely the larger it is; 1 and 2 did not
    # differ beyond noise on a loaded 2-core CPU over gloo)
    LAG = 1

    def __init__(self, depth: int = 1, early: tuple[int, ...] = (),
                 host: Callable[[torch.Tensor, int | None], None] | None = None,
                 done: Callable[[torch.Tensor], None] | None = None, side: Assembly | None = None,
                 buffers: HostBuffers | None = None) -> None:
        super().__init__(depth, early, host, done, side, buffers)
        self._order: list[int] = []  # the buckets in the order their flights started

    def begin(self, b: int, start: Callable[[], Any]) -> None:
        super().begin(b, self._then_advance(b, start))

    def rest(self, zeros: Callable[[int], Callable[[], Any]]) -> dict[int, Any]:
        return super().rest(lambda b: self._then_advance(b, zeros(b)))

    def _then_advance(self, b: int, start: Callable[[], Flight]) -> Callable[[], Flight]:
        def run() -> Flight:
            flight = start()
            self._order.append(b)
            if len(self._order) > self.LAG:
                k = self._order[-1 - self.LAG]
                self.started[k] = self.started[k].advance()
            return flight

        return run


def _zeros_reduction(state: ZeroState, b: int) -> Callable[[], Flight]:
    """Where no unit backward reached bucket `b` on this rank: its reduction of zeros, as `reduce`
    does for a missing gradient (every rank must reduce every bucket)."""
    return lambda: state.stage.after_backward.start(state.mesh, plan_of(state.info)[b].wire, _zero_grad(state, b))


def _zero_grad(state: ZeroState, b: int) -> torch.Tensor:
    """Zeros like the tensor the step differentiates for bucket `b` (`offload.differentiated`): the
    gradient of a bucket no unit backward reached on this rank."""
    return torch.zeros_like(differentiated(state.info, b, state.params[b], state.master[b], state.mesh.device)[0])


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
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"{type(out).__name__} {getattr(out, 'shape', '')}"
        raise ConfigError(f"normalize='tokens' needs loss_fn to return (loss_sum, count), got {got}")
    loss_sum, count = out
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0 or not loss_sum.dtype.is_floating_point:
        raise ConfigError(f"normalize='tokens': the loss_sum loss_fn returned must be a 0-d floating tensor (the sum "
                          f"of this micro-batch's token losses; where it has no token, the model's loss summed over "
                          f"the empty batch, a 0 that reads every param as the others do), got "
                          f"{type(loss_sum).__name__} {getattr(loss_sum, 'dtype', '')} {getattr(loss_sum, 'shape', '')}")
    try:  # a Python float in float64: `torch.as_tensor` made it float32, 16777217.0 -> 16777216 (found in review)
        if isinstance(count, bool) or isinstance(count, torch.Tensor) and count.dtype == torch.bool:
            raise TypeError("a bool is not a count")  # (found in review: True was taken as 1)
        count = count.detach() if isinstance(count, torch.Tensor) else torch.as_tensor(count, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"normalize='tokens': the count loss_fn returned must be one finite number >= 0 (an int, "
                          f"a float or a 1-element tensor), got {type(count).__name__} {count!r}") from None
    if count.numel() != 1 or count.is_floating_point() and not bool(torch.isfinite(count)) or bool(count < 0):
        raise ConfigError(f"normalize='tokens': the count loss_fn returned must be one finite number >= 0, got {count}")
    return loss_sum, count.to(device="cpu", dtype=torch.float64).reshape(())


def _autograd(loss_of: Callable, train: tuple, probes: dict[str, Probe], ahead: Slot | None = None,
              step: Any = None, roots: Mapping[str, torch.Tensor] | None = None):
    """`torch.autograd.grad` of `loss_of`'s loss. `ahead` (the state's `casting.Slot`): the
    forward hands the casts it learned, and its `Reads` learns (the first step) or checks the
    reads of the watched leaves through the forward and the backward (`fzero._src.casting`);
    `step` names the step in its errors. `roots`: filled by `loss_of` with its placeholders'
    roots, differentiated too (allowed unused: the engine does nothing for one the loss does not
    reach), `{path: gradient or None}` returned last."""
    train = tuple([x.detach().requires_grad_() for x in train])
    reads = ahead.reads(step) if ahead is not None else None
    try:
        with torch.enable_grad():
            loss, count = loss_of(train, probes, ahead.casts if ahead is not None else None, reads)
        if reads is not None:
            reads.forward_done(loss)
        extra = dict(roots or {})
        inputs = [*train, *[t for p in probes.values() for t in p], *extra.values()]
        if not loss.requires_grad or not inputs:  # nothing reaches a param, or there is none (params `{}`)
            grads = [None] * len(inputs)
        else:
            grads = list(torch.autograd.grad(loss, inputs, allow_unused=True))
        if reads is not None:
            reads.check()  # a read in the backward (a hook) the engine swallowed is not: raise it
    finally:
        if reads is not None:
            reads.close()
    if ahead is not None:
        ahead.seen(reads)
    g_probes = {u: Probe(*grads[len(train) + 2 * k : len(train) + 2 * k + 2]) for k, u in enumerate(probes)}
    g_roots = dict(zip(extra, grads[len(grads) - len(extra):]))
    return grads[: len(train)], g_probes, loss, count, g_roots


def refuse_placeholder_gradients(g_roots: Mapping[str, torch.Tensor | None]) -> None:
    """Raise `ConfigError` where a placeholder's root got a gradient (`gathering.FirstUse`): a
    custom `torch.autograd.Function` -- or another call that bypasses torch's function dispatch
    -- was applied to the placeholder of those leaves in grad mode, so its node's edge is the
    placeholder's, and the leaf would get no gradient through it (before, the step updated the
    leaf without that path, silently; found in review). Every rank runs the same loss, so every
    rank raises here, after its reductions, before anything is updated."""
    named = [path for path, g in g_roots.items() if g is not None]
    if named:
        raise ConfigError(
            f"gather='on_use' with params that are not a flat dict: a custom autograd.Function (or another call that "
            f"bypasses torch's function dispatch) was applied in grad mode to the placeholder of {named[:8]}. fzero "
            f"swaps a placeholder for the gathered leaf at the first torch function that receives it, but "
            f"Function.apply is not one, so the Function was built on the placeholder and the leaf would get no "
            f"gradient through it; pass a view of the leaf made by torch (Fn.apply(w.view_as(w))), use "
            f"gather='eager', or flat-dict params. Nothing was updated")


def _report(state: ZeroState, programs: list, g_probes: dict[str, Probe]) -> Report:
    """The probes' gradients as one `Report`: the units' `used[L_u]` concatenated (CPU) and their
    `bad[B_u]` concatenated on the mesh device, each put in layout order by one index where the
    units' order is not the layout's (`StepPlan`); a unit whose probe got no gradient reports
    zeros. No per-bucket op: indexing a device tensor with a Python list would copy the index
    host-to-device, and a blocking copy synchronises the stream."""
    plan, dev = step_plan(state.info), state.mesh.device
    gs = [g_probes[p.name] for p in programs]
    used = torch.cat([plan.unused[p.name] if g.used is None else g.used for p, g in zip(programs, gs)] or
                     [torch.zeros(0)])
    if plan.leaf_order is not None:
        used = torch.zeros(len(state.layout.leaves)).index_copy_(0, plan.leaf_order, used)
    got = [g.bad is not None and g.bad.numel() == len(p.buckets) for p, g in zip(programs, gs)]  # not: unlocated
    if not any(got):  # zeros made once (read only: the step only reads and copies them)
        return Report(used, shared_zeros((len(state.layout.buckets),), dev))
    parts = [g.bad.to(dev) if ok else shared_zeros((len(p.buckets),), dev)  # zeros where a probe got none
             for p, g, ok in zip(programs, gs, got)]
    bad = torch.cat(parts)
    if plan.bucket_at is not None:
        bad = torch.stack([bad.new_zeros(()) if k is None else bad[k] for k in plan.bucket_at])
    return Report(used, bad)


# -- 2. reduce ---------------------------------------------------------------------------------


def reduce(state: ZeroState, grads: dict[int, torch.Tensor | None], started: dict[int, Flight] | None = None
           ) -> dict[int, torch.Tensor]:
    """Per trainable bucket, the reduced gradient the optimizer reads (`Stage.after_backward`);
    a bucket no gradient reached on this rank contributes zeros, as every rank must reduce.
    Every bucket's collectives are started before the first is waited for (`Stage` pieces'
    `start`), or were started in its unit's backward (`started`: stages 0-1); on DistMesh they run
    concurrently; the calls and their order per bucket are those of the blocking form, so the bits
    are too. Where stage 0 reduces by reduce-scatter + all-gather (a mesh without
    `all_reduce_is_reduce_scatter_gather`), its all-gathers not started in backward (`Chained`)
    start after every reduce-scatter has been started, in bucket order; elsewhere its reduction is
    one all-reduce."""
    stage, mesh = state.stage, state.mesh
    started = started or {}
    grads = {b: g if g is not None else _zero_grad(state, b) for b, g in grads.items() if b not in started}
    plan = plan_of(state.info)
    if not overlaps(grads.values()):  # differentiated through: the blocking, differentiable form
        return {b: stage.after_backward.run(mesh, plan[b].wire, g) for b, g in grads.items()}
    flights = {b: started[b] if b in started else stage.after_backward.start(mesh, plan[b].wire, grads[b])
               for b in plan if b in started or b in grads}
    flights = {b: f.advance() for b, f in flights.items()}  # stage 0: each all-gather as its reduce-scatter ends
    return {b: f.wait() for b, f in flights.items()}


def overlaps(tensors: Any) -> bool:
    """Whether the step may issue collectives without waiting (`Piece.start`: detached, outside
    autograd): only where nothing differentiates through the step -- no torch.func transform is
    active and no tensor requires grad. Otherwise the blocking, differentiable `Piece.run`."""
    return func_level() is None and not any(map(_REQUIRES_GRAD, tensors))


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_IS_TENSOR = functools.partial(operator.is_not, None)


# -- 3. agree ---------------------------------------------------------------------------------


class Row(NamedTuple):
    """The columns of `agreement`'s row, `[loss, used[L], bad[B], ‖g_shard‖², count, broken,
    settings, step, serial, lr, scale, scaled]`, for L leaves and B buckets: loss at 0, used at
    `1 : 1 + L`, bad at `1 + L : sq`, then one column each."""

    sq: int
    tokens: int
    broken: int
    settings: int
    step: int
    serial: int
    lr: int
    scale: int
    scaled: int
    width: int

    @staticmethod
    def of(num: int, nb: int) -> "Row":
        sq = 1 + num + nb
        return Row(*range(sq, sq + 10))


def agreement(state: ZeroState, loss: torch.Tensor, report: Report, reduced: dict[int, torch.Tensor],
              count: torch.Tensor, norms: EarlyNorms | None, settings: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The one agreement collective: `(rows[N, L + B + 10], the rank's gradient shards)`, the rows
    of `[loss, used[L], bad[B], ‖g_shard‖², count, broken, settings, step, serial, lr, scale,
    scaled]` (float64, `Row`) from every rank, gathered on the device and not read yet: `agree`
    reads them on the host (the step's one host synchronisation), and what the host can do before
    that read runs before it (`prepare`). `settings` is the fingerprint of the step's settings
    (`StepConfig.fingerprint`), `step` the state's step counter, `serial` which `init` made it
    (`StateInfo.serial`), `lr` the optimizer's lr at this step (`scheduled_lr`, exact in
    float64), `scale` the loss scale the step used and `scaled` its scaler's update count
    (`LossScaleState.iteration`, -1 without a scaler: a skipped step leaves `step` as it was, so a
    rank that kept the state from before a skip shows only there): ranks whose steps differ in any
    raise `ConfigError` on every rank, before anything is updated (`_check_same_steps`).

    `‖g_shard‖²` is `sum_of_squares` of the rank's shards of the *reduced* gradient (stage 0
    takes its rank's shard of the full buffer, so every stage computes it from the same tensor
    values); ranks' parts and losses are then summed in rank order on the host (`in_order`:
    Python floats, float64 adds). `broken` is the state's `pending` flag
    (0 without one): whether the donating update that made the state left a NaN or inf on this
    rank. Where some rank's part is not finite -- a NaN or inf, or a float32 norm that overflowed
    -- every rank (all see the same rows) recomputes its part exactly in float64
    (`exact_sum_of_squares`) and the parts are gathered again: the rare path decides finiteness
    exactly. The units check their local gradients only with `locate_nonfinite` at N > 1 (else
    `bad` is 0): a NaN or inf in any rank's local gradient makes the reduced gradient's `‖g‖²`
    NaN or inf all the same (proofs/stages.md §1, step 3), and at N = 1 the rare path then names
    the buckets from the reduced gradient, which is the local one. `norms`
    (`EarlyNorms`): the shard norms already taken in the backward, the same bits.
    """
    layout, stage, mesh, rank = state.layout, state.stage, state.mesh, state.rank
    n, dev = mesh.world_size, mesh.device
    num, nb = len(layout.leaves), len(layout.buckets)
    shards = [stage.grad_shard(layout, b, g, rank) for b, g in reduced.items()]
    known = early_norms(state.info, shards) | ({} if norms is None else norms.known(shards))
    sq = sum_of_squares(shards, dev, known)
    scaled = -1 if state.loss_scale is None else int(state.loss_scale.iteration)
    checks = torch.tensor([settings, int(state.step), state.info.serial, scheduled_lr(state), loss_scale_of(state),
                           scaled], dtype=torch.float64)
    # one copy to the device
    host = torch.cat([report.used.to(torch.float64), count.to(torch.float64).reshape(1), checks])
    host = (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
    broken = (state.pending.to(device=dev, dtype=torch.float64).reshape(1) if state.pending is not None
              else sq.new_zeros(1))
    row = torch.cat([loss.to(device=dev, dtype=torch.float64).reshape(1), host[:num],
                     report.bad.to(dev, torch.float64), sq.reshape(1), host[num : num + 1], broken, host[num + 1 :]])
    return all_gather(row, mesh, tag="fzero.step/agree").view(n, Row.of(num, nb).width), shards


def scheduled_lr(state: ZeroState) -> float:
    """The optimizer's lr at the state's step (`Optimizer.lr`), before any group's `lr_scale`
    (which `init` compares); 0.0 for an optimizer that does not say (`lr=None`); -1.0 where the
    schedule raises at this step (its values are >= 0, `as_schedule`): the update raises it again
    after the verdict, unless the step is skipped (a skipped step reads no lr, as torch's).
    `as_schedule`'s schedules compute each step's value once (the update reads the same)."""
    schedule, step = state.optimizer.lr, int(state.step)
    if schedule is None:
        return 0.0
    try:
        value = schedule(step)
    except Exception:  # noqa: BLE001 -- raised again by the update, where there is one
        return -1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"step {step}: Optimizer.lr returned {type(value).__name__} {value!r}; a schedule returns "
                          f"a finite float >= 0 (fzero.optim.as_schedule checks one)")
    return float(value)


def agree(config: StepConfig, state: ZeroState, rows: torch.Tensor, shards: list[torch.Tensor],
          reduced: dict[int, torch.Tensor]) -> Verdict:
    """`agreement`'s rows read on the host once (`tolist`: the step's one synchronisation), as the
    `Verdict` every rank agrees on (`_verdict`)."""
    return _verdict(config, state, rows.tolist(), shards, reduced)


class Early(NamedTuple):
    """An update launched before the agreement's read whose kernels ran (`agree_launching`): per
    bucket the new optimizer state its launch returned, and the finite check already taken of
    each bucket after its kernels (`Ends`; None off CUDA), as `update` takes it."""

    states: dict[int, Any]
    ends: Ends | None


def agree_launching(config: StepConfig, state: ZeroState, rows: torch.Tensor, shards: list[torch.Tensor],
                    reduced: dict[int, torch.Tensor], report: Report, ready: Ready | None
                    ) -> tuple[Verdict, Ready | None, Early | None]:
    """`agree`, with the update launched before the read where nothing the verdict decides but
    whether it runs changes its kernels (`early_skip`): `(verdict, ready, launched)`.

    The rows' copy to the host is queued first (`HostRead`), then every prepared bucket's kernels
    with the device flag that skips them (`Launch.skips`), then the host reads: the device goes
    from the agreement to the update without waiting for the host, as DDP's optimizer follows its
    backward; each bucket's finite check follows its kernels (`Ends`), as in `update`.
    `launched` (`Early`): where the flag was 0 (the kernels ran; the verdict is then finite and
    every leaf used); None otherwise. Where the flag was 1 the kernels wrote nothing and the
    prepared launches are spent (`ready` None): a verdict that is finite all the same (a float32
    ‖g‖² that overflowed but whose exact value is finite, `_verdict`) updates through `update_`.
    Ranks may differ in whether they launch early (a check that fails on one rank only): the
    launches are local, and every rank makes the same collectives after the read."""
    skip = early_skip(config, state, rows, reduced, report, ready)
    grads = None if skip is None else _checked(ready, reduced)
    if grads is None:
        return agree(config, state, rows, shards, reduced), ready, None
    read = HostRead(rows, skip)
    ends, states = Ends.of(state, True), {}
    for b, g in grads.items():
        with _updating(ends):
            states[b] = ready.launches[b].run(g, skip)
        if ends is not None:
            ends.take(b, ready.params[b])
    got, skipped = read.values()
    verdict = _verdict(config, state, got, shards, reduced)
    if skipped:
        return verdict, None, None
    assert verdict.finite and all(verdict.used) and not verdict.broken_ranks, "the device flag and the verdict disagree"
    return verdict, ready, Early(states, ends)


def _checked(ready: Ready, reduced: dict[int, torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """Each bucket's gradient in its param's dtype, checked by its launch (`Launch.check`), or None
    where some check fails: nothing is launched early then, and the error is raised after the
    verdict, where a step that is skipped raises none (as without the early launch)."""
    grads = {b: g.to(ready.params[b].dtype) for b, g in reduced.items()}
    try:
        for b, g in grads.items():
            ready.launches[b].check(g)
    except Exception:  # noqa: BLE001 -- `update` launches it again after the verdict, and it raises there
        return None
    return grads


def early_skip(config: StepConfig, state: ZeroState, rows: torch.Tensor, reduced: dict[int, torch.Tensor],
               report: Report, ready: Ready | None) -> torch.Tensor | None:
    """The flag an update launched before the agreement's read gives its kernels (float32 0-d on
    the mesh device: 1 where some rank's row has a non-finite loss or ‖g‖², a non-finite local
    gradient, or a broken previous update -- every way a verdict is not finite), or None where
    the update may not be launched then: it must be a donating step's (`ready`, nothing
    differentiates through it) whose every bucket is prepared with kernels that skip on the flag
    (`Launch.skips`: torch's fused kernels), and the verdict must decide nothing else about it --
    no clipping and no loss scaler (no factor from the norm), "mean" normalizing (none from the
    count), every leaf used on this rank (so in every rank's OR too, `_used`)."""
    if (ready is None or not ready.overlap or config.clip_norm is not None or state.info.scaler is not None
            or config.normalize != "mean"):
        return None
    if not all(b in ready.launches and ready.launches[b].skips for b in reduced) or not reduced:
        return None
    if not bool((report.used > 0).all()):  # a host tensor: no synchronisation
        return None
    return skip_flag(rows, len(state.layout.leaves), len(state.layout.buckets))


def skip_flag(rows: torch.Tensor, num: int, nb: int) -> torch.Tensor:
    """float32 0-d, on the rows' device: 1 where some row of `agreement`'s (`Row`) has a
    non-finite loss or ‖g‖², a bad bucket (> 0) or a broken flag (≠ 0), or where the rows' step
    settings or step counters differ, else 0. Where it is 0, `_verdict` of the same rows is
    finite, names no broken rank and raises no `ConfigError`."""
    c = Row.of(num, nb)
    loss, bad, sq, broken = rows[:, 0], rows[:, 1 + num : c.sq], rows[:, c.sq], rows[:, c.broken]
    checks = rows[:, c.settings : c.width]
    clean = (torch.isfinite(loss).all() & torch.isfinite(sq).all() & (bad <= 0).all() & (broken == 0).all()
             & (checks == checks[:1]).all())
    return clean.logical_not().to(torch.float32)


class HostRead:
    """Tensors' values for the host, their copy queued now and read later (`values`): on CUDA into
    pinned memory behind an event, so that work queued after it on the stream does not delay the
    read; elsewhere `tolist` when read."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors, self.done = tensors, None
        if tensors and tensors[0].device.type == "cuda":
            self.tensors = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                 for t in tensors)
            self.done = torch.cuda.Event()
            self.done.record()

    def values(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return [t.tolist() for t in self.tensors]


def _verdict(config: StepConfig, state: ZeroState, rows: list[list[float]], shards: list[torch.Tensor],
             reduced: dict[int, torch.Tensor]) -> Verdict:
    """The agreed rows (one per rank, `agree`'s layout) -> `Verdict`: Python over ranks and
    columns, no tensor op but on the rare paths."""
    layout, mesh = state.layout, state.mesh
    n, num, nb = mesh.world_size, len(layout.leaves), len(layout.buckets)
    c = Row.of(num, nb)
    _check_same_steps(config, state, rows, c)
    losses, sqs, counts = [r[0] for r in rows], [r[c.sq] for r in rows], [r[c.tokens] for r in rows]
    bad_rows = [r[1 + num : c.sq] for r in rows]
    if not all(math.isfinite(q) for q in sqs):  # the rare path: decide exactly (shed shards: their host copies)
        shards = list(readable(state.info, dict(enumerate(shards))).values())
        exact = exact_sum_of_squares(shards, mesh.device).reshape(1)
        sqs = all_gather(exact, mesh, tag="fzero.step/agree_exact").tolist()
    bad_ranks = {r: [layout.buckets[b].tag for b, x in enumerate(bad_rows[r]) if x > 0]
                 for r in range(n) if not math.isfinite(losses[r]) or max(bad_rows[r], default=0.0) > 0}
    if n == 1 and not math.isfinite(sqs[0]):  # the rare path without a local check: the reduced is the local
        bad_ranks[0] = _nonfinite_buckets(state, readable(state.info, reduced))
    used = _used(rows, num)
    broken = tuple(r for r in range(n) if rows[r][c.broken] != 0)
    located = n == 1 or config.locate_nonfinite
    return Verdict(used, bad_ranks, in_order(losses), in_order(sqs), in_order(counts), broken, located)


def _check_same_steps(config: StepConfig, state: ZeroState, rows: list[list[float]], c: Row) -> None:
    """Raise `ConfigError` on every rank (all read the same rows) where the ranks' steps differ in
    their settings (`StepConfig.shared`; one more all-gather, of each setting's fingerprint, names
    the first that differs: `state.check_same_settings`), in the `init` that made their states
    (`StateInfo.serial`), in their state's step counter or its loss scaler's update count (a rank
    that stepped an older state: a skipped step moves only the latter), in the loss scale (each
    rank would divide the one reduced gradient by its own) or in their optimizer's lr at this step
    (schedules `init` could not tell apart: a `functools.partial`'s arguments, a callable object's
    attributes)."""
    if any(r[c.settings] != rows[0][c.settings] for r in rows):
        check_same_settings(state.mesh, "fzero.train_step", **config.shared)
        raise ConfigError(f"train_step settings differ across ranks (world size {state.mesh.world_size}), though "
                          f"each setting alone agrees: rank {state.mesh.rank}'s are {config.shared}")
    for col, what, fix in ((c.serial, "the state of its init #{}", "the state the same fzero.init made (and its "
                            "steps returned)"),
                           (c.step, "step {}", "the state its previous step returned (a rank kept an older state, "
                            "or restored another checkpoint)"),
                           (c.scaled, "loss scaler update {}", "the state its previous step returned, skipped steps "
                            "included (a rank kept the state from before a skipped step, or restored another "
                            "checkpoint)")):
        values = [int(r[col]) for r in rows]
        if any(v != values[0] for v in values):
            said = ", ".join(f"rank {r}: " + what.format(v) for r, v in enumerate(values))
            raise ConfigError(f"ranks stepped different states ({said}; world size {len(values)}): every rank must "
                              f"step {fix}. Nothing was updated")
    scales = [r[c.scale] for r in rows]
    if any(v != scales[0] for v in scales):
        said = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(scales))
        raise ConfigError(f"step {int(state.step)}: the loss scale differs across ranks ({said}; world size "
                          f"{len(scales)}): every rank must step the state its previous step returned, or load one "
                          f"checkpoint. Nothing was updated")
    lrs = [r[c.lr] for r in rows]
    if any(v != lrs[0] for v in lrs):
        said = ", ".join(f"rank {r}: " + ("its schedule raised" if v < 0 else repr(v)) for r, v in enumerate(lrs))
        raise ConfigError(f"step {int(state.step)}: the optimizer's lr differs across ranks ({said}; world size "
                          f"{len(lrs)}): every rank must pass the same lr schedule (fzero.init compares the values "
                          f"a schedule's closure holds, not a functools.partial's arguments or a callable object's "
                          f"attributes). Nothing was updated")


def _check_some_leaf_used(state: ZeroState, verdict: Verdict) -> None:
    """Raise `ConfigError` on every rank (the verdict is agreed) where no rank's loss reached any
    trainable leaf that has elements: the loss has no autograd graph to the params (made under
    `torch.no_grad()`, detached, or from other tensors), so the step would train nothing and
    report a zero gradient norm. (torch's `loss.backward()` raises for such a loss where it needs
    no grad at all; one that needs grad through some other tensor it accepts, and its optimizer
    step does nothing: fzero raises for both.)"""
    layout, trainable = state.layout, step_plan(state.info).trained_leaves
    if trainable and not any(verdict.used[i] for i in trainable):  # stops at the first used one
        raise ConfigError(f"step {int(state.step)}: no rank's loss depends on any trainable param ({len(trainable)} "
                          f"leaves, e.g. {layout.leaves[trainable[0]].path!r}; world size {state.mesh.world_size}): "
                          f"loss_fn returned a loss with no autograd graph to the params (computed under "
                          f"torch.no_grad(), detached, or from copies of them), so the step would train nothing. "
                          f"Nothing was updated")


def _used(rows: list[list[float]], num: int) -> list[bool]:
    """Per leaf, whether some rank's row says it got a gradient (`used[L]`, columns 1 to L): where
    every rank used every leaf (the common case) one pass of C-level `min`s says so, without a
    Python step per leaf."""
    if not num:
        return []
    cols = [r[1 : 1 + num] for r in rows]
    if min(map(min, cols)) > 0:
        return [True] * num
    return [m > 0 for m in map(max, zip(*cols))]


def in_order(values: list[float]) -> float:
    """`((0 + v_0) + v_1) + ...` in float64 (Python floats): the sum over ranks, in rank order."""
    total = 0.0
    for v in values:
        total += v
    return total


def shard_squares(shards: list[torch.Tensor], device: torch.device,
                  known: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """`ν²[K]` in float64 (on `device`), `ν_k = ‖x_k‖₂` of shard k: one `torch._foreach_norm`
    per (device, dtype) of the shards (a single read of each, no transient; accumulated in
    float32, or float64 for float64 shards: 16-bit shards are widened to float32 in the
    kernel), then one stack, cast and square. `ν_k²` is exact in float64.

    The value of `ν_k` depends only on the shard's values and length, never on where it sits in
    memory (a slice of stage 0's full buffer, or a tensor of its own in stages 1-3), so every
    stage gets the same bits: on the CPU the kernel is `torch.linalg.vector_norm` per tensor,
    whose order of additions does not depend on the address (`tests/test_speed.py`); on CUDA the
    multi-tensor kernel takes a vectorised path for a tensor whose address is a multiple of 16
    bytes and a scalar path otherwise, which add in different orders, so a shard that is not so
    placed (stage 0's slice of the full buffer at N > 1, where `S * itemsize` is not a multiple
    of 16 bytes) is copied first, to a fresh (aligned) tensor as stages 1-3 hold.
    Relative error of `ν_k²` against the exact `Σ x²`: at most `γ_{S+1} + 2u` (u = 2^-24, S the
    shard's length: S squares and additions in any order, one square root and its rounding to
    float32), the same kind of error torch's `clip_grad_norm_` has (proofs/stages.md §3). NaN and
    inf propagate; a float32 norm of finite values may overflow to inf, which `agree` resolves
    exactly. `known`: `{k: ν_k}` taken already (`shard_norm`, of shards whose memory is gone:
    `offload.early_copies`), used instead of reading shard k.
    """
    if not shards:
        return torch.zeros(0, dtype=torch.float64, device=device)
    known = known or {}
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}  # CUDA's one kernel: one device and dtype
    for k, x in enumerate(shards):
        if k not in known:
            groups.setdefault((x.device, x.dtype), []).append(k)
    norms: list[torch.Tensor | None] = [known.get(k) for k in range(len(shards))]
    for (where, dtype), ks in groups.items():
        xs = [_placed(shards[k].detach().reshape(-1)) for k in ks]  # read as numbers: not differentiated
        for k, nu in zip(ks, _norms(xs, _norm_dtype(dtype))):
            norms[k] = nu
    return torch.stack([nu if nu.device == device else nu.to(device) for nu in norms]).to(torch.float64).square()


def shard_norm(x: torch.Tensor) -> torch.Tensor:
    """`ν = ‖x‖₂` of one shard, as `shard_squares` takes it (the same kernel on the same values:
    `_foreach_norm` gives each tensor of its list the value it gives that tensor alone), before
    the square: for a shard whose memory goes before the agreement (`offload.early_copies`)."""
    return _norms([_placed(x.detach().reshape(-1))], _norm_dtype(x.dtype))[0]


class EarlyNorms:
    """The shard norms of a step's reduced gradients taken as each exists in the backward, on a
    side stream on CUDA, so that the agreement's pass over the gradient runs beside the rest of
    the backward instead of after it: at N = 1 each unit's reduction returns its input, which is
    then the bucket's reduced gradient and, where nothing else adds to it, the shard the
    agreement reads (`of` says where).

    The same side stream assembles those gradients (`assembly`, `unit._assemble`): at N = 1 a
    unit's backward reads its assembled gradient only through the identity, so its copy runs
    beside the backward of the units below, and the norm after it, in stream order.

    `take(x)` starts `shard_norm(x)` (the side stream first waits for what the step's stream has
    queued, which made `x`); `known(shards)` joins the side stream to the step's and returns
    `{k: ν_k}` for the shards taken: the same tensor (address, length, dtype, contiguous) with
    no write since (`_version`). `x` is kept until then, so no other tensor takes its address.
    The same kernel on the same values, so the same bits (`shard_norm`); a shard not taken, or
    written since, is read by the agreement as before."""

    DEVICES = ("cuda",)  # where a step takes them (a side stream runs beside the backward)

    def __init__(self, device: torch.device) -> None:
        self.side = Side(device)
        self.taken: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def of(config: StepConfig, state: ZeroState) -> EarlyNorms | None:
        """For a step whose reductions return the bucket's gradient in the backward and whose
        agreement reads it unchanged: `beside_backward`, and one micro-batch (with more, the
        agreement reads their sum); else None."""
        return EarlyNorms(state.mesh.device) if config.micro_batches == 1 and beside_backward(config, state) else None

    def assembly(self, state: ZeroState) -> Assembly | None:
        """The units' gradient assembly on this side stream (`Inflight.side`; `side_assembly`)."""
        return side_assembly(self.side, state)

    def take(self, x: torch.Tensor) -> None:
        if x.requires_grad or not x.is_contiguous() or x.device != self.side.device:
            return
        self.taken[_norm_key(x)] = (x, self.side.run(shard_norm, x))

    def known(self, shards: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        self.side.join()
        hits = {k: self.taken.get(_norm_key(x)) for k, x in enumerate(shards) if x.is_contiguous()}
        return {k: hit[1] for k, hit in hits.items() if hit is not None}


def beside_backward(config: StepConfig, state: ZeroState) -> bool:
    """Whether each unit's reduction returns its input in the backward and work may run beside
    the backward on a side stream: one rank, a device of `EarlyNorms.DEVICES`, the autograd engine,
    no offload tier (whose early host copies read the reduced gradient in the backward, on the
    step's stream; it takes its own norms, `offload.early_norms`), nothing differentiating
    through the step."""
    mesh = state.mesh
    return (mesh.world_size == 1 and mesh.device.type in EarlyNorms.DEVICES and config.engine == "autograd"
            and state.info.tier is None and func_level() is None)


def side_assembly(side: Side, state: ZeroState) -> Assembly | None:
    """The units' gradient assembly on `side` (`Inflight.side`), or None: CUDA (a stream to run
    beside), and the params on the device (an offloaded unit's gathered storage is freed after its
    backward, which the assembly may still read). The step joins it at the end of each
    micro-batch's backward, before any gradient is read or added to the micro-batches' sum."""
    return Assembly(side) if side.stream is not None and state.info.offload.params is None else None


def _norm_key(x: torch.Tensor) -> tuple:
    return (x.data_ptr(), x.numel(), x.dtype, x._version)


class Side:
    """Work queued beside the step's stream: on CUDA on the device's side stream, after what the
    step's stream has queued so far (`run`), until `join` makes the step's stream wait for it;
    elsewhere run in line."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.used = device, False
        self.stream = _side_stream(device) if device.type == "cuda" else None

    def run(self, fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
        if self.stream is None:
            return fn(x)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.used = True
        with torch.cuda.stream(self.stream):
            return fn(x)

    def join(self) -> None:
        if self.used:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per CUDA device, made once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _norms(xs: list[torch.Tensor], acc: torch.dtype) -> list[torch.Tensor]:
    """`‖x‖₂` of each 1-d `x` (one device and dtype), accumulated in `acc`: one `_foreach_norm`;
    under a torch.func transform, which has no rule for it, one `vector_norm` each (on the CPU the
    kernel `_foreach_norm` runs per tensor: the same bits)."""
    if func_level() is None:
        return list(torch._foreach_norm(xs, 2, dtype=acc))
    return [torch.linalg.vector_norm(x, 2, dtype=None if x.dtype == acc else acc) for x in xs]


def _placed(x: torch.Tensor) -> torch.Tensor:
    """`x`, or on CUDA a copy of it where its address is not a multiple of 16 bytes (`shard_squares`)."""
    return x.clone() if x.device.type == "cuda" and func_level() is None and x.data_ptr() % 16 else x


def sum_of_squares(shards: list[torch.Tensor], device: torch.device,
                   known: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """`Σ_k ν_k²` in float64 (0-d, on `device`): one `torch.sum` of `shard_squares` (a fresh
    tensor, the same values in the same order in every stage, so the same bits; its order of
    additions depends on K and the device only). Relative error against the exact `Σ x²`: at
    most `γ_{S+1} + 2u` per shard (`shard_squares`), and `γ_{K-1}` in float64 for the sum of the
    K non-negative terms (proofs/stages.md §3). `known`: `shard_squares`'s."""
    return shard_squares(shards, device, known).sum()


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


class Ready(NamedTuple):
    """A donating update's host work done before the agreement's read (`prepare`): per bucket
    updated on the device, the params its optimizer writes (`Stage.optimizer_params`) and the
    optimizer's `launch` (`Optimizer.prepare_`), built for a step that uses every leaf. After the
    read `update` only launches them -- where the verdict says every leaf was used; otherwise
    (and for a bucket missing here) it runs the general `update_`."""

    params: dict[int, torch.Tensor]
    launches: dict[int, Callable[[torch.Tensor], Any]]
    overlap: bool  # `overlaps` of the step's gradients and params, which the verdict does not change


def prepare(state: ZeroState, reduced: dict[int, torch.Tensor], donate: bool) -> Ready | None:
    """`Ready` for a donating step whose optimizer has a `prepare_` (None otherwise): for every
    trainable bucket updated on the device, what `update` would build before its kernels. It
    writes nothing (a skipped step leaves the state as it was) and reads no device value (but
    `fused.elementwise`'s probe, once per kernel configuration, as `update_` would), so it runs
    while the device still computes what the agreement gathers. A bucket whose `prepare_`
    raises is left out: `update` calls `update_`, which raises the same error after the verdict,
    where it always did."""
    optimizer = state.optimizer
    if not donate or optimizer.prepare_ is None:
        return None
    layout, stage, rank = state.layout, state.stage, state.rank
    plan, on_host, step = plan_of(state.info), step_plan(state.info).on_host, int(state.step)
    params, launches = {}, {}
    for b in reduced:
        if b in on_host:
            continue
        p = stage.optimizer_params(layout, b, state.params[b], rank, state.master[b])
        try:
            launches[b] = optimizer.prepare_(state.opt_state[b], p, plan[b].context(step, None))
        except Exception:  # noqa: BLE001 -- `update_` raises it again, after the verdict
            continue
        params[b] = p
    return Ready(params, launches, _overlap(state, reduced))


def update(state: ZeroState, reduced: dict[int, torch.Tensor], used: list[bool], donate: bool = False,
           host_factor: float = 1.0, ready: Ready | None = None, launched: Early | None = None
           ) -> tuple[ZeroState, list[str]]:
    """The optimizer over what this rank owns, then the stage's `finish`: `(new state, [])`; or,
    without `donate`, `(state, leaves)` -- the input state and the leaves the update would have
    made NaN or inf, agreed by every rank (one all-reduce of a flag, read on the host), so a state
    is never corrupted silently.

    With `donate`, the optimizer writes the state's own tensors (`Optimizer.update_`) and nothing
    waits on the host: this rank's flag (`_nonfinite_flag`, on the device) becomes the new state's
    `pending`, which the next step's agreement row carries and every other reader checks first
    (`state.check_pending`): a broken update is found there, on every rank, naming its step.

    Each bucket's `finish` (stages 1-2: the all-gather of its new params) starts as soon as its
    update is done, so it runs while the next bucket is updated; all are waited for after the
    finite check (and discarded if it fails). Nothing writes an updated shard before its wait.
    With `donate` the all-gather writes into the params buffer the state held (`Piece.begin`),
    whose own chunk the update has just written: no second copy of the params.

    `ready` (`prepare`, donating steps): where every leaf was used, a prepared bucket's update is
    its `launch` on the gradient, the same kernels on the same views as `update_`'s; `launched`
    (`agree_launching`): the buckets whose launch already ran, the new optimizer state each
    returned and their finite checks."""
    layout, stage, mesh, rank, optimizer = state.layout, state.stage, state.mesh, state.rank, state.optimizer
    if donate and optimizer.update_ is None:
        raise ConfigError("donate=True needs an optimizer with an in-place form (Optimizer.update_); this one has "
                          "none: use donate=False")
    step = int(state.step)
    new_params, new_opt, new_master = list(state.params), list(state.opt_state), list(state.master)
    updated: dict[int, torch.Tensor] = {}
    kept, checked = {}, {}  # per bucket: the master the new state keeps, what the finite check reads
    flights, back = {}, {}
    overlap = ready.overlap if ready is not None else _overlap(state, reduced)
    plan = plan_of(state.info)
    # offloaded buckets: gradients start for the host now (none: nothing to look up per bucket)
    host = HostUpdate(state.info, reduced if step_plan(state.info).offloaded else {}, host_factor)
    launches = ready.launches if ready is not None and donate and all(used) else {}
    early = launched.states if launched is not None else {}
    ends = launched.ends if launched is not None else Ends.of(state, donate)
    try:
        for b, g in reduced.items():
            launch = launches.get(b)
            updating = _updating(ends if b not in early else None)
            if launch is not None:  # prepared before the agreement's read: only the kernels are left (or none)
                p = ready.params[b]
                with updating:
                    updated[b], new_opt[b] = p, early[b] if b in early else launch(g.to(p.dtype))
                back[b] = kept[b] = checked[b] = p
            else:
                # offloaded: the host copies (NVMe: the master and state read from their files)
                g, opt, master, leaf_sum = host.inputs(b, g, state.opt_state[b], state.master[b], plan[b].leaf_sum)
                ctx = plan[b].context(step, used, leaf_sum)
                p = stage.optimizer_params(layout, b, state.params[b], rank, master)  # offloaded: the host master
                g = g.to(p.dtype)  # the reduce dtype -> the master's (a no-op without a precision policy)
                if donate:
                    with updating:
                        updated[b], new_opt[b] = p, optimizer.update_(g, opt, p, ctx)
                else:
                    updated[b], new_opt[b] = optimizer.update(g, opt, p, ctx)
                out = host.outputs(b, updated[b], new_opt[b], state.params[b].dtype)  # NVMe: `updated[b]` is freed
                back[b], new_opt[b], kept[b], checked[b] = out.back, out.opt_state, out.master, out.checked
            if ends is not None and b not in early:  # a bucket launched early: taken after its kernels
                ends.take(b, checked[b])
            if overlap:  # overlaps the next update; a donating step gathers into the params it held
                flights[b] = stage.finish.begin(mesh, plan[b].wire, back[b], state.params[b] if donate else None)
        host.done()
    except BaseException as e:
        host.abort(e)  # NVMe: the read buffers given back, so that a retry reads the files (found in review)
        raise
    flag = _nonfinite_flag(state, checked, ends, plan)
    broken = not donate and bool(updated) and _agreed_nonfinite(state, flag)
    gathered = {b: f.wait() for b, f in flights.items()}  # every rank started them: wait, even to discard
    if broken:
        return state, updated_nonfinite_leaves(state, updated)
    if not overlap:  # differentiated through: the blocking, differentiable finish
        gathered = {b: stage.finish.run(mesh, plan[b].wire, p) for b, p in back.items()}
    for b in updated:
        new_params[b] = gathered[b]
        if state.master[b] is not None:
            new_master[b] = kept[b]
    return state.replace(params=tuple(new_params), opt_state=tuple(new_opt), master=tuple(new_master),
                         step=state.step + 1, pending=flag if donate else None), []


def _overlap(state: ZeroState, reduced: dict[int, torch.Tensor]) -> bool:
    """Whether the update may start its finish without waiting (`overlaps` of the reduced
    gradients and the state's params; `_rescale` keeps `requires_grad`)."""
    return overlaps(itertools.chain(reduced.values(), filter(_IS_TENSOR, state.params)))


def _nonfinite_flag(state: ZeroState, updated: dict[int, torch.Tensor], taken: Ends | BlockEnds | None,
                    plan: dict[int, BucketPlan]) -> torch.Tensor:
    """float32 0-d on the mesh device: 1 where this rank's updated params hold a NaN or inf, else
    0: each bucket's `unit.finite_witness` (its minimum and maximum, NaN if any element is, ±inf
    if one is, no overflow; on the CPU its sum where that is finite), all checked at once;
    no host synchronisation for buckets updated on the device (an offloaded bucket's ends are
    computed on the host and copied). `taken` (`Ends`): the ends already taken on a side stream.
    Where a bucket computes in a dtype of narrower range than its master (`BucketPlan.within`:
    fp16 units), the master's extremes as that dtype holds them: an fp32 master past 65504 is
    inf in its fp16 copy, which the next forward would read (found in review: the state's held
    fp16 params went inf, and every later step was skipped as an overflow)."""
    dev = state.mesh.device
    known = {} if taken is None else taken.joined()
    ends: dict[torch.dtype | None, list[torch.Tensor]] = {}  # per `within`: the extremes cast to it at once
    for b, p in updated.items():
        if p.numel():
            within = plan[b].within
            ends.setdefault(within, []).extend(
                e.to(dev) for e in (known[b] if b in known else finite_witness(p, within is not None)))
    if not ends:
        return torch.zeros((), dtype=torch.float32, device=dev)
    finite = [torch.isfinite(torch.stack(e) if d is None else torch.stack(e).to(d)).all() for d, e in ends.items()]
    return (finite[0] if len(finite) == 1 else torch.stack(finite).all()).logical_not().to(torch.float32)


class Ends:
    """A donating update's finite check taken bucket by bucket on a side stream (CUDA): each
    bucket's `finite_witness` starts as soon as its update is queued (the side stream first waits for
    the step's stream), so that it reads the bucket while the next buckets are updated instead
    of after the last; `joined()` makes the step's stream wait for them and returns `{bucket:
    witness}`. The witness is exact, so the flag is the one it gives after the update. The next step's in-place update of a bucket is queued after the join."""

    DEVICES = ("cuda",)  # where a step takes them on a side stream (the CPU: `BlockEnds`; elsewhere after the loop)

    def __init__(self, device: torch.device, extremes: frozenset[int]) -> None:
        self.side, self.extremes = Side(device), extremes
        self.taken: dict[int, tuple[torch.Tensor, ...]] = {}

    @staticmethod
    def of(state: ZeroState, donate: bool) -> Ends | BlockEnds | None:
        """Where the update writes in place on a mesh device of `DEVICES` and nothing
        differentiates through it; on a CPU mesh, `BlockEnds`. `extremes`: the buckets whose
        check reads the extremes, to cast them (`BucketPlan.within`)."""
        dev = state.mesh.device
        if not donate or func_level() is not None:
            return None
        extremes = frozenset(b for b, p in plan_of(state.info).items() if p.within is not None)
        return Ends(dev, extremes) if dev.type in Ends.DEVICES else BlockEnds(extremes) if dev.type == "cpu" else None

    def updating(self) -> contextlib.AbstractContextManager:
        """Around one bucket's update, before its `take`: nothing to collect here."""
        return contextlib.nullcontext()

    def take(self, b: int, p: torch.Tensor) -> None:
        if p.device != self.side.device or not p.numel():
            return
        if self.side.stream is not None:  # freed before the join (an NVMe tier's temporary): not reused before it is read
            p.record_stream(self.side.stream)
        extremes = b in self.extremes
        self.taken[b] = self.side.run(lambda x: finite_witness(x, extremes), p)

    def joined(self) -> dict[int, tuple[torch.Tensor, ...]]:
        self.side.join()
        return self.taken


def _updating(ends: Ends | BlockEnds | None) -> contextlib.AbstractContextManager:
    """What wraps one bucket's update: `ends.updating()`, or nothing without `ends`."""
    return ends.updating() if ends is not None else contextlib.nullcontext()


class BlockEnds:
    """A donating update's finite check on the CPU from the sums the blocked update takes of each
    block of params just after writing it, while the block is in cache (`optim.base.block_sums`),
    instead of a second read of every bucket from memory after the update (`finite_witness`'s
    sum). `updating()` wraps one bucket's update; `take(b, p)` then gives its witness
    (`_block_witness`; a bucket of `extremes`, `finite_witness`'s extremes: sums cannot say
    whether a cast overflows); `joined()` returns them, as `Ends` does."""

    def __init__(self, extremes: frozenset[int]) -> None:
        self.extremes = extremes
        self.taken: dict[int, tuple[torch.Tensor, ...]] = {}
        self._sums: list[tuple[torch.Tensor, torch.Tensor]] = []

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        with block_sums() as sums:
            yield
        self._sums = sums

    def take(self, b: int, p: torch.Tensor) -> None:
        if p.numel():
            self.taken[b] = finite_witness(p, True) if b in self.extremes else _block_witness(p, self._sums)
        self._sums = []

    def joined(self) -> dict[int, tuple[torch.Tensor, ...]]:
        return self.taken


def _block_witness(p: torch.Tensor, sums: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """`p`'s finite witness (`unit.finite_witness`: finite if and only if every element is) from
    `sums`, `(view, its sum)` of views of `p` that do not overlap: the given sums and the sum of
    every stretch of `p` no view covers (padding, leaves the update skipped) where all of them are
    finite, for a finite sum says each of its elements is finite; else, as a sum of finite elements
    can overflow, `p`'s minimum and maximum. `finite_witness(p)` itself where a view is not a
    contiguous 1-d stretch of `p`'s storage inside it, or there are no sums."""
    flat = p.detach().reshape(-1)
    if not sums or not flat.is_contiguous():
        return finite_witness(flat)
    base, size, storage = flat.data_ptr(), flat.element_size(), flat.untyped_storage().data_ptr()
    spans = []
    for v, total in sums:
        start, rest = divmod(v.data_ptr() - base, size)
        if (v.dim() != 1 or not v.is_contiguous() or v.dtype != flat.dtype or rest
                or v.untyped_storage().data_ptr() != storage or start < 0 or start + v.numel() > flat.numel()):
            return finite_witness(flat)
        spans.append((start, v.numel(), total))
    parts, at = [], 0
    for start, n, total in sorted(spans, key=lambda s: s[0]):
        if start < at:  # overlapping views: not the blocks of one update
            return finite_witness(flat)
        if start > at:
            parts.append(flat[at:start].sum())
        parts.append(total)
        at = start + n
    if at < flat.numel():
        parts.append(flat[at:].sum())
    witness = torch.stack(parts)
    return (witness,) if bool(torch.isfinite(witness).all()) else torch.aminmax(flat)


def _agreed_nonfinite(state: ZeroState, flag: torch.Tensor) -> bool:
    """Whether any rank's flag is set: one all-reduce (max), tag "fzero.step/update" (a control
    collective), read on the host."""
    return bool(all_reduce(flag.to(torch.float64).reshape(1), state.mesh, "max", tag="fzero.step/update").item() > 0)


# -- the rare path: a non-finite step ----------------------------------------------------------


def _culprits(verdict: Verdict) -> str:
    """The ranks whose loss or local gradient the agreement found non-finite, or that only the
    reduced gradient's norm is."""
    if not verdict.bad_ranks:
        return (f"the reduced gradient (sum of squares {verdict.norm_sq}; every rank's loss"
                f"{' and local gradient' if verdict.located else ''} finite)")
    return "; ".join(f"rank {r}: " + (f"local gradient in bucket(s) {tags}" if tags else "loss")
                     for r, tags in verdict.bad_ranks.items())


def _nonfinite_message(step: int, verdict: Verdict, leaves: list[str]) -> str:
    named = ", ".join(repr(p) for p in leaves[:8]) + (" ..." if len(leaves) > 8 else "")
    where = f"; the reduced gradient is non-finite in {named}" if leaves else ""
    unchecked = ("local gradients were not checked: train_step(locate_nonfinite=True) names the ranks whose local "
                 "gradient is non-finite, at one more read of it per step")
    if not verdict.bad_ranks and verdict.located:
        return (f"step {step}: every rank's loss and local gradient are finite but the reduced gradient is not "
                f"(sum of squares {verdict.norm_sq}{where}): the sum over ranks overflowed. The state is unchanged; "
                f"lower the learning rate or loss scale, or use on_nonfinite='skip'")
    if not verdict.bad_ranks:
        return (f"step {step}: every rank's loss is finite but the reduced gradient is not (sum of squares "
                f"{verdict.norm_sq}{where}): some rank's local gradient held a NaN or inf, or the sum over ranks "
                f"overflowed ({unchecked}). The state is unchanged; use on_nonfinite='skip' to skip such steps")
    parts = [f"rank {r}: non-finite " + (f"local gradient in bucket(s) {tags}" if tags else "loss")
             for r, tags in verdict.bad_ranks.items()]
    also = "" if verdict.located else f" ({unchecked})"
    return (f"step {step}: non-finite values on rank(s) {list(verdict.bad_ranks)} ({'; '.join(parts)}){where}"
            f"{also}. The state is unchanged; use on_nonfinite='skip' to skip such steps")
