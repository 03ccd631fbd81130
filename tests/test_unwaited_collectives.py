"""Collectives a rank started and then left unwaited, over a gloo `DistMesh` at N = 2, where
all-gathers and reduce-scatters are point-to-point exchanges (`mesh._all_gather_by_exchange`,
`_reduce_scatter_by_exchange`): gloo cancels such an exchange when its work handle is freed, so a
peer that then waits for it waits out the group's timeout (`MeshError`) instead of getting its
data (`DistMesh.abandon`). Each scenario has the two ranks raise errors of their own at
different points; each rank must get its own error at once, not after the group's timeout `T`.

A rank's delays (`time.sleep`) make the races deterministic: the rank that raises first lets go
of what it started (and collects garbage) before its peer starts the same exchange.
"""

from __future__ import annotations

import datetime
import gc
import time

import pytest
import torch

import fzero
import fzero.testing
from fzero import optim

T = 3.0  # the gloo group's and the mesh's timeout, seconds
PROMPT = 1.5  # seconds: well within T; an error that waited the timeout out takes more than T
PARAMS = {"a": torch.linspace(-1.0, 1.0, 6), "b": torch.linspace(0.5, 1.5, 6), "c": torch.linspace(1.0, 2.0, 6)}
ACT: dict[str, int] = {}  # what runs on which rank now: {"name": rank} (a module global, read by the Functions)


class Stop(BaseException):
    """A `KeyboardInterrupt`-like exception that is not an `Exception`."""


class _Act(torch.autograd.Function):
    """Identity forward; its backward sleeps 0.5 s on the rank `ACT[f"{name}_sleep"]` names, and
    raises on the rank `ACT[f"{name}_raise"]` names."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        rank = torch.distributed.get_rank()
        if ACT.get(f"{ctx.name}_sleep") == rank:
            time.sleep(0.5)
        if ACT.get(f"{ctx.name}_raise") == rank:
            raise ValueError(f"rank {rank} refused in {ctx.name}'s backward")
        return g, None


def _mesh(verify: bool) -> fzero.DistMesh:
    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=T))
    return fzero.DistMesh(group, verify=verify, timeout=T)


def _timed(call) -> tuple[str, str, float]:
    """`(the error's type name, its text, seconds)` of `call()`, which must raise; garbage is
    collected at once after (what a rank drops is freed before its peer goes on)."""
    start = time.monotonic()
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - what each rank raised is the result
        out = (type(e).__name__, str(e)[:200], round(time.monotonic() - start, 2))
    else:
        out = ("returned", "", round(time.monotonic() - start, 2))
    del call
    gc.collect()
    return out


# -- 1. a backward that raises with reductions in flight (`unit.Inflight`) -------------------------


def backward_raises_at_different_units(_pool_mesh, stage: int, verify: bool):
    """On a pool worker: rank 0's backward sleeps before any unit's, so rank 1 starts c's reduction
    (stages 2-3: reduce-scatter; stages 0-1: the early all-reduce / reduce-scatter), then raises
    in `one`'s backward and lets go of it; rank 0 then starts c's reduction, waits for it when b's
    starts, and raises in `two`'s backward."""
    mesh = _mesh(verify)
    state = fzero.init(PARAMS, optim.sgd(0.25), stage=stage, mesh=mesh, units=lambda path: path)

    def loss(p, x):
        h = _Act.apply(p["a"] * x, "two")
        h = _Act.apply(h * p["b"], "one")
        return _Act.apply(h * p["c"], "first").sum()

    ACT.update(first_sleep=0, one_raise=1, two_raise=0)
    try:
        return _timed(lambda: fzero.train_step(loss, prefetch=0)(state, torch.linspace(0.0, 1.0, 6) + mesh.rank))
    finally:
        ACT.clear()


@pytest.mark.dist
def test_a_reduction_a_rank_that_raised_in_backward_started_still_reaches_its_peer():
    """Over `DistMesh(verify=False)` at every stage (and verify=True, stage 2, checked too), rank 1's
    backward raises with c's reduction in flight (`unit.Inflight`, depth 1; stages 0-1 `Chained`'s
    early reductions), while rank 0, later, starts the same reduction and waits for it before
    raising an error of its own. The flights of a step whose backward raised are handed to the
    mesh (`Mesh.abandon`). Before, rank 1 dropped them, gloo cancelled the exchange, and rank 0
    waited out the timeout for c's reduction (`MeshError`) instead of raising its own error."""
    cases = [(stage, False) for stage in range(4)] + [(2, True)]
    with fzero.testing.Pool(2, timeout=90) as pool:  # a pool of its own: cancelled exchanges stay behind
        got = {case: pool.run(backward_raises_at_different_units, [case] * 2) for case in cases}
    for (stage, verify), per_rank in got.items():
        for rank, (kind, text, seconds) in enumerate(per_rank):
            if verify and rank == 0:  # told of rank 1's error at its next collective
                assert kind == "RankFailed" and "rank(s) [1] raised" in text, (stage, verify, rank, kind, text)
            else:
                want = f"rank {rank} refused in {'one' if rank == 1 else 'two'}'s backward"
                assert (kind, text) == ("ValueError", want), (stage, verify, rank, kind, text, seconds)
            assert seconds < PROMPT, (stage, verify, rank, kind, text, seconds)


# -- 2. a refill started for backward that the peer, raised in its forward, never started ----------


def forward_raises_after_a_backward_refill(_pool_mesh, verify: bool):
    """On a pool worker, stage 3, prefetch 1, units a, b, c released after use (`p.release`): rank 0's
    loss raises at its end, after reading every unit; rank 1's returns, so its step starts b's
    refill for the backward (prefetch), then its backward raises in `one`'s (after c's
    reduction started). Rank 0 never started that refill."""
    mesh = _mesh(verify)
    state = fzero.init(PARAMS, optim.sgd(0.25), stage=3, mesh=mesh, units=lambda path: path)

    def loss(p, x):
        h = p["a"] * x
        p.release("a")
        h = _Act.apply(h * p["b"], "one")
        p.release("b")
        h = h * p["c"]
        p.release("c")
        if mesh.rank == 0:
            raise ValueError("rank 0 refused at the end of its loss")
        return h.sum()

    ACT.update(one_raise=1)
    try:
        return _timed(lambda: fzero.train_step(loss, prefetch=1)(state, torch.linspace(0.0, 1.0, 6) + mesh.rank))
    finally:
        ACT.clear()


@pytest.mark.dist
def test_a_rank_that_raised_in_backward_does_not_wait_for_a_refill_its_peer_never_started():
    """Over `DistMesh(verify=False)` a rank whose backward raised cannot know that its peer reached
    the backward: one whose loss raised at its end never started the refill the first one
    prefetched for its backward. `Gathering.finish` waits only where the mesh `starts_agreed`
    (and hands the rest to `Mesh.abandon`); before, it waited for every refill of a unit the
    loss had read ("every rank reached the backward"), and rank 1 got its own error only after
    the group's timeout. verify=True: rank 1 stops with `RankFailed` at once, as before."""
    with fzero.testing.Pool(2, timeout=60) as pool:
        got = {verify: pool.run(forward_raises_after_a_backward_refill, [(verify,)] * 2) for verify in (False, True)}
    for verify, per_rank in got.items():
        (kind0, text0, s0), (kind1, text1, s1) = per_rank
        assert (kind0, text0) == ("ValueError", "rank 0 refused at the end of its loss"), (verify, kind0, text0)
        if verify:
            assert kind1 == "RankFailed" and "rank(s) [0] raised" in text1, (kind1, text1)
        else:
            assert (kind1, text1) == ("ValueError", "rank 1 refused in one's backward"), (kind1, text1)
        assert s0 < PROMPT and s1 < PROMPT, (verify, per_rank)


# -- 3. an evaluation interrupted with gathers prefetched (a BaseException) ------------------------


def evaluation_interrupted_with_a_prefetch(_pool_mesh, verify: bool):
    """On a pool worker, stage 3, `fzero.evaluate(prefetch=1)`: rank 1's function reads a and b (so
    c's gather is prefetched) and raises `Stop` (a BaseException, as KeyboardInterrupt); rank 0's
    sleeps after reading a, so it starts c's gather only after rank 1 let go of it, then reads c
    (waiting for that gather) and raises a ValueError."""
    mesh = _mesh(verify)
    state = fzero.init(PARAMS, optim.sgd(0.25), stage=3, mesh=mesh, units=lambda path: path)

    def fn(p, x):
        h = p["a"] * x
        if mesh.rank == 0:
            time.sleep(0.5)
        h = h * p["b"]
        if mesh.rank == 1:
            raise Stop("rank 1 interrupted")
        h = h * p["c"]
        raise ValueError("rank 0 refused after reading c")

    return _timed(lambda: fzero.evaluate(fn, prefetch=1)(state, torch.linspace(0.0, 1.0, 6)))


@pytest.mark.dist
def test_an_interrupted_evaluation_leaves_its_prefetched_gathers_to_the_peer():
    """`fzero.evaluate`'s forward hands `Gathering.finish` any exception, a BaseException
    (KeyboardInterrupt) too, as the step does: the gathers an interrupted rank prefetched are
    kept by the mesh (`Mesh.abandon`). Before, only an `Exception` reached `finish`; the
    interrupted rank dropped c's gather, gloo cancelled it, and rank 0 waited out the timeout in
    c's gather instead of raising its own error (verify=False)."""
    with fzero.testing.Pool(2, timeout=60) as pool:
        got = pool.run(evaluation_interrupted_with_a_prefetch, [(False,)] * 2)
    (kind0, text0, s0), (kind1, text1, s1) = got
    assert (kind1, text1) == ("Stop", "rank 1 interrupted"), got
    assert (kind0, text0) == ("ValueError", "rank 0 refused after reading c"), got
    assert s0 < PROMPT and s1 < PROMPT, got
