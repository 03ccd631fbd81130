"""The update: the optimizer over what this rank owns, the stage's `finish`, and a finite check.

After the agreement, `update` applies the optimizer to each trainable bucket this rank owns
(`Optimizer.update`, or in place with `donate`, `Optimizer.update_`), starts each bucket's
`finish` (stages 1-2: the all-gather of its new params) as its update ends, and checks that the
new params are finite (`_nonfinite_flag`): the pure step reads the flag at once (one all-reduce),
a donating step leaves it on the device as the new state's `pending`, taken bucket by bucket
beside the update (`Ends` on CUDA, `BlockEnds` on the CPU). A donating update's host work is done
before the agreement's read (`prepare` -> `Ready`), and where the verdict can only say whether it
runs, its kernels are launched before the read too (`agreement.agree_launching` -> `Early`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from .collectives import all_reduce, func_level, unwrapped
from .errors import ConfigError
from .gathering import version_of
from .norms import Side
from .offload import HostUpdate, host_leaf_sum
from .optim.base import (DIFFERENTIABLE, Launch, Optimizer, OptimizerError, block_sums, optimizer_words, spec_of,
                         tracked, update_result_problem)
from .plan import BucketPlan, plan_of, step_plan
from .reduce import overlaps
from .state import PADDING_WRITTEN, ZeroState, fresh, keep, lose, lost_by, renewed, updated_nonfinite_leaves
from .unit import finite_witness, settle_flights


class Ready(NamedTuple):
    """A donating update's host work done before the agreement's read (`prepare`): per bucket
    updated on the device, the params its optimizer writes (`Stage.optimizer_params`) and the
    optimizer's `launch` (`Optimizer.prepare_`), built for a step that uses every leaf. After the
    read `update` only launches them -- where the verdict says every leaf was used; otherwise
    (and for a bucket missing here) it runs the general `update_`."""

    params: dict[int, torch.Tensor]
    launches: dict[int, Callable[[torch.Tensor], Any]]
    overlap: bool  # `overlaps` of the step's gradients and params, which the verdict does not change
    refused: frozenset[int] = frozenset()  # the buckets whose `prepare_` raised (`_raise_before_writing`)


def prepare(state: ZeroState, reduced: dict[int, torch.Tensor], donate: bool) -> Ready | None:
    """`Ready` for a donating step whose optimizer has a `prepare_` (None otherwise): for every
    trainable bucket updated on the device, what `update` would build before its kernels. It
    writes nothing (a skipped step leaves the state as it was) and reads no device value (but
    `fused.elementwise`'s probe, once per kernel configuration, as `update_` would), so it runs
    while the device still computes what the agreement gathers. A bucket whose `prepare_`
    raises is left out: `update` calls `update_`, which raises the same error after the verdict,
    where it always did."""
    optimizer = state.optimizer
    if not donate or optimizer.prepare_ is None or differentiated_through(state, reduced):
        return None  # differentiated through: nothing launched early; `update` raises
    layout, stage, rank = state.layout, state.stage, state.rank
    plan, on_host, step = plan_of(state.info), step_plan(state.info).on_host, int(state.step)
    params, launches, refused = {}, {}, set()
    for b in reduced:
        if b in on_host:
            continue
        p = stage.optimizer_params(layout, b, state.params[b], rank, state.master[b])
        try:
            launches[b] = optimizer.prepare_(state.opt_state[b], p, plan[b].context(step, None))
        except Exception:  # noqa: BLE001 -- `update_` raises it again, after the verdict, and
            refused.add(b)  # `_raise_before_writing` before any write
            continue
        params[b] = p
    return Ready(params, launches, _overlap(state, reduced), frozenset(refused))


class Early(NamedTuple):
    """An update launched before the agreement's read whose kernels ran (`agree_launching`): per
    bucket the new optimizer state its launch returned, and the finite check already taken of
    each bucket after its kernels (`Ends`; None off CUDA), as `update` takes it."""

    states: dict[int, Any]
    ends: Ends | None


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
    returned and their finite checks.

    Where anything raises after a finish started -- an interrupt (a `KeyboardInterrupt`, an
    exception a signal handler raises) of a wait or of the agreement's all-reduce, a failed wait,
    a later bucket's update -- every finish not waited for is waited for or handed to the mesh
    (`unit.settle_flights`). Before, only this function's `flights` held them, which nothing on
    the step's error path sees: they were dropped, and gloo cancelled those all-gathers under
    peers that then waited out the timeout (found in review).

    A donating update that raises after it wrote the input state in place (a bucket's `update_` or
    launch ran, or wrote before raising: `Watch`; stages 1-2's all-gather into the params buffer)
    leaves that state lost (`state.lose`, set just before the first write, `_settle_lost`): every
    reader but a checkpoint's load target refuses it, naming the step and the error. Before, it was
    left as it stood -- its step count the old one, the buckets written at the next step's values
    -- and `gather`, `checkpoint.save` and a retried step read it without a word (found in review:
    a `KeyboardInterrupt` at the second bucket). One that raises before any write leaves it usable."""
    layout, stage, mesh, rank, optimizer = state.layout, state.stage, state.mesh, state.rank, state.optimizer
    if donate and optimizer.update_ is None:
        raise ConfigError("donate=True needs an optimizer with an in-place form (Optimizer.update_); this one has "
                          "none: use donate=False")
    if donate and ready is None and differentiated_through(state, reduced):  # (a `Ready`: `prepare` found it is not)
        raise donated_through(state)
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
    # a donating update: the buckets it has written in place (those launched early: written), and the first
    # one's tensors watched (`_first_write`: the state is marked lost before it; `_settle_lost` on the error path)
    wrote, watch = list(early), None
    in_files = _in_files(state) if donate else frozenset()
    ahead = _raise_before_writing(state, reduced, used, ready, in_files) if donate else {}
    try:
        for b, g in reduced.items():
            launch = launches.get(b)
            updating = _updating(ends if b not in early else None)
            if launch is not None:  # prepared before the agreement's read: only the kernels are left (or none)
                p = ready.params[b]
                if not wrote:
                    watch = _first_write(state, b, p, state.opt_state[b])
                with updating:
                    updated[b], new_opt[b] = p, early[b] if b in early else launch(g.to(p.dtype))
                if b not in early:
                    wrote.append(b)
                check_update_result(optimizer, new_opt[b], p, state.opt_state[b], layout, b, "a prepared launch")
                back[b] = kept[b] = checked[b] = p
            else:
                # offloaded: the host copies (NVMe: the master and state read from their files)
                g, opt, master, leaf_sum = host.inputs(b, g, state.opt_state[b], state.master[b], plan[b].leaf_sum)
                ctx = plan[b].context(step, used, leaf_sum)
                p = stage.optimizer_params(layout, b, state.params[b], rank, master)  # offloaded: the host master
                g = g.to(p.dtype)  # the reduce dtype -> the master's (a no-op without a precision policy)
                if donate:
                    if not wrote:  # NVMe (`in_files`): `p` and `opt`'s "shard" fields are read buffers; its
                        # other fields are the state's own tensors, which `update_` may write in place
                        watch = (_first_write(state, b, state.master[b], state.opt_state[b]) if b in in_files
                                 else _first_write(state, b, p, opt))
                    with updating:  # (a bucket prepared by the before-write check: its launch, `update_`'s kernels)
                        updated[b], new_opt[b] = p, ahead[b](g) if b in ahead else optimizer.update_(g, opt, p, ctx)
                    if b not in in_files:
                        wrote.append(b)
                    check_update_result(optimizer, new_opt[b], p, opt, layout, b, "Optimizer.update_")
                else:
                    updated[b], new_opt[b] = _pure_update(optimizer, g, opt, p, ctx, state, b)
                    if not overlap and stage.reads_differ(layout, b, used):  # a transform, or autograd, may differentiate
                        updated[b], new_opt[b] = tied(updated[b], new_opt[b], (g, *_shard_fields(opt, optimizer)),
                                                      optimizer)
                out = host.outputs(b, updated[b], new_opt[b], state.params[b].dtype)  # NVMe: `updated[b]` is freed
                back[b], new_opt[b], kept[b], checked[b] = out.back, out.opt_state, out.master, out.checked
            if ends is not None and b not in early:  # a bucket launched early: taken after its kernels
                ends.take(b, checked[b])
            if overlap:  # overlaps the next update; a donating step gathers into the params it held
                if in_files and b in in_files:  # NVMe: the first write of the state's own buffers
                    if not wrote:
                        lose(state)
                    wrote.append(b)
                flights[b] = stage.finish.begin(mesh, plan[b].wire, back[b], state.params[b] if donate else None)
        host.done()
    except BaseException as e:
        if donate:
            _settle_lost(state, e, wrote, watch)
        try:
            host.abort(e)  # NVMe: the read buffers given back, so that a retry reads the files (found in review)
        finally:
            settle_flights(mesh, list(flights.values()), e)  # the finishes started: waited for, or kept by the mesh
        raise
    try:  # (a try costs nothing until it catches)
        flag = _nonfinite_flag(state, checked, ends, plan)
        broken = not donate and bool(updated) and _agreed_nonfinite(state, flag)
        gathered = {b: f.wait() for b, f in flights.items()}  # every rank started them: wait, even to discard
    except BaseException as e:  # those not waited for (an interrupt, a failed wait or agreement): as above
        if donate:
            _settle_lost(state, e, wrote, watch)
        settle_flights(mesh, list(flights.values()), e)
        raise
    if broken:
        leaves = updated_nonfinite_leaves(state, updated)  # every rank the same (one all-reduce)
        if not leaves:
            raise OptimizerError(f"step {int(state.step)}: {PADDING_WRITTEN} ({state.mesh!r}; the state is unchanged)")
        return state, leaves
    if not overlap:  # differentiated through: the blocking, differentiable finish
        gathered = {b: stage.finish.run(mesh, plan[b].wire, p) for b, p in back.items()}
    for b in updated:
        new_params[b] = gathered[b]
        if state.master[b] is not None:
            new_master[b] = kept[b]
    made = renewed if donate else fresh  # a donating step's buffers are the input's, written in place
    return made(state, params=tuple(new_params), opt_state=tuple(new_opt), master=tuple(new_master),
                step=state.step + 1, pending=flag if donate else None), []


def _raise_before_writing(state: ZeroState, reduced: dict[int, torch.Tensor], used: list[bool], ready: Ready | None,
                          in_files: frozenset[int]) -> dict[int, Launch]:
    """A donating update's errors of values raised before its first write: every bucket after the
    first that `prepare` did not prepare -- its `prepare_` raised there, or it is updated on a host
    tier -- is prepared again (`Optimizer.prepare_`: the checks and the values, nothing written)
    with the context its `update_` takes. Where that raises -- an `lr * lr_scale` past the range of
    a later parameter group's dtype (`check_fits`) -- the state is left as it was and usable, as
    where the first bucket raises. Before, the buckets ahead of it were written and the state lost,
    though every value that decides the error was known before any write (found in review; row
    205). Only an `OptimizerError` (the optimizer's refusal of a value) is raised here; another
    exception leaves the bucket to its `update_`, as before. Not for an NVMe bucket (its state is
    read from files in the loop) nor an optimizer without a `prepare_` (lamb's, adafactor's, a
    user's), whose `update_` raises where it runs. Returns each bucket's `Launch` so prepared, with
    the context and the tensors `update` hands its `update_` (a host tier's: the state's own host
    master and state, `HostTier.fetch`), which `update` runs in its place: the same checks and
    kernels, prepared once (found in review: prepared twice, 70 µs a host bucket a step)."""
    optimizer = state.optimizer
    if optimizer.prepare_ is None or len(reduced) < 2:
        return {}
    refused = ready.refused if ready is not None else frozenset()  # (None: spent by a skipped early launch,
    # which every bucket was prepared for)
    plan, step, on_host = plan_of(state.info), int(state.step), step_plan(state.info).on_host
    launches = {}
    for b in list(reduced)[1:]:
        if b in refused or (b in on_host and b not in in_files):
            p = state.stage.optimizer_params(state.layout, b, state.params[b], state.rank, state.master[b])
            leaf_sum = host_leaf_sum(plan[b].leaf_sum, state.mesh.device) if b in on_host else None
            try:
                launches[b] = optimizer.prepare_(state.opt_state[b], p, plan[b].context(step, used, leaf_sum))
            except OptimizerError:
                raise
            except Exception:  # noqa: BLE001 -- not a value of the update: `update_` runs as before (found in
                continue  # review: a user's `prepare_` declining a group, whose `update_` trains it)
    return launches


class Watch(NamedTuple):
    """The first bucket a donating update writes in place (`bucket`), its param and optimizer
    state tensors and their version counters just before (`versions`): where that bucket's update
    raises, whether it wrote anything first (`moved`), read on the error path only. The version
    counter moves with every in-place torch op on a tensor or its views (not with a write through
    `.data`, which is not seen)."""

    bucket: int
    tensors: tuple[Any, ...]
    versions: list[int | None]

    def moved(self) -> bool:
        return _versions(self.tensors) != self.versions


def _first_write(state: ZeroState, b: int, param: torch.Tensor, opt_state: Any) -> Watch:
    """Before a donating update's first in-place write of the state (bucket `b`'s `update_` or
    prepared launch): the state marked lost (`state.lose`: an exception from here until the step
    returns leaves it refused), and bucket `b`'s tensors watched (`Watch`). Once per step."""
    lose(state)
    tensors = (param, *(opt_state if isinstance(opt_state, tuple) else ()))
    return Watch(b, tensors, _versions(tensors))


def _settle_lost(state: ZeroState, error: BaseException, wrote: list[int], watch: Watch | None) -> None:
    """On a donating update's error path: where no bucket's in-place update ran to its end and the
    first one's tensors kept their version counters (`Watch.moved`: it raised before writing, an
    `OptimizerError` of its hyper-parameters, an interrupt before its first kernel), the state is
    as it was, and `lose`'s mark is taken back (`state.keep`); else the state is lost, naming
    `error` and the buckets written (`state.lost_by`). Never raises (a failure here keeps the
    mark)."""
    with contextlib.suppress(Exception):
        written = list(wrote)
        if watch is not None and watch.bucket not in written and watch.moved():
            written.append(watch.bucket)
        if not written:
            keep(state)
            return
        lost_by(state, error, [state.layout.buckets[b].tag for b in written])


def _in_files(state: ZeroState) -> frozenset[int]:
    """The buckets whose master and "shard" optimizer-state fields live in files (an NVMe tier,
    `HostTier.in_place`): their update reads and writes host buffers of their own (`NvmeTier.fetch`
    reads the files), and the files are rewritten by `store`, which the tier's `check_holds`
    watches. Their other fields ("leaf", "rows", "cols": a step count) are the state's own pinned
    tensors, handed to `update_` as they are, so an `update_` that writes one in place writes the
    state: `update` watches the state's own tensors of such a bucket (its master and "shard"
    fields are stand-ins, never written), and counts the bucket written only once `store` ran
    (found in review: an `update_` that bumped its step count in place and then raised was taken as
    unwritten, and the retry trained from a step count one ahead)."""
    tier = state.info.tier
    return step_plan(state.info).on_host if tier is not None and tier.in_place else frozenset()


def _pure_update(optimizer: Optimizer, grad: torch.Tensor, opt_state: Any, param: torch.Tensor, ctx: Any,
                 state: ZeroState, b: int) -> tuple[torch.Tensor, Any]:
    """`optimizer.update`, which must be pure, checked not to have written its inputs (their
    version counters; torch.func's wrappers unwrapped to the tensor a write moves): a user's
    update that writes `param` (or the state, or the gradient) in place changed the input state
    of a pure step, at every stage, silently (found in review), as a loss that writes a param
    does (`Gathering._check_unwritten`); the state is then marked lost, as a donating step's that
    raised after its first write (found in review: `gather` read the written state without a
    word). A few version reads per bucket."""
    layout = state.layout
    inputs = (grad, param, *opt_state)
    before = _versions(inputs)
    out = optimizer.update(grad, opt_state, param, ctx)
    after = _versions(inputs)
    if after != before:
        names = ["grad", "param", *(f"state.{f}" for f in getattr(opt_state, "_fields", range(len(opt_state))))]
        written = [n for n, x, y in zip(names, before, after) if x != y]
        error = OptimizerError(
            f"the optimizer's update wrote its input(s) {written} in place ({_bucket_named(layout, b)}): "
            f"Optimizer.update must be pure -- it gets views of the "
            f"state's own buffers, so the write changes the step's input state -- write into clones (as "
            f"fzero.optim.pure does), or give the optimizer an in-place form (Optimizer.update_, "
            f"fzero.optim.in_place) for donating steps")
        if written != ["grad"]:  # the state's own buffers were written
            lose(state, pure=True)
            lost_by(state, error, [layout.buckets[b].tag])
        raise error
    check_update_result(optimizer, out, param, opt_state, layout, b, "Optimizer.update")
    return out


def check_update_result(optimizer: Optimizer, out: Any, param: torch.Tensor, opt_state: Any, layout: Any, b: int,
                        form: str) -> None:
    """`OptimizerError` where `out`, the result of bucket `b`'s update in form `form`
    ("Optimizer.update": `(new param, new state)`; "Optimizer.update_" or "a prepared launch": the
    new state), does not keep the shapes, dtypes, devices and state fields of the update's inputs
    `param` and `opt_state` (`optim.base.update_result_problem`), naming the optimizer (for a
    prepared launch, its `prepare_`), the bucket and its leaves, what was returned and what was
    expected. Host metadata only, per bucket and step (found in review: a wrong result failed a
    step later inside the user's update, in torch, as a false `DivergentPaths`, or not at all --
    params silently truncated or widened, a checkpoint that could not be loaded)."""
    wrong = update_result_problem(out, param, opt_state, pure=form == "Optimizer.update")
    if wrong is not None:
        role = "prepare_" if form == "a prepared launch" else "update"
        raise OptimizerError(f"{optimizer_words(optimizer, role)}: {form} {wrong} ({_bucket_named(layout, b)})")


def _bucket_named(layout: Any, b: int) -> str:
    """Bucket `b` in an update's errors: its tag and its leaves' paths (the first 6)."""
    spec = layout.buckets[b]
    paths = [layout.leaves[i].path for i in spec.leaves]
    return f"bucket {spec.tag!r}, leaves {paths[:6]}{' ...' if len(paths) > 6 else ''}"


def _versions(tensors: Sequence[Any]) -> list[int | None]:
    return [version_of(unwrapped(t)) if isinstance(t, torch.Tensor) else None for t in tensors]


def differentiated_through(state: ZeroState, reduced: dict[int, torch.Tensor]) -> bool:
    """Whether a derivative is taken through this update (`optim.base.tracked`: a meta-gradient or
    an HVP through the step, under torch.func or autograd): of the reduced gradients, the params,
    the masters or the optimizer state. Reads one `requires_grad` per tensor in a plain step."""
    return tracked(*_step_tensors(state, reduced))


def donated_through(state: ZeroState) -> ConfigError:
    """The error of a donating step differentiated through (`differentiated_through`): its update writes
    the state's params and optimizer state in place, which torch refuses for a transform's inputs
    ("a view of a leaf Variable that requires grad is being used in an in-place operation", found
    in review, every stage) and through which its foreach and fused kernels would otherwise record
    no derivative. Raised on every rank (each differentiates the same step): before the forward
    where the input state's tensors are tracked (`step._check_no_derivative_through_a_donating_step`),
    else after the agreement and before anything is written (`prepare` launches nothing early
    then); a donating step under
    a transform that differentiates nothing through it runs as before."""
    return ConfigError(f"train_step(..., donate=True) is being differentiated through (a meta-gradient or an HVP "
                       f"through the step; {state.mesh!r}, rank {state.rank}, stage {state.stage.level}): a donating "
                       f"step updates its input state in place, which no derivative goes through. Use donate=False "
                       f"(the default) for steps a derivative is taken through; the pure update is differentiable "
                       f"for {DIFFERENTIABLE}")


def tied(params: torch.Tensor, opt_state: Any, inputs: Sequence[torch.Tensor], optimizer: Optimizer
         ) -> tuple[torch.Tensor, Any]:
    """The update's new `params` and the "shard" fields of its new `opt_state`, the same bits (a
    copy each), each with every one of `inputs` -- the reduced gradient shard and the input
    state's floating "shard" fields (`_shard_fields`) -- entering it at zero weight (`torch.where`
    on a false condition): their cotangents from it are zeros, so every derivative is the step's
    (on a rank whose optimizer reads them too, the sum with those zeros turns a -0 into +0).

    Only where the step may be differentiated through (`overlap` false: under a torch.func
    transform, or where a tensor requires grad) and the ranks differ in reading their shard at all
    (`Stage.reads_differ`: a shard of padding only, or of leaves no rank used, updates nothing);
    the plain step never calls it. The input state is tied too: a derivative with respect to it
    alone made the new params require grad on a rank that updates its shard and not on one that
    updates nothing, and the all-gather of the finish parted (`CollectiveMismatch`, found in
    review). Autograd runs the adjoint of the reduction that made `grad` (an
    all-gather, a collective) only on a rank whose differentiated result depends on `grad`: before,
    the ranks that read it ran that all-gather and the others did not, a `CollectiveMismatch` (gloo,
    unverified: "Received data size doesn't match"; found in review: a 1-element leaf in its own
    unit at N = 2, `examples/hvp.py --world-size 4`). Tied on every rank alike, so every rank runs
    it whatever the optimizer reads and whichever of these outputs the derivative is of."""
    off = torch.zeros((), dtype=torch.bool, device=params.device)

    def tie(t: torch.Tensor) -> torch.Tensor:
        for x in inputs:
            t = torch.where(off, x.to(t.dtype), t)
        return t

    fields = [tie(t) if kind == "shard" and t.is_floating_point() else t
              for t, kind in zip(opt_state, spec_of(optimizer, opt_state))]
    return tie(params), type(opt_state)(*fields)


def _overlap(state: ZeroState, reduced: dict[int, torch.Tensor]) -> bool:
    """Whether the update may start its finish without waiting (`overlaps` of the reduced
    gradients, the state's params, masters and optimizer state; `_rescale` keeps
    `requires_grad`). The masters and optimizer state count: a derivative through the step with
    respect to the optimizer state alone (plain autograd) took the detached finish, so the new
    params of stages 1-2 came back not requiring grad and their part of the derivative was
    silently zero (found in review)."""
    return overlaps(_step_tensors(state, reduced))


def _step_tensors(state: ZeroState, reduced: dict[int, torch.Tensor]) -> Iterator[torch.Tensor]:
    """The tensors a derivative through the update may be taken with respect to: the reduced
    gradients, the state's params, masters and optimizer-state fields (what `_overlap` and
    `differentiated_through` read)."""
    opt = (t for s in state.opt_state if s is not None for t in s)
    return (t for t in itertools.chain(reduced.values(), state.params, state.master, opt) if isinstance(t, torch.Tensor))


def _shard_fields(opt_state: Any, optimizer: Optimizer) -> list[torch.Tensor]:
    """The input optimizer state's floating "shard" fields (`tied` ties them into the update)."""
    return [t for t, kind in zip(opt_state, spec_of(optimizer, opt_state)) if kind == "shard" and t.is_floating_point()]


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
    # 0-d parts, as `finite_witness`'s: `_nonfinite_flag` stacks every bucket's together (found in review: a
    # bucket's 1-d stack beside another's of another length was torch's "stack expects each tensor to be equal
    # size", after the donating update had written the state)
    return tuple(parts) if bool(torch.isfinite(torch.stack(parts)).all()) else torch.aminmax(flat)


def _agreed_nonfinite(state: ZeroState, flag: torch.Tensor) -> bool:
    """Whether any rank's flag is set: one all-reduce (max), tag "fzero.step/update" (a control
    collective), read on the host."""
    return bool(all_reduce(flag.to(torch.float64).reshape(1), state.mesh, "max", tag="fzero.step/update").item() > 0)
