"""The optimizer interface: `(init, update, spec, update_)` over one bucket's `shard[S]`.

A bucket is the flat buffer of the leaves of one (unit, dtype, ParamGroup), back to back,
padded and cut into N shards (see `fzero._src.layout`). An optimizer sees one rank's shard of
the parameters and of the (already reduced) gradient, and the `Segment`s that say which leaf
elements sit where. Element-wise optimizers apply torch's ops (single-tensor, foreach or fused,
see `Impl`) to runs of segments; a layer-wise optimizer reduces per-leaf partial sums through
`ctx.leaf_sum`.

`update` is pure; `update_` is the same update written into its inputs (for a caller that
donates the state, as JAX's `donate_argnums`): `update(g, s, p, ctx)` is, bit for bit,
`update_(g, clone(s), clone(p), ctx)` with `p` the result's param (see `pure`).

State is a NamedTuple of tensors. `spec(state)` is the same NamedTuple of strings:

  "shard"  the field is shaped like the shard, `[S]`, and is sharded like the parameters;
  "leaf"   the field is `[len(ctx.leaves)]`, one entry per bucket leaf, replicated on every rank;
  "rows"   factored statistics, replicated on every rank: per bucket leaf of shape `[..., R, C]`
           (2 or more dims) a block of shape `[..., R]` (one value per row), none for a leaf of
           fewer dims; the field is the blocks flattened and concatenated in bucket-leaf order;
  "cols"   the same with a block of shape `[..., C]` per leaf of 2 or more dims (one per column).

`field_shapes` gives each kind's per-leaf shapes (what checkpoints map a field to).

so checkpointing and resharding read the spec, never the optimizer's class.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import numbers
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple, Union

import torch
import torch.autograd.forward_ad as fwAD

from ..collectives import func_level, unwrapped
from ..errors import FzeroError, as_int
from ..layout import PARAM_DTYPES, ParamGroup, Segment, as_flag, type_name


class OptimizerError(FzeroError, ValueError):
    """A hyper-parameter, a schedule or a shard does not fit the optimizer."""


class UpdateContext(NamedTuple):
    """What `update` needs to know beyond tensors; built by the stage code per bucket and rank.

    Attributes:
      step: the global optimizer-step index, 0 for the first update; schedules read it.
      group: the bucket's `ParamGroup` (`weight_decay` mask, `lr_scale`, `frozen`).
      segments: `layout.segments(bucket, rank)`, this shard's pieces of leaves in shard
        coordinates. Padding lies outside every segment and is never touched.
      leaves: `BucketSpec.leaves`; "leaf" state fields are indexed by position in this tuple.
      used: per bucket leaf, True if the leaf got a gradient this step. An unused leaf is
        skipped exactly as torch.optim skips `p.grad is None`: no update, no weight decay, no
        state change, its step count not incremented.
      leaf_sum: sums a float64 tensor over all ranks, element-wise, in a fixed rank order, without
        changing its dtype or shape: any layout -- per-leaf partial values `[..., len(leaves)]`
        (lamb's norms, adafactor's row and column sums) or pieces of whole leaves (`whole_leaves`);
        identity when N == 1 or where each rank updates whole buffers (stage 0). A collective where
        it is not the identity: every rank calls it the same number of times with the same shape
        (lamb once, adafactor twice), a rank that has nothing to add included.
      leaf_numels: `numel` of each bucket leaf, in the order of `leaves`, or `()`. Only
        `impl="fused"` with a placement-dependent kernel (CPU always, CUDA for some
        configurations; see `fzero._src.optim.fused`) reads it, to check that every updated
        leaf lies whole in the shard.
      leaf_shapes: the shape of each bucket leaf, in the order of `leaves`, or `()`. Optimizers
        with "rows" / "cols" state (`adafactor`) need it, to map shard elements to rows and columns.
    """

    step: int
    group: ParamGroup
    segments: tuple[Segment, ...]
    leaves: tuple[int, ...]
    used: tuple[bool, ...]
    leaf_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    leaf_numels: tuple[int, ...] = ()
    leaf_shapes: tuple[tuple[int, ...], ...] = ()


class Launch(NamedTuple):
    """A prepared update (`Optimizer.prepare_`): `launch(grad)` checks the grad shard (`check`,
    which raises before anything is written), runs the kernels (`run(grad, found_inf)`) and
    returns the new state. `skips`: whether the kernels take torch's `found_inf`, a float32 0-d
    flag on the shard's device that, where it is 1, makes them write nothing and, where it is 0,
    changes no bit (torch's fused kernels read it before any write) -- so a caller may launch the
    update before it knows whether the step is taken, without waiting to find out.

    `math`: `(grad, state, param) -> (new param, new state)`, the same update out of place in
    differentiable torch ops, on the pieces, step counts and hyper-parameters `prepare_` found,
    the new state's "shard" fields set and its other fields None; or None. It writes nothing
    and its values are not the kernels' bits: `derived` takes the bits from the kernels and the
    derivative from it, where a derivative is taken through the update (`tracked`)."""

    run: Callable[[torch.Tensor, torch.Tensor | None], Any]
    check: Callable[[torch.Tensor], None]
    skips: bool = False
    math: Callable[[torch.Tensor, Any, torch.Tensor], tuple[torch.Tensor, Any]] | None = None

    def __call__(self, grad: torch.Tensor, found_inf: torch.Tensor | None = None) -> Any:
        if found_inf is not None and not self.skips:
            raise OptimizerError("this update's kernels cannot skip on a device flag (found_inf): only torch's "
                                 "fused kernels can (impl='fused'); launch it without one")
        check_in_place("a prepared update (Optimizer.prepare_)", (grad,))
        self.check(grad)
        return self.run(grad, found_inf)


class Optimizer(NamedTuple):
    """An optimizer over flat shards (optax's `GradientTransformation`, praxis's spec).

    Attributes:
      init: `(param shard[S], number of bucket leaves L) -> state`; with `shaped=True`,
        `(param shard[S], the bucket leaves' shapes) -> state` (see `init_state`).
      update: `(grad shard[S], state, param shard[S], ctx) -> (new param shard[S], new state)`;
        pure: never mutates its inputs (grad, state, param). Where a derivative is taken through
        it (`tracked`: a meta-gradient or an HVP through a step), sgd's and adam's / adamw's give
        the same bits and the derivative of their math (`derived`); lamb's and adafactor's raise
        `OptimizerError` (`refuse_derivative`).
      spec: `state -> same NamedTuple of "shard" / "leaf" / "rows" / "cols"` (`SPECS`).
      update_: `(grad shard[S], state, param shard[S], ctx) -> new state`, the same update in
        place: `param` and every "shard" field of `state` are overwritten with their new values
        (the new state holds those very tensors); other fields are replaced by new tensors (the
        input's are not written); `grad` is never written (a donating step on the CPU assembles a
        later step's gradient into its buffer, `unit.HostBuffers`, unless the returned state holds
        it). Afterwards the input `state` must not
        be used (its replicated fields are stale). A derivative through it is refused
        (`check_in_place`). Errors of the checks (`check_shards`,
        `check_placement`) come before any write; an error raised later (a failing
        `ctx.leaf_sum`) may leave `param` and the state partly written. `None` for an
        optimizer with no in-place form.

      prepare_: `(state, param shard[S], ctx) -> launch` (a `Launch`), `launch(grad shard[S])
        -> new state`: `update_` in two parts, for a caller that knows everything but the
        gradient's values before it knows them (the step, before its agreement's host read):
        `prepare_` makes the checks, reads the host-side state and builds the kernels' arguments,
        writing nothing; `launch` checks the grad shard and runs the kernels. `update_(g, s, p,
        ctx)` is `prepare_(s, p, ctx)(g)` bit for bit (`two_phase` builds it so). A `launch` is
        called at most once, with `s`, `p` and `ctx` unchanged since `prepare_`; where its kernels
        can skip on a device flag (`Launch.skips`), `launch(g, found_inf)` with a flag of 0 gives
        the same bits and with 1 writes nothing. `None` where the optimizer has no such form (the
        step then calls `update_`). `_replace(update_=...)` without a `prepare_` drops it (a
        wrapper of `update_` must not launch the old kernels).
      lr: the `step -> lr` schedule the update reads (`as_schedule`'s), or None where it is not
        known. The step carries `lr(step)` in its agreement row, so ranks whose schedules give
        different values at a step raise `ConfigError` on every rank before anything is updated
        (`fzero.init` compares only what the update's closures hold: not a `functools.partial`'s
        arguments or a callable object's attributes). Not part of the optimizer's description
        (`state.describe`): the update's closure holds the same schedule.

    Frozen buckets have no state and are never updated: `update` / `update_` on a group with
    `frozen=True` raise `OptimizerError` (`check_shards`).
    """

    init: Callable[[torch.Tensor, int], Any]
    update: Callable[[torch.Tensor, Any, torch.Tensor, UpdateContext], tuple[torch.Tensor, Any]]
    spec: Callable[[Any], Any]
    update_: Callable[[torch.Tensor, Any, torch.Tensor, UpdateContext], Any] | None = None
    shaped: bool = False
    prepare_: Callable[[Any, torch.Tensor, UpdateContext], Launch] | None = None
    lr: Schedule | None = None


_fields_replaced = Optimizer._replace


def _replace(self: Optimizer, **fields: Any) -> Optimizer:
    """namedtuple's `_replace`, except that a new `update_` given without a `prepare_` drops the
    old `prepare_` (its `launch` runs the old update's kernels): a wrapper of `update_` is safe by
    construction. (A NamedTuple's body may not define `_replace`, hence the assignment.)"""
    if "update_" in fields and "prepare_" not in fields:
        fields["prepare_"] = None
    return _fields_replaced(self, **fields)


Optimizer._replace = _replace  # type: ignore[method-assign]


def init_state(optimizer: "Optimizer", param: torch.Tensor, leaf_shapes: Sequence[tuple[int, ...]]) -> Any:
    """One bucket's initial state: `optimizer.init(param shard[S], L)`, or, for an optimizer whose
    state has "rows" / "cols" fields (`shaped=True`), `optimizer.init(param, leaf_shapes)`.
    `leaf_shapes` other than a sequence of shapes is an `OptimizerError` (found in review: a leaf
    count gave Python's "'int' object is not iterable")."""
    try:
        shapes = tuple(tuple(as_int(d) for d in s) for s in leaf_shapes)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for s in shapes for d in s):
            raise TypeError
    except TypeError:
        raise OptimizerError(f"init_state: leaf_shapes must be one shape (a tuple of ints >= 0) per leaf of the "
                             f"bucket, e.g. [(4, 3), (3,)] (fzero.layout.plan's leaves' shapes; a leaf count is not "
                             f"one); got {leaf_shapes!r}") from None
    return optimizer.init(param, shapes) if optimizer.shaped else optimizer.init(param, len(shapes))


def pure(update_: Callable, spec: Callable) -> Callable:
    """The pure `update` of an in-place `update_`: clone `param` and the "shard" fields (as `spec`
    names the state's fields), then write into the clones. Replicated fields ("leaf", "rows",
    "cols") are passed as they are (`update_` replaces them).

    Where a derivative is taken through the update (`tracked`: a meta-gradient or an HVP through
    a step) and `update_` has a differentiable form (its `derive` attribute, `two_phase`'s), that
    form instead: the same bits, and the derivative of the update's math. (An attribute, not a
    closure variable: `state.describe`, and so every saved checkpoint's description, reads
    closures.)"""

    def update(grad: torch.Tensor, state: Any, param: torch.Tensor, ctx: UpdateContext):
        check_inputs("Optimizer.update", grad, state, param, spec)  # a global: the closure (and so
        # `state.describe`'s description of every optimizer, which checkpoints store) is unchanged
        derive = getattr(update_, "derive", None)
        if derive is not None and tracked(grad, param, *state):
            return derive(grad, state, param, ctx)
        fresh = type(state)(*[t.clone() if kind == "shard" else t for t, kind in zip(state, spec(state))])
        p = param.clone()
        return p, update_(grad, fresh, p, ctx)

    return update


def in_place(init: Callable, update_: Callable, spec: Callable, shaped: bool = False,
             prepare_: Callable | None = None, lr: Schedule | None = None) -> Optimizer:
    """`Optimizer(init, pure(update_, spec), spec, update_, shaped, prepare_, lr)`: both forms from
    the in-place one."""
    return Optimizer(init, pure(update_, spec), spec, update_, shaped, prepare_, lr)


def two_phase(name: str, prepare_: Callable) -> Callable:
    """The `update_` of a two-phase `prepare_` (`Optimizer.prepare_`) of optimizer `name`: the
    grad shard checked
    first (so a bad grad raises before anything else, as `check_shards` orders its checks), then
    prepared and launched at once. Its `derive` attribute is the differentiable out-of-place form
    (`derived`) that `pure` takes where a derivative goes through the update; `update_` itself,
    which writes its inputs, refuses one (`check_in_place`)."""

    def update_(grad: torch.Tensor, state: Any, param: torch.Tensor, ctx: UpdateContext) -> Any:
        check_grad(name, grad, param)
        check_in_place(name, (grad, param, *state))
        return prepare_(state, param, ctx)(grad)

    update_.derive = functools.partial(derived, name, prepare_)  # type: ignore[attr-defined]
    return update_


def tracked(*tensors: Any) -> bool:
    """Whether a derivative is being taken through any of `tensors` (non-tensors are skipped):
    outside every torch.func transform and forward-AD level, whether one requires grad under
    grad mode (plain autograd); inside, whether any of its torch.func layers, from the current
    level down, requires grad (`grad`, `vjp`, `jacrev`, an outer level of a nested transform) or
    carries a tangent (`jvp`, `jacfwd`, `forward_ad`). A tensor a transform wraps but does not
    track -- a `detach()`, a value the differentiated inputs do not reach, vmap's batch -- is not
    tracked: a step under a transform that differentiates something else, or a `vmap` inside the
    loss, runs the plain update. The plain step reads one `requires_grad` per tensor."""
    grad_mode = torch.is_grad_enabled()
    if func_level() is None and fwAD._current_level < 0:
        if grad_mode:
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    return True
        return False
    return any(isinstance(t, torch.Tensor) and _layers_tracked(t, grad_mode) for t in tensors)


def _layers_tracked(x: torch.Tensor, grad_mode: bool, tangents: bool = True) -> bool:
    """`tracked` of one tensor under a transform: each wrapper layer in turn, down to the plain
    tensor (torch keeps the layers privately, `torch._C._functorch`, in 2.11 and 2.13, as
    `collectives.unwrapped` reads them); `tangents=False`: reverse mode only (a forward-mode
    tangent not counted)."""
    f = torch._C._functorch
    while True:
        if (grad_mode and x.requires_grad) or tangents and fwAD.unpack_dual(x).tangent is not None:
            return True
        if not (f.is_functorch_wrapped_tensor(x) or f.is_batchedtensor(x)):
            return False
        x = f.get_unwrapped(x)


DIFFERENTIABLE = ("sgd (every impl: plain, momentum, nesterov, dampening, weight decay, maximize) and adam / adamw "
                  "(every impl, amsgrad too)")
"""What `check_in_place` and the refusals of the optimizers that have no differentiable form
(`refuse_derivative`) name as the way out."""


def check_in_place(name: str, tensors: Sequence[Any]) -> None:
    """`OptimizerError` where a derivative is taken through an in-place update (`update_`, a
    launch): torch's kernels write their inputs, which autograd refuses for a transform's inputs
    (torch's "a view of a leaf Variable that requires grad is being used in an in-place
    operation") and where it does not, its foreach and fused kernels record no derivative -- a
    zero one, silently (found in review: Adam's meta-gradient through a step was the identity).
    The pure `update` is differentiable (`derived`)."""
    if tracked(*tensors):
        raise OptimizerError(
            f"{name}: a derivative is being taken through an in-place update (update_ / a prepared launch; a step "
            f"with donate=True): torch's kernels write their inputs and record no derivative (foreach, fused) or "
            f"refuse to (a transform's input). Call the pure update (Optimizer.update; train_step(..., "
            f"donate=False)), which is differentiable for {DIFFERENTIABLE}")


def written_by_kernel(*lists: Sequence[torch.Tensor]) -> None:
    """Just before a kernel that writes every tensor of `lists` in place without moving its
    version counter -- torch's fused optimizer kernels (`torch._fused_adam_`, `_fused_adamw_`,
    `_fused_sgd_`) move none -- their counters moved, as any in-place torch op moves them
    (`torch.autograd.graph.increment_version`), so that what reads them sees the write: a donating
    update's `update.Watch`, which judges whether a first bucket interrupted after its kernel ran
    was written (found in review: an interrupt landing just after a fused kernel of the first
    bucket left the state usable, and its retry updated that bucket twice). Before, not after: an
    interrupt between the two counts as a write (the state is refused, never silently wrong).
    Under a torch.func transform, the tensors under the wrappers (`collectives.unwrapped`: a
    wrapper's own counter is not the one a write through it moves). Moving a counter more than
    once is harmless (torch's words); on the step's own tensors, it is what torch's in-place ops
    do; on clones (`pure`, `derived`) and probes it changes nothing."""
    tensors = [t for ts in lists for t in ts]
    if func_level() is not None:
        tensors = [unwrapped(t) for t in tensors]
    torch.autograd.graph.increment_version(tensors)


def refuse_derivative(name: str, why: str, tensors: Sequence[Any]) -> None:
    """`OptimizerError` where a derivative is taken through the update of an optimizer that has
    no differentiable form (`tracked`), naming why and the optimizers that have one; on every
    rank, before anything is computed (each rank's inputs are tracked alike: the same program
    differentiates the same step)."""
    if tracked(*tensors):
        raise OptimizerError(
            f"{name}: a derivative is being taken through its update (a meta-gradient or an HVP through a step: "
            f"torch.func.grad / vjp / jvp, or autograd, of a function of the new state), but {why}, so the "
            f"derivative would be wrong. Differentiable through a step (donate=False): {DIFFERENTIABLE}; or take "
            f"the step outside the transform (no derivative through it: pass params that do not require grad)")


class _Valued(torch.autograd.Function):
    """`valued`: the forward returns a copy of `value`; every derivative (backward, jvp, vmap's
    generated rule) is `formula`'s."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor, formula: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return None, grad

    @staticmethod
    def jvp(ctx: Any, value_t: Any, formula_t: torch.Tensor) -> torch.Tensor:
        return formula_t


def valued(value: torch.Tensor, formula: torch.Tensor) -> torch.Tensor:
    """`value`'s bits with `formula`'s derivative, `formula` being the same function computed
    another way (differentiable ops in place of torch's optimizer kernels). Exact, unlike
    `formula + (value - formula).detach()`, which rounds and turns -0 into +0."""
    return _Valued.apply(value, formula)


def derived(name: str, prepare_: Callable, grad: torch.Tensor, state: Any, param: torch.Tensor,
            ctx: UpdateContext) -> tuple[torch.Tensor, Any]:
    """`update` where a derivative is taken through it (`tracked`): `prepare_` and its launch on
    detached copies (the kernels of the plain update, so its bits, its checks and their order)
    give every value; the launch's `math` on the inputs themselves gives each derivative
    (`valued`) of the new param and the new state's "shard" fields. The other fields (step
    counts) are the launch's, as in the plain update. Twice the plain update's work and one
    more copy of param and state, only here."""
    check_grad(name, grad, param)
    p = param.detach().clone()
    launch = prepare_(type(state)(*[t.detach().clone() for t in state]), p, ctx)
    new = launch(grad.detach())
    if launch.math is None:
        raise OptimizerError(f"{name}: this update has no differentiable form (its launch's math is None); "
                             f"differentiable: {DIFFERENTIABLE}")
    p_math, s_math = launch.math(grad, state, param)
    fields = [v if m is None else valued(v, m) for v, m in zip(new, s_math)]
    return valued(p, p_math), type(new)(*fields)


def spliced(x: torch.Tensor, spans: Sequence[tuple[int, int]], parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """`x` with `x[a:b]` replaced by each part (`spans` in order, not overlapping), out of place:
    what an update that writes only its pieces leaves, differentiably (padding and unused leaves
    keep `x`'s elements and derivatives)."""
    if not spans:
        return x
    out, at = [], 0
    for (a, b), part in zip(spans, parts):
        out += [x[at:a], part]
        at = b
    out.append(x[at:])
    return torch.cat(out)


class EmptyState(NamedTuple):
    """The state of a stateless optimizer (SGD without momentum)."""


Schedule = Callable[[int], float]
LearningRate = Union[float, Schedule, Sequence[float]]


def check_hyper(name: str, value: Any, lo: float = 0.0, hi: float = math.inf, hi_open: bool = False,
                allow_inf: bool = False) -> float:
    """`value` as a Python float, or an `OptimizerError` naming it (`name`) and the valid range,
    `[lo, hi]` (`[lo, hi)` with `hi_open`). Any real
    number but a bool is taken (`numbers.Real`: a Python int or float, numpy's scalars, a
    `Fraction`). It must be finite (an inf learning rate or decay makes every update NaN or inf,
    which the step would then blame on the update) unless `allow_inf` (a threshold where inf
    means "off")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = "; pass float(...) of it" if _one_value_array(value) else ""
        raise OptimizerError(f"{name} must be a Python float, got {type(value).__name__} {value!r}{hint}")
    try:
        value = float(value)
    except OverflowError:  # an int (or a Fraction) beyond float's range
        size = f"an int of {len(str(abs(value)))} digits" if isinstance(value, numbers.Integral) else repr(value)
        raise OptimizerError(f"{name} must be a finite float in [{lo}, {hi}], got {size} (beyond float's "
                             f"range)") from None
    ok = lo <= value and (value < hi if hi_open else value <= hi)
    if not ok or math.isnan(value):
        bracket = ")" if hi_open else "]"
        where = (f"a {'' if allow_inf else 'finite '}float >= {lo}" if math.isinf(hi) else f"in [{lo}, {hi}{bracket}")
        raise OptimizerError(f"{name} must be {where}, got {value}")  # (found in review: "[0.0, inf]" where
        # inf is refused)
    if math.isinf(value) and not allow_inf:
        raise OptimizerError(f"{name} must be finite, got {value} (every update would make the params NaN or inf)")
    return value


def _one_value_array(x: Any) -> bool:
    """Whether `x` is a 0-d tensor or array (torch's, numpy's): a number `float(x)` gives."""
    return hasattr(x, "item") and getattr(x, "ndim", None) == 0


def check_flag(name: str, value: Any) -> bool:
    """`value` as a bool (`layout.as_flag`: a bool, a numpy bool, 0 or 1), else an `OptimizerError`
    naming it (a truthy string or number would silently switch a behaviour on: `maximize="no"`
    maximizes)."""
    flag = as_flag(value)
    if flag is None:
        raise OptimizerError(f"{name} must be a bool (True or False), got {type_name(value)} {value!r}")
    return flag


def as_schedule(lr: LearningRate) -> Schedule:
    """`lr` (a float, a callable `step -> float` or a sequence of per-step floats) as
    `step -> float`.

    The value is checked (finite, >= 0) each time it is read, so a schedule that goes negative
    fails at the step where it does, naming the step. A callable is called once per step (the
    step's agreement and every bucket's update read that value), so an object that moves on at
    each call moves once a step, as a torch scheduler's `step()` does. The returned function's
    `source` is that callable (for a sequence, its reader).

    A callable must take the step (`lr(step)`: its signature is read once, here), and one that
    returns something that is no real number at some step (a torch scheduler's `get_last_lr()`
    list, a tensor, None) raises `OptimizerError` there, naming the callable, the step and what
    it returned. That check is the range check's own type test, on a value read once a step (the
    memo): its words are made on the error path only. A torch LR scheduler or optimizer given as
    `lr` is refused, naming fzero's schedules.
    """
    if isinstance(lr, numbers.Real) and not isinstance(lr, bool):  # numpy's scalars too
        value = check_hyper("lr", lr)
        return lambda step: value
    if _torch_scheduling(lr):
        raise OptimizerError(_torch_lr_words(lr))
    if callable(lr):
        _check_takes_step(lr)
        fn = lr
    elif isinstance(lr, Sequence) and not isinstance(lr, (str, bytes)):
        values = tuple(lr)
        for i, v in enumerate(values):
            try:
                check_hyper(f"lr[{i}]", v)
            except OptimizerError as e:
                if isinstance(v, (list, tuple)):  # found in review: sequence(recorded get_last_lr() lists)
                    raise OptimizerError(f"{e}: each value is the lr of one step, a float; a torch scheduler's "
                                         f"get_last_lr() is a list (one lr per param group): record "
                                         f"get_last_lr()[0]") from None
                raise

        def fn(step: int) -> float:
            if not 0 <= step < len(values):
                raise OptimizerError(
                    f"the lr sequence has {len(values)} values but step {step} was asked for; "
                    f"give one value per optimizer step, or a callable schedule"
                )
            return float(values[step])
    else:
        hint = ("; a tensor or array of one value: pass float(lr) (fzero reads the lr on the host, as a number; one "
                "that changes is a schedule)" if _one_value_array(lr) else "")
        raise OptimizerError(f"lr must be a float, a callable step -> float or a sequence of floats, got {lr!r}"
                             f"{hint}")  # (the hint: found in review; torch.optim takes a tensor lr)

    memo: list = [(None, None)]  # [(step, its value)]: each step's value computed once (the step's
    # agreement and every bucket's update read it; a schedule object that counts its calls counts
    # steps). A list: `state.describe` leaves it out, so descriptions do not change as steps run

    def checked(step: int) -> float:
        at, value = memo[0]
        if at == step:
            return value
        value = fn(step)
        try:
            value = check_hyper(f"lr at step {step}", value)
        except OptimizerError:  # the words for a value of no number type, on the error path only
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise OptimizerError(_returned_words(fn, step, value)) from None
            raise
        memo[0] = (step, value)
        return value

    checked.source = fn  # what a reader outside the steps calls, past the memo (`checkpoint.schedule_source`)
    return checked


_SCHEDULES = ("fzero's schedules of the step index t (t = 0 is the first update): fzero.optim.cosine(peak, "
              "decay_steps, warmup_steps=...), fzero.optim.linear_warmup(peak, warmup_steps), "
              "fzero.optim.step_decay(init, step_size, gamma), or a function of the step (lambda t: 3e-4 * "
              "min(1.0, (t + 1) / 100)); or replay the torch scheduler: record sched.get_last_lr()[0] before each "
              "optimizer.step() and pass fzero.optim.sequence(recorded)")


def _torch_scheduling(lr: Any) -> bool:
    """Whether `lr` is a torch LR scheduler (or one like it: an object with `get_last_lr` and
    `step` that is not callable, as DeepSpeed's) or a torch optimizer: what a port from torch or
    DeepSpeed hands as the lr. A callable is a schedule, `lr(step)`, whatever else it has (a user's
    schedule class that logs through `get_last_lr` too)."""
    return isinstance(lr, (torch.optim.lr_scheduler.LRScheduler, torch.optim.Optimizer)) or (
        not callable(lr) and callable(getattr(lr, "get_last_lr", None)) and hasattr(lr, "step"))


def _torch_lr_words(lr: Any) -> str:
    """`as_schedule`'s refusal of a torch scheduler or optimizer given as the lr."""
    kind = type(lr)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(lr, torch.optim.Optimizer):
        return (f"lr is a torch optimizer ({name}): a fzero optimizer is made by fzero.optim (e.g. "
                f"fzero.optim.adamw(3e-4, weight_decay=0.1)), and its lr is a float or a schedule: {_SCHEDULES}")
    return (f"lr is a torch LR scheduler ({name}), which writes a torch optimizer's param groups as it steps; "
            f"fzero's lr is a float, a function step -> lr, or a sequence of per-step values, read once a step: "
            f"use {_SCHEDULES}. A replay carries the first group's lr only: fzero's ParamGroup(lr_scale=...) "
            f"scales that whole schedule, floors included (torch's per-group eta_min or min_lr does not scale, "
            f"nor do per-group lambdas carry over){_scheduler_caveat(lr)}")


def _scheduler_caveat(lr: Any) -> str:
    """What a replay of `lr`'s values leaves out, for the schedulers where that is more than the lr
    (found in review of a user porting torch schedulers): a cycled momentum, a metric-driven lr."""
    if getattr(lr, "cycle_momentum", False):
        return (f"; {type(lr).__name__} with cycle_momentum=True also cycles the optimizer's momentum (Adam's "
                f"beta1), which fzero's optimizers keep fixed: a replay of its lr alone trains otherwise than "
                f"torch; make it with cycle_momentum=False to compare")
    if isinstance(lr, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return ("; ReduceLROnPlateau's lr follows a metric, so it cannot be recorded ahead: keep it on a torch "
                "optimizer of one dummy parameter, feed it the step's loss (sched.step(float(metrics.loss))), and "
                "pass lr=lambda t: dummy_optimizer.param_groups[0]['lr'] (read once a step, after the previous "
                "step's sched.step)")
    return ""


def _fn_words(fn: Any) -> str:
    """A callable in a message: a bound method as `Class.name` of its object's class, a Python
    function by its qualified name and where it is defined (a lambda's name says nothing), any
    other by its (or its class's) qualified name."""
    if isinstance(fn, types.MethodType):
        return f"{type(fn.__self__).__qualname__}.{fn.__name__} (a bound method)"
    if isinstance(fn, types.FunctionType):
        return f"{fn.__qualname__} ({fn.__code__.co_filename}:{fn.__code__.co_firstlineno})"
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _check_takes_step(fn: Callable[..., Any]) -> None:
    """A callable lr is called as `fn(step)`: one whose signature takes no positional argument (a
    torch scheduler's bound `get_last_lr`, found in review: accepted, then Python's TypeError at
    the first step) is an `OptimizerError` here, naming it. A signature that cannot be read (some
    builtins) is not checked."""
    try:
        signature = inspect.signature(fn, follow_wrapped=False)  # a decorator's own: what the call binds
    except (TypeError, ValueError):
        return
    try:
        signature.bind(0)
    except TypeError as e:
        owner = getattr(fn, "__self__", None)
        torch_like = owner is not None and _torch_scheduling(owner)
        hint = (f"; a torch scheduler's get_last_lr reads the torch optimizer's lr, not a step's: use {_SCHEDULES}"
                if torch_like else "; pass a function of the step, lambda t: ...")
        why = "takes no step" if not signature.parameters else f"cannot be called with the step alone ({e})"
        raise OptimizerError(f"lr {_fn_words(fn)} is called as lr(step), with the step index (0 for the first "
                             f"update), but its signature {signature} {why}{hint}") from None


def _returned_words(fn: Any, step: int, value: Any) -> str:
    """The refusal of a value of no real-number type that the lr callable `fn` returned at `step`."""
    shown = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    hint = ("return float(x) (x.item()) for a tensor" if isinstance(value, torch.Tensor) else
            "a torch scheduler's get_last_lr() is a list, one lr per param group: return get_last_lr()[0]"
            if isinstance(value, (list, tuple)) else "return the lr of that step")
    return (f"the lr schedule {_fn_words(fn)} returned {shown} {value!r:.80} at step {step}, where the lr of that "
            f"step, a Python float, is needed; {hint}")


def group_lr(schedule: Schedule, ctx: UpdateContext) -> float:
    """`fl(schedule(ctx.step) * ctx.group.lr_scale)`: a Python float, as torch's `group["lr"]`."""
    return schedule(ctx.step) * ctx.group.lr_scale


def check_fits(name: str, ctx: UpdateContext, dtype: torch.dtype, values: dict[str, float]) -> None:
    """Every Python float an update takes (`values`: its formula -> its value) lies in the range
    of the params' `dtype`, `|v| <= finfo(dtype).max`, else an `OptimizerError` naming the
    optimizer, the formula, the value, the step, the parameter group and the way out.

    torch takes a scalar for a kernel over float32, bfloat16 or float16 tensors as a float32 (as
    the dtype itself for `add(..., alpha=)`). Past that range it raises from inside the update
    ("value cannot be converted to type float without overflow") or turns inf, making the params
    inf or an eps of inf silently stopping the update; an lr can be finite as a Python float and
    still past float32's 3.4e38 (`lr=1e39`, or a `step_decay` whose gamma > 1 grows it; found in
    review). Callers check the lr (`lr(step) * lr_scale`) and each value they hand a kernel (a
    weight decay, eps, a bias-corrected step size, `1 - lr * weight_decay`, ...), from values every
    rank holds alike (so every rank raises), before they write the params: a pure update (the
    step's default) then leaves the whole state as it was. float64: only inf (a product past
    float64's range) is refused."""
    if not dtype.is_floating_point:
        return
    limit = torch.finfo(dtype).max
    for what, value in values.items():
        if not abs(value) <= limit:  # inf and nan too
            kind = str(dtype).removeprefix("torch.")
            raise OptimizerError(
                f"{name}: {what} is {value!r} at step {ctx.step} (parameter group {ctx.group.name!r}, lr_scale "
                f"{ctx.group.lr_scale!r}), past the range of the params' dtype {kind} (largest {limit!r}): torch's "
                f"kernels would fail on it or make the params inf, so the update stops before writing them. Lower "
                f"the lr (or its schedule's value at this step) or the hyper-parameter named, or keep the params in "
                f"a wider dtype"
            )


def check_inputs(name: str, grad: Any, state: Any, param: Any, spec: Callable[[Any], Any]) -> None:
    """What `pure`'s update reads before the optimizer's own checks (`check_shards`): `grad` and
    `param` tensors (`check_tensor`) and `state` a NamedTuple of the fields `spec` gives it
    (`check_state_fields`), else an `OptimizerError` led by `name` (found in review: another
    optimizer's state, a plain tuple or None was a `TypeError` / `AttributeError` from inside)."""
    check_tensor(name, "grad shard", grad)
    check_tensor(name, "param shard", param)
    if getattr(state, "_fields", None) is None:
        raise OptimizerError(f"{name}: the optimizer state must be the NamedTuple this optimizer's init made for the "
                             f"bucket, got {type_name(state)} {state!r:.80}")
    check_state_fields(name, state, spec(state))


def check_tensor(name: str, what: str, x: Any) -> None:
    """`x` (a grad or param shard, `what`) is a tensor, else an `OptimizerError` led by `name`."""
    if not isinstance(x, torch.Tensor):
        raise OptimizerError(f"{name}: {what} must be a tensor, a 1-d shard[S] of one bucket (pass "
                             f"layout.local_shards(...) entries), got {type_name(x)} {x!r:.80}")


def check_state_fields(name: str, state: Any, spec: Any) -> None:
    """`state`'s fields are those of `spec` (the optimizer's `spec(state)`), else an
    `OptimizerError` led by `name` naming both: the state another optimizer made (an `AdamState`
    handed to sgd) is refused before anything reads it."""
    got, want = getattr(state, "_fields", None), getattr(spec, "_fields", None)
    if want is not None and (got is None or tuple(got) != tuple(want)):
        shown = f"{type(state).__name__}{tuple(got)}" if got is not None else f"{type_name(state)} {state!r:.80}"
        raise OptimizerError(f"{name}: the optimizer state is {shown}, but this optimizer's state has the fields "
                             f"{tuple(want)} ({type(spec).__name__}); pass the state this optimizer's init made for "
                             f"the bucket (another optimizer's state does not fit it). An optimizer put into a state "
                             f"mid-run (state.replace(info=dataclasses.replace(state.info, optimizer=...))) must keep "
                             f"the form of its state: switching momentum on or off, amsgrad, or another algorithm "
                             f"cannot take the state over; start the new optimizer's state with fzero.init from "
                             f"fzero.gather(state), its step then 0 (shift a schedule: lambda t: schedule(t + k))")


def check_grad(name: str, grad: torch.Tensor, param: torch.Tensor) -> None:
    """`grad` (the grad shard) is `param`'s (the param shard's): one 1-d `shard[S]` of a dtype
    fzero's optimizers update (`layout.PARAM_DTYPES`), one device; else an `OptimizerError` led by
    `name` (the optimizer's)."""
    check_tensor(name, "grad shard", grad)
    check_param(name, param)
    if grad.dim() != 1 or param.dim() != 1 or grad.shape != param.shape:
        raise OptimizerError(
            f"{name}: grad shard {list(grad.shape)} and param shard {list(param.shape)} must be the same "
            f"1-d shard[S] of one bucket (pass layout.local_shards(...) entries, not leaves)"
        )
    if grad.dtype != param.dtype or grad.device != param.device:
        raise OptimizerError(
            f"{name}: grad shard is {grad.dtype} on {grad.device} but param shard is {param.dtype} on {param.device}"
        )


def check_param(name: str, param: Any) -> None:
    """`param` (a param shard) is a tensor of a dtype fzero's optimizers update (float16, bfloat16,
    float32, float64), else an `OptimizerError` led by `name` (found in review: an int64 shard
    reached torch's kernels, "lerp_kernel_scalar not implemented for 'Long'")."""
    check_tensor(name, "param shard", param)
    if param.dtype not in PARAM_DTYPES:
        raise OptimizerError(f"{name}: param shard is {param.dtype}; fzero's optimizers update float16, bfloat16, "
                             f"float32 and float64 shards")


def check_shards(name: str, grad: torch.Tensor | None, param: torch.Tensor, state: Any, spec: Any,
                 ctx: UpdateContext) -> None:
    """Shapes and dtypes of one update's inputs (`grad`, `param`, `state` against its `spec`, and
    `ctx`), with `OptimizerError` messages led by `name` that name them; `grad` None: all but the
    grad shard (`prepare_`, whose `launch` checks it, `check_grad`)."""
    if grad is not None:
        check_grad(name, grad, param)
    else:
        check_param(name, param)
    if param.dim() != 1:
        raise OptimizerError(f"{name}: param shard {list(param.shape)} must be a 1-d shard[S] of one bucket (pass "
                             f"layout.local_shards(...) entries, not leaves)")
    if not isinstance(ctx, UpdateContext):
        raise OptimizerError(f"{name}: ctx must be a fzero.optim.UpdateContext, got {type_name(ctx)} {ctx!r:.80}")
    if not isinstance(ctx.group, ParamGroup):
        raise OptimizerError(f"{name}: ctx.group must be the bucket's fzero.ParamGroup, got {type_name(ctx.group)} "
                             f"{ctx.group!r:.80}")
    if ctx.group.frozen:
        raise OptimizerError(
            f"{name}: parameter group {ctx.group.name!r} is frozen; frozen buckets have no optimizer state "
            f"and are never updated (skip them, as the stage code does)"
        )
    if len(ctx.used) != len(ctx.leaves):
        raise OptimizerError(f"{name}: ctx.used has {len(ctx.used)} entries for {len(ctx.leaves)} bucket leaves")
    if ctx.segments and isinstance(ctx.segments[-1], Segment) and ctx.segments[-1].stop > param.numel():
        raise OptimizerError(
            f"{name}: ctx.segments reach element {ctx.segments[-1].stop} of a shard of {param.numel()}; "
            f"were they made for another bucket or world size?"
        )
    check_state_fields(name, state, spec)
    for field, kind in zip(state._fields, spec):
        if kind in FACTORED and len(ctx.leaf_shapes) != len(ctx.leaves):
            raise OptimizerError(
                f"{name}: state field {field!r} is {kind!r} (factored), which needs ctx.leaf_shapes (one shape per "
                f"bucket leaf, got {len(ctx.leaf_shapes)} for {len(ctx.leaves)}); pass them in the UpdateContext"
            )
    check_state_shapes(name, state, spec, param.numel(), len(ctx.leaves), ctx.leaf_shapes,
                       "; was it made by init for this bucket?")
    check_segments(name, ctx, param.numel())


def field_shape(kind: str, shard_numel: int, leaves: int, leaf_shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape a state field of spec `kind` has in a bucket of `leaves` leaves (shapes
    `leaf_shapes`, read by "rows" / "cols" only) whose shard has `shard_numel` elements: "shard"
    `[S]`, "leaf" `[L]`, "rows" / "cols" `[field_numel]`."""
    if kind == "shard":
        return (shard_numel,)
    return (leaves,) if kind == "leaf" else (field_numel(kind, leaf_shapes),)


def check_state_shapes(name: str, state: Any, spec: Any, shard_numel: int, leaves: int,
                       leaf_shapes: Sequence[tuple[int, ...]], hint: str) -> None:
    """Each field of `state` (spec `spec`, checked by `spec_of`) is a tensor of the shape its kind
    gives (`field_shape`), else an `OptimizerError` led by `name` naming the field, its kind, the
    shape it has and the one expected, then `hint` (its own punctuation first); a 0-d field is
    told that a scalar (a step count) is a "leaf" field (found in review: a 0-d step count of spec
    "leaf" trained, then `checkpoint.save` failed naming no field). Host metadata only
    (`check_shards` and `fzero.init`)."""
    for field, t, kind in zip(state._fields, state, spec):
        want = field_shape(kind, shard_numel, leaves, leaf_shapes)
        if isinstance(t, torch.Tensor) and tuple(t.shape) == want:
            continue
        got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else f"{type_name(t)} {t!r:.40}, not a tensor"
        scalar = (". A scalar (a step count) is a 'leaf' field [L], one entry per bucket leaf: init "
                  f"torch.zeros(L), update entry k where ctx.used[k]." if isinstance(t, torch.Tensor) and t.dim() == 0
                  else "")
        raise OptimizerError(
            f"{name}: state field {field!r} ({kind}) has {got}, expected {list(want)} for a shard of {shard_numel} "
            f"elements and {leaves} bucket leaves{hint}{scalar}"
        )


def whole_leaves(ctx: UpdateContext, shard: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each bucket leaf this rank's `shard` touches (`ctx.segments`), whole: `{k: leaf}`, `k` its
    position in `ctx.leaves`, `leaf` of shape `ctx.leaf_shapes[k]` and `shard`'s dtype and device
    -- for an update that needs a whole leaf (Muon's orthogonalisation, Shampoo, a per-leaf norm)
    where stages 1-3 hand it a flat piece, which may cut a leaf between ranks. `shard`: a tensor
    shaped like the shard (the grad, the param, a "shard" state field).

    Exact: each rank writes its pieces into a float64 buffer of the bucket's leaves filled with
    -0.0 and `ctx.leaf_sum` adds the ranks' buffers; every element is held by one rank and -0.0 is
    the additive identity of IEEE floats (x + -0.0 == x bit for bit, a signed zero, inf and NaN
    included), and float64 holds every float16, bfloat16 and float32 value. A collective at
    stages 1-3 (N > 1): call it on every rank, the same number of times, whether or not the rank
    touches or uses a leaf (`ctx.used`). It moves the whole bucket as float64 (an all-reduce of
    `sum(leaf numels)` float64 per call) and is not differentiable; where every leaf is whole in
    the shard (stage 0, N = 1) it is the identity's cost. Needs `ctx.leaf_shapes`.

    To write back this rank's piece of a leaf-shaped result `u` of leaf k:
    `u.reshape(-1)[seg.leaf_start : seg.leaf_start + seg.stop - seg.start]` goes to
    `[seg.start : seg.stop]` for each `seg` of `ctx.segments` with `seg.leaf == ctx.leaves[k]`."""
    if len(ctx.leaf_shapes) != len(ctx.leaves):
        raise OptimizerError(f"whole_leaves needs ctx.leaf_shapes, one shape per bucket leaf (got "
                             f"{len(ctx.leaf_shapes)} for {len(ctx.leaves)}): pass them in the UpdateContext")
    check_tensor("whole_leaves", "shard", shard)
    if shard.dim() != 1:
        raise OptimizerError(f"whole_leaves: shard {list(shard.shape)} must be a 1-d shard[S] of the bucket (the "
                             f"grad, the param or a 'shard' state field the update got)")
    check_segments("whole_leaves", ctx, shard.numel())
    pos = {leaf: k for k, leaf in enumerate(ctx.leaves)}
    numels = [math.prod(shape) for shape in ctx.leaf_shapes]
    starts = [0, *itertools.accumulate(numels)]
    flat = torch.full((starts[-1],), -0.0, dtype=torch.float64, device=shard.device)
    for seg in ctx.segments:
        at = starts[pos[seg.leaf]] + seg.leaf_start
        flat[at : at + seg.stop - seg.start] = shard[seg.start : seg.stop].detach()
    flat = ctx.leaf_sum(flat)
    touched = sorted({pos[seg.leaf] for seg in ctx.segments})
    return {k: flat[starts[k] : starts[k + 1]].to(shard.dtype).view(ctx.leaf_shapes[k]) for k in touched}


def update_result_problem(out: Any, param: torch.Tensor, state: Any, pure: bool = True) -> str | None:
    """What is wrong with an update's result, in words, or None: `out` of `Optimizer.update`
    (`pure`: `(new param, new state)`, the new param a tensor of `param`'s shape, dtype and
    device) or of `update_` / a prepared launch (the new state); the new state a NamedTuple of
    `state`'s fields (its own class, or one of the same `_fields`: an optimizer that makes its
    NamedTuple class anew each call, which nothing downstream tells apart -- `spec_of`,
    `check_state_fields` and checkpoints read the fields; found in review: refused with a
    message naming the same class twice), each field a tensor of the input field's shape, dtype
    and device -- the inputs the update was given (an offloaded bucket's host copies). A result
    that does not keep them failed later, far from the update (found in review: a bare unpacking
    error, a false `DivergentPaths`, params silently truncated to integers or changed to float64,
    a checkpoint that could never be loaded). Host metadata only (every step, per bucket: no device read);
    words are made only for a result that does not fit."""
    if pure:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            size = f" of {len(out)} values" if isinstance(out, (tuple, list)) else ""
            return (f"returned {type_name(out)}{size}, expected the pair (new param shard, new state) "
                    f"(Optimizer.update's result; update_ returns the new state alone)")
        new_param, out = out
        wrong = _unlike("the new param shard", new_param, param)
        if wrong:
            return wrong
    if type(out) is not type(state) and not (isinstance(out, tuple) and getattr(out, "_fields", None) == state._fields):
        fields = getattr(out, "_fields", None)
        got = (f"{type_name(out)}{tuple(fields)}" if fields is not None
               else f"a {type_name(out)} of keys {list(out)[:6]}" if isinstance(out, dict)
               else f"a {type_name(out)} of {len(out)} values" if isinstance(out, (tuple, list))
               else f"{type_name(out)} {out!r:.60}")
        return (f"returned the new state as {got}, expected a NamedTuple of the input state's fields, as its own "
                f"class {type_name(state)}{tuple(state._fields)} (fzero keeps a state only in a NamedTuple: spec, "
                f"checkpoints and the next update read its fields)")
    for field, new, old in zip(state._fields, out, state):
        wrong = _unlike(f"state field {field!r}", new, old)
        if wrong:
            return wrong
    return None


def _unlike(what: str, new: Any, old: torch.Tensor) -> str | None:
    """`new` in words where it is not a tensor of `old`'s shape, dtype and device, else None."""
    if isinstance(new, torch.Tensor) and new.shape == old.shape and new.dtype == old.dtype and new.device == old.device:
        return None
    shown = _tensor_words(new) if isinstance(new, torch.Tensor) else f"{type_name(new)} {new!r:.60}"
    return (f"returned {what} as {shown}, expected {_tensor_words(old)} (the input's shape, dtype and device: "
            f"the update gets this rank's flat shard of the bucket -- at stages 1-3 a piece of it -- and returns "
            f"tensors of the same shapes, dtypes and device)")


def _tensor_words(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def optimizer_words(optimizer: "Optimizer", role: Literal["init", "update", "prepare_"] = "update") -> str:
    """The optimizer in words, for errors: its name (the function that made its init, as
    `checkpoint.optimizer_name` reads it: "lion" of `lion.<locals>.init`) and its `role` function
    (`init`; `update` -- `update_`'s where `update` is `pure`'s; or "prepare_", for what a prepared
    launch did: the `prepare_` that made it, found in review naming `update_`, which did not run),
    with where it is defined."""
    init = getattr(optimizer.init, "__qualname__", None) or type_name(optimizer.init)
    name = init.split(".<locals>.")[0].lstrip("_") or init
    if role == "prepare_" and optimizer.prepare_ is not None:
        return f"optimizer {name!r} (the launch of prepare_ {_fn_words(optimizer.prepare_)})"
    fn = optimizer.init if role == "init" else optimizer.update
    if getattr(fn, "__qualname__", "") == "pure.<locals>.update" and optimizer.update_ is not None:
        fn = optimizer.update_
    return f"optimizer {name!r} ({role if role == 'init' else 'update'} {_fn_words(fn)})"


def check_segments(name: str, ctx: UpdateContext, numel: int) -> None:
    """`ctx.segments` are `Segment`s of leaves in `ctx.leaves`, in shard order, not overlapping,
    within a shard of `numel` elements (what `layout.segments(bucket, rank)` gives), else an
    `OptimizerError` led by `name` naming the first that is not (found in review: a hand-made
    context's segment of another leaf was a `KeyError`; one out of order, overlapping or with a
    negative start updated other elements, or an element twice, silently)."""
    leaves, at = set(ctx.leaves), 0
    for k, seg in enumerate(ctx.segments):
        if not (isinstance(seg, Segment) and seg.leaf in leaves and at <= seg.start <= seg.stop <= numel
                and seg.leaf_start >= 0):
            raise OptimizerError(
                f"{name}: ctx.segments[{k}] = {seg!r} does not fit: segments are Segments of leaves in ctx.leaves "
                f"{tuple(ctx.leaves)}, in shard order, not overlapping, within the shard's {numel} elements "
                f"(0 <= start <= stop <= {numel}); pass layout.segments(bucket, rank) for this bucket and rank")
        at = seg.stop


SPECS = ("shard", "leaf", "rows", "cols")  # what `Optimizer.spec` may say of a state field
FACTORED = ("rows", "cols")  # the replicated per-row / per-column kinds


def factored(shape: Sequence[int]) -> bool:
    """Whether a leaf of this shape has row and column statistics (2 or more dims)."""
    return len(shape) >= 2


def field_shapes(kind: str, leaf_shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The canonical per-leaf form of a state field of spec `kind`: one shape per bucket leaf
    (`leaf_shapes`: the bucket leaves' shapes).

      "shard"  the leaf's own shape (the field holds the leaf's elements at the leaf's place in
               the bucket's flat buffer; each rank holds its shard of that buffer);
      "leaf"   `()`, one value (the field's entry at the leaf's position);
      "rows"   `shape[:-1]` of a leaf `[..., R, C]`, `(0,)` for a leaf of fewer than 2 dims;
      "cols"   `shape[:-2] + shape[-1:]`, `(0,)` likewise.

    A "rows" / "cols" field is the per-leaf blocks flattened (row-major) and concatenated in
    bucket-leaf order, the same on every rank: leaf k's block is
    `field[sum(numel of blocks < k) :][: numel of block k].view(shape)`."""
    if kind not in SPECS:
        raise OptimizerError(f"unknown state field kind {kind!r}; expected one of {SPECS}")
    out = []
    for shape in leaf_shapes:
        shape = tuple(shape)
        if kind == "shard":
            out.append(shape)
        elif kind == "leaf":
            out.append(())
        elif not factored(shape):
            out.append((0,))
        else:
            out.append(shape[:-1] if kind == "rows" else shape[:-2] + shape[-1:])
    return tuple(out)


def leaf_blocks(kind: str, field: torch.Tensor, leaf_shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """A replicated `field` of spec `kind` ("leaf", "rows", "cols") of one bucket whose leaves
    have the shapes `leaf_shapes` -> one view per bucket leaf, of the leaf's canonical shape
    (`field_shapes`): what a checkpoint saves per leaf. The inverse is
    `join_blocks`. "shard" fields are cut by the layout (the leaf's offset in the flat buffer)."""
    shapes = field_shapes(kind, leaf_shapes)
    if kind == "shard":
        raise OptimizerError("a 'shard' field is cut by the layout (layout.leaves[i].offset), not by leaf_blocks")
    if tuple(field.shape) != (field_numel(kind, leaf_shapes),):
        raise OptimizerError(f"a {kind!r} field of {len(shapes)} leaves {list(leaf_shapes)} has "
                             f"{field_numel(kind, leaf_shapes)} elements, got shape {list(field.shape)}")
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(field[at : at + n].view(shape))
        at += n
    return out


def join_blocks(kind: str, blocks: Sequence[torch.Tensor], leaf_shapes: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """`blocks`, per-leaf blocks of a replicated field of spec `kind` for leaves of shapes
    `leaf_shapes`, each of its canonical shape -> the field (`[L]` or
    the blocks flattened and concatenated in bucket-leaf order): the inverse of `leaf_blocks`."""
    shapes = field_shapes(kind, leaf_shapes)
    for k, (b, shape) in enumerate(zip(blocks, shapes)):
        if tuple(b.shape) != shape:
            raise OptimizerError(f"block {k} of a {kind!r} field has shape {list(b.shape)}, expected {list(shape)} "
                                 f"for a leaf of shape {list(leaf_shapes[k])}")
    if len(blocks) != len(shapes):
        raise OptimizerError(f"{len(blocks)} blocks for {len(shapes)} bucket leaves")
    return torch.cat([b.reshape(-1) for b in blocks]) if blocks else torch.zeros(0)


def field_numel(kind: str, leaf_shapes: Sequence[tuple[int, ...]]) -> int:
    """Elements of a replicated field of spec `kind` ("leaf", "rows", "cols"; "shard" raises
    `OptimizerError`) for a bucket whose leaves have the shapes `leaf_shapes`."""
    if kind == "shard":
        raise OptimizerError("a 'shard' field's size is the shard's, [S]; field_numel is for replicated kinds")
    return sum(math.prod(s) for s in field_shapes(kind, leaf_shapes))


def spec_of(optimizer: "Optimizer", state: Any) -> Any:
    """`optimizer.spec(state)`, checked: one entry per field of the state, each one of `SPECS`
    (memory accounting, checkpoints and resharding read it, never the optimizer's class)."""
    spec = optimizer.spec(state)
    fields = getattr(state, "_fields", None)
    if fields is None or len(tuple(spec)) != len(fields):
        raise OptimizerError(f"the optimizer's spec {spec!r} must be the state's NamedTuple of strings, one per field "
                             f"of {type(state).__name__}{tuple(fields or ())}")
    for field, kind in zip(fields, spec):
        if kind not in SPECS:
            raise OptimizerError(f"spec of state field {field!r} is {kind!r}; each field's spec is one of {SPECS} "
                                 f"(checkpoints and resharding read it)")
    return spec

Impl = Literal["fused", "foreach", "single"]
IMPLS: tuple[Impl, ...] = ("fused", "foreach", "single")


# torch.optim keywords with no fzero counterpart of the same name, and what to write instead
_TORCH_ONLY_KEYWORDS = {
    "foreach": "torch's implementation is picked with impl=: foreach=True is impl='foreach', "
               "foreach=False impl='single', and impl left out is torch's default choice",
    "fused": "torch's implementation is picked with impl=: fused=True is impl='fused', and impl left out is "
             "torch's default choice",
    "differentiable": "a derivative through a step needs no flag: train_step(engine='func', donate=False) "
                      "differentiates sgd, adam and adamw of every impl (docs/func.md)",
    "capturable": "fzero has no setting for CUDA-graph capture; torch's kernels are picked with impl=",
    "decoupled_weight_decay": "Adam's decoupled weight decay is fzero.optim.adamw, given the same weight_decay "
                              "(adamw's default is 0.01, adam's 0)",
}


def refuses_torch_only_keywords(factory: Callable[..., Any]) -> Callable[..., Any]:
    """`factory` (sgd, adam, adamw), where a keyword torch.optim's counterpart takes and fzero
    spells otherwise (`foreach=`, `fused=`, ...) is a `TypeError` that names fzero's spelling,
    not Python's bare "unexpected keyword argument" (found in review of a user porting a torch
    script)."""

    @functools.wraps(factory)
    def made(*args: Any, **kwargs: Any) -> Any:
        if torch_only := sorted(kwargs.keys() & _TORCH_ONLY_KEYWORDS.keys()):
            key = torch_only[0]
            raise TypeError(f"fzero.optim.{factory.__name__}() takes no {key}= (a torch.optim keyword, "
                            f"got {key}={kwargs[key]!r}): {_TORCH_ONLY_KEYWORDS[key]}")
        return factory(*args, **kwargs)

    return made


def check_impl(name: str, impl: Impl | None) -> Impl | None:
    """`impl` if it is one of `IMPLS` or None (the default), else an `OptimizerError` led by
    `name` (the optimizer's)."""
    if impl is not None and impl not in IMPLS:
        raise OptimizerError(
            f"{name}: impl must be one of {', '.join(map(repr, IMPLS))}, or None for the default "
            f"('fused' on CUDA where its kernel is element-wise, else 'foreach'), got {impl!r}"
        )
    return impl


def resolve_impl(name: str, impl: Impl | None, param: torch.Tensor, elementwise: Callable[[], bool]) -> tuple[Impl, bool]:
    """`(implementation, per_leaf)` of one update of optimizer `name` on the shard `param`;
    `elementwise()` says whether the fused kernel
    configuration computes every element alike wherever it sits (`fused.elementwise`).

    Default (`impl=None`): "fused" on a CUDA floating-point shard whose fused kernel is
    element-wise, else "foreach": a function of the device, dtype and hyper-parameters, never
    of where shards cut leaves. An explicit "fused" needs a device and dtype torch has a fused
    kernel for (torch.optim's rule: a fused-supported device type, a floating dtype); where
    the kernel is not element-wise it runs per leaf (`per_leaf`), each leaf placed as torch's
    own tensor (`check_placement`).
    """
    if impl is None:
        cuda = param.device.type == "cuda" and param.is_floating_point()
        return ("fused", False) if cuda and elementwise() else ("foreach", False)
    if impl != "fused":
        return impl, False
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    if param.device.type not in devices or not param.is_floating_point():
        raise OptimizerError(
            f"{name}: impl='fused' needs a floating-point shard on one of {devices} (torch's fused "
            f"kernels), got {param.dtype} on {param.device}; use impl='foreach' or 'single'"
        )
    return "fused", not elementwise()


def check_placement(name: str, ctx: UpdateContext, operands: Sequence[torch.Tensor]) -> None:
    """Every used leaf of `ctx` lies whole in this shard, its pieces of `operands` (param, grad,
    state shards) placed as torch's own tensors would be (`fused.placed_as_torch`), else an
    `OptimizerError` led by `name` (the optimizer's), naming the leaf and the way out."""
    from .fused import placed_as_torch

    device = operands[0].device
    if len(ctx.leaf_numels) != len(ctx.leaves):
        raise OptimizerError(
            f"{name}: impl='fused' here ({device.type}, a placement-dependent kernel) needs ctx.leaf_numels (one "
            f"per bucket leaf, got {len(ctx.leaf_numels)} for {len(ctx.leaves)}) to check that no leaf is cut; "
            f"pass them, or use impl='foreach'"
        )
    pos = {leaf: k for k, leaf in enumerate(ctx.leaves)}
    for seg in ctx.segments:
        k = pos[seg.leaf]
        if not ctx.used[k]:
            continue
        numel, held = ctx.leaf_numels[k], (seg.leaf_start, seg.leaf_start + seg.stop - seg.start)
        why = None
        if held != (0, numel):
            why = f"is cut by the shard (this rank holds elements [{held[0]}, {held[1]}))"
        elif not placed_as_torch([t[seg.start : seg.stop] for t in operands], numel):
            why = f"sits at shard element {seg.start}, not at a {4 * operands[0].element_size()}-byte aligned address"
        if why:
            raise OptimizerError(
                f"{name}: impl='fused' on {device.type}: bucket leaf {seg.leaf} ({numel} elements) {why}; this "
                f"kernel configuration rounds by placement (see fzero._src.optim.fused), so the leaf would not get "
                f"torch's bits. Use impl='foreach' (the default here), or a layout that keeps leaves whole and "
                f"aligned (N = 1, stage 0, leaf sizes multiples of 4)"
            )


def used_pieces(ctx: UpdateContext, key: Sequence[Any], per_segment: bool = False) -> list[tuple[int, int, Any]]:
    """`(start, stop, key)` of the used leaves' elements of `ctx`: maximal runs of consecutive
    used segments with equal `key[leaf position]` (`runs`), or, with `per_segment`, one entry per
    used segment."""
    if per_segment:
        pos = {leaf: k for k, leaf in enumerate(ctx.leaves)}
        return [(seg.start, seg.stop, key[pos[seg.leaf]]) for seg in ctx.segments if ctx.used[pos[seg.leaf]]]
    return [(a, b, k) for a, b, (u, k) in runs(ctx, list(zip(ctx.used, key))) if u]


def runs(ctx: UpdateContext, key: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """Maximal runs `(start, stop, key)` of consecutive segments of `ctx` with equal
    `key[leaf position]`.

    Segments of consecutive leaves are adjacent in the shard, so in the common case (every
    leaf used, all step counts equal) this is one run over all non-padding elements.
    """
    pos = {leaf: k for k, leaf in enumerate(ctx.leaves)}
    out: list[tuple[int, int, Any]] = []
    for seg in ctx.segments:
        k = key[pos[seg.leaf]]
        if out and out[-1][2] == k and out[-1][1] == seg.start:
            out[-1] = (out[-1][0], seg.stop, k)
        else:
            out.append((seg.start, seg.stop, k))
    return out


CPU_BLOCK = 1 << 17
"""Elements per thread in one block of a CPU update (`in_blocks`): 512 KiB of each fp32 operand
per thread, a block's five operands (param, grad, two moments, the work buffer) 2.5 MiB, about
a core's L2 (2 MiB on the team's VM), so that the kernel's passes after the first read them from
cache rather than memory. A performance setting only (each op is element-wise: any cut gives the
same bits); on that VM blocks of 2^17 to 2^22 elements ran alike (BENCHMARKS.md, seventeenth
session)."""
_BLOCKED = (torch.float32, torch.float64)  # the dtypes whose CPU update ops round an element alike anywhere


def in_blocks(kernel: Callable[..., None], how: Impl, lists: Sequence[list[torch.Tensor]], keys: list,
              **hyper: Any) -> None:
    """`kernel(*lists, keys, **hyper)` (one of an optimizer's `KERNELS`: per-piece lists of 1-d
    views, `[]` for an absent operand, and per-piece keys), on the CPU block by block.

    torch's "single" and "foreach" updates make one pass over all their elements per op (eight
    for AdamW); over a shard larger than the cache each pass reads memory. On the CPU, for
    float32 and float64, the pieces are cut into consecutive blocks of `CPU_BLOCK` elements per
    thread, and the kernel runs over one block at a time, every op of it while the block is in
    cache. Each op is element-wise, so the bits are the same as one call over the pieces, as for
    any cut of a shard (proofs/optimizers.md, "Blocks on the CPU"); the work buffer is one block.
    Not for bfloat16 / float16: one call, as before (torch's CPU `add(..., alpha=)` and `rsqrt`
    round an element of these dtypes by where it falls in a call; the optimizers compute those
    through `ops`, which rounds alike anywhere, so blocks would give the same bits, but no test
    holds half-precision blocks to that yet, and they were measured no faster: `ops` is
    compute-bound there, AdamW 1.03-1.22x one call's time in blocks,
    `benchmarks/bench_cpu_blocks.py`). "fused" and other devices: one
    call (torch's fused kernels and CUDA's multi-tensor kernels make one pass). Inside
    `block_sums`, each block's params are summed as soon as the kernel has written them.
    `lists[0]` is the params in every caller."""
    first = lists[0]
    block = CPU_BLOCK * max(1, torch.get_num_threads())
    if (how == "fused" or not first or first[0].device.type != "cpu" or first[0].dtype not in _BLOCKED
            or sum(t.numel() for t in first) <= block):
        kernel(*lists, keys, **hyper)
        return
    sums = getattr(_SUMS, "into", None)
    for group in _blocks([t.numel() for t in first], block):
        views = [[op[i][a:b] for i, a, b in group] if op else [] for op in lists]
        kernel(*views, [keys[i] for i, _, _ in group], **hyper)
        if sums is not None:  # the block's params, just written, read while in cache
            sums.extend((v, v.sum()) for v in views[0])


_SUMS = threading.local()  # `block_sums`' list on this thread, or none


@contextlib.contextmanager
def block_sums() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Within it, `in_blocks` appends to the list it yields, for every block it runs on the CPU,
    `(view, view.sum())` of each view of the first operand (the params) just after the kernel
    wrote it: a sum of every element the update wrote, read while the block is in cache
    (`update.BlockEnds`, the update's finite check). Nothing where `in_blocks` makes one call."""
    before = getattr(_SUMS, "into", None)
    _SUMS.into = taken = []
    try:
        yield taken
    finally:
        _SUMS.into = before


def _blocks(numels: Sequence[int], block: int) -> list[list[tuple[int, int, int]]]:
    """Pieces of lengths `numels` cut into groups of `(piece, start, stop)` that cover `block`
    consecutive elements each (the last fewer), in order."""
    groups: list[list[tuple[int, int, int]]] = [[]]
    room = block
    for i, n in enumerate(numels):
        at = 0
        while at < n:
            take = min(n - at, room)
            groups[-1].append((i, at, at + take))
            at, room = at + take, room - take
            if room == 0:
                groups.append([])
                room = block
    return [g for g in groups if g]


_FLOAT32_EXACT = float(2**24)  # every integer count up to here is a float32


def bumped(counts: list[float], used: Sequence[bool], dtype: torch.dtype = torch.float32) -> list[float]:
    """Per-leaf step counts after one update: +1 where used, as a count tensor of `dtype` holds
    it (torch's `state["step"]`, float32 but where the default dtype is float64): from 2**24 on a
    float32 count stays at 2**24, as torch's does, and the bias correction reads that (found in
    review: Adam's single / foreach kernels read 2**24 + 1, 5 elements of 1000 apart from torch)."""
    out = [c + 1.0 if u else c for c, u in zip(counts, used)]
    if dtype == torch.float32 and any(c > _FLOAT32_EXACT for c in out):
        out = [float(torch.tensor(c, dtype=torch.float32)) for c in out]
    return out
