"""The reduction: each trainable bucket's gradient reduced over ranks (`Stage.after_backward`).

The step's second phase: `reduce` gives per trainable bucket the reduced gradient
`Σ_r fl(1/N) g_r` that the agreement and the update read, every bucket's collectives started
before the first is waited for. With the autograd engine the units' backward starts them
(`unit.Inflight`; `Chained` where a bucket's reduction is more than one collective, stage 0's
reduce-scatter + all-gather), and `reduce` finishes the flights; a bucket no gradient reached
on this rank reduces zeros (`_zero_grad`). `overlaps` says where collectives may run without
waiting (nothing differentiates through the step); elsewhere the blocking, differentiable form
runs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from .collectives import func_level
from .offload import differentiated
from .plan import plan_of
from .stages import Flight
from .state import ZeroState
from .unit import Assembly, HostBuffers, Inflight, settle_flights


class Chained(Inflight):
    """`unit.Inflight` where a bucket's reduction is more than one collective (stage 0: the
    reduce-scatter, then the all-gather of the reduced shard): each bucket's next collective
    starts as soon as the next bucket's reduction has started -- it waits for the bucket's own
    reduce-scatter (`Flight.advance`), which has had a unit's backward to run -- so the gradient
    all-gathers run during the rest of the backward, not after it; `reduce` advances the
    last one. Which flight is advanced depends only on the order the flights start in, which
    `Inflight` fixes (`early`, from the last bucket): every rank issues
    `RS(k_1), RS(k_2), AG(k_1), RS(k_3), AG(k_2), ...`, the same calls on the same tensors as
    `reduce`'s (the same bits). A one-collective reduction that holds its input (stage 1's
    reduce-scatter, not stage 0's all-reduce in place) is waited for there instead (`Flight.advance`
    of its last phase): stage 1's local gradient
    `flat[N * S]` is then released one bucket after its reduction
    starts, not all together after the backward -- a step that holds one or two of them at a
    time instead of every unit's reuses freed memory instead of asking the system for fresh pages.

    Each bucket's flight is in `started` as soon as its start returns, before the older one's wait
    (where an interrupt is most likely to land): before, it was held only by a local until that
    wait returned, and an interrupt of the wait lost it -- neither `Inflight.settle` nor the mesh
    saw it, and gloo cancelled it under a peer that then waited out the timeout (found in review)."""

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
            self.started[b] = flight = start()  # held before the wait below (`Inflight.begin` stores it again)
            self._order.append(b)
            if len(self._order) > self.LAG:
                self.started[self._order[-1 - self.LAG]].advance()  # in place (`Flight.advance`)
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
    one all-reduce.

    Where anything raises here -- an interrupt of a wait (a `KeyboardInterrupt`, an exception a
    signal handler raises), a failed wait, a start -- every flight not waited for (`started`'s and
    those started here, each at its phase) is waited for or handed to the mesh
    (`unit.settle_flights`, as `Inflight.settle` after a backward that raised). Before, they were
    held only by this function's locals, which nothing on the step's error path sees: they were
    dropped, and gloo cancelled those exchanges under peers that then waited out the timeout
    (found in review)."""
    flights: dict[int, Flight] = {}
    try:  # (a try costs nothing until it catches)
        stage, mesh = state.stage, state.mesh
        started = started or {}
        grads = {b: g if g is not None else _zero_grad(state, b) for b, g in grads.items() if b not in started}
        plan = plan_of(state.info)
        if not overlaps(grads.values()):  # differentiated through: the blocking, differentiable form
            return {b: stage.after_backward.run(mesh, plan[b].wire, g) for b, g in grads.items()}
        for b in plan:
            if b in started:
                flights[b] = started[b]
            elif b in grads:
                flights[b] = stage.after_backward.start(mesh, plan[b].wire, grads[b])
        for flight in flights.values():
            flight.advance()  # stage 0: each all-gather as its reduce-scatter ends (in place)
        return {b: flight.wait() for b, flight in flights.items()}
    except BaseException as e:
        settle_flights(state.mesh, [*(started or {}).values(), *flights.values()], e)
        raise


def overlaps(tensors: Any) -> bool:
    """Whether the step may issue collectives without waiting (`Piece.start`: detached, outside
    autograd): only where nothing differentiates through the step -- no torch.func transform is
    active and no tensor requires grad. Otherwise the blocking, differentiable `Piece.run`."""
    return func_level() is None and not any(map(_REQUIRES_GRAD, tensors))


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
