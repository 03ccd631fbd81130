"""The step's bookkeeping keeps a collective it started until that collective's wait returns
(`unit.wait_held`): `Inflight.wait` / `add` / `make_room` (`Inflight._close`), `Inflight.settle`,
`Gathering._drop` / `refill` / `_entering` (a unit's read), and `HostUpdate.inputs` (offload).
Where the wait is interrupted (`KeyboardInterrupt`, an exception a signal handler raises), the
item is still there, so `Inflight.settle` / `Gathering.finish` hand it to `Mesh.abandon` (gloo
cancels a point-to-point exchange whose handle is freed, and a peer waiting for it waits out the
group's timeout). Before, each caller took the item out first (`flights.pop(0).wait()`): an
interrupt before `Pending.wait` held it -- in a wrapper, in `Flight.wait` between its phases --
lost it (found in review). A wait that fails (`RuntimeError`) leaves the item done, and it is
taken out, as before.

Unit level, with fake collectives whose `wait()` raises `KeyboardInterrupt` (or a `MeshError`)
once; one step on SimMesh for a unit's read.
"""

from __future__ import annotations

import types

import pytest
import torch

import fzero
from fzero import optim
from fzero._src.gathering import Gathering, _entering
from fzero._src.mesh import MeshError, Pending
from fzero._src.offload import HostUpdate
from fzero._src.stages import Flight, get_stage
from fzero._src.unit import Inflight, UnitProgram
from tests.fake_collectives import FakeFlight, FakeMesh, FakePending
from tests.fake_collectives import flights as _flights


def _names(flights) -> list[str]:
    return [f.pending.name for f in flights]


# -- Inflight: `_close` (wait, add past depth, make_room) and settle ------------------------------


def _wait(inflight: Inflight, flights: list[FakeFlight]) -> None:
    for f in flights:
        inflight.add(f)
    inflight.wait()


def _add(inflight: Inflight, flights: list[FakeFlight]) -> None:
    for f in flights:
        inflight.add(f)  # depth 1: adding the second closes the first


def _make_room(inflight: Inflight, flights: list[FakeFlight]) -> None:
    inflight.add(flights[0])
    inflight.make_room()


@pytest.mark.parametrize("close", [_wait, _add, _make_room], ids=["wait", "add", "make_room"])
def test_an_interrupted_close_leaves_the_flight_in_inflight_for_settle(close):
    """The oldest reduction's wait is interrupted while `Inflight` closes it: it is still among
    the open flights, so `settle` hands it (and the rest) to the mesh. Before, `_close` was given
    the flight already taken out of `_flights`, and `settle` never saw it."""
    log: list[str] = []
    flights = _flights("ab", log, failing="a", raises=KeyboardInterrupt())
    inflight = Inflight(depth=1 if close is not _wait else 3)
    with pytest.raises(KeyboardInterrupt):
        close(inflight, flights)
    assert log == ["a"], log
    assert _names(f for f, _, _ in inflight._flights) == (["a"] if close is _make_room else ["a", "b"])
    mesh = FakeMesh(waits=False)
    inflight.settle(mesh, KeyboardInterrupt())
    assert mesh.abandoned == (["a"] if close is _make_room else ["a", "b"]), mesh.abandoned


def test_a_failed_close_still_takes_the_done_flight_out():
    """A wait that fails (`MeshError`) leaves its collective done: it is taken out, and `settle`
    sees only the rest (unchanged)."""
    log: list[str] = []
    inflight = Inflight(depth=3)
    with pytest.raises(MeshError):
        _wait(inflight, _flights("abc", log, failing="a", raises=MeshError("timed out")))
    assert _names(f for f, _, _ in inflight._flights) == ["b", "c"]


def _gathering(mesh: FakeMesh, ahead: dict[str, list]) -> Gathering:
    """A `Gathering` over units named by `ahead`'s keys, on `mesh`, with `ahead` in flight.
    `_drop`, `refill` and `finish` read only each program's name and mesh."""
    programs = [types.SimpleNamespace(name=u, mesh=mesh) for u in ahead]
    gathering = Gathering(None, programs, [], [], {}, "on_use", releasable=False, prefetch=0)
    gathering._ahead.update(ahead)
    return gathering


def test_an_interrupted_drop_leaves_the_gather_for_finish():
    """`_drop` (a prefetch nobody reads, or a refill left at the unit's `after_backward`): the
    first gather's wait is interrupted. It is still in `_ahead` with the second, and `finish`
    hands both to the mesh. Before, `_drop` popped it first: only the second was handed on."""
    log: list[str] = []
    mesh = FakeMesh(waits=False)
    gathering = _gathering(mesh, {"u1": _flights("ab", log, failing="a", raises=KeyboardInterrupt())})
    with pytest.raises(KeyboardInterrupt):
        gathering._drop("u1")
    assert _names(gathering._ahead["u1"]) == ["a", "b"]
    gathering.finish(KeyboardInterrupt())
    assert (log, mesh.abandoned, gathering._ahead) == (["a"], ["a", "b"], {})


def test_an_interrupted_refill_leaves_the_gather_for_finish_and_a_second_refill_fills_the_unit():
    """A released unit's refill (three gathers into its three storages): the second's wait is
    interrupted. The second and third are still in `_ahead` (finish would hand them on); a
    refill called again waits for the second (not gathered again) and the third, and fills
    every storage. Before, the second was popped first: lost, and a second refill filled the
    second storage with the third's gather."""
    log: list[str] = []
    gathering = _gathering(FakeMesh(), {"u1": _flights("abc", log, failing="b", raises=KeyboardInterrupt())})
    storages = [torch.zeros(1).untyped_storage() for _ in "abc"]
    for s in storages:
        s.resize_(0)
    gathering._leaves["u1"] = {}
    gathering._storages["u1"] = [(None, s, 4) for s in storages]
    gathering._released.add("u1")
    with pytest.raises(KeyboardInterrupt):
        gathering.refill("u1")
    assert _names(gathering._ahead["u1"]) == ["b", "c"]
    gathering.refill("u1")
    assert log == ["a", "b", "b", "c"], log
    got = [torch.empty(0).set_(s, 0, (1,)).item() for s in storages]
    assert got == [float(ord(c)) for c in "abc"], got
    assert "u1" not in gathering._released and gathering._ahead == {}


def test_an_interrupted_enter_leaves_the_gather_in_the_units_list():
    """A unit's read over its prefetched gathers (`_entering`): the first bucket's wait is
    interrupted. Its gather is still in the list the `Gathering` keeps (`_ahead[unit]`), for
    `finish`. Before, `enter` popped it first."""
    log: list[str] = []
    gathered = _flights("ab", log, failing="a", raises=KeyboardInterrupt())
    program = _entering(UnitProgram("u1", None, get_stage(3), ()), gathered)
    with pytest.raises(KeyboardInterrupt):
        program.stage.enter.run(None, None, None)
    assert _names(gathered) == ["a", "b"]
    assert program.stage.enter.run(None, None, None).item() == float(ord("a"))  # waited again, then taken out
    assert _names(gathered) == ["b"]


class Work:
    """A backend work handle whose `wait()` raises `raises` once, if given (then returns)."""

    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises, self.waits = raises, 0

    def wait(self) -> None:
        self.waits += 1
        raises, self.raises = self.raises, None
        if raises is not None:
            raise raises


def test_a_two_phase_flight_interrupted_in_its_second_phase_stays_at_that_phase():
    """A flight of two phases (`stages.Flight`: e.g. an NVMe read, then the all-gather) whose
    second collective's wait is interrupted while `_drop` waits for it: `_ahead` holds the flight
    at its second phase (its pending is the collective in flight, for `Mesh.abandon`), and a wait
    after the error (`finish`, over a mesh that waits) waits for that collective, without
    starting the second phase again. Before, the flight was popped first (nothing held); a fix
    that only reordered `Flight.wait` and the pop would restart the second phase on a second
    wait -- a collective only this rank starts."""
    second = Pending(torch.ones(2), Work(KeyboardInterrupt()))
    starts: list[torch.Tensor] = []

    def start_second(x: torch.Tensor) -> Pending:
        starts.append(x)
        return second

    flight = Flight(Pending(torch.zeros(2)), (start_second,))
    mesh = FakeMesh(waits=True)
    gathering = _gathering(mesh, {"u1": [flight]})
    with pytest.raises(KeyboardInterrupt):
        gathering._drop("u1")
    assert [f.pending for f in gathering._ahead["u1"]] == [second] and not second.done
    gathering.finish(ValueError("the loss raised"))
    assert len(starts) == 1 and second.done and second._work is None, starts
    assert (gathering._ahead, mesh.abandoned) == ({}, [])


# -- a unit's read, through a step on SimMesh ---------------------------------------------------

PARAMS = {"a": torch.linspace(-1.0, 1.0, 6), "b": torch.linspace(0.5, 1.5, 6, dtype=torch.float64),
          "c": torch.linspace(1.0, 2.0, 6)}


def test_an_interrupted_read_leaves_its_gather_for_finish(monkeypatch):
    """Stage 3, prefetch 1, SimMesh(2): on rank 0, the first wait of unit u1's gathers (in the
    loss's read) is interrupted. The step raises it, and `finish` hands that gather to the mesh
    with every other one rank 0 started and did not wait for. Before, `_entering` popped it
    first, and it was neither waited for again nor handed on."""
    mesh = fzero.SimMesh(2)
    started, abandoned = [], []
    start = Gathering._start

    def interrupting_start(self, unit):
        flights = start(self, unit)
        if mesh.rank == 0:
            if not started:
                flight = flights[0]

                def interrupted():
                    del flight.wait  # once
                    raise KeyboardInterrupt

                flight.wait = interrupted
            started.extend(flights)
        return flights

    def abandon(held):
        if isinstance(held, (list, tuple)):
            for h in held:
                abandon(h)
        elif mesh.rank == 0:
            abandoned.append(held)

    monkeypatch.setattr(Gathering, "_start", interrupting_start)
    monkeypatch.setattr(mesh, "abandon", abandon)

    def rank_fn():
        state = fzero.init(PARAMS, optim.sgd(0.25), stage=3, mesh=mesh,
                           units=lambda path: "u1" if path in ("a", "b") else "u2")
        loss = lambda p, x: (p["a"] * x * p["b"].float()).sum() + (p["c"] * x).sum()  # noqa: E731
        fzero.train_step(loss, prefetch=1)(state, torch.linspace(0.0, 1.0, 6))

    with pytest.raises(KeyboardInterrupt):
        mesh.run(rank_fn)
    assert len(started) == 3, started  # u1's two buckets, u2's one (prefetched)
    assert [id(f) for f in abandoned] == [id(f) for f in started], (abandoned, started)


# -- offload: HostUpdate.inputs ------------------------------------------------------------------


def test_an_interrupted_host_copy_wait_stays_in_host_update():
    """`HostUpdate.inputs` waits for bucket 0's gradient copy to the host; the wait is
    interrupted: the copy is still in `grads` (and a retry takes it). Before, it was popped first."""
    log: list[str] = []
    copy = FakePending("g", log, KeyboardInterrupt())
    host = object.__new__(HostUpdate)
    tier = types.SimpleNamespace(fetch=lambda b, s: s, fetch_master=lambda b, m: m)
    host.device, host.factor, host.following = torch.device("cpu"), 1.0, {}
    host.tiers, host.grads = {0: tier}, {0: copy}
    with pytest.raises(KeyboardInterrupt):
        host.inputs(0, torch.zeros(1), None, None, lambda x: x)
    assert host.grads == {0: copy}
    g, *_ = host.inputs(0, torch.zeros(1), None, None, lambda x: x)
    assert g is copy.result and host.grads == {} and log == ["g", "g"]
