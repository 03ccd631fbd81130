"""Review of the waits on the collective-error paths: `Inflight.wait` (a close that fails leaves the
other open flights to `Inflight.settle`), `Gathering.finish(error)` (the first failed wait ends
the waiting, and everything not waited for goes to `Mesh.abandon`), and `DistMesh._p2p_tag` (its
per-collective counts are bounded, and a tag never comes back).

The first two are checked at unit level with fake collectives whose `wait()` counts and can
raise (a frozen or dead peer would take the group's timeout per wait); the third on the
function itself and over gloo at N = 2, where all-gathers and reduce-scatters are the
point-to-point exchanges it tags.
"""

from __future__ import annotations

import datetime
import types

import pytest
import torch

import fzero
from fzero._src import mesh as mesh_module
from fzero._src.gathering import Gathering
from fzero._src.mesh import DistMesh, MeshError, _Call
from fzero._src.unit import Inflight
from tests.fake_collectives import FakeMesh, Stop
from tests.fake_collectives import flights as _flights


# -- 1. `Inflight.wait`: a close that fails leaves the rest open, for `settle` ---------------------


@pytest.mark.parametrize("raises", [MeshError("timed out"), Stop()], ids=["failed-wait", "interrupt"])
def test_a_close_that_fails_in_wait_leaves_the_other_flights_to_settle(raises):
    """Three reductions in flight (`Inflight(depth=3)`); the step's `wait` closes the first, whose
    wait fails (a peer that timed out: `MeshError`) or is interrupted. The step then calls
    `settle`, which must see the other two: here (the mesh does not wait after this error) it
    hands them to `Mesh.abandon`. Before, `wait` took the list away before closing any, so the
    other two were in neither `_flights` nor anywhere else: never waited for, never abandoned,
    and gloo cancelled them (a peer waiting for one waited out the group's timeout)."""
    log: list[str] = []
    inflight = Inflight(depth=3)
    for flight in _flights("abc", log, failing="a", raises=raises):
        inflight.add(flight)
    with pytest.raises(type(raises)):
        inflight.wait()
    mesh = FakeMesh(waits=False)
    inflight.settle(mesh, raises)
    assert log == ["a"], log
    kept = [] if isinstance(raises, RuntimeError) else ["a"]  # an interrupted close leaves its flight (`_close`)
    assert mesh.abandoned == [*kept, "b", "c"], mesh.abandoned


def test_after_a_host_copy_that_fails_in_wait_settle_waits_for_the_rest():
    """The same with a mesh that waits after the error (a `ValueError` raised by the offload copy,
    `Inflight.host`, after the first reduction's wait succeeded): `settle` waits for the other two
    reductions, once each. Before, they were lost, and nothing waited for them."""
    log: list[str] = []
    calls: list[int | None] = []

    def host(shard, bucket):
        calls.append(bucket)
        raise ValueError("the host copy failed")

    inflight = Inflight(depth=3, host=host)
    for b, flight in enumerate(_flights("abc", log)):
        inflight.add(flight, b)
    with pytest.raises(ValueError, match="host copy"):
        inflight.wait()
    mesh = FakeMesh(waits=True)
    inflight.settle(mesh, ValueError("the host copy failed"))
    assert calls == [0], calls
    assert log == ["a", "b", "c"], log
    assert mesh.abandoned == [], mesh.abandoned


def test_an_interrupt_of_settles_waits_hands_the_rest_to_the_mesh():
    """`settle` after a backward that raised, over a mesh that waits after the error: its first
    wait is interrupted (a `KeyboardInterrupt`-like `Stop`). The interrupt goes on up, and the two
    reductions not waited for are handed to the mesh. Before, only a `RuntimeError` was caught:
    an interrupt dropped them, neither waited for nor abandoned (gloo cancelled them)."""
    log: list[str] = []
    inflight = Inflight(depth=3)
    for flight in _flights("abc", log, failing="a", raises=Stop()):
        inflight.add(flight)
    mesh = FakeMesh(waits=True)
    with pytest.raises(Stop):
        inflight.settle(mesh, ValueError("the backward raised"))
    assert log == ["a"], log
    assert mesh.abandoned == ["a", "b", "c"], mesh.abandoned  # the interrupted one too (`unit.wait_held`)


def test_wait_closes_every_flight_in_order_and_leaves_none():
    """The normal path: `wait` closes every open flight once, oldest first, and none is left."""
    log: list[str] = []
    inflight = Inflight(depth=3)
    for flight in _flights("abc", log):
        inflight.add(flight)
    inflight.wait()
    assert log == ["a", "b", "c"], log
    mesh = FakeMesh(waits=False)
    inflight.settle(mesh, ValueError("later"))
    assert mesh.abandoned == [], mesh.abandoned


# -- 2. `Gathering.finish(error)`: stop at the first failed wait, abandon the rest ----------------


def _gathering(mesh: FakeMesh, ahead: dict[str, list[FakeFlight]]) -> Gathering:
    """A `Gathering` over units named by `ahead`'s keys, all on `mesh`, with `ahead` in flight
    (as prefetched gathers or backward refills). `finish` reads only each program's name and mesh."""
    programs = [types.SimpleNamespace(name=u, mesh=mesh) for u in ahead]
    gathering = Gathering(None, programs, [], [], {}, "on_use", releasable=False, prefetch=0)
    gathering._ahead.update(ahead)
    return gathering


def test_finish_after_an_error_stops_waiting_at_the_first_failed_wait():
    """Three units with two gathers each in flight when the step raises, over a mesh that waits
    after the error, with a frozen peer: every wait fails (after the group's timeout, on a real
    mesh). `finish` waits once and hands the other five gathers to the mesh. Before, it passed
    over each unit's failed wait and waited for the next unit's: three waits, each the whole
    timeout (N units x timeout), and each unit's second gather was lost (`_drop` had taken the
    unit out before waiting): nothing was abandoned."""
    log: list[str] = []
    failing = "abcdef"
    mesh = FakeMesh(waits=True)
    gathering = _gathering(mesh, {"u1": _flights("ab", log, failing, MeshError("timed out")),
                                  "u2": _flights("cd", log, failing, MeshError("timed out")),
                                  "u3": _flights("ef", log, failing, MeshError("timed out"))})
    gathering.finish(ValueError("the loss raised"))
    assert log == ["a"], log
    assert sorted(mesh.abandoned) == ["b", "c", "d", "e", "f"], mesh.abandoned
    assert gathering._ahead == {}, gathering._ahead


def test_finish_after_an_error_abandons_the_rest_of_a_unit_whose_wait_failed():
    """Unit u1 has three buckets' gathers in flight, the second of which fails; u2 has one. Waited
    for: u1's first and second; abandoned: u1's third and u2's (not waited for). Before, u1's
    third was lost (neither waited for nor abandoned) and u2's was waited for anyway."""
    log: list[str] = []
    mesh = FakeMesh(waits=True)
    gathering = _gathering(mesh, {"u1": _flights("abc", log, "b", RuntimeError("gloo: connection closed")),
                                  "u2": _flights("d", log)})
    gathering.finish(ValueError("the backward raised"))
    assert log == ["a", "b"], log
    assert sorted(mesh.abandoned) == ["c", "d"], mesh.abandoned
    assert gathering._ahead == {}, gathering._ahead


def test_finish_abandons_what_is_left_when_an_interrupt_stops_its_waits():
    """An interrupt (any BaseException) while `finish` waits after an error: it propagates, and
    the gathers not waited for are handed to the mesh first. Before, they were dropped (gloo
    cancelled them, and a peer waiting for one waited out the timeout)."""
    log: list[str] = []
    mesh = FakeMesh(waits=True)
    gathering = _gathering(mesh, {"u1": _flights("ab", log, "a", Stop()), "u2": _flights("c", log)})
    with pytest.raises(Stop):
        gathering.finish(ValueError("the loss raised"))
    assert log == ["a"], log
    assert sorted(mesh.abandoned) == ["a", "b", "c"], mesh.abandoned  # the interrupted one too (`unit.wait_held`)


@pytest.mark.parametrize("waits", [True, False])
def test_finish_without_an_error_or_where_the_mesh_does_not_wait_is_unchanged(waits):
    """The normal path waits for every gather, in unit and bucket order, and abandons none;
    after an error on a mesh that does not wait (`verify=False`, a `MeshError`, an interrupt),
    every gather is abandoned and none waited for."""
    log: list[str] = []
    mesh = FakeMesh(waits=waits)
    gathering = _gathering(mesh, {"u1": _flights("ab", log), "u2": _flights("c", log)})
    gathering.finish()
    assert (log, mesh.abandoned, gathering._ahead) == (["a", "b", "c"], [], {})
    log.clear()
    gathering = _gathering(mesh, {"u1": _flights("ab", log), "u2": _flights("c", log)})
    gathering.finish(ValueError("raised"))
    assert (log, mesh.abandoned) == ((["a", "b", "c"], []) if waits else ([], ["a", "b", "c"]))


# -- 3. `DistMesh._p2p_tag`: bounded counts, tags that never come back -----------------------------


def _tagger() -> DistMesh:
    """A `DistMesh` with only what `_p2p_tag` reads (no process group): its tag state as made."""
    mesh = object.__new__(DistMesh)
    mesh._ordinal, mesh._exchanges, mesh._era = 0, {}, 0
    return mesh


def _call(tag: str, shape: tuple[int, ...] = (4,)) -> _Call:
    return _Call("all_gather", torch.float32, shape, None, tag)


def test_the_tag_counts_stay_bounded_and_a_collectives_tags_never_repeat():
    """A user's collective tagged by the step (`tag=f"step{i}"`) is a new collective each step:
    `_p2p_tag` kept a count for each, forever (about 250 B each). Now at most `_TAG_KEYS` are
    kept, and each exchange of one collective, across the clears, gets a tag of its own (a count
    restarted without the era would give a new exchange the tag of the collective's first one,
    which may still be in flight: kept unwaited after an error, `DistMesh.abandon`)."""
    mesh, k = _tagger(), mesh_module._TAG_KEYS
    tags = [mesh._p2p_tag(_call("held"))]
    for step in range(3 * k):
        mesh._p2p_tag(_call(f"step{step}"))
        if step % 1000 == 0:
            tags.append(mesh._p2p_tag(_call("held")))
        assert len(mesh._exchanges) <= k
    tags.append(mesh._p2p_tag(_call("held")))
    assert len(set(tags)) == len(tags), tags
    assert all((1 << 30) <= t < (1 << 31) for t in tags), tags


def test_two_ranks_that_issue_the_same_exchanges_tag_them_alike_across_clears():
    """The clears come at the same exchange on every rank that issues the same sequence: the two
    ranks' tags are the same, exchange by exchange (shapes that change, repeated collectives)."""
    ranks, k = [_tagger(), _tagger()], mesh_module._TAG_KEYS
    calls = [_call("grad", (i % 7 + 1,)) if i % 3 else _call(f"step{i}") for i in range(3 * k)]
    tags = [[m._p2p_tag(c) for c in calls] for m in ranks]
    assert tags[0] == tags[1]
    assert ranks[0]._exchanges == ranks[1]._exchanges and len(ranks[0]._exchanges) <= k


T = 10.0  # the gloo group's and the mesh's timeout, seconds


def many_tags_over_gloo(_pool_mesh, keys: int, steps: int, verify: bool):
    """On a pool worker: a `DistMesh` over a gloo group of its own with `_TAG_KEYS = keys` (restored
    after). An all-gather tagged "held" is started and left in flight; then `steps` all-gathers
    and reduce-scatters tagged by the step (new collectives each, so the counts fill up and are
    cleared every `keys`), each checked; then "held" is waited for, and all-gathered again.
    Returns `(wrong results, len(_exchanges), era)`."""
    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=T))
    m = fzero.DistMesh(group, verify=verify, timeout=T)
    r, saved = m.rank, mesh_module._TAG_KEYS
    mesh_module._TAG_KEYS = keys
    wrong = []
    try:
        held = m.start("all_gather", torch.full((2,), 100.0 + r), tag="held")
        for step in range(steps):
            got = m.collective("all_gather", torch.full((2,), 10.0 * step + r), tag=f"step{step}").tolist()
            if got != [10.0 * step] * 2 + [10.0 * step + 1] * 2:
                wrong.append((step, "all_gather", got))
            got = m.collective("reduce_scatter", torch.arange(4.0) + step + r, tag=f"step{step}").tolist()
            want = (2 * (torch.arange(4.0) + step) + 1).tolist()[2 * r : 2 * r + 2]
            if got != want:
                wrong.append((step, "reduce_scatter", got))
        if held.wait().tolist() != [100.0, 100.0, 101.0, 101.0]:
            wrong.append(("held", held.result.tolist()))
        got = m.collective("all_gather", torch.full((2,), 200.0 + r), tag="held").tolist()
        if got != [200.0, 200.0, 201.0, 201.0]:
            wrong.append(("held again", got))
    finally:
        mesh_module._TAG_KEYS = saved
    return wrong, len(m._exchanges), getattr(m, "_era", 0)


@pytest.mark.dist
@pytest.mark.parametrize("verify", [False, True])
def test_over_gloo_collectives_tagged_by_the_step_keep_the_mesh_bounded_and_right(dist2, verify):
    """Over gloo at N = 2, a user's collectives tagged by the step (two new collectives per step),
    with an exchange started before them and waited for after them: every result is right across
    the clears (`_TAG_KEYS` lowered to 8 on the workers: ten clears in 40 steps; the default's
    bound is checked without a group above), both ranks agree on the era, and the mesh keeps at
    most 8 counts. Before, it kept one per collective ever seen (2 * steps + 1)."""
    keys, steps = 8, 40
    got = dist2.run(many_tags_over_gloo, [(keys, steps, verify)] * 2, timeout=60)
    for wrong, size, era in got:
        assert wrong == [], wrong
        assert size <= keys, (size, keys)
    assert got[0][2] == got[1][2] >= (2 * steps + 1) // keys, got
