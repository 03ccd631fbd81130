"""`Gathering.read` and `Gathering.refill` keep a unit's gathers in the step's bookkeeping
(`Gathering._ahead`) until each is waited for: where a wait raises (a lost peer, a timeout, an
interrupt), the gathers not waited for yet are still there for `Gathering.finish`, which waits
for them or hands them to the mesh (`Mesh.abandon`), as `Inflight.wait` / `settle` and
`Gathering._drop` / `finish` do. Before, both took the unit's list out first: a failed wait lost
the rest, neither waited for nor abandoned (gloo cancels such an exchange when its handle is
freed, and a peer waiting for it waits out the group's timeout; found in review).

`read` is checked through a step on SimMesh (its gathers wrapped to log their waits, one made to
raise), `refill` at unit level with fake gathers, as tests/test_error_path_waits.py checks
`finish`.
"""

from __future__ import annotations

import types

import pytest
import torch

import fzero
from fzero import optim
from fzero._src.gathering import Gathering
from fzero._src.mesh import MeshError
from tests.fake_collectives import FakeFlight, FakeMesh, FakePending, Stop

# two units of two buckets each (a float32 and a float64 bucket), so a unit has a gather after the
# one whose wait raises
PARAMS = {"a": torch.linspace(-1.0, 1.0, 6), "b": torch.linspace(0.5, 1.5, 6, dtype=torch.float64),
          "c": torch.linspace(1.0, 2.0, 6), "d": torch.linspace(0.0, 2.0, 6, dtype=torch.float64)}


def _unit(path: str) -> str:
    return "u1" if path in ("a", "b") else "u2"


def _loss(p, x):
    return (p["a"] * x * p["b"].float()).sum() + (p["c"] * p["d"].float()).sum()


class Logged:
    """A `stages.Flight` whose `wait()` is logged by `name` and raises once where `name` is in
    `failing` (taken out of it then); `pending` is the flight's, as `Mesh.abandon` reads it."""

    def __init__(self, flight, name: str, log: list[str], failing: dict[str, BaseException]) -> None:
        self.flight, self.name, self.log, self.failing = flight, name, log, failing

    @property
    def pending(self):
        return self.flight.pending

    def wait(self) -> torch.Tensor:
        self.log.append(self.name)
        if self.name in self.failing:
            raise self.failing.pop(self.name)
        return self.flight.wait()


def _logging(monkeypatch, mesh, failing: dict[int, dict[str, BaseException]]
             ) -> tuple[list[str], list[str], list[str]]:
    """Wrap every gather a `Gathering` starts on `mesh` (`Gathering._start`) as `Logged`, named
    `unit#k` (k: the bucket's place in the unit), raising on rank r as `failing[r]` says; log
    rank 0's gathers and what rank 0 hands to `mesh.abandon`: `(started, waited, abandoned)`."""
    started: list[str] = []
    waited: list[str] = []
    abandoned: list[str] = []
    start = Gathering._start

    def logged_start(self, unit):
        flights, rank = start(self, unit), mesh.rank
        names = [f"{unit}#{k}" for k in range(len(flights))]
        if rank == 0:
            started.extend(names)
        return [Logged(f, n, waited if rank == 0 else [], failing.setdefault(rank, {})) for f, n in zip(flights, names)]

    def abandon(held):
        if isinstance(held, (list, tuple)):
            for h in held:
                abandon(h)
        elif mesh.rank == 0:
            abandoned.append(held.name)

    monkeypatch.setattr(Gathering, "_start", logged_start)
    monkeypatch.setattr(mesh, "abandon", abandon)
    return started, waited, abandoned


@pytest.mark.parametrize("raises", [MeshError("lost a peer"), Stop()], ids=["failed-wait", "interrupt"])
def test_a_wait_that_raises_in_a_units_read_leaves_its_other_gathers_to_finish(monkeypatch, raises):
    """Stage 3, prefetch 1, SimMesh(2): the loss reads u1, whose gathers (and u2's, prefetched)
    are in flight; u1's first bucket's wait raises on rank 0 (a `MeshError`, or an interrupt:
    the mesh does not wait after either, `Mesh.waits_after`). Every gather rank 0 started is then
    waited for or handed to the mesh: u1's second bucket's too. Before, `read` took u1's list
    out of `_ahead` before the unit's forward waited for it, and that gather was lost."""
    mesh = fzero.SimMesh(2)
    started, waited, abandoned = _logging(monkeypatch, mesh, {0: {"u1#0": raises}})

    def rank_fn():
        state = fzero.init(PARAMS, optim.sgd(0.25), stage=3, mesh=mesh, units=_unit)
        fzero.train_step(_loss, prefetch=1)(state, torch.linspace(0.0, 1.0, 6))

    with pytest.raises(type(raises)):
        mesh.run(rank_fn)
    assert started == ["u1#0", "u1#1", "u2#0", "u2#1"], started  # non-vacuous: u1 has a gather after the failed one
    assert waited == ["u1#0"], waited
    # a failed wait leaves its gather done; an interrupted one stays in `_ahead` (`unit.wait_held`), handed on too
    kept = [] if isinstance(raises, RuntimeError) else ["u1#0"]
    assert sorted(abandoned) == [*kept, "u1#1", "u2#0", "u2#1"], abandoned


def test_a_read_that_raised_midway_and_is_read_again_gathers_the_unit_anew(monkeypatch):
    """The loss catches the error of u1's first read (its first bucket's wait raised, on rank 0
    and rank 1 alike) and reads u1 again: the read drops what the failed one left (u1's second
    gather, still in `_ahead`, waited for) and gathers the unit anew, so the step's params are
    those of a step that never failed, bit for bit (a read that took the partial list would have
    handed u1's first bucket the second's gather)."""

    def step_params(fail: bool):
        mesh = fzero.SimMesh(2)
        failing = {r: {"u1#0": RuntimeError("the first wait failed")} for r in range(2)} if fail else {}
        started, waited, _ = _logging(monkeypatch, mesh, failing)
        caught = []

        def loss(p, x):
            try:
                a = p["a"]
            except RuntimeError as e:
                caught.append(str(e))
                a = p["a"]
            return (a * x * p["b"].float()).sum() + (p["c"] * p["d"].float()).sum()

        def rank_fn():
            state = fzero.init(PARAMS, optim.sgd(0.25), stage=3, mesh=mesh, units=_unit)
            return fzero.gather(fzero.train_step(loss, prefetch=1)(state, torch.linspace(0.0, 1.0, 6) + mesh.rank)[0])

        out = mesh.run(rank_fn)
        monkeypatch.undo()
        return out, caught, started, waited

    (got, caught, started, waited), (want, *_) = step_params(True), step_params(False)
    assert caught == ["the first wait failed"] * 2, caught
    assert started[:6] == ["u1#0", "u1#1", "u2#0", "u2#1", "u1#0", "u1#1"], started  # u1 gathered anew
    assert waited[:2] == ["u1#0", "u1#1"], waited  # the failed read's second gather was waited for
    for r in range(2):
        assert got[r].keys() == want[r].keys() and all(torch.equal(got[r][k], want[r][k]) for k in want[r]), r


# -- refill, at unit level ------------------------------------------------------------------------


def _released_unit(mesh: FakeMesh, names: str, log: list[str], failing: str, raises: BaseException
                   ) -> tuple[Gathering, list[torch.UntypedStorage]]:
    """A `Gathering` whose unit u1 was read and released (one storage per character of `names`,
    freed), with its refill's gathers in flight (as prefetched in backward): those in `failing`
    raise `raises` when waited. `refill` reads only the program's name and mesh."""
    program = types.SimpleNamespace(name="u1", mesh=mesh)
    gathering = Gathering(None, [program], [], [], {}, "on_use", releasable=False, prefetch=0)
    storages = [torch.zeros(1).untyped_storage() for _ in names]
    for s in storages:
        s.resize_(0)
    gathering._leaves["u1"] = {}
    gathering._storages["u1"] = [(None, s, 4) for s in storages]
    gathering._released.add("u1")
    gathering._ahead["u1"] = [FakeFlight(FakePending(n, log, raises if n in failing else None)) for n in names]
    return gathering, storages


@pytest.mark.parametrize("raises", [MeshError("timed out"), Stop()], ids=["failed-wait", "interrupt"])
@pytest.mark.parametrize("waits", [False, True], ids=["abandons", "waits"])
def test_a_refill_whose_wait_raises_leaves_the_rest_to_finish(raises, waits):
    """u1's refill has three gathers in flight; the second's wait raises. The refill raises it,
    the unit stays released (not half filled and called gathered), and the third gather is still
    in `_ahead`: `finish` waits for it where the mesh waits after the error, else hands it to the
    mesh. Before, `refill` popped the unit's list first, and the third was lost: `finish` saw
    nothing, and it was neither waited for nor abandoned."""
    log: list[str] = []
    mesh = FakeMesh(waits)
    gathering, storages = _released_unit(mesh, "abc", log, "b", raises)
    with pytest.raises(type(raises)):
        gathering.refill("u1")
    assert log == ["a", "b"], log
    assert "u1" in gathering._released
    assert storages[0].nbytes() == 4 and storages[1].nbytes() == 0, [s.nbytes() for s in storages]
    gathering.finish(raises)
    kept = [] if isinstance(raises, RuntimeError) else ["b"]  # an interrupted gather stays in `_ahead` (`wait_held`)
    want = (["a", "b", *kept, "c"], []) if waits else (["a", "b"], [*kept, "c"])
    assert (log, mesh.abandoned) == want, (log, mesh.abandoned)
    assert gathering._ahead == {}, gathering._ahead
    if waits:  # `_drop` waited for the rest, and freed the released unit's storage again
        assert [s.nbytes() for s in storages] == [0, 0, 0], [s.nbytes() for s in storages]


def test_a_refill_that_succeeds_fills_every_storage_and_leaves_nothing():
    """The normal path: every gather waited for once, in order, each copied into its storage, the
    unit no longer released, and nothing left for `finish`."""
    log: list[str] = []
    mesh = FakeMesh(waits=False)
    gathering, storages = _released_unit(mesh, "abc", log, "", MeshError("unused"))
    gathering.refill("u1")
    assert log == ["a", "b", "c"], log
    assert "u1" not in gathering._released and gathering._ahead == {}
    got = [torch.empty(0).set_(s, 0, (1,)).item() for s in storages]
    assert got == [float(ord(c)) for c in "abc"], got
    gathering.finish(ValueError("later"))
    assert mesh.abandoned == [], mesh.abandoned
