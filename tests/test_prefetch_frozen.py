"""Stage-3 backward prefetches that nobody reads: frozen first units, an embedding first, a probe
whose frozen weight autograd saves and frees unread (tests/prefetch_cases.py `FROZEN`).

Found in review: the step's `Gathering` was held only by the graph's saved-tensor hooks, so it was
freed mid-backward, once autograd had freed the last tensor saved through them, with a backward
prefetch in flight (the refill of the unit backward reaches next, started at a refill): that
gather was never waited for, and the unit Functions' `after_backward` (held weakly) no longer
ran. On gloo (DistMesh, torchrun) the next collective hung until the mesh timeout, with a
misleading "ranks did not all reach reduce_scatter"; `prefetch=0` ran. Now the step holds the
`Gathering` to the end of its backward and then drops every refill still in flight
(`Gathering.finish`), and backward prefetches only units a tensor was saved from (`_saves`:
none of a frozen unit whose inputs need no grad, nor of an embedding).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import fzero
from fzero._src.gathering import Gathering
from fzero._src.stages import Flight
from fzero.testing.pool import Died, run_job

from . import prefetch_cases as cases


def _equal(a, b):
    """Same losses and same gathered params, bit for bit, on every rank."""
    for (pa, la), (pb, lb) in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(la, lb)), (la, lb)
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@contextlib.contextmanager
def _unwaited():
    """Yield a list that, once the body is done, names the unit of each flight `Gathering._start`
    started in the body and nobody waited for (`Flight.wait`)."""
    started: list[tuple[str, Flight]] = []
    waited: set[int] = set()
    start, wait = Gathering._start, Flight.wait

    def spy_start(self, unit):
        flights = start(self, unit)
        started.extend((unit, f) for f in flights)
        return flights

    def spy_wait(self):
        waited.add(id(self))
        return wait(self)

    left: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Gathering, "_start", spy_start)
        mp.setattr(Flight, "wait", spy_wait)
        try:
            yield left
        finally:
            left.extend(u for u, f in started if id(f) not in waited)


def _flights_and_gathers(variant, k):
    """Stage 3 on SimMesh(2), two steps with `prefetch=k`: `(per-rank results, {unit: all-gathers
    on rank 0}, the units of the flights `Gathering._start` started that nobody waited for)`."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        with mesh.record() as log:
            out = cases.train_stack(mesh, variant, 3, prefetch=k)
        units = [r.tag.split("/")[0] for r in log if r.op == "all_gather" and r.rank == mesh.rank
                 and not r.tag.startswith("fzero.")]
        return out, {u: units.count(u) for u in set(units)}

    with _unwaited() as left:
        res = mesh.run(rank_fn)
    return [o for o, _ in res], res[0][1], left


@pytest.mark.parametrize("variant", list(cases.FROZEN))
@pytest.mark.parametrize("k", [1, 2])
def test_no_prefetched_gather_is_left_unwaited_after_a_step(variant, k):
    """Every gather the step started ahead is waited for by the end of the step (before: the
    refill of a frozen first block, of an embedding whose backward reads no weight, or of a
    probe whose saved weight autograd freed unread, was started in backward and never waited
    for); the bits are stage 0's."""
    mesh = fzero.SimMesh(2)
    want = mesh.run(functools.partial(cases.train_stack, mesh, variant, 0))
    got, _, unwaited = _flights_and_gathers(variant, k)
    _equal(want, got)
    assert unwaited == [], unwaited


@pytest.mark.parametrize("variant", ["frozen_first", "frozen_root", "emb_first"])
def test_backward_does_not_prefetch_a_unit_it_never_reads(variant):
    """A unit no tensor was saved from (a frozen block whose input needs no grad, an embedding,
    whose backward reads only the indices) is never gathered again in backward, so it is not
    prefetched there either: each unit is gathered as often with prefetch as without."""
    _, count0, _ = _flights_and_gathers(variant, 0)
    for k in (1, 2):
        _, count, _ = _flights_and_gathers(variant, k)
        assert count == count0, (k, count0, count)


def test_a_backward_that_raises_still_waits_for_the_refills_it_started():
    """A backward that raises (a hook on the logits, the backward's first node) after the forward's
    end started the refill of the block backward reaches next: that gather is waited for and its
    storage freed, and the hook's error is the one the step raises, on every rank."""
    params, apply, info = cases.stack_model("emb_first")
    mesh = fzero.SimMesh(2)

    def refuse(_grad):
        raise ValueError("refused in backward")

    def loss(p, b):
        logits = apply(p, b[0])
        logits.register_hook(refuse)
        return torch.nn.functional.cross_entropy(logits, b[1])

    def rank_fn():
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units)
        with mesh.record() as log:
            with pytest.raises(ValueError, match="refused in backward"):
                fzero.train_step(loss, prefetch=1)(state, (torch.arange(6) % 9, torch.arange(6) % 9))
        return [r.tag.split("/")[0] for r in log if r.op == "all_gather" and not r.tag.startswith("fzero.")]

    with _unwaited() as left:
        gathered = mesh.run(rank_fn)
    assert gathered[0][-1] == "blocks.2", gathered  # non-vacuous: the refill was started
    assert left == [], left


@pytest.mark.dist
@pytest.mark.parametrize("variant", ["frozen_root", "probe_first"])
def test_over_gloo_backward_prefetches_nobody_reads_do_not_hang_and_the_bits_are_stage_0s(variant):
    """DistMesh (gloo, 2 fresh processes, a 10 s mesh timeout), stage 3 with the default prefetch
    (one unit ahead there): two steps run and equal stage 0's, bit for bit. Before, "frozen_root"
    (the forward's last block kept for backward, whose start prefetched the frozen block before
    it) and "probe_first" (a probe's weight saved and freed unread, the probe's refill started by
    the next block's) raised MeshError "ranks did not all reach reduce_scatter" at the mesh
    timeout in their first step: the Gathering, freed with a gather in flight, left gloo's
    exchange unwaited."""
    out = run_job(2, cases.stack_over_gloo, [(variant, 10.0)] * 2, timeout=90)
    for result in out:
        assert not isinstance(result, (Died, fzero.testing.RemoteError)), str(result)
    _equal([s0 for s0, _ in out], [s3 for _, s3 in out])


def test_finish_waits_for_a_refill_still_in_flight_when_the_backward_ends(monkeypatch):
    """`Gathering.finish` after a whole backward: a refill still in flight when it ends is waited
    for and its storage freed. Made here by an `after_backward` that releases its unit but leaves
    the refill prefetched for it (which it drops itself, so no other test reaches `finish` with
    one: found in review); the bits are stage 0's."""
    variant = "probe_first"  # the probe's refill, started by the next block's, is what its backward never reads
    mesh = fzero.SimMesh(2)
    want = mesh.run(functools.partial(cases.train_stack, mesh, variant, 0))
    at_finish: list[str] = []
    finish = Gathering.finish

    def keep_refill(self, unit):
        self._backward_done.add(unit)
        self.release(unit)

    def spy_finish(self, error=None):
        at_finish.extend(self._ahead)
        return finish(self, error)

    monkeypatch.setattr(Gathering, "after_backward", keep_refill)
    monkeypatch.setattr(Gathering, "finish", spy_finish)
    got, _, unwaited = _flights_and_gathers(variant, 1)
    assert at_finish, "no refill was in flight when the backward ended"  # non-vacuous
    _equal(want, got)
    assert unwaited == [], unwaited
