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
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.profiler import record_function

from .agreement import Report, Verdict, _check_some_leaf_used, agree_launching, agreement
from .casting import Reads, Slot
from .collectives import func_level
from .config import StepConfig
from .eager import note_fullgraph
from .errors import ConfigError, FzeroError, LossScaleError, NonFiniteError, outside_stacklevel, said
from .gathering import Gathering, held_tensor, in_micro_batch, refuse_compiled_placeholders, same_paths
from .norms import EarlyNorms, Side, beside_backward, shard_norm, side_assembly
from .offload import differentiated, early_copies, readable
from .originals import refuse_changed_module, refuse_original_reads, warn_written_module
from .plan import _probes, step_plan
from .precision import _shown, added_in, at_least_float32, note_batch_dtypes
from .reduce import Chained, _zeros_reduction, reduce
from .scale import StaticLossScale, warn_at_floor
from .stages import Flight
from .state import (ZeroState, broken_update, checked, consume, holds_leaf, inference_parts, loss_scale_of, lost_by,
                    nonfinite_leaves, outside_inference_mode, range_words, renewed, unmastered_words)
from .tree import flatten, flatten_with_paths, named_paths
from .unit import HostBuffers, Probe, at_the_steps_level, differentiating, shared_zeros
from .optim.base import tracked
from .update import differentiated_through, donated_through, prepare, update

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
    """Build `step(state, batch) -> (state, metrics)` for one rank (see `fzero._src.step`'s docstring);
    `step.config` is its `StepConfig` (with what `cast_ahead` learned, `config.ahead`).

    The stage, the mesh and the optimizer are the state's (`fzero.init`'s). Called under
    `torch.no_grad()` or `torch.inference_mode()`, the step trains as outside them: the same bits,
    into normal tensors (a state or batch of inference tensors: see docs/bad-input.md).

    Args:
      loss_fn: `(params, batch) -> 0-d loss`, this rank's mean loss on its micro-batch; with
        `normalize="tokens"`, `(params, batch) -> (loss_sum, count)`.
      engine: "autograd" (`torch.autograd.grad` over the unit Functions; lower peak memory:
        `torch.func.grad` held 11-15 GiB more at peak on a 1.34B GPT, proofs/memory.md) or "func"
        (`torch.func.grad_and_value`; composes with other transforms; a `torch.compile`d loss runs
        eager under it, and a loss passed compiled gets a `UserWarning`: docs/compile.md).
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
        dtype at one place are refused, and an error the loss raises carries a note saying how
        the batch was read) and makes one optimizer step. Each micro-batch's loss is divided by k before its backward
        (as DDP users write `(loss / k).backward()`). With `gather="on_use"` at stages 2-3 every
        rank's loss must read the same units in each micro-batch: on an empty one, run the model
        and return a zero that depends on its output (`out.sum() * 0.0`); a rank that reads none
        there raises `DivergentPaths`, naming the micro-batches. With k = 1 (the default)
        `step(state, batch)` takes one batch, what the loss takes, as it is: where the loss raises
        on one that looks like a list of micro-batches (`[(x, y)]`), its error carries a note
        saying so and the way out.
      accumulate: "each" (every stage: each micro-batch's gradient is reduced as it is made and
        the reduced parts are added, so stages 2-3 keep only an accumulation shard) or "once"
        (stages 0-1: local gradients are added in micro-batch order and reduced once after the
        last, as DDP's `no_sync`). The two round differently; within a mode all stages agree
        bit for bit (proofs/accumulation.md).
      accum_dtype: the dtype gradients are added in; None (the default): float32, or the
        gradient's own dtype where that is wider (float64 params: float64); a dtype given is used
        as it is. The sum is cast to the params' dtype for the reduction ("once") or the optimizer
        ("each", whose reduced parts are each cast to the params' dtype before they are added).
        The gradient passes through `accum_dtype` at every `micro_batches`, 1 too: one narrower
        than the gradient (bfloat16 under fp32 reduction) rounds it even where nothing is added
        (found in review: the words above read as if only a sum were cast).
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
        leaves it intact. A step that raises after its update wrote the input state in place (an
        interrupt, a later bucket's `OptimizerError`) leaves that state lost: the next step,
        `fzero.gather`, `fzero.evaluate` and `fzero.checkpoint.save` of it raise `FzeroError`
        naming the step and the error; `fzero.checkpoint.load(path, state)` restores into it. One
        that raises before any write leaves it usable (a retry is the uninterrupted run). The step's only host synchronisation is its agreement: whether the
        update itself made params NaN or inf (which cannot be undone in place) is computed on the
        device and kept in the new state (`ZeroState.pending`), and the next step's agreement
        row carries it; so the step that breaks the state returns, and the next step -- or any
        other reader first (`fzero.gather`, `fzero.checkpoint.save`, `fzero.evaluate`) --
        raises `NonFiniteError` on every rank, naming that step and the leaves, whatever
        `on_nonfinite` says: restore from a checkpoint (`fzero.checkpoint.load` into the broken
        state works). `donate=False` checks each update at once (one all-reduce of a flag, read
        on the host): its promise is the input state unchanged, so an update that would break
        it raises or is skipped (`on_nonfinite`) before anything is kept. A derivative through a
        donating step (a meta-gradient, an HVP) raises `ConfigError`, before the loss runs where
        the input state's tensors are differentiated.
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
@outside_inference_mode  # under torch.inference_mode() the step trains as outside it (as under torch.no_grad())
def eager_step(config: StepConfig, state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
    with checked(state, pending=False):  # the step's agreement carries the pending flag
        _check_in_place_tiers(config, state)
        _check_no_transform_over_offload(state)
        _check_no_derivative_through_the_autograd_engine(config, state)
        _check_no_derivative_through_a_donating_step(config, state)
        _check_master_differentiated_with_its_copy(state)
        refuse_changed_module(state.layout)  # a module flag or tie changed since from_module (docs/bad-input.md
        # rows 211, 216)
        warn_written_module(state, holds_leaf)  # at its first step: the module written since init copied it,
        # with values the state does not hold (row 248)
        _check_no_inference_state_donated(config, state)
        if config.engine == "autograd":  # (under func dynamo traces no compiled code: it meets no placeholder)
            refuse_compiled_placeholders(config.loss_compiled, state.layout, config.gather)
        _warn_compiled_module_under_func(config, state.layout)
        with same_paths(state.layout), _no_vmap_over_steps():
            try:
                return run_step(config, state, batch)
            except RuntimeError as e:  # (a try costs nothing until it catches)
                _explain_inference_tensors(e, config, state, batch)
                _explain_saved_tensor_hooks(e, config)
                raise


def _warn_compiled_module_under_func(config: StepConfig, layout: Any) -> None:
    """engine "func" over the params of `from_module(torch.compile(model))` (named `_orig_mod.*`):
    a `UserWarning` at each step of this `train_step` on this thread until one has run
    (`config.checked`), as for `train_step(torch.compile(loss_fn), engine="func")`, whose loss the
    step can uncompile. Found in review of torch.compile: the compiled module, called by `apply`
    under torch.func.grad, ran eager with no word, failed under backend="eager" with a bare
    AssertionError, and left dynamo skipping its classes' code for the rest of the process."""
    if config.engine != "func" or config.checked.done:
        return
    paths = [ls.path for ls in layout.leaves if ls.path.startswith("_orig_mod.") or "._orig_mod." in ls.path]
    if paths:
        warnings.warn(f"train_step(engine=\"func\") over the params of a torch.compile'd model ({paths[0]!r}, ...: "
                      f"from_module(torch.compile(model))): the model is not compiled under torch.func.grad; dynamo "
                      f"runs it eager (backend=\"eager\" fails with an AssertionError), and afterwards compiles none "
                      f"of its modules' code in this process. Compile with engine=\"autograd\", or pass the model "
                      f"uncompiled to from_module (docs/compile.md)", UserWarning, stacklevel=outside_stacklevel())


def _check_no_inference_state_donated(config: StepConfig, state: ZeroState) -> None:
    """A donating step of a state of inference tensors: refused before anything runs, as torch's
    in-place kernels write an inference tensor and only then raise ("Inplace update to inference
    tensor outside InferenceMode", after `_foreach_mul_` wrote it: found in review), so the error
    path (`_explain_inference_tensors`) would find the state half updated. Two flag reads, on
    donating steps only: the step counter (made with the rest of the state by `init`, `load`, a
    step or a tree_map) and the first bucket's params (a `state.replace(params=...)`)."""
    if config.donate and (state.step.is_inference() or bool(state.params) and state.params[0].is_inference()):
        raise _inference_state(state, unchanged=True)


def _inference_state(state: ZeroState, unchanged: bool) -> ConfigError:
    """The error of a step given a state of inference tensors, naming its parts (`inference_parts`);
    `unchanged`: whether the state is known to be as it was (a pure step never writes it)."""
    parts = inference_parts(state)
    named = "; ".join(parts[:4]) + (f"; ... ({len(parts)} parts)" if len(parts) > 4 else "")
    return ConfigError(f"this state holds inference tensors (made under torch.inference_mode()): {named} "
                       f"({state.mesh!r}, rank {state.rank}). A step trains outside inference mode, where torch "
                       f"cannot differentiate, save for backward or write an inference tensor"
                       f"{'; the state is unchanged' if unchanged else ''}. "
                       f"Make states outside torch.inference_mode() (fzero.init, the step and checkpoint.load leave it "
                       f"themselves), or clone this one outside it: "
                       f"state = torch.utils._pytree.tree_map(torch.clone, state)")


def _explain_inference_tensors(e: RuntimeError, config: StepConfig, state: ZeroState, batch: Any) -> None:
    """torch's error for an inference tensor (made under `torch.inference_mode()`) where the step
    trains, outside inference mode (`outside_inference_mode`): autograd can neither differentiate
    nor save one, nor the update write one. Where the input state holds some (made by `init`,
    `checkpoint.load` or a step under inference mode before these ran outside it, or by a
    `tree_map` under it), `ConfigError` naming them and the way out (before: torch's "Setting
    requires_grad=True on inference tensor outside InferenceMode", naming no part of the state;
    found in review); else, where the batch holds some, a note on torch's error naming their
    paths. The error path only; nothing else is read."""
    if "nference tensor" not in said(e):
        return
    if inference_parts(state):
        raise _inference_state(state, unchanged=not config.donate) from e
    paths, leaves, _ = flatten_with_paths(batch)
    found = [p for p, t in zip(paths, leaves) if isinstance(t, torch.Tensor) and t.is_inference()]
    if found:
        e.add_note(f"fzero: the batch holds inference tensors (made under torch.inference_mode()) at {found[:8]}; the "
                   f"step trains outside inference mode, as it does outside torch.inference_mode(), where autograd "
                   f"cannot save one for backward: make the batch outside torch.inference_mode(), or pass a .clone() "
                   f"of it made outside")


def _explain_saved_tensor_hooks(e: RuntimeError, config: StepConfig) -> None:
    """A note on torch's refusal of saved-tensor hooks inside `torch.func.grad` (engine "func"):
    `torch.utils.checkpoint` in the forward, most often, whose way out in fzero is its own
    recompute (found in review: torch's words alone, which name neither). The error path only."""
    if config.engine == "func" and "saved tensor hooks" in said(e):
        e.add_note("fzero: under train_step(engine='func') the loss runs inside torch.func.grad, which takes no "
                   "saved-tensor hooks: torch.utils.checkpoint in the forward? Checkpoint with fzero's own recompute, "
                   "from_module(model, remat=[...]) naming the units (it works under engine='func'), with the "
                   "submodule called directly in the forward")


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


def _check_no_derivative_through_the_autograd_engine(config: StepConfig, state: ZeroState) -> None:
    """A step with `engine="autograd"` under plain autograd, whose params (or masters) require
    grad: a derivative is being taken through the step (a meta-gradient, a hypergradient by
    `torch.autograd.grad` of a function of the new state), but that engine detaches what it
    differentiates to take the step's gradient, so the new params would depend on the old only
    through the update's identity term: `d<c, new>/dp = c`, without `-lr H c`, for trainable and
    frozen leaves alike (found in review: a silent wrong derivative). Refused before the step, on
    every rank (each holds its own params: the same program requires grad of the same ones). Any
    such step inside a torch.func transform is refused too, naming `engine="func"`
    (`_autograd_engine_in_a_transform`)."""
    if config.engine != "autograd":
        return
    level = func_level()
    if level is not None:
        raise ConfigError(_autograd_engine_in_a_transform(level, state))
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (*state.params,
                                                                                        *state.master)):
        return
    tracked = {b for b, (p, m) in enumerate(zip(state.params, state.master))
               if p.requires_grad or m is not None and m.requires_grad}
    paths = [ls.path for ls in state.layout.leaves if ls.bucket in tracked]
    named = named_paths(paths)
    raise ConfigError(f"a step with engine='autograd' whose params require grad ({named}; {state.mesh!r}, rank "
                      f"{state.rank}): autograd is differentiating through the step (a meta-gradient), but this "
                      f"engine detaches the params to take the step's gradient, so the derivative would lack every "
                      f"term through that gradient (d<c, new>/dp = c, without -lr H c), silently. Use "
                      f"train_step(..., engine='func'), which is differentiable through (docs/func.md); where no "
                      f"derivative through the step is wanted, pass params that do not require grad (p.detach())")


def _autograd_engine_in_a_transform(level: int, state: ZeroState) -> str:
    """The refusal of an `engine="autograd"` step called inside a torch.func transform. Before, torch
    raised its own `Tensor.requires_grad_()` error from inside the step, naming neither the step
    nor the way out (found in review)."""
    return (f"a step with engine='autograd' inside a torch.func transform (level {level}; {state.mesh!r}, rank "
            f"{state.rank}): this engine takes the step's gradient with torch.autograd.grad on detached params, "
            f"which torch refuses inside a transform (Tensor.requires_grad_) and no transform could see through. "
            f"To differentiate through the step (grad / vjp / jacrev / jvp of a function of the new state: a "
            f"meta-gradient, a hypergradient, a derivative with respect to the batch) use train_step(..., "
            f"engine='func') (docs/func.md). A vmap over steps is not supported with either engine: vmap inside the "
            f"loss, or loop over states")


def _check_no_derivative_through_a_donating_step(config: StepConfig, state: ZeroState) -> None:
    """A donating step whose input state is tracked (`update.differentiated_through` of its params,
    masters and optimizer state: a torch.func level differentiating them, or under plain
    autograd one that requires grad) is differentiated through, which its in-place update
    refuses (`update.donated_through`): refused here, before the forward, with the same error,
    where before the whole forward and backward ran first (found in review). `update` still
    refuses what only the gradients show (a derivative with respect to a tensor the loss closes
    over, or the batch). Every rank's state is tracked alike (the same program), so every rank
    raises here."""
    if config.donate and differentiated_through(state, {}):
        raise donated_through(state)


def _check_master_differentiated_with_its_copy(state: ZeroState) -> None:
    """Where the state keeps master values apart from the compute copy the forward reads (stages
    1-2 under a `Precision` with a wider master: `state.master` each rank's fp32 shard,
    `state.params` the 16-bit copy), a derivative through the step with respect to one of the
    two alone: the update reads the master, the forward the copy, so the derivative with respect
    to either misses the part that goes through the other (found in review of a torch.func
    researcher: a meta-gradient under a bf16 policy at stage 1 lacked the identity term, at stage
    2 was zero, silently, where stages 0 and 3, which keep the master as the params, were right).
    Stage 2 differentiates the master shard itself, so there the master alone is whole and passes.
    Refused before the step, on every rank (each tracks the same inputs); the plain step reads
    one `requires_grad` per bucket with a master."""
    if all(m is None for m in state.master):
        return
    # stage 2 differentiates the master shard itself (`Stage.differentiated`): the master alone is whole there
    whole = state.stage.sharded("grads") and not state.stage.sharded("params")
    both = {b: (tracked(p), tracked(m)) for b, (p, m) in enumerate(zip(state.params, state.master)) if m is not None}
    parted = [b for b, (p, m) in both.items() if p != m and not (whole and m)]
    if not parted:
        return
    b = parted[0]
    alone, other = ("params", "master") if both[b][0] else ("master", "params")
    paths = [ls.path for ls in state.layout.leaves if ls.bucket in set(parted)]
    named = named_paths(paths, 6)
    raise ConfigError(
        f"a derivative is taken through this step with respect to state.{alone} alone ({named}; {state.mesh!r}, "
        f"rank {state.rank}, stage {state.stage.level}, {state.info.precision!r}): this state keeps its master values "
        f"(state.master, each rank's {str(state.master[b].dtype).removeprefix('torch.')} shard) apart from the copy "
        f"the forward reads (state.params), and the update reads the master, so a derivative with respect to state."
        f"{alone} misses the part that goes through state.{other}, silently. Differentiate with respect to both and "
        f"add: with kept = [b for b, m in enumerate(state.master) if m is not None] (a frozen bucket keeps no "
        f"master), torch.func.grad(lambda p, ms: f(step(state.replace(params=p, master=tuple(ms[kept.index(b)] if "
        f"b in kept else None for b in range(len(p)))), batch)), argnums=(0, 1))(state.params, tuple(state.master[b] "
        f"for b in kept)); per bucket, the params' part summed over the ranks (each holds a copy) plus the master's "
        f"shards joined in rank order is the derivative with respect to the master values, which stages 0 and 3 "
        f"(they keep the master as the params) give directly")


@contextlib.contextmanager
def _no_vmap_over_steps() -> Iterator[None]:
    """torch's `.item()` / data-dependent-control-flow error under vmap, or its error for the
    agreement's host read (`tolist`) of a batched tensor, which has no storage (only vmap batches:
    under the other transforms the read works), as what it means for a step (docs/func.md)."""
    try:
        yield
    except RuntimeError as e:
        msg = said(e)
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
    except BaseException as e:
        if lends:
            config.buffers.close(kept=False)
        lost_by(state, e)  # where a donating update wrote the state in place before `e`: it is lost, naming `e`
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
    config.checked.done = True  # every micro-batch's loss read no original (`refuse_original_reads`)
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
            warn_at_floor(scaler, s, step, verdict.bad_losses,
                          tuple(r for r in sorted(verdict.bad_ranks) if r not in verdict.bad_losses))
            if config.donate:  # the new state shares every buffer: the next donating step writes them for
                consume(state, wrote=False)  # both (found in review: the old one then read, and saved, the next
                # step's values); nothing written yet, so a copy made before stays usable until that step
            return renewed(state, loss_scale=next_scale), _metrics(*seen, skipped=True)
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
        return (new if scaler is None else renewed(new, loss_scale=next_scale)), _metrics(*seen, skipped=False)
    if config.on_nonfinite == "raise":
        named = named_paths(broken)
        advice = unmastered_words(state, broken,  # 16-bit params with no wider master: fp16's way out replaces it
                                  "Lower the learning rate, keep params in a wider dtype, or use on_nonfinite='skip'")
        raise NonFiniteError(f"step {step}: the gradients are finite but the optimizer's update made the params "
                             f"NaN or inf{range_words(state)} in {named} ({state.mesh!r}, {len(broken)} leaves); the "
                             f"state is unchanged. {advice}")
    return state, _metrics(*seen, skipped=True)


def _scaler_update(scaler: Any, state: ZeroState, verdict: Verdict, step: int) -> Any:
    """The scaler's next state after this step (`update`); its `LossScaleError` at the floor
    (`raise_at_min`) said only "the gradients overflowed": it now says what was non-finite, on
    which ranks (a NaN loss on rank 1 every step, in review, read as an overflow)."""
    try:
        return scaler.update(state.loss_scale, not verdict.finite)
    except LossScaleError as e:
        raise LossScaleError(f"update {step} (state.step; the scaler counts every step, skipped or not): {e}. What "
                             f"was non-finite: {_culprits(verdict)}") from None


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
        raise ConfigError(_not_micro_batches(k, batch))
    _check_alike(batch)
    _warn_tuple_of_tensors(batch)
    return list(batch)


class AmbiguousMicroBatches(UserWarning):
    """A step with `micro_batches=k` was given a tuple of k bare tensors: k micro-batches, or one
    batch `(x, y)` passed as it is (docs/bad-input.md row 273)."""


def _warn_tuple_of_tensors(batch: Sequence[Any]) -> None:
    """`AmbiguousMicroBatches` where the micro-batches are a tuple of bare tensors: a batch
    `(x, y)` of one dtype and number of dimensions (a float regression, an autoencoder's `(x, x)`)
    passed with `micro_batches=2` reads as the micro-batches x and y, and a loss that indexes
    `b[0]`, `b[1]` (or unpacks a batch of two rows) trained on them with no error (found in review
    of accumulation). A list says they are micro-batches: it is not warned."""
    if type(batch) is tuple and all(isinstance(mb, torch.Tensor) for mb in batch):
        k = len(batch)
        warnings.warn(AmbiguousMicroBatches(
            f"micro_batches={k}: the step reads this tuple of {k} tensors ({', '.join(_shown(t) for t in batch[:4])}"
            f"{', ...' if k > 4 else ''}) as {k} micro-batches, each a bare tensor the loss is given alone. If it is "
            f"one batch (x, y), the loss trains on x and y as micro-batches: pass [(x0, y0), (x1, y1), ...]. If they "
            f"are micro-batches, pass them as a list (list(x.chunk({k}))), which is not warned"),
            stacklevel=outside_stacklevel())


def _not_micro_batches(k: int, batch: Any) -> str:
    """`ConfigError`'s message for a batch that is not a list or tuple of k > 1 micro-batches:
    what was given (its type, length or shape, and its structure, `_literal`), what
    `micro_batches=k` takes, and the way out for what it looks like: a list of another number of
    micro-batches (`_like_micro_batches`), one batch passed whole (a tuple of tensors, a tensor,
    a dict), or an iterator. Before: "got a list of 3", "got a Tensor", "got a dict" alone
    (found in a new-user walkthrough)."""
    wanted = (f"micro_batches={k}: step(state, batches) needs a list or tuple of {k} micro-batches, each what the "
              f"loss takes ([(x0, y0), (x1, y1), ...])")
    if isinstance(batch, torch.Tensor):
        return (f"{wanted}, got a tensor {_shown(batch)}. The step does not split a batch: pass "
                f"list(batch.unbind(0)) where its first dim of {k} indexes the micro-batches, or "
                f"list(batch.chunk({k})) to split one batch into {k}")
    if not isinstance(batch, (list, tuple, Mapping)):
        return (f"{wanted}, got a {type(batch).__name__}; pass a list (list(batches) of an iterator of {k} "
                f"micro-batches)")
    if isinstance(batch, Mapping):
        return (f"{wanted}, got a {type(batch).__name__} of {len(batch)} keys, {_literal(batch)}: one batch passed "
                f"whole, which the step does not split; pass a list of {k} micro-batches (here {k} such mappings), "
                f"or make the step with micro_batches=1")
    got = f"{wanted}, got a {type(batch).__name__} of {len(batch)}, {_literal(batch)}"
    if _like_micro_batches(batch):
        return (f"{got}: to take these {len(batch)} micro-batches make the step with train_step(..., "
                f"micro_batches={len(batch)}), else pass {k}")
    return (f"{got}: one batch passed whole reads as {len(batch)} micro-batches, and the step does not split it; "
            f"pass {k} micro-batches (split each tensor: list(zip(x.chunk({k}), y.chunk({k})))), or make the step "
            f"with micro_batches=1")


def _like_micro_batches(batch: Any) -> bool:
    """Whether `batch` looks like a list of micro-batches: a non-empty list or tuple whose entries
    are each a container (list, tuple, mapping) of tensors, all of one pytree structure
    (`[(x, y)]`, `[(x0, y0), (x1, y1)]`). A batch `(x, y)` of tensors is not; a batch of
    containers of one structure (`((x0, x1), (y0, y1))`) is, which is why what says so is worded
    "if it is"."""
    if not isinstance(batch, (list, tuple)) or not batch:
        return False
    if not all(isinstance(mb, (list, tuple, Mapping)) for mb in batch):
        return False
    specs = [flatten(mb) for mb in batch]
    return (all(spec == specs[0][1] for _, spec in specs)
            and any(isinstance(t, torch.Tensor) for leaves, _ in specs for t in leaves))


def _literal(x: Any, depth: int = 3) -> str:
    """A batch as a Python literal of its containers, each tensor as dtype[shape]
    (`[(float32[4, 8], int64[4])]`): at most 3 entries of a container and `depth` levels shown."""
    if isinstance(x, torch.Tensor):
        return _shown(x)
    if isinstance(x, Mapping):
        items = [f"{key!r}: {_literal(v, depth - 1)}" for key, v in list(x.items())[:3]] if depth else []
        return "{" + ", ".join([*items, *(["..."] if len(x) > len(items) else [])]) + "}"
    if isinstance(x, (list, tuple)):
        items = [_literal(v, depth - 1) for v in x[:3]] if depth else []
        inner = ", ".join([*items, *([f"... ({len(x)} in all)"] if len(x) > len(items) else [])])
        if isinstance(x, list):
            return f"[{inner}]"
        return f"{'' if type(x) is tuple else type(x).__name__}({inner}{',' if len(x) == 1 else ''})"
    return type(x).__name__


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


def _fzero_error_under_dynamo(e: Exception) -> FzeroError | None:
    """fzero's own error that dynamo wrapped while tracing a compiled loss (`InternalTorchDynamoError`,
    the `FzeroError` its context: a check of `cast_ahead`'s watched leaves raising inside the
    traced frame), else None: the step raises it as fzero raised it, so `except fzero.ConfigError`
    catches it (found in review of a compile user: three of four patterns gave dynamo's error)."""
    internal = getattr(getattr(torch, "_dynamo", None), "exc", None)
    internal = getattr(internal, "InternalTorchDynamoError", None)
    if internal is None or not isinstance(e, internal):
        return None
    inner = e.__cause__ or e.__context__
    if not isinstance(inner, FzeroError):
        return None
    if inner.args and isinstance(inner.args[0], str):  # without the frames dynamo appended to its words
        inner.args = (inner.args[0].split("\n\nfrom user code:")[0], *inner.args[1:])
    return inner


def _note_loss_error(e: Exception, config: StepConfig, state: ZeroState, i: int, mb: Any) -> None:
    """The notes an error the loss raised on micro-batch `i` (`mb`) gets, built on the error path
    only (nothing runs where the loss returns): how the batch was read (`_note_micro_batches`),
    and, for torch's error of operands of different dtypes, the batch's floating leaves in none of
    the dtypes the params reach the loss in (a precision policy casts the params, not the batch:
    `precision.note_batch_dtypes`). None on fzero's own errors (they say what they found)."""
    if isinstance(e, FzeroError):
        return
    k = config.micro_batches
    with contextlib.suppress(Exception):  # a note that cannot be made never hides the loss's error
        _note_micro_batches(e, k, i, mb)
    with contextlib.suppress(Exception):
        note_fullgraph(e, config.gather)
    note_batch_dtypes(e, state.precision, state.layout.buckets, mb, "the batch" if k == 1 else f"micro-batch {i}")


def _note_micro_batches(e: Exception, k: int, i: int, mb: Any) -> None:
    """Where the loss raised `e` on micro-batch `i` of `k` > 1, a note naming it. Where that
    micro-batch is a bare tensor, the note says how the batch was read too: a batch `(x, y)`
    passed as it is with `micro_batches=2`, x and y of one dtype and number of dimensions (token
    ids and their targets, both int64 [B, T]), passes `_check_alike` and reads as the
    micro-batches x and y, so the loss's `x, y = mb` raises "too many values to unpack" (or an
    indexing error), which named no step setting (found in review); a micro-batch of another
    kind cannot come from that mix-up, and its note is one line (a model's own error under
    well-formed micro-batches, found in review of the first note), but where it is itself a list
    of micro-batches (`[[(x0, y0)], [(x1, y1)]]`, `_like_micro_batches`) it says so. At k = 1,
    a note only where the batch looks like a list of micro-batches: `[(x, y)]` given to
    `micro_batches=1` (the user read "micro_batches" and passed a list of one), whose loss's
    `x, y = batch` raised "not enough values to unpack" naming no step setting (found in a
    new-user walkthrough). Not on fzero's own errors (they say what they found)."""
    if isinstance(e, FzeroError):
        return
    if k == 1:
        if _like_micro_batches(mb):
            e.add_note(_one_batch_note(mb))
        return
    if isinstance(mb, torch.Tensor):
        e.add_note(f"fzero: with micro_batches={k} the step read its batch as a list of {k} micro-batches and the "
                   f"loss raised on micro-batch {i}, a tensor {_shown(mb)}. If that is not what the loss takes: "
                   f"step(state, batches) takes a list of {k} micro-batches, each what the loss takes "
                   f"([(x0, y0), (x1, y1), ...]), and a batch (x, y) passed as it is reads as the micro-batches "
                   f"x and y")
    elif _like_micro_batches(mb):
        e.add_note(f"fzero: the loss raised on micro-batch {i} of {k} (micro_batches={k}), which is itself a "
                   f"{type(mb).__name__} of {len(mb)} like micro-batches, {_literal(mb)}: each of the {k} entries of "
                   f"step(state, batches) is one micro-batch, what the loss takes ([(x0, y0), (x1, y1), ...], not "
                   f"[[(x0, y0)], [(x1, y1)]])")
    else:
        e.add_note(f"fzero: the loss raised on micro-batch {i} of {k} (micro_batches={k})")


def _one_batch_note(batch: Sequence[Any]) -> str:
    """The note on a loss's error where `micro_batches=1` was given what looks like a list of
    micro-batches (`_like_micro_batches`)."""
    n = len(batch)
    way = ("pass the batch itself, step(state, batches[0])" if n == 1 else
           f"make the step with train_step(..., micro_batches={n}), which takes such a list, or pass one batch")
    entries = "entry" if n == 1 else "entries of one structure"
    return (f"fzero: with micro_batches=1 the step hands the loss its batch as it is, and the loss raised on "
            f"{_literal(batch)}, a {type(batch).__name__} of {n} {entries}, as a list of micro-batches is. If it "
            f"is one: {way} (micro_batches=1 takes one batch, what the loss takes; micro_batches=k a list of k)")


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
            grads, l_i, report, c_i, started = backward(config, state, mb, norms, buffers, i)
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


_FP16_INF = 65520.0  # the least value float16 rounds to inf


def _static_scale_over_fp16(s: float) -> str:
    """A `StaticLossScale` of 65520 or more under a loss returned in float16: the gradient reaching
    the loss is the scale in the loss's dtype, inf there, so every step overflowed and was skipped,
    with no word but `metrics.skipped` (found in review of an AMP user; a dynamic scaler backs off
    and trains)."""
    return (f"StaticLossScale({s!r}) under a loss the loss function returned in float16: the gradient reaching the "
            f"loss is the scale in the loss's dtype, which rounds to inf in float16 (above 65504), so every step "
            f"would overflow and be skipped (a loss.float() of it would not help: its gradient reaches the float16 "
            f"value as the scale in float16 again). Use a scale of at most 32768.0 (float16's largest power of two), "
            f"or fzero.DynamicLossScale(), which backs off")


def _scaled(loss: torch.Tensor, s: float) -> torch.Tensor:
    """`loss * s` in float32 or wider, as DeepSpeed's ZeRO optimizers scale `loss.float()`: an
    fp16 loss times the scale overflows where its gradients do not (5.6 * 2^15 > 65504), and
    the step then skipped for the loss alone (found in review: every step under a
    `StaticLossScale(2^14)`). The gradient reaching the loss is `s` cast to its dtype, the same
    value as the narrow product's."""
    return loss.to(at_least_float32(loss.dtype)) * s


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


# -- 1. forward and backward (2. reduce.py, 3. agreement.py, 4. update.py) ---------------------


def _trainable(state: ZeroState) -> list[int]:
    return list(step_plan(state.info).trainable)


def backward(config: StepConfig, state: ZeroState, batch: Any, norms: EarlyNorms | None = None,
             buffers: HostBuffers | None = None, index: int = 0
             ) -> tuple[dict[int, torch.Tensor | None], torch.Tensor, Report, torch.Tensor, dict[int, Flight]]:
    """One micro-batch: `({bucket: gradient of its differentiated tensor, or None}, detached loss
    as differentiated, Report, token count (float64; 0 in "mean" mode), {bucket: its reduction in
    flight})`. With the autograd engine and `accumulate="each"`, stages 0-1 start each bucket's
    reduction (`Stage.after_backward`) in its unit's backward, as stages 2-3 start theirs: the
    bucket's gradient is then None and `reduce` finishes the flight (the same calls on the same
    tensor, so the same bits). `norms` (`EarlyNorms`) takes the norm of each reduction's result
    that exists in the unit's backward (N = 1); `buffers` (`HostBuffers`) where the units assemble
    their gradients (`Inflight.buffers`); `index`: the micro-batch's, which an error of the loss
    names (`_note_loss_error`)."""
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
    made: list[Gathering] = []  # the loss's, held to the end of the backward (`_finished`)

    def loss_of(train: tuple[torch.Tensor, ...], probes: dict[str, Probe], casts: dict[str, tuple] | None = None,
                reads: Reads | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        at_the_steps_level()  # the level the units' backward builds the step's gradient at
        merged = list(xs)
        for b, x in zip(trainable, train):
            merged[b] = x
        counts: list[torch.Tensor] = []

        def objective(params: Any, mb: Any) -> torch.Tensor:
            try:
                out = config.call(params, mb)
            except Exception as e:  # (a try costs nothing until it catches)
                own = _fzero_error_under_dynamo(e)
                if own is not None:
                    raise own from None
                _note_loss_error(e, config, state, index, mb)
                raise
            loss, count = _objective(config, out)
            refuse_original_reads(loss, config.checked)  # each loss of this train_step's first step on this thread
            counts.append(count)
            # a loss the check refuses goes to it as returned (scaled, it was named float32)
            scalable = s != 1.0 and isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()
            if scalable and loss.dtype == torch.float16 and s >= _FP16_INF and isinstance(state.info.scaler,
                                                                                         StaticLossScale):
                raise ConfigError(_static_scale_over_fp16(s))
            return _scaled(loss, s) if scalable else loss

        gathering = Gathering(layout, programs, merged, fulls, probes, config.gather, releasable,
                              config.persist_bytes, config.max_live_bytes, config.prefetch, inflight, casts, reads)
        made.append(gathering)
        loss = gathering.loss(objective, batch)
        roots.update(gathering.roots)
        return loss, counts[0]

    train = tuple([xs[b] for b in trainable])
    try:
        with _finished(made), differentiating():
            if config.engine == "func":  # (no placeholder roots: the loss runs at grad_and_value's level)
                (g_train, g_probes), (loss, count) = torch.func.grad_and_value(
                    loss_of, argnums=(0, 1), has_aux=True)(train, probes)
                g_roots = {}
            else:
                g_train, g_probes, loss, count, g_roots = _autograd(
                    loss_of, train, probes, config.ahead.of(state.info) if casting else None, state.step, roots)
        if inflight is not None:  # the autograd engine's
            inflight.wait()  # the reductions the units' backward started: done before any gradient is read
            if inflight.side is not None:  # the gradients assembled beside the backward: before any is read
                inflight.side.join()
        refuse_placeholder_gradients(g_roots)
        # the rest of stages 0-1's reductions (`Chained` waits for an older one's reduce-scatter
        # there) and the report, inside the `try`: an interrupt or an error there leaves what was
        # started to `settle`, not to locals (found in review)
        started = inflight.rest(lambda b: _zeros_reduction(state, b)) if inflight is not None else {}
        report = _report(state, programs, g_probes)
    except BaseException as e:
        if inflight is not None:  # its reductions in flight: waited for, or kept by the mesh (`Inflight.settle`)
            inflight.settle(mesh, e)
        raise
    return dict(zip(trainable, g_train)), loss.detach(), report, count, started


@contextlib.contextmanager
def _finished(made: list[Gathering]) -> Iterator[None]:
    """Around a micro-batch's loss and backward: hold the `Gathering` the loss makes (`made`) until
    the backward is over, then `finish` it (drop the gathers still in flight), also where the loss
    or the backward raises -- and then have autograd's engine let go of what it had not run of the
    graph (`drop_unrun_backward`). Nothing else holds it strongly: its units' Functions hold their
    `after_backward` weakly, and the graph's saved-tensor hooks only until autograd frees the last
    tensor saved through them."""
    try:
        yield
    except BaseException as e:
        for gathering in made:
            gathering.finish(e)
        if made:  # the loss ran: its backward may have raised
            drop_unrun_backward()
        raise
    for gathering in made:
        gathering.finish()


def drop_unrun_backward() -> None:
    """Where a backward raised, make torch's autograd engine let go of the part of the graph it
    had not run. The engine keeps the nodes that were ready to run when a node raised (each with
    the gradients it was handed) in this thread's ready queue until the next backward on the
    thread: those nodes hold the rest of the graph -- its saved activations, each unit's
    Function context with the step's reductions in flight (`Inflight`), and in stage 3 the
    saved-tensor hooks' `Gathering`, with the gathered units not yet released and the input
    state's buffers. So a step whose backward raised (an error of a custom Function's backward,
    torch's in-place check, `DivergentPaths` in a unit's reduction, an out-of-memory error),
    caught, kept all of it alive until the next step's backward; after a last such step (a
    handler that saves, evaluates or loads a checkpoint and exits) for the rest of the thread
    (found in review: a leak hunt; tests/test_no_leaks.py). A backward of one zero here pops
    those stale nodes (their graph is gone, so they are dropped, not run), as the next backward
    would. `_finished` calls it on any error once the loss has run (after an error of the forward
    there is nothing to pop: one backward of a zero, on the error path only); under a torch.func
    transform too (a step differentiated through: a meta-gradient whose step's backward raised
    left them as well; before, it was skipped there, found in review), as plain tensors
    (`_DisableFuncTorch`): the queue is the engine's, not a level's, and no backward of the
    transform runs while its function does; a failure here never hides the error being raised."""
    with (contextlib.suppress(Exception), torch._C._DisableFuncTorch(), torch.inference_mode(False),
          torch.enable_grad()):
        z = torch.zeros((), requires_grad=True)
        torch.autograd.grad(z.view(()), z)


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


def _objective(config: StepConfig, out: Any) -> tuple[Any, torch.Tensor]:
    """What is differentiated, and the micro-batch's token count: `loss / k` and 0 ("mean"), or
    `loss_sum` and `count` ("tokens")."""
    if config.normalize == "mean":
        k = config.micro_batches
        if isinstance(out, tuple):
            raise ConfigError(_tuple_under_mean(out))
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
        # on the host first: one copy (one wait for a device count), then the checks read the copy (before, a
        # CUDA count was read three times, each a host synchronisation: found in review)
        count = (count.detach().to("cpu") if isinstance(count, torch.Tensor) else
                 torch.as_tensor(count, dtype=torch.float64))
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"normalize='tokens': the count loss_fn returned must be one finite number >= 0 (an int, "
                          f"a float or a 1-element tensor), got {type(count).__name__} {count!r}") from None
    if count.numel() != 1 or count.is_floating_point() and not bool(torch.isfinite(count)) or bool(count < 0):
        raise ConfigError(f"normalize='tokens': the count loss_fn returned must be one finite number >= 0, got {count}")
    return loss_sum, count.to(dtype=torch.float64).reshape(())


def _tuple_under_mean(out: tuple) -> str:
    """`ConfigError`'s message for a loss returning a tuple under `normalize="mean"`: torch.func's
    `(loss, aux)` habit (`grad_and_value(..., has_aux=True)`) most often. Before, it pointed to
    `normalize="tokens"` alone, where a 0-d aux (an accuracy) is then read as the token count and
    divides the gradient, silently (found in review); now it says the step takes no aux, how to
    keep one, and what that 2-tuple means."""
    shown = ", ".join(_shown(x) if isinstance(x, torch.Tensor) else type(x).__name__ for x in out[:4])
    return (f"loss_fn returned a tuple of {len(out)} ({shown}{', ...' if len(out) > 4 else ''}); with "
            f"normalize='mean' it must return one 0-d loss. The step takes no auxiliary output (no has_aux, as "
            f"torch.func.grad_and_value(..., has_aux=True) takes): to keep one (an accuracy, the logits), append "
            f"aux.detach() to a list the loss closes over and read it after the step, or compute it with "
            f"fzero.evaluate(fn)(state, batch), which returns whatever fn returns. A 2-tuple is what "
            f"normalize='tokens' takes: (loss_sum, count), count the number of tokens loss_sum sums over, by which "
            f"the step divides (summed over ranks and micro-batches); an aux returned there is read as that count")


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


# -- the rare path: a non-finite step ----------------------------------------------------------


_UNCHECKED = ("local gradients were not checked: train_step(locate_nonfinite=True) names the ranks whose local "
              "gradient is non-finite")


def _culprits(verdict: Verdict) -> str:
    """The ranks whose loss or local gradient the agreement found non-finite, or that only the
    reduced gradient's norm is."""
    if not verdict.bad_ranks:  # (found in review: no rank, and no way to one, where local gradients went unchecked)
        unchecked = "" if verdict.located else f"; {_UNCHECKED}"
        return (f"the reduced gradient (sum of squares {verdict.norm_sq}; every rank's loss"
                f"{' and local gradient' if verdict.located else ''} finite{unchecked})")
    return "; ".join(f"rank {r}: {_bad_on(verdict, r)}" for r in verdict.bad_ranks)


def _bad_on(verdict: Verdict, r: int) -> str:
    """What is non-finite on rank `r`: its loss, its local gradient's buckets, or both (found in
    review: a rank whose loss and gradient were both NaN was named for its gradient alone)."""
    tags = verdict.bad_ranks[r]
    return " and ".join(filter(None, ("loss" if r in verdict.bad_losses or not tags else "",
                                      f"local gradient in bucket(s) {tags}" if tags else "")))


def _nonfinite_message(step: int, verdict: Verdict, leaves: list[str]) -> str:
    named = named_paths(leaves)
    where = f"; the reduced gradient is non-finite in {named}" if leaves else ""
    unchecked = f"{_UNCHECKED}, at one more read of it per step"
    if not verdict.bad_ranks and verdict.located:
        return (f"step {step}: every rank's loss and local gradient are finite but the reduced gradient is not "
                f"(sum of squares {verdict.norm_sq}{where}): the sum over ranks overflowed. The state is unchanged; "
                f"lower the learning rate or loss scale, or use on_nonfinite='skip'")
    if not verdict.bad_ranks:
        return (f"step {step}: every rank's loss is finite but the reduced gradient is not (sum of squares "
                f"{verdict.norm_sq}{where}): some rank's local gradient held a NaN or inf, or the sum over ranks "
                f"overflowed ({unchecked}). The state is unchanged; use on_nonfinite='skip' to skip such steps")
    parts = [f"rank {r}: non-finite {_bad_on(verdict, r)}" for r in verdict.bad_ranks]
    also = "" if verdict.located else f" ({unchecked})"
    return (f"step {step}: non-finite values on rank(s) {list(verdict.bad_ranks)} ({'; '.join(parts)}){where}"
            f"{also}. The state is unchanged; use on_nonfinite='skip' to skip such steps")
