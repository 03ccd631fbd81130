"""ZeRO stages 0-3: the one place that says what a stage means.

A stage is the set of model-state categories it shards, and each category that is sharded
swaps one piece of the step for another. Every stage is the composition of four pieces:

| piece          | replicated (not in `shards`)         | sharded (in `shards`)                        |
|----------------|--------------------------------------|----------------------------------------------|
| params         | hold `flat[N * S]`; enter as is      | hold `shard[S]`; enter by all-gather         |
| grads          | leave the unit whole; reduce after   | reduce-scatter as each unit's backward ends  |
|                | backward (started in the unit's      |                                              |
|                | backward where the step overlaps)    |                                              |
| optimizer      | update `flat[N * S]` (grad gathered  | update this rank's `shard[S]`                |
| state + master | back: RS then AG of the gradient, or | (then all-gather params unless sharded)      |
|                | the one all-reduce with their bits)  |                                              |

    stage 0  shards {}                                   (DDP)
    stage 1  shards {optimizer_state, master}
    stage 2  shards {optimizer_state, master, grads}
    stage 3  shards {optimizer_state, master, grads, params}

Every stage reduces with the same primitive (reduce-scatter of fl(1/N) * g, summed in the
mesh's rank order) over the same buffers, so the reduced gradient has the same bits in every
stage; stage 0 all-gathers it back, which copies bits -- or, on a mesh whose all-reduce has
exactly the bits of that reduce-scatter and all-gather (`Mesh.all_reduce_is_reduce_scatter_gather`:
SimMesh, gloo, any backend at N <= 2), issues the one all-reduce instead, as DDP does. The
optimizer is element-wise or uses exact per-leaf sums, so updating a shard equals updating the
full buffer. Hence stages 1-3 equal stage 0 bit for bit (proofs/stages.md).

Nothing outside this module compares a stage's level: the state, the step, the memory
estimate and the communication formulas ask the `Stage`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .collectives import all_gather, all_reduce, mean_of_ranks, reduce_scatter
from .errors import ConfigError
from .layout import Layout
from .mesh import Mesh, Pending

CATEGORIES = ("params", "grads", "optimizer_state", "master")


class Move(NamedTuple):
    """One collective a bucket sees per step: `op` over the bucket's `flat[N * S]` of params or
    grads (`what`), in forward (`when="forward"`), backward or after it (`"backward"`), after the
    update (`"update"`), or again in backward where the stage re-gathers (`"regather"`)."""

    op: str
    what: str
    when: str


class Wire(NamedTuple):
    """How one bucket travels: its tag, the dtype the loss computes in (`compute`: params are
    cast to it once per unit and step, before any gather) and the dtype gradients are reduced in
    (`reduce`). Without a precision policy both are the bucket's own dtype."""

    tag: str
    compute: torch.dtype
    reduce: torch.dtype


BucketFn = Callable[[Mesh, Wire, torch.Tensor], torch.Tensor]  # (mesh, how the bucket travels, tensor) -> tensor


class Flight:
    """One bucket's collectives in flight: `pending`, and the collectives still to start on its
    result (`then`: result -> Pending), in order. `advance()` waits for `pending` and starts the
    next; on the last phase it only waits, and only where the collective holds more than its
    result (`Pending.holds_more`: a reduce-scatter's input, released then, not at
    `wait()`); `wait()` runs every phase and returns the last result. A step starts every bucket's
    first collective, then advances each (stage 0: each reduce-scatter's all-gather), then waits:
    the same calls, the same bits, as the blocking pieces, with many in flight at once.

    A flight moves through its phases in place: `pending` is always the collective in flight, and
    whoever holds the flight (the step's bookkeeping: `Inflight`, `Gathering._ahead`, `reduce`'s and
    `update`'s flights) holds it. So a wait that something interrupts (a `KeyboardInterrupt`, an
    exception a signal handler raises) leaves the flight at its phase, for `Mesh.abandon`, and a
    later `wait()` resumes there, starting no phase twice. The next phase's collective is stored in
    `pending` as its start returns, with no call in between (CPython runs a signal's handler at a
    function's entry, a loop's backward jump or after a call into C, not where a Python function
    returns). Before, `advance` returned a new flight, whose construction (`Flight.__init__`, a
    function's entry) came after the start, and `wait` advanced a local copy: an interrupt there
    lost the collective just started, and gloo cancelled it under a peer that then waited out the
    timeout (found in review)."""

    def __init__(self, pending: Pending, then: tuple[Callable[[torch.Tensor], Pending], ...] = ()) -> None:
        self.pending, self.then = pending, then

    def advance(self) -> "Flight":
        """Wait for `pending` and start the next phase, in place (the last phase: wait where it
        holds more than its result, and let that go now); returns this flight."""
        if self.then:
            self.pending, self.then = self.then[0](self.pending.wait()), self.then[1:]
        elif self.pending.holds_more:
            self.pending.wait()
        return self

    def wait(self) -> torch.Tensor:
        while self.then:
            self.advance()
        return self.pending.wait()


StartFn = Callable[[Mesh, Wire, torch.Tensor], Flight]


@dataclasses.dataclass(frozen=True)
class Piece:
    """A step function of one category and the collectives it issues (per trainable bucket, and
    `frozen_moves` per frozen bucket). `run` is differentiable (a step may be differentiated
    through: meta-gradients, forward mode). Pieces that run after backward or after the update,
    and the reduction inside a unit's backward, also have `start`: the same collectives and the
    same bits without waiting, on detached data, which the step uses only where nothing
    differentiates through it (`reduce.overlaps`)."""

    run: BucketFn
    moves: tuple[Move, ...] = ()
    frozen_moves: tuple[Move, ...] = ()
    start: StartFn | None = None
    # what `run` and `start` issue instead of `moves` on a mesh whose all-reduce has the bits of its
    # reduce-scatter + all-gather (`Mesh.all_reduce_is_reduce_scatter_gather`); None: `moves` everywhere
    moves_by_all_reduce: tuple[Move, ...] | None = None
    # `start` with the result written into a buffer the caller hands over (a donating step's own
    # params: `Piece.begin`); None: `start` makes its result
    start_into: Callable[[Mesh, Wire, torch.Tensor, torch.Tensor], Flight] | None = None
    # a unit backward's piece at a level of differentiation outside the step's own (a derivative
    # through the step): the adjoint of the unit's forward alone, without the mean's fl(1/N);
    # None: `run`
    adjoint: BucketFn | None = None

    def outer(self) -> BucketFn:
        """What this piece runs in a unit's backward at a level outside the step's own."""
        return self.adjoint if self.adjoint is not None else self.run

    def begin(self, mesh: Mesh, wire: Wire, x: torch.Tensor, into: torch.Tensor | None = None) -> Flight:
        """`start(mesh, wire, x)`, or, where `into` is given and this piece writes a result of its
        shape (`start_into`: stages 1-2's parameter all-gather), that result written into `into`,
        which the caller hands over: the same collectives, the same bits, no new buffer."""
        if into is not None and self.start_into is not None:
            return self.start_into(mesh, wire, x, into)
        return self.start(mesh, wire, x)

    def issued(self, trainable: bool, mesh: Mesh | None = None) -> tuple[Move, ...]:
        """The collectives this piece issues per bucket on `mesh` (None: a mesh that does not
        claim `all_reduce_is_reduce_scatter_gather`)."""
        if not trainable:
            return self.frozen_moves
        if self.moves_by_all_reduce is not None and mesh is not None and mesh.all_reduce_is_reduce_scatter_gather:
            return self.moves_by_all_reduce
        return self.moves


def _identity(mesh: Mesh, wire: Wire, x: torch.Tensor) -> torch.Tensor:
    return x


def _no_sum(x: torch.Tensor) -> torch.Tensor:
    return x


def _gather(mesh: Mesh, wire: Wire, shard: torch.Tensor) -> torch.Tensor:
    """`shard[S] -> flat[N * S]` (not differentiable: used on detached data and inside the unit).
    At N = 1 the shard is the whole buffer: `shard` itself (`Mesh.solo`), no copy."""
    if mesh.world_size == 1:
        return mesh.solo("all_gather", shard, tag=wire.tag)
    return mesh.collective("all_gather", shard, tag=wire.tag)


def reduce_grad(mesh: Mesh, wire: Wire, grad: torch.Tensor) -> torch.Tensor:
    """`flat[N * S] -> shard[S]` of `Σ_r fl(1/N) * g_r` in the reduce dtype (DDP multiplies by
    fl(1/N), then sums).

    At N = 1 this is `g.to(reduce)` with no collective and no multiply: fl(1/1) = 1 and
    `x * 1.0 == x` for every float x (signed zeros included), and a sum over one rank is its one
    term (`Mesh.solo`: recorded, not moved). The result may then be `grad` itself: every caller
    passes a fresh gradient buffer that nothing else holds (the unit's assembled `flat[N * S]`, or
    the step's sum of micro-batches).
    """
    if mesh.world_size == 1:
        return mesh.solo("reduce_scatter", grad.to(wire.reduce), tag=wire.tag)
    return reduce_scatter(grad.to(wire.reduce) * (1.0 / mesh.world_size), mesh, tag=wire.tag)


def _start_reduce(mesh: Mesh, wire: Wire, grad: torch.Tensor) -> Flight:
    """`reduce_grad` without waiting (outside autograd, on a detached gradient): `flat[N * S] ->`
    (in flight) `shard[S]` of `Σ_r fl(1/N) * g_r`. The multiply is in place (the same bits as
    `x * c`; one gradient-sized buffer fewer at peak): every caller hands over a fresh gradient
    buffer it does not read again (the unit's assembled `flat[N * S]`, the step's gradient or
    micro-batch sum), which the Pending keeps until waited."""
    x = grad.detach().to(wire.reduce)
    if mesh.world_size == 1:
        return Flight(Pending(mesh.solo("reduce_scatter", x, tag=wire.tag)))
    return Flight(mesh.start("reduce_scatter", x.mul_(1.0 / mesh.world_size), tag=wire.tag))


def _reduce_in_unit(mesh: Mesh, wire: Wire, grad: torch.Tensor) -> torch.Tensor:
    """`reduce_grad` inside the unit's backward at the step's own level (the same bits): the
    mean's fl(1/N) by `collectives.mean_of_ranks`, whose backward scales cotangents as its
    forward does. At N = 1 it is `reduce_grad`'s solo path: the identity, in every derivative
    order too."""
    if mesh.world_size == 1:
        return reduce_grad(mesh, wire, grad)
    return _sum_in_unit(mesh, wire, mean_of_ranks(grad.to(wire.reduce), mesh))


def _sum_in_unit(mesh: Mesh, wire: Wire, grad: torch.Tensor) -> torch.Tensor:
    """The unit's backward at a level outside the step's own (a derivative through the step): the
    adjoint of the forward's gather, a plain reduce-scatter. The mean's fl(1/N) is not the
    gather's: a cotangent from the step's gradient meets it once in `mean_of_ranks`' backward,
    on its way to whatever the loss read (the params through this unit, the batch, a tensor the
    loss closes over); applying it here too divided the params' derivative by N (and leaving it
    out of `mean_of_ranks`' backward, as before, made every other input's N times too large;
    found in review). At N = 1 the identity."""
    if mesh.world_size == 1:
        return reduce_grad(mesh, wire, grad)
    return reduce_scatter(grad.to(wire.reduce), mesh, tag=wire.tag)


def _reduce_and_gather(mesh: Mesh, wire: Wire, grad: torch.Tensor) -> torch.Tensor:
    """`flat[N * S] -> flat[N * S]` of `Σ_r fl(1/N) * g_r` (stage 0): reduce-scatter, then all-gather;
    or one all-reduce where the mesh's has exactly their bits (`_all_reduce_grad`). At N = 1
    nothing moves."""
    if mesh.all_reduce_is_reduce_scatter_gather:
        return _all_reduce_grad(mesh, wire, grad)
    reduced = reduce_grad(mesh, wire, grad)
    if mesh.world_size == 1:
        return mesh.solo("all_gather", reduced, tag=wire.tag)
    return all_gather(reduced, mesh, tag=wire.tag)


def _all_reduce_grad(mesh: Mesh, wire: Wire, grad: torch.Tensor) -> torch.Tensor:
    """`flat[N * S] -> flat[N * S]` of `Σ_r fl(1/N) * g_r` by one sum all-reduce (differentiable: its
    adjoint is an all-reduce, with the bits of the reduce-scatter + all-gather adjoint on such a
    mesh). fl(1/N) multiplies before the sum, as in `reduce_grad`. At N = 1 `g.to(reduce)` itself
    (`Mesh.solo`, as `reduce_grad`)."""
    if mesh.world_size == 1:
        return mesh.solo("all_reduce", grad.to(wire.reduce), arg="sum", tag=wire.tag)
    return all_reduce(grad.to(wire.reduce) * (1.0 / mesh.world_size), mesh, "sum", tag=wire.tag)


def _gather_params(mesh: Mesh, wire: Wire, shard: torch.Tensor) -> torch.Tensor:
    """The updated (master) shard, cast to the compute dtype, on every rank: `flat[N * S]` (at N = 1
    the cast shard itself: see `_start_gather_params`)."""
    x = shard.to(wire.compute)
    if mesh.world_size == 1:
        return mesh.solo("all_gather", x, tag=wire.tag)
    return all_gather(x, mesh, tag=wire.tag)


def _start_enter(mesh: Mesh, wire: Wire, shard: torch.Tensor) -> Flight:
    """`_gather` without waiting (stage 3's prefetch): `shard[S] ->` (in flight) `flat[N * S]`; at
    N = 1 `shard` itself, as `_gather`."""
    return Flight(_start_gather(mesh, wire, shard))


def _start_gather(mesh: Mesh, wire: Wire, shard: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
    """`shard[S] -> flat[N * S]` in flight, written into `out` where given (`Mesh.start`'s `out`);
    at N = 1 the shard itself (`Mesh.solo`)."""
    if mesh.world_size == 1:
        return Pending(mesh.solo("all_gather", shard, tag=wire.tag))
    return mesh.start("all_gather", shard, tag=wire.tag, out=out)


def start_enter_into(mesh: Mesh, wire: Wire, shard: torch.Tensor, out: torch.Tensor) -> Flight:
    """`ENTER_GATHER`'s start with its result written into `out` (`[N * S]`, N > 1): the same
    all-gather, recorded alike (`Mesh.start`'s `out`), for a stage-3 refill into the storage
    its unit's saved tensors read."""
    return Flight(_start_gather(mesh, wire, shard, out))


def _start_reduce_and_gather(mesh: Mesh, wire: Wire, grad: torch.Tensor) -> Flight:
    """`flat[N * S] -> flat[N * S]` of `Σ_r fl(1/N) * g_r` (stage 0), in flight: reduce-scatter,
    then all-gather (a Flight of two phases); or the one all-reduce (one phase, so `advance` is a
    no-op) where the mesh's has exactly their bits. At N = 1 nothing moves."""
    if mesh.all_reduce_is_reduce_scatter_gather:
        return _start_all_reduce(mesh, wire, grad)
    reduced = _start_reduce(mesh, wire, grad)
    return Flight(reduced.pending, (lambda x: _start_gather(mesh, wire, x),))


def _start_all_reduce(mesh: Mesh, wire: Wire, grad: torch.Tensor) -> Flight:
    """`_all_reduce_grad` without waiting (on a detached gradient). The multiply is in place and
    the buffer is donated to the all-reduce (summed in its own storage, no copy), as `_start_reduce`
    multiplies in place: the caller hands over a fresh buffer it does not read again."""
    x = grad.detach().to(wire.reduce)
    if mesh.world_size == 1:
        return Flight(Pending(mesh.solo("all_reduce", x, arg="sum", tag=wire.tag)))
    return Flight(mesh.start("all_reduce", x.mul_(1.0 / mesh.world_size), arg="sum", tag=wire.tag, donate=True))


def _start_gather_params(mesh: Mesh, wire: Wire, shard: torch.Tensor, out: torch.Tensor | None = None) -> Flight:
    """The updated (master) shard, cast to the compute dtype, on every rank: `flat[N * S]`, written
    into `out` where given (`Piece.begin`: a donating step's params, whose own chunk the update
    has just written where `shard` is a view of it, so only the other ranks' chunks move in).

    At N = 1 the shard is the whole buffer and nothing is moved (`Mesh.solo`): the result is
    `shard` itself where no cast is needed. That aliasing is safe: stages 1-2 hold that buffer as
    their params, and where they keep a separate master the cast makes a fresh tensor (compute !=
    master dtype). `shard` must not be written until the flight is waited (the next step's update)."""
    return Flight(_start_gather(mesh, wire, shard.to(wire.compute), out))


def _start_identity(mesh: Mesh, wire: Wire, x: torch.Tensor) -> Flight:
    return Flight(Pending(x))


_AG_PARAM_FWD = Move("all_gather", "params", "forward")
_AG_PARAM_AGAIN = Move("all_gather", "params", "regather")
_RS_GRAD = Move("reduce_scatter", "grads", "backward")

ENTER_FULL = Piece(_identity)
# at N = 1 stage 3's gather is the held shard itself (`Mesh.solo`): `Gathering` frees only gathered
# storage that is not the held tensor's, so such a unit stays whole (there is nothing to shard).
ENTER_GATHER = Piece(_gather, (_AG_PARAM_FWD, _AG_PARAM_AGAIN), (_AG_PARAM_FWD, _AG_PARAM_AGAIN), start=_start_enter)
LEAVE_LOCAL = Piece(_identity)
LEAVE_REDUCED = Piece(_reduce_in_unit, (_RS_GRAD,), start=_start_reduce, adjoint=_sum_in_unit)
AFTER_NONE = Piece(_identity, start=_start_identity)
AFTER_REDUCE = Piece(reduce_grad, (_RS_GRAD,), start=_start_reduce)
AFTER_REDUCE_GATHER = Piece(_reduce_and_gather, (_RS_GRAD, Move("all_gather", "grads", "backward")),
                            start=_start_reduce_and_gather,
                            moves_by_all_reduce=(Move("all_reduce", "grads", "backward"),))
FINISH_KEEP = Piece(_identity, start=_start_identity)
FINISH_GATHER = Piece(_gather_params, (Move("all_gather", "params", "update"),), start=_start_gather_params,
                      start_into=_start_gather_params)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One ZeRO stage: what it shards, and the pieces of the step that follow from that.

    Attributes:
      level: 0-3 (the name; never branched on outside this module).
      shards: the model-state categories held as `shard[S]` (of `CATEGORIES`).
      enter: the unit Function's forward per bucket: held params -> `flat[N * S]` the loss reads.
      leave: the unit Function's backward per bucket: the unit's full local gradient
        `flat[N * S]` -> the gradient of what the step differentiates.
      after_backward: per bucket, after the whole backward: that gradient -> the reduced
        gradient the optimizer reads (`flat[N * S]` in stage 0, else `shard[S]`).
      finish: per bucket, after the update: the optimizer's new params -> what the state holds.
    """

    level: int
    shards: frozenset[str]
    enter: Piece
    leave: Piece
    after_backward: Piece
    finish: Piece

    # -- what the state holds --------------------------------------------------------------

    def sharded(self, category: str) -> bool:
        """Whether `category` (one of `CATEGORIES`) is held as `shard[S]` by each rank."""
        if category not in CATEGORIES:
            raise ConfigError(f"unknown model-state category {category!r}; one of {CATEGORIES}")
        return category in self.shards

    def hold(self, layout: Layout, b: int, flat: torch.Tensor, rank: int, compute: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(params, master)`: what a rank keeps of bucket `b`, from the full `flat[N * S]` (fresh
        tensors). `params` is what the unit enters from: this rank's `shard[S]` where the stage
        shards params, else the whole buffer -- in the compute dtype where the stage shards the
        master copy but not the params (stages 1-2 under a precision policy; trainable buckets),
        beside the fp32 `master` shard; `master` is None where `params` is the master copy itself
        (a frozen bucket keeps its own values and is cast when entered, as in stage 0)."""
        if self.sharded("params"):
            return layout.rank_shard(b, flat, rank).clone(), None
        if self.sharded("master") and compute != flat.dtype and not layout.buckets[b].group.frozen:
            return flat.to(compute), layout.rank_shard(b, flat, rank).clone()
        return flat, None

    def optimizer_params(self, layout: Layout, b: int, held: torch.Tensor, rank: int,
                         master: torch.Tensor | None = None) -> torch.Tensor:
        """The params the optimizer of this rank updates: the master shard where one is kept; else
        its `shard[S]` of what the state holds where the optimizer state is sharded (a view of
        `flat[N * S]`, or the held shard itself), else the whole `flat[N * S]`."""
        if master is not None:
            return master
        if self.sharded("optimizer_state") and not self.sharded("params"):
            return layout.rank_shard(b, held, rank)
        return held

    def segments(self, layout: Layout, b: int, rank: int):
        """The leaf pieces of the params `optimizer_params` returns, in its coordinates."""
        return layout.segments(b, rank) if self.sharded("optimizer_state") else layout.flat_segments(b)

    def grad_shard(self, layout: Layout, b: int, reduced: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's `shard[S]` of bucket `b`'s reduced gradient (`after_backward`'s output:
        the whole `flat[N * S]` where the optimizer state is replicated)."""
        return reduced if self.sharded("optimizer_state") else layout.rank_shard(b, reduced, rank)

    def reads_differ(self, layout: Layout, b: int, used: Sequence[bool] | None) -> bool:
        """Whether the ranks' updates differ in reading bucket `b`'s reduced gradient at all: where
        the optimizer state is sharded, a rank whose shard holds no element of a used leaf (`used`,
        over all leaves, agreed; None: every leaf) -- padding only, or leaves no rank used -- has
        nothing to update, while another rank updates its shard. The same answer on every rank; a
        step differentiated through then ties the gradient into the update (`update.tied`)."""
        reads = {any(used is None or used[s.leaf] for s in self.segments(layout, b, r))
                 for r in range(layout.world_size)}
        return len(reads) > 1

    def leaf_sum(self, mesh: Mesh, tag: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """How a layer-wise optimizer completes its per-leaf partial sums: over all ranks (in rank
        order) where each rank updates a shard, else nothing to add."""
        if not self.sharded("optimizer_state"):
            return _no_sum
        return lambda x: all_reduce(x, mesh, "sum", tag=tag + "/leaf_sum")

    def differentiated(self, layout: Layout, b: int, held: torch.Tensor, rank: int,
                       master: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(x, full)`: the tensor the step differentiates for bucket `b`, and the full buffer the
        unit reads beside it (or None: it reads `enter(x)`). Where gradients are sharded but params
        are not (stage 2), the gradient is taken with respect to this rank's shard -- the master
        shard where one is kept -- so that `leave` (a reduce-scatter) returns exactly its shape."""
        if self.sharded("grads") and not self.sharded("params"):
            return (master if master is not None else layout.rank_shard(b, held, rank)), held
        return held, None

    @property
    def reduces_after_leave(self) -> bool:
        """Whether the gradient leaves the unit local and all its reduction is `after_backward`'s
        (stages 0-1): the step may then start that reduction inside the unit's backward
        (`unit.Inflight`'s `early`), the same calls on the same tensor."""
        return self.leave.start is None and self.after_backward.start is not None

    # -- what the step communicates ---------------------------------------------------------

    def moves(self, trainable: bool, regather: bool, mesh: Mesh | None = None) -> tuple[Move, ...]:
        """The collectives one bucket sees in one step on `mesh`, in order (`regather`: whether a
        stage that gathers params in forward gathers them again in backward; `mesh` None: one
        that does not claim `all_reduce_is_reduce_scatter_gather`, where stage 0 reduces by
        reduce-scatter + all-gather)."""
        pieces = (self.enter, self.leave, self.after_backward, self.finish)
        out = [m for p in pieces for m in p.issued(trainable, mesh)]
        return tuple(m for m in out if regather or m.when != "regather")


def _compose(level: int, shards: frozenset[str]) -> Stage:
    """The stage that shards `shards`: each sharded category picks its piece."""
    params, grads, opt = (c in shards for c in ("params", "grads", "optimizer_state"))
    after = AFTER_NONE if grads else AFTER_REDUCE if opt else AFTER_REDUCE_GATHER
    finish = FINISH_GATHER if opt and not params else FINISH_KEEP
    return Stage(level, shards, ENTER_GATHER if params else ENTER_FULL,
                 LEAVE_REDUCED if grads else LEAVE_LOCAL, after, finish)


STAGES = tuple(
    _compose(level, frozenset(cats))
    for level, cats in enumerate([
        (),
        ("optimizer_state", "master"),
        ("optimizer_state", "master", "grads"),
        ("optimizer_state", "master", "grads", "params"),
    ])
)


def get_stage(stage: int | Stage) -> Stage:
    """`0 | 1 | 2 | 3 | Stage -> Stage`; anything else is an error naming the choices."""
    if isinstance(stage, Stage):
        return stage
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ConfigError(f"stage must be 0, 1, 2 or 3 (the ZeRO stage), got {stage!r}")
    return STAGES[stage]
