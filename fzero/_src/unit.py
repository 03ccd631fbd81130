"""The per-unit Function: how a unit's parameters enter the loss and its gradient leaves it.

Every stage runs the loss through one `_Unit` Function per unit, built from the two pieces of
the `Stage` that act inside it (see `stages.py`), so stages are compositions, not branches:

    stage.enter(x)  -> flat[N * S]    the full flat buffer the loss reads (stage 3: all-gather)
    stage.leave(g)  -> grad of x      g is this rank's full local gradient flat[N * S]
                                      (stages 2-3: reduce-scatter fl(1/N) * g now -> shard[S])

The Function returns one tensor per leaf (views of the entered flat buffer) and a 0-d anchor.
Its backward runs once per step, after autograd has added up every use of every leaf of the
unit, so a tied leaf is reduced once, after its last use, as in DDP. Outputs no loss term used
arrive as `None` (`set_materialize_grads(False)`).

What backward learns comes back as data, through autograd itself: the Function takes a `Probe`
(two zero tensors) as inputs and returns as their "gradients" which leaves got a gradient
(`used[L_u]`, float32 on the CPU: Python bools, no device copy) and, where the step locates
non-finite gradients (`train_step(locate_nonfinite=True)` at N > 1: the probe's `bad` is not
empty), whether each bucket's local gradient held a NaN or inf (`bad[B_u]`, float32 on the
gradient's device: no host sync in backward). The step differentiates with respect to the probes too. Works under
`torch.func.grad` / `grad_and_value` and plain `torch.autograd.grad`.

Under other transforms (docs/func.md): `jvp` is the Function's forward on the tangents (the
enter is linear: a cast, a gather, views), with a zero anchor; `vmap` runs the Function
unbatched (a unit first read inside a vmapped loss: its inputs are the step's, never batched);
batched params (a vmap over states) raise `ConfigError`, as a vmap over a step must.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from .collectives import all_gather, check_forward_mode, func_level
from .errors import ConfigError, LayoutError
from .layout import Layout
from .mesh import Mesh
from .precision import FULL, Precision
from .stages import ENTER_GATHER, Stage, Wire
from .watched import Watched


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What the unit Function needs of one bucket: its index, tag, leaf offsets and shapes."""

    index: int
    wire: Wire
    frozen: bool
    leaves: tuple[int, ...]
    offsets: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    size: int  # N * S, the padded flat buffer
    paths: tuple[str, ...] = dataclasses.field(compare=False)  # the leaves' dotted paths (errors)

    @staticmethod
    def of(layout: Layout, b: int, precision: Precision = FULL) -> "Bucket":
        spec = layout.buckets[b]
        leaves = [layout.leaves[i] for i in spec.leaves]
        return Bucket(b, precision.wire(spec), spec.group.frozen, spec.leaves, tuple(ls.offset for ls in leaves),
                      tuple(ls.shape for ls in leaves), spec.padded_numel, tuple(ls.path for ls in leaves))

    @property
    def tag(self) -> str:
        return self.wire.tag

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat[N * S] -> [leaf views]`, one `as_strided` per leaf (a slice and a view would be
        two ops of host time each): leaf k is `flat[o_k : o_k + n_k]` in its contiguous shape.
        For the Function's forward and `fzero.gather`, where no transform batches `flat`;
        tangents use `split_views`."""
        at = flat.storage_offset()
        return [flat.as_strided(s, st, at + o) for o, s, st in zip(self.offsets, self.shapes, self._strides)]

    def cast_views(self, flat: torch.Tensor, views: list[torch.Tensor], casts: Sequence[torch.dtype | None]
                   ) -> list[torch.Tensor]:
        """`views` with leaf k replaced by its cast to `casts[k]` where that is not None
        (`fzero._src.casting`): each run of neighbouring leaves cast to one dtype is cast by one
        `to` of its span of `flat` (on CUDA torch's vectorised cast kernel), and its leaves are
        views of that."""
        out, k = list(views), 0
        while k < len(casts):
            dtype, j = casts[k], k
            if dtype is None:
                k += 1
                continue
            while j + 1 < len(casts) and casts[j + 1] == dtype:
                j += 1
            lo = self.offsets[k]
            run = flat[lo : self.offsets[j] + self.numels[j]].to(dtype)
            for i in range(k, j + 1):
                out[i] = run.as_strided(self.shapes[i], self._strides[i], self.offsets[i] - lo)
            k = j + 1
        return out

    def split_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`views` by one split of `flat` into leaves, gaps and padding, then a view to the leaf's
        shape where it is not 1-d: ops with batching rules, for tangents that `jacfwd` batches."""
        sizes, pick = self._pieces
        parts = flat.split_with_sizes(sizes)
        return [parts[k] if len(s) == 1 else parts[k].view(s) for k, s in zip(pick, self.shapes)]

    @functools.cached_property
    def _strides(self) -> tuple[tuple[int, ...], ...]:
        """Each leaf's contiguous strides, as torch makes them (a side of 0 counts as 1)."""
        return tuple(tuple(math.prod(max(n, 1) for n in s[d + 1 :]) for d in range(len(s))) for s in self.shapes)

    @functools.cached_property
    def numels(self) -> tuple[int, ...]:
        """Each leaf's number of elements."""
        return tuple(math.prod(s) for s in self.shapes)

    @functools.cached_property
    def _pieces(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """`(sizes, pick)`: `flat[N * S]` split by `sizes` (each leaf, and each gap before one and
        after the last) has leaf k's elements in piece `pick[k]`."""
        sizes: list[int] = []
        pick: list[int] = []
        end = 0
        for o, n in zip(self.offsets, self.numels):
            if o > end:
                sizes.append(o - end)
            pick.append(len(sizes))
            sizes.append(n)
            end = o + n
        if self.size > end:
            sizes.append(self.size - end)
        return tuple(sizes), tuple(pick)


class Inflight:
    """The reductions one step's unit backwards started and nobody has waited for yet.

    Where the stage reduces inside the unit's backward (stages 2-3) and the step differentiates
    with `torch.autograd.grad` without a graph of the backward, each bucket's reduce-scatter is
    started (`Stage.leave.start`) and its result tensor handed to autograd unread; the step waits
    for all of them (`wait`) when the backward is done, before anything reads a gradient. So the
    reductions run while the backward of the units below goes on.

    At most `depth` flights stay open: each holds its bucket's scaled local gradient `flat[N * S]`
    (and, on gloo, the backend's own copy of it) until waited. The unit's backward calls
    `make_room` before it assembles a bucket's gradient, so the oldest flight is closed before
    the next `flat[N * S]` exists, not after its reduction starts: with the default depth 1 the
    reduction of one unit runs while the next unit's per-leaf gradients are computed (the
    overlap), and the next assembled buffer replaces it (the memory: one bucket's gradient
    buffer at any time, beside the per-leaf gradients being assembled and the backend's staging;
    proofs/stage3.md, section 7). `add` past `depth` also waits for the oldest. (SimMesh
    completes at start: nothing stays open.)

    `host` (offload, `fzero._src.offload.early_copies`): `host(shard, bucket)` is called with each
    flight's reduced `shard[S]` as soon as it exists -- when the flight is closed (`make_room`,
    `add` past `depth`, `wait`), or at `add` where the reduction completed when started (N = 1,
    SimMesh); and, where the unit reduces in another dtype than its gradient's (a bf16 policy's
    fp32 master: the blocking reduction, then the cast), with the cast shard -- so that its
    device -> host copy runs during the rest of the backward instead of at the update. `bucket`
    is the index `add` was given, or None.

    With `early` (stages 0-1, whose leave keeps the gradient local: the trainable buckets, which
    the step passes where it reduces each micro-batch), the unit's backward hands autograd no
    gradient and `begin`s the step's own reduction of each bucket (`Stage.after_backward.start`
    on the gradient the step would get); `reduce.reduce` finishes the flights (`started`). They
    start in one order on every rank, as DDP launches its buckets: the buckets of `early` from the
    last, each once it and every later one are ready -- ranks whose backward reaches the units in
    another order (a unit some rank skipped) still call the same collectives in the same order.
    They are not bounded by `depth`: stage 0 holds every unit's reduced gradient after backward
    anyway, and `reduce.Chained` waits each of stage 1's once the next has started.

    `done(result)` (`norms.EarlyNorms.take`) is called with each reduction's result that exists
    when it starts (N = 1: the reduction returns its input), as soon as it does.

    `side` (`Assembly`, N = 1 on CUDA): where the unit's backward reads its assembled gradient
    only through the identity (a reduction over one rank, no cast), the gradient is assembled on
    its side stream (`_assemble`), beside the backward of the units below instead of in its
    path; the step joins it (`Assembly.join`) before it reads any gradient.

    `buffers` (`HostBuffers`, a donating step on the CPU): the assembled gradients' buffers, taken
    from what the step function's previous step left (`_assemble`)."""

    def __init__(self, depth: int = 1, early: tuple[int, ...] = (),
                 host: Callable[[torch.Tensor, int | None], None] | None = None,
                 done: Callable[[torch.Tensor], None] | None = None, side: Assembly | None = None,
                 buffers: HostBuffers | None = None) -> None:
        self._flights: list[tuple[Any, int | None, bool]] = []  # (flight, bucket, copied at add)
        self.buffers = buffers  # a donating CPU step's: where `_assemble` takes its `flat[N * S]`
        self.depth = depth
        self.early = list(early)  # stages 0-1: the buckets whose reduction starts in backward, last first
        self.host = host
        self.done = done  # called with a reduction's result where it completed when started (N = 1)
        self.side = side
        self._ready: dict[int, Callable[[], Any]] = {}  # bucket -> its start, waiting for its turn
        self.started: dict[int, Any] = {}  # bucket -> its Flight, which the step finishes (`reduce.reduce`)

    def begin(self, b: int, start: Callable[[], Any]) -> None:
        """Bucket `b`'s reduction is ready: start it, and every ready one after it in turn."""
        self._ready[b] = start
        while self.early and self.early[-1] in self._ready:
            k = self.early.pop()
            self.started[k] = self._seen(self._ready.pop(k)())

    def _seen(self, flight: Any) -> Any:
        """`flight`, after handing its result to `done` where it completed when started."""
        if self.done is not None and _complete(flight):
            self.done(flight.pending.result)
        return flight

    def rest(self, zeros: Callable[[int], Callable[[], Any]]) -> dict[int, Any]:
        """After the backward: start the rest in turn (a bucket no unit backward reached on this
        rank with `zeros(b)`, its reduction of zeros), and return every bucket's flight."""
        while self.early:
            k = self.early.pop()
            start = self._ready.pop(k, None) or zeros(k)
            self.started[k] = start()
        return self.started

    def _close(self) -> None:
        """Close the oldest open flight: wait for it while `_flights` holds it, take it out, then
        hand its shard to `host`. A wait that something interrupts leaves it in `_flights`, for
        `settle` (as `wait_held`; these flights have one phase, `LEAVE_REDUCED`)."""
        flight, bucket, copied = self._flights[0]
        try:
            shard = flight.wait()
        except RuntimeError:  # a failed wait: done (`Pending.wait`), nothing left to hand on
            del self._flights[0]
            raise
        del self._flights[0]
        if self.host is not None and not copied:
            self.host(shard, bucket)

    def make_room(self) -> None:
        """Close the oldest flights until fewer than `depth` are open (room for one more)."""
        while self._flights and len(self._flights) >= self.depth:
            self._close()

    def add(self, flight: Any, bucket: int | None = None) -> torch.Tensor:
        """Keep `flight` (bucket `bucket`'s reduction) open; its result, for autograd, unread."""
        done = self.host is not None and _complete(flight)  # N = 1: the shard exists
        if done:
            self.host(flight.pending.result, bucket)
        self._flights.append((self._seen(flight), bucket, done))
        while len(self._flights) > self.depth:
            self._close()
        return flight.pending.result

    def wait(self) -> None:
        """Close every open flight, oldest first. Each stays in `_flights` until its turn: where
        closing one raises (a failed wait, an interrupt, the `host` copy), that one is done and
        the rest are still open here, for `settle` (before, the list was taken away first, and a
        failure dropped the rest -- unwaited, in neither `_flights` nor anywhere else: gloo
        cancelled those exchanges, and a peer waiting for one waited out the timeout; found in
        review). Each is taken out only once its wait returns (`_close`): an interrupted one is
        still here too (before, it was taken out first, and an interrupt before `Pending.wait`
        held it lost it; found in review)."""
        while self._flights:
            self._close()

    def settle(self, mesh: Mesh, error: BaseException) -> None:
        """The step's backward raised `error`: the reductions started and not waited for (the open
        flights, and `early`'s started ones) are waited for where the mesh `waits_after` it (every
        rank started them, and `error` is neither `MeshError` nor an interrupt; a wait that fails
        passes silently, and the rest are not waited for), else handed to the mesh
        (`Mesh.abandon`): over `DistMesh(verify=False)` the peers may have raised before starting
        them, and a peer that did start one and waits for it gets its data. Before, they were
        dropped: gloo cancels a point-to-point exchange whose handle is freed, and a peer that
        waited for that reduction before raising an error of its own waited out the timeout
        instead (found in review). Only each flight's current collective: nothing starts here
        (`settle_flights`). This object lets them go only once they are handed on: before, it
        cleared its lists first, and an interrupt before the waits' `try` -- in
        `mesh.waits_after`, a function's entry -- lost them all (found in review)."""
        settle_flights(mesh, [f for f, _, _ in self._flights] + list(self.started.values()), error)
        self._flights, self.started, self._ready = [], {}, {}


def settle_flights(mesh: Mesh, held: Sequence[Any], error: BaseException) -> None:
    """The step raised `error` while `held` (the flights or pendings it started, in start order;
    the list stays the caller's) may still be in flight: each one's current collective (a
    flight's `pending`: nothing starts here) that is not done is waited for where the mesh
    `waits_after(error)` (every rank started them, and `error` is neither `MeshError` nor an
    interrupt; a wait that fails passes silently, and the rest are not waited for); what is left
    -- all of it after an interrupt or a `MeshError`, or over a mesh whose starts are not agreed
    -- is handed to the mesh (`Mesh.abandon`, one entry however many there are): gloo cancels a
    point-to-point exchange whose handle is freed, and a peer waiting for it would wait out the
    timeout. An interrupt anywhere here hands on what is left too (`held` itself, where it comes
    before they are listed). `Inflight.settle`, and `reduce.reduce` / `update.update` for the
    flights they start and wait for."""
    pendings = None
    try:
        pendings = list({id(p): p for p in (getattr(h, "pending", h) for h in held)
                         if not getattr(p, "done", False)}.values())
        wait = mesh.waits_after(error)
        while wait and pendings:
            try:
                wait_held(pendings)  # an interrupted one stays, for `abandon` (found in review)
            except RuntimeError:  # (MeshError is one): the rest are not waited for
                wait = False
    finally:  # an interrupt of these waits too (found in review: it dropped the rest)
        left = held if pendings is None else pendings
        if left:
            mesh.abandon(left)  # one entry of the mesh's last `_ABANDONED`, however many buckets


def wait_held(held: list | dict, key: Any = 0) -> Any:
    """`held[key].wait()` (a `stages.Flight`, a `Pending`, anything with `wait()`), then `held[key]`
    taken out of `held`, the step's bookkeeping of what it started (`Gathering._ahead`'s lists,
    `Inflight.settle`'s pendings, `HostUpdate.grads`). Where the wait is interrupted (anything but
    a `RuntimeError`: a `KeyboardInterrupt`, an exception a signal handler raises), it stays in
    `held`, for `Gathering.finish` / `Inflight.settle` to wait for or hand to `Mesh.abandon`;
    where it fails (a `RuntimeError`, `MeshError` among them) it is done (`Pending.wait`) and taken
    out. A flight of several phases moves through them in place (`stages.Flight`), so what is held
    is the collective in flight, and a later wait resumes at its phase, starting none again.
    Before, callers took it out first (`flights.pop(0).wait()`): an interrupt before
    `Pending.wait` held it -- in `Flight.wait`, between its phases, in the `eager` wrapper -- lost
    it, and gloo cancelled the exchange under a peer that then waited to the timeout (found in
    review)."""
    try:
        out = held[key].wait()
    except RuntimeError:
        del held[key]
        raise
    del held[key]
    return out


def _complete(flight: Any) -> bool:
    """Whether a flight's result exists already: one phase, completed when started (N = 1)."""
    return not flight.then and flight.pending.done


@dataclasses.dataclass(frozen=True)
class UnitProgram:
    """The static description of one unit under one stage (not a pytree node): made once per
    state's `StateInfo` (`plan.step_plan`); what is a step's own (its `Inflight`) is passed to
    `run_unit` at each call. `casts`: per leaf (`leaves` order), the dtype its forward hands
    it in, or None as it is (`casting.casting`: the leaves an autocast region would cast);
    `watch`: the forward hands the leaves whose reads the step watches as `Watched` (the cast
    ones, or, with no casts, every fp32 one)."""

    name: str
    mesh: Mesh
    stage: Stage
    buckets: tuple[Bucket, ...]
    casts: tuple[torch.dtype | None, ...] | None = None
    watch: bool = False

    @functools.cached_property
    def leaves(self) -> tuple[int, ...]:
        """The unit's leaf indices, in bucket order (the order of its outputs and of `used`)."""
        return tuple(i for b in self.buckets for i in b.leaves)

    @functools.cached_property
    def gathered_bytes(self) -> int:
        """Bytes of the unit's entered buffers: `Σ_b N * S_b * itemsize(compute_b)` (padding
        included) -- what a stage-3 gather of the unit allocates."""
        return sum(b.size * b.wire.compute.itemsize for b in self.buckets)


def unit_programs(layout: Layout, mesh: Mesh, stage: Stage, precision: Precision = FULL) -> list[UnitProgram]:
    buckets = _unit_buckets(layout, precision)
    return [UnitProgram(unit, mesh, stage, buckets[unit]) for unit in layout.units]


def remembered(cache: dict, owner: Any, extra: Any, build: Callable[[], Any]) -> Any:
    """`build()`, once per `(owner, extra)` while `owner` lives: kept in `cache` under the owner's
    identity and dropped with it (weakly), for owners whose hash would cost a pass over them
    (a layout reads every leaf). Every step reads what is built from its state's static parts."""
    key = (id(owner), extra)
    hit = cache.get(key)
    if hit is not None and hit[0]() is owner:
        return hit[1]
    value = build()
    cache[key] = (weakref.ref(owner, lambda _: cache.pop(key, None)), value)
    return value


_BUCKETS: dict = {}


def _unit_buckets(layout: Layout, precision: Precision) -> dict[str, tuple[Bucket, ...]]:
    """`{unit: its Buckets}`, built once per (layout, precision)."""
    return remembered(_BUCKETS, layout, precision, lambda: {
        unit: tuple(Bucket.of(layout, b, precision) for b in layout.unit_buckets(unit)) for unit in layout.units})


class Probe(NamedTuple):
    """Zero inputs whose gradients carry what a unit's backward saw: `used[L_u]` (1 where the
    leaf got a gradient; CPU) and `bad[B_u]` (1 where the bucket's local gradient is non-finite;
    empty, and its gradient None, where the step does not locate non-finite gradients: the unit
    then reads no local gradient for it)."""

    used: torch.Tensor
    bad: torch.Tensor

    @staticmethod
    def of(program: UnitProgram, device: torch.device, locate: bool = False) -> "Probe":
        """Fresh tensors over zeros made once per shape and device (`detach()`: a new tensor, and
        so a new autograd leaf, on the same storage; no allocation and no fill kernel per step).
        Sharing the storage is safe: nothing writes a probe, and its "gradient" is returned by
        `torch.autograd.grad` / `torch.func.grad` as a new tensor, never accumulated into it;
        each call's tensors are their own autograd leaves (two units never share one; the step keeps
        one `Probe` per unit for all of a state's steps, `plan._probes`)."""
        with torch._C._DisableFuncTorch():  # plain tensors also where a transform runs (`shared_zeros`)
            return Probe(shared_zeros((len(program.leaves),), _CPU).detach(),
                         shared_zeros((len(program.buckets) if locate else 0,), device).detach())


_SHARED_ZEROS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
_CPU = torch.device("cpu")


def shared_zeros(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float32 zeros of `shape` on `device`, made once (read only: callers take views or detached
    aliases, and nothing writes them)."""
    z = _SHARED_ZEROS.get((shape, device))
    if z is None:
        # a tensor autograd may use later, also if made under inference_mode; and a plain one where a
        # torch.func transform runs (under jvp torch.zeros makes a tensor wrapped at that level, which,
        # kept here, escaped it: the next transform through a step hit torch's internal assert)
        with torch.inference_mode(False), torch._C._DisableFuncTorch():
            z = torch.zeros(shape, device=device)
        if type(z) is not torch.Tensor:  # made under a mode that returns subclasses (fake tensors): not kept
            return z
        z = _SHARED_ZEROS.setdefault((shape, device), z)
    return z


def gather_leaves(program: UnitProgram, xs: Sequence[torch.Tensor], cast: bool = True,
                  alone: Sequence[bool] = ()) -> list[torch.Tensor]:
    """The unit's leaves from the full buffer (or the held tensor) of each bucket, cast to the
    compute dtype first (once per unit, before any gather), and those of `program.casts` then
    cast on (`Bucket.cast_views`): the Function's forward, and `fzero.gather` outside autograd
    (`cast=False`: the master dtype, no casts).

    `alone` (the Function's forward): per bucket, whether its differentiated tensor requires grad
    (not where frozen, nor under torch.func, whose wrappers track grad); in such a bucket a leaf
    that is not a view of an `xs` that requires grad (a view of a buffer gathered or cast here,
    or of stage 2's full buffer beside its shard) is handed as the same view of an alias of its
    buffer that requires grad (`_of_grad_bases`), as the leaves that are views of a
    differentiated `xs` are. Their views then behave as a param's
    do: under `torch.no_grad()` a view of a tensor that requires grad still reports
    `requires_grad`, which `torch.matmul` reads to choose between one product and a batched one
    (a `linear` on a transposed 3-d input, as `nn.MultiheadAttention` with `batch_first` makes);
    as views of a buffer that requires no grad, stage 2's and 3's leaves took the other product in
    a no-grad forward (remat's), and their bits differed from stage 0's (found in review). And an
    in-place write to one in grad mode is refused by torch at every stage, as a view a Function
    returned (a first fix handed them detached, which torch let stage 2 write into its state)."""
    mesh, enter, casts, at = program.mesh, program.stage.enter.run, program.casts if cast else None, 0
    leaves: list[torch.Tensor] = []
    for k, (bucket, x) in enumerate(zip(program.buckets, xs)):
        flat = enter(mesh, bucket.wire, x.to(bucket.wire.compute) if cast else x)
        views = bucket.views(flat)
        views = views if casts is None else bucket.cast_views(flat, views, casts[at : at + len(views)])
        at += len(views)
        leaves += _of_grad_bases(views, x) if alone and alone[k] else views
    if cast and program.watch:
        leaves = [t.as_subclass(Watched) if (t.dtype == torch.float32 if casts is None else casts[k] is not None)
                  else t for k, t in enumerate(leaves)]
    return leaves


def _frozen_leaves(program: UnitProgram, output: tuple[torch.Tensor, ...], ctx: Any) -> list[torch.Tensor]:
    """The leaves of the unit's frozen buckets among the Function's `output` (leaves in bucket
    order, then the anchor), but for those of a bucket this level differentiates (`_derived`):
    they get no gradient, and are handed not requiring grad, as torch's frozen params are (found
    in review: a frozen weight that required grad made `torch.matmul` fold a `linear` on a
    transposed 3-d input where torch's does not, other bits than DDP's)."""
    out, at = [], 0
    for k, bucket in enumerate(program.buckets):
        n = len(bucket.leaves)
        if bucket.frozen and not _derived(ctx, k):
            out.extend(output[at : at + n])
        at += n
    return out


def _derived(ctx: Any, k: int) -> bool:
    """Whether this level of differentiation may carry a derivative to bucket k's held tensor: it
    requires grad here (`needs_input_grad`: a reverse-mode level -- `torch.func.grad`, `vjp`,
    `jacrev`, or plain autograd -- that differentiates with respect to it), or a forward-AD level
    is open (`jvp`, `jacfwd`, `forward_ad.dual_level`: torch.func hands every input a tangent,
    zeros where none was given, so which ones carry one is not known here). Where a frozen
    bucket's params are differentiated through a step (a hyperparameter kept frozen, and its
    hypergradient), its leaves stay differentiable at that level and the loss's use of them
    reaches the other leaves' gradients, as in torch; in a plain step, outside every transform,
    it is false (found in review: frozen leaves were marked non-differentiable at every level,
    so that derivative silently lacked `-lr H c` of the other leaves, and a `jvp` of a step of
    a state with a frozen group raised torch's "not a differentiable Tensor")."""
    return bool(ctx.needs_input_grad[4 + k]) or torch.autograd.forward_ad._current_level >= 0


def _of_grad_bases(leaves: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    """`leaves` (one bucket's) with each view of a buffer other than `x` where `x` requires grad
    (a gathered or cast buffer, stage 2's full one) re-made as the same view of one alias of
    that buffer (`detach`: the same storage and version counter) that requires grad
    (`gather_leaves`, `alone`)."""
    aliases: dict[int, torch.Tensor] = {}
    out = []
    for t in leaves:
        base = t._base
        if base is None or (x.requires_grad and t.untyped_storage()._cdata == x.untyped_storage()._cdata):
            out.append(t)
            continue
        alias = aliases.get(id(base))
        if alias is None:
            alias = aliases[id(base)] = base.detach().requires_grad_()
        out.append(alias.as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


def run_unit(program: UnitProgram, xs: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor | None],
             probe: Probe, after_backward: Callable[[str], None] | None = None, inflight: Inflight | None = None
             ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`([leaf tensors] in bucket order, anchor)` for one unit.

    `xs[k]` is bucket k's differentiated input (`Stage.differentiated`); `fulls[k]` the full
    buffer the unit reads beside it, or None. `after_backward(unit)` runs when the backward of
    every use of the unit's leaves is done, at the start of the Function's own backward, before
    its gradients are assembled and reduced: nothing reads the unit's params after that point
    (held weakly: the step's gathering object must not live in the graph; the step holds it
    until its backward is over, `step._finished`). `inflight`: the step's
    reductions in flight, where the unit's backward starts its own (None: it waits for each).
    The anchor is a 0-d zero the step adds to the loss times 0: it makes the unit's backward run
    on every rank, also where no leaf of the unit reached this rank's loss, so every rank calls
    the unit's reduce-scatter in the same order (the engine runs the unit nodes, all made in the
    same order on every rank, after every node made later).
    """
    after = weakref.WeakMethod(after_backward) if after_backward is not None else None
    *leaves, anchor = _apply(program, after, inflight, len(xs), *xs, *fulls, *probe)
    return leaves, anchor


class _Unit(torch.autograd.Function):
    @staticmethod
    def forward(*inputs: Any) -> tuple[torch.Tensor, ...]:
        """`inputs = (program, after, inflight, k, *xs[k], *fulls[k], *probe)` (one variadic
        parameter: `Function.apply` binds its arguments to this signature on every call, and
        binding one parameter costs about half of binding five)."""
        program, k, tensors = inputs[0], inputs[3], inputs[4:]
        xs, fulls = tensors[:k], tensors[k : 2 * k]
        if program.stage.enter.moves:
            check_forward_mode(program.mesh)
        held = [x if full is None else full for x, full in zip(xs, fulls)]
        anchor = shared_zeros((), xs[0].device).view(())  # a view: no kernel
        return (*gather_leaves(program, held, alone=[x.requires_grad for x in xs]), anchor)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.program, ctx.after, ctx.inflight, ctx.k = inputs[0], inputs[1], inputs[2], inputs[3]
        level, step = func_level(), _STEP.get()
        ctx.outer = step is None or level != step.level  # this ctx's backward: the step's own, or outside it
        frozen = _frozen_leaves(inputs[0], output, ctx)
        if frozen:  # as a torch param with requires_grad=False: torch.matmul reads that to choose its product
            ctx.mark_non_differentiable(*frozen)
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs[4 : 4 + ctx.k]]
        ctx.beside = [full is not None for full in inputs[4 + ctx.k : 4 + 2 * ctx.k]]
        ctx.set_materialize_grads(False)
        ctx.locate = inputs[-1].numel() > 0  # the probe's `bad`: check each local gradient (`Probe`)
        releases = inputs[1] is not None and level is None  # the step frees the unit's params
        ctx.entered = _entered(inputs[0], output) if releases else frozenset()

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Tangents of the leaves: the forward on the tangents of what it read (the full buffer's
        where one is read beside x; else x's, entered as x is), and a zero anchor."""
        program, k = ctx.program, ctx.k
        xs_t, fulls_t = tangents[4 : 4 + k], tangents[4 + k : 4 + 2 * k]
        leaves: list[torch.Tensor] = []
        for bucket, x_t, full_t, beside, (shape, dtype, device) in zip(program.buckets, xs_t, fulls_t, ctx.beside,
                                                                      ctx.like):
            if beside:  # stage 2: the unit reads the full buffer; x is its shard (or the master's)
                t = full_t if full_t is not None else _gather_tangent(program, bucket, x_t, shape, dtype, device)
                flat = t.to(bucket.wire.compute)
            else:
                t = x_t if x_t is not None else torch.zeros(shape, dtype=dtype, device=device)
                flat = _enter_tangent(program, bucket, t.to(bucket.wire.compute))
            leaves.extend(v.clone() for v in bucket.split_views(flat))
        return (*leaves, torch.zeros((), dtype=torch.float32, device=ctx.like[0][2]))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, program: UnitProgram, after: Any, inflight: Any, k: int,
             *tensors: torch.Tensor | None) -> tuple:
        if any(d is not None for d in in_dims[4:]):
            raise ConfigError(
                f"vmap over a step: unit {program.name!r}'s params are batched (a vmap over states). A step "
                f"decides on Python numbers every rank agrees on (the loss, the gradient norm, whether to skip), "
                f"which vmap cannot batch; vmap inside the loss instead, or loop over states (docs/func.md)")
        outs = _Unit.apply(program, after, inflight, k, *tensors)  # a unit first read inside a vmapped loss
        return outs, (None,) * len(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        program = ctx.program
        grads = grads[:-1]  # the anchor's gradient (a zero) only made this backward run
        after = ctx.after() if ctx.after is not None else None
        released = after is not None and not _reads_entered(ctx, grads)
        if released:  # every use of the unit's leaves is differentiated: its params go before its gradient is built
            after(program.name)
        leave, inflight = program.stage.leave, ctx.inflight
        run = leave.outer() if ctx.outer else leave.run  # (`differentiating`)
        started = inflight is not None and leave.start is not None and not torch.is_grad_enabled()  # no graph
        early = inflight is not None and bool(inflight.early) and leave.start is None and not torch.is_grad_enabled()
        result: list[torch.Tensor | None] = []
        bad: list[torch.Tensor] = []
        at = 0
        for k, (bucket, (shape, dtype, device)) in enumerate(zip(program.buckets, ctx.like)):
            gs = grads[at : at + len(bucket.leaves)]
            at += len(bucket.leaves)
            if bucket.frozen:  # no gradient, but where this level differentiates w.r.t. it (`_derived`)
                result.append(_frozen_gradient(run, program, bucket, gs, dtype, device)
                              if ctx.needs_input_grad[4 + k] else None)
                if ctx.locate:
                    bad.append(shared_zeros((), device))  # no fill kernel per step (stack copies it)
                continue
            if started:
                inflight.make_room()  # the previous reduction's buffers go before this one exists
            into = _assembled_dtype(bucket.wire, leave)
            # beside the backward where nothing here reads `flat` (an identity, no cast) and no
            # gradient shares storage the release below frees (`_reads_entered`)
            beside = (inflight.side if inflight is not None and into == bucket.wire.reduce == dtype
                      and (after is None or released) else None)
            flat = _assemble(bucket, gs, into, device, beside, inflight.buffers if inflight is not None else None)
            if ctx.locate:
                bad.append(nonfinite(flat).float())
            if started and bucket.wire.reduce == dtype:  # in flight; the step waits before reading it
                result.append(inflight.add(leave.start(program.mesh, bucket.wire, flat), bucket.index))
            elif early:  # the step's own reduction of what it would get (`flat.to(dtype)`), started in turn
                inflight.begin(bucket.index, functools.partial(program.stage.after_backward.start, program.mesh,
                                                               bucket.wire, flat.to(dtype)))
                result.append(None)
            else:
                g = run(program.mesh, bucket.wire, flat).to(dtype)  # x's dtype
                if started and inflight.host is not None:  # offload, reduced in another dtype: the cast
                    inflight.host(g, bucket.index)  # shard is the tensor the update reads
                result.append(g)
        if after is not None and not released:
            after(program.name)
        used = torch.tensor([g is not None for g in grads], dtype=torch.float32)
        return (None, None, None, None, *result, *([None] * ctx.k), used, torch.stack(bad) if ctx.locate else None)


def _frozen_gradient(run: Callable[..., torch.Tensor], program: UnitProgram, bucket: Bucket,
                     grads: Sequence[torch.Tensor | None], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A frozen bucket's gradient where a derivative through the step is taken with respect to its
    held tensor (`_derived`): a trainable bucket's, built the same way (assembled, then `run`,
    the stage's `leave` at this level: outside the step's own, in stages 2-3, the gather's plain
    adjoint, `stages._sum_in_unit`), waited in place -- never in the step's own reduction or
    update, which take no frozen bucket."""
    leave = program.stage.leave
    return run(program.mesh, bucket.wire, _assemble(bucket, grads, _assembled_dtype(bucket.wire, leave), device)
               ).to(dtype)


class _Differentiating:
    """The level of torch.func transforms at which a step differentiates its loss (None: plain
    autograd), set by the loss when it runs (`at_the_steps_level`)."""

    __slots__ = ("level",)

    def __init__(self) -> None:
        self.level: int | None | str = "unset"


_STEP: contextvars.ContextVar[_Differentiating | None] = contextvars.ContextVar("fzero_step", default=None)


@contextlib.contextmanager
def differentiating() -> Iterator[None]:
    """Around a step's own differentiation of its loss (forward, backward and any recompute): the
    loss records its level (`at_the_steps_level`). A unit applied at that level is the
    step's own: its backward builds the step's gradient, the mean over ranks (`Stage.leave`'s
    `run`). A unit's context at any other level -- an outer transform differentiating through the
    step, plain autograd over `engine="func"`, an outer step whose loss runs this one -- or made
    outside every step's differentiation is an outer derivative's: its backward is the unit
    forward's plain adjoint (`Piece.outer`), the mean's fl(1/N) left to `mean_of_ranks` on the
    path from the gradient (found in review: before, every level applied it, and derivatives
    with respect to the batch or a tensor the loss closes over came out N times too large)."""
    token = _STEP.set(_Differentiating())
    try:
        yield
    finally:
        _STEP.reset(token)


def at_the_steps_level() -> None:
    """Called by the step's loss, inside `differentiating`: the level it runs at now is the step's
    own (the units' backward builds the step's gradient there)."""
    _STEP.get().level = func_level()  # type: ignore[union-attr]  # (set by `differentiating`)


# torch's `Function.apply` derives `forward`'s signature on every call (`inspect.signature`, tens
# of microseconds of host time per unit per step); inspect reads a cached `__signature__` instead.
_Unit.forward.__signature__ = inspect.signature(_Unit.forward)


def _direct_apply() -> Callable[..., Any] | None:
    """`_Unit`'s C-level apply (`torch._C._FunctionBase.apply` bound to `_Unit`: what
    `Function.apply` ends in where no torch.func transform is active), or None where this torch
    lacks the pieces (`_FunctionBase`, `_are_functorch_transforms_active`; both in torch since 2.0
    and unchanged through 2.13)."""
    base = getattr(torch._C, "_FunctionBase", None)
    if base is None or not hasattr(torch._C, "_are_functorch_transforms_active") or not issubclass(_Unit, base):
        return None
    return super(torch.autograd.Function, _Unit).apply


_DIRECT = _direct_apply()
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def _apply(*args: Any) -> tuple[torch.Tensor, ...]:
    """`_Unit.apply(*args)`. Where no torch.func transform is active, `Function.apply` binds the
    arguments to `forward`'s signature (the identity for its one variadic parameter: no
    defaults to fill), unwraps dead functorch wrappers among them (none can be here: the inputs
    are the step's own tensors, made outside any transform, and a transform alive now takes the
    other path), then calls the C-level apply: this calls that apply directly, a third of a
    unit's host calls in the forward. Under a transform (or without `_DIRECT`) `_Unit.apply`."""
    if _DIRECT is not None and not _transforms_active():
        return _DIRECT(*args)
    return _Unit.apply(*args)


def _entered(program: UnitProgram, output: Sequence[torch.Tensor]) -> frozenset[int]:
    """The storages of the unit's entered buffers: a bucket's leaves are views of one buffer, so
    its first leaf's storage is every one's."""
    firsts, at = [], 0
    for bucket in program.buckets:
        if bucket.leaves:
            firsts.append(output[at].untyped_storage()._cdata)
        at += len(bucket.leaves)
    return frozenset(firsts)


def _reads_entered(ctx: Any, grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether an incoming gradient shares storage with the unit's entered buffers (a backward that
    returns a saved param as a gradient, e.g. a custom Function's): then the params are released
    only after the gradients are assembled."""
    if func_level() is not None:
        return True  # a transform's wrapped tensors have no storage to compare: release after
    return any(g is not None and (g.layout != torch.strided or g.untyped_storage()._cdata in ctx.entered)
               for g in grads)  # a sparse gradient: not compared, released after


def _gather_tangent(program: UnitProgram, bucket: Bucket, x_t: torch.Tensor | None, shape: torch.Size,
                    dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Stage 2's tangent of the full buffer from its shard's: `AG(x_t)` (zeros without one)."""
    t = x_t if x_t is not None else torch.zeros(shape, dtype=dtype, device=device)
    return all_gather(t, program.mesh, tag=bucket.tag)


def _enter_tangent(program: UnitProgram, bucket: Bucket, t: torch.Tensor) -> torch.Tensor:
    """The stage's enter on a tangent: the same all-gather (the same bits) through the collective
    Function where the stage gathers, since `jacfwd` batches tangents and only the Function has a
    batching rule; otherwise the enter itself (the identity)."""
    if program.stage.enter is ENTER_GATHER:
        return all_gather(t, program.mesh, tag=bucket.tag)
    return program.stage.enter.run(program.mesh, bucket.wire, t)


_WIDER = {torch.float32: (torch.bfloat16, torch.float16), torch.float64: (torch.bfloat16, torch.float16, torch.float32)}


def _assembled_dtype(wire: Wire, leave: Any) -> torch.dtype:
    """The dtype a unit's local gradient is assembled in: the compute dtype, or -- where the stage
    reduces it in the unit (`LEAVE_REDUCED`, whose first act is the cast to the reduce dtype) and
    that cast only widens (bf16 / fp16 -> fp32, anything -> fp64: exact) -- the reduce dtype
    itself, so the per-leaf copies widen on the way in and no separate cast pass runs (the same
    values: each element is the same number either way)."""
    if leave.start is not None and wire.compute in _WIDER.get(wire.reduce, ()):
        return wire.reduce
    return wire.compute


def _assemble(bucket: Bucket, grads: Sequence[torch.Tensor | None], dtype: torch.dtype,
              device: torch.device, side: Assembly | None = None, buffers: HostBuffers | None = None
              ) -> torch.Tensor:
    """Per-leaf gradients (None: unused) -> this rank's full local gradient `flat[N * S]`.

    One write per element: each gradient is copied into its slice `[o, o + n)` of an empty
    buffer (cast to `dtype` on the way), and only what no gradient covers -- unused leaves and
    the padding -- is zero-filled, in one fill per gap. Under a torch.func transform the buffer
    is concatenated out of place instead (the same values): a vmapped gradient cannot be written
    into an unbatched buffer, and a transform must see every op on its tensors.

    `side` (`Inflight.side`, an `Assembly`; nothing records a graph): the writes are queued on
    its CUDA side stream, and the caller joins it before reading `flat` (`Assembly.join`). The
    same kernels on the same tensors: the same bits.

    `buffers` (`HostBuffers`; a CPU buffer, no graph recorded): `flat` is one the step function's
    previous step assembled into, not new memory -- every element is written either way.

    A gradient that is not dense (a sparse one: `F.embedding(..., sparse=True)`) raises
    `LayoutError` naming its leaf, before anything is written (one attribute read per gradient)."""
    for g in grads:
        if g is not None and g.layout is not _STRIDED:
            raise _not_dense(bucket, grads)
    if func_level() is not None:
        return _concatenated(bucket, grads, dtype, device)
    if buffers is not None and device.type == "cpu" and not torch.is_grad_enabled():
        flat = buffers.take(bucket.size, dtype)
    else:
        flat = torch.empty(bucket.size, dtype=dtype, device=device)
    if side is not None and not torch.is_grad_enabled():
        side.write(bucket, grads, flat)
    else:
        _write(bucket, grads, flat)
    return flat


_STRIDED = torch.strided


def _not_dense(bucket: Bucket, grads: Sequence[torch.Tensor | None]) -> LayoutError:
    """The error for a bucket's gradients of which some are not dense (`_assemble`): each such
    leaf's path and shape, the gradients' layouts, and the way out."""
    found = [k for k, g in enumerate(grads) if g is not None and g.layout is not _STRIDED]
    named = ", ".join(f"{bucket.paths[k]!r} {list(bucket.shapes[k])}" for k in found)
    layouts = " / ".join(dict.fromkeys(str(grads[k].layout) for k in found))  # type: ignore[union-attr]
    one = len(found) == 1
    return LayoutError(
        f"params leaf{'' if one else 's'} {named} got {'a ' if one else ''}{layouts} gradient{'' if one else 's'}, "
        f"which fzero's flat gradient buckets cannot hold (dense, torch.strided gradients only). "
        f"F.embedding / F.embedding_bag called with sparse=True make one (nn.Embedding / nn.EmbeddingBag built "
        f"with sparse=True too): pass sparse=False (the same values, a dense gradient), or freeze the leaf")


class HostBuffers:
    """The CPU buffers a donating stage-0 step function assembles its units' local gradients into
    (`step._lends`), kept from one step to the next (as DDP keeps its buckets): stage 0 holds them
    all until its update anyway, and glibc hands freed memory this large back
    to the kernel, and a step that asks for it again faults in every page afresh, which on a small
    machine costs a few percent of the step (BENCHMARKS.md, the fifteenth session).

    `take(numel, dtype)` lends a buffer the previous step lent and gave back, or a new one; `open()`
    starts a step and `close(kept, holding)` ends it: with `kept` (the step returned) every buffer
    it lent is given back but one whose storage a tensor of `holding` (the leaves of the state it
    returned) shares
    -- an optimizer that kept the gradient it was handed (fzero's copy what they keep; as with
    torch's `.grad`, which the next backward writes in place, an optimizer must not keep a
    reference to the gradient past its update); else (it raised) they are let go. Stage 0's
    gradient is reduced in place and read by the update; the other stages reduce into new
    tensors: when a step returns, nothing else reads what it lent. Per thread (SimMesh's ranks are
    threads); a step that runs inside another's on the same thread takes new buffers."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _mine(self) -> Any:
        mine = self._local
        if not hasattr(mine, "free"):
            mine.free, mine.lent, mine.open = collections.defaultdict(list), [], False
        return mine

    def open(self) -> bool:
        """Start a step: True where this one lends (none is open on this thread)."""
        mine = self._mine()
        if mine.open:
            return False
        mine.open = True
        return True

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        mine = self._mine()
        free = mine.free[(numel, dtype)]
        flat = free.pop() if free else torch.empty(numel, dtype=dtype)
        mine.lent.append(flat)
        return flat

    def close(self, kept: bool, holding: Sequence[Any] = ()) -> None:
        mine = self._mine()
        if kept:
            held = {t.untyped_storage().data_ptr() for t in holding if isinstance(t, torch.Tensor)}
            for flat in mine.lent:
                if flat.untyped_storage().data_ptr() not in held:
                    mine.free[(flat.numel(), flat.dtype)].append(flat)
        mine.lent, mine.open = [], False


class Assembly:
    """The units' gradient assembly on a CUDA side stream (`norms.Side`), beside the backward of
    the units below (`Inflight.side`, N = 1).

    `write(bucket, grads, flat)` queues `_write` on the side stream after what the step's stream
    has queued (which made the gradients). `flat` is allocated on the step's stream and marked
    used by the side stream (`record_stream`): freed early -- a step that raises before its join
    -- its memory goes to no other tensor before the side stream's writes are done. Each
    gradient is kept referenced until the side stream has read it (an
    event after its copies, polled at the next `write`; all at `join`): so the caching allocator
    does not give its memory to a later tensor, and the autograd engine, which accumulates a
    gradient into the tensor it holds only where it holds the last reference (its input
    buffers' `add_`, AccumulateGrad's steal), writes no tensor the side stream has yet to read --
    the same tensor reaches two units' backward where a sum of their leaves is differentiated.
    Such a gradient is summed out of place instead: the same values. `join()` makes the step's
    stream wait for every write."""

    def __init__(self, side: Any) -> None:
        self.side = side
        self.held: collections.deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = collections.deque()

    def write(self, bucket: Bucket, grads: Sequence[torch.Tensor | None], flat: torch.Tensor) -> None:
        while self.held and self.held[0][0].query():  # read already: let them go
            self.held.popleft()
        flat.record_stream(self.side.stream)
        self.side.run(functools.partial(_write, bucket, grads), flat)
        read = torch.cuda.Event()
        read.record(self.side.stream)
        self.held.append((read, [g for g in grads if g is not None]))

    def join(self) -> None:
        self.side.join()  # later work on the step's stream, a reuse of these tensors' memory too, comes after
        self.held.clear()


def _write(bucket: Bucket, grads: Sequence[torch.Tensor | None], flat: torch.Tensor) -> None:
    """`_assemble`'s writes into `flat`: each gradient into its slice, zeros in the gaps."""
    end, slices, given = 0, [], []  # end: the end of the last slice written
    for o, s, st, n, g in zip(bucket.offsets, bucket.shapes, bucket._strides, bucket.numels, grads):
        if g is None:
            continue
        if o > end:
            flat[end:o].zero_()
        slices.append(flat.as_strided(s, st, o))  # the leaf's slice in its shape: one view op, as `Bucket.views`
        given.append(g)
        end = o + n
    if bucket.size > end:
        flat[end:].zero_()
    copy_all(slices, given)


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """`dst[i].copy_(src[i])` for every i (casting to dst's dtype; exact where it widens): one
    multi-tensor kernel (`torch._foreach_copy_`) where autograd records nothing, per-tensor copies
    where it does (a backward with `create_graph`). The same values either way, but on CUDA a
    per-tensor copy that casts (bf16 -> fp32) runs torch's dynamic-cast loop, at about a third of
    the memory bandwidth, one launch per leaf; the multi-tensor copy is vectorised, one launch
    per bucket (BENCHMARKS.md, the seventh session's kernel probe)."""
    if torch.is_grad_enabled():
        for d, s in zip(dst, src):
            d.copy_(s)
        return
    dtypes = dict.fromkeys(s.dtype for s in src)
    if len(dtypes) == 1:
        torch._foreach_copy_(dst, src)
    else:  # cast-ahead leaves' gradients beside full-width ones: one multi-tensor copy per source dtype
        for dtype in dtypes:
            ks = [k for k, s in enumerate(src) if s.dtype == dtype]
            torch._foreach_copy_([dst[k] for k in ks], [src[k] for k in ks])


def _concatenated(bucket: Bucket, grads: Sequence[torch.Tensor | None], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """`_assemble` out of place: the per-leaf gradients (zeros where None) and the padding, joined."""
    parts, end = [], 0
    for o, n, g in zip(bucket.offsets, bucket.numels, grads):
        parts.append(g.reshape(-1).to(dtype) if g is not None else torch.zeros(n, dtype=dtype, device=device))
        end = o + n
    parts.append(torch.zeros(bucket.size - end, dtype=dtype, device=device))
    return torch.cat(parts)


def nonfinite(x: torch.Tensor) -> torch.Tensor:
    """0-d bool: does `x` hold a NaN or inf? Decided by `finite_witness` (one read of `x` where it
    is finite, no transient, no rounding that could hide one). The units take it of each local
    gradient only where the step locates non-finite gradients (`Probe`): elsewhere the step's
    `‖g‖²` of the *reduced* gradient finds a NaN or inf of any rank's local one (a sum with a NaN
    or inf term is not finite), and `agreement.agree` names the leaves on that rare path."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=x.device)
    return ~torch.isfinite(torch.stack(finite_witness(x))).all()


def finite_witness(x: torch.Tensor, extremes: bool = False) -> tuple[torch.Tensor, ...]:
    """0-d tensors, all finite if and only if every element of `x` (not empty) is; a flag, not
    differentiated.

    With `extremes`, always `x`'s minimum and maximum: cast to a narrower dtype they are finite
    exactly where every element's cast is, the cast being monotone (`precision.narrower_range`:
    fp16 units over an fp32 master), which a finite sum cannot say (7e4 - 7e4).

    Anywhere: `x`'s minimum and maximum (`torch.aminmax`, one read), which are NaN if any
    element is and ±inf if one is, and cannot overflow. On the CPU, for float32 / float64 and
    outside torch.func transforms, first `x`'s sum, a faster read (`benchmarks/bench_checks.py`):
    a sum is NaN or ±inf where some element is (NaN and ±inf absorb finite terms; inf - inf is
    NaN), so a finite sum says that every element is finite. A sum of finite elements can
    overflow too, so where it is not finite the minimum and maximum decide (a second read on that
    path only); reading a CPU sum on the host waits for nothing."""
    flat = x.detach().reshape(-1)
    if extremes:
        return torch.aminmax(flat)
    if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64) and func_level() is None:
        total = flat.sum()
        if bool(torch.isfinite(total)):
            return (total,)
    return torch.aminmax(flat)  # aminmax has no forward AD: detached
