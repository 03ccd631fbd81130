"""`DistMesh` where a rank leaves the program's collectives: by returning from its script before a
call every rank must make, or by an interrupt inside a collective's agreement.

Each test runs a fresh 2-process gloo job (`fzero.testing.pool.run_job`: torchrun's environment,
no agent, so a rank that returns simply exits).

1. Rank 1 returns from its script after `init`; rank 0 then calls `fzero.checkpoint.save` or
   `fzero.gather` alone (the DDP habit: `if rank == 0: save(...)`). Rank 0 gets `RankFailed`,
   which before said only that rank 1 was "lost" and to restart the job: nothing had crashed.
   Now it says both: the rank died, or it finished its program without making the call (named),
   which every rank must make.
2. An interrupt (`KeyboardInterrupt`) on rank 0 inside a collective's agreement, or between the
   agreement and the start of its data exchange, left rank 0 out of step with rank 1 (its
   sequence number behind, or a data exchange rank 1 started and rank 0 never did): rank 0's
   next collective met rank 1's out of step and both waited out the whole timeout, called "a
   rank is stuck". Now the mesh marks itself unusable: rank 0's next call raises at once, saying
   it was interrupted mid-agreement and must be rebuilt.
"""

from __future__ import annotations

import time

import pytest
import torch

import fzero
from fzero import optim
from fzero._src import mesh as mesh_impl
from fzero.testing.pool import run_job

pytestmark = pytest.mark.dist

T = 15.0  # the mesh's timeout (and its process group's), seconds: a hang shows as this
PARAMS = {"a": torch.linspace(-1.0, 1.0, 6), "b": torch.linspace(0.5, 1.5, 6)}


# -- 1. a rank that returned before a call every rank must make --------------------------------


def rank1_returns_first(what: str, root: str):
    """Both ranks `init` (stage 3); rank 1 returns, rank 0 calls `what` ("save": checkpoint.save,
    "gather": fzero.gather). Rank 0 returns (error type, message, seconds from the call)."""
    mesh = fzero.DistMesh(backend="gloo", timeout=T)
    state = fzero.init(PARAMS, optim.sgd(0.25), stage=3, mesh=mesh)
    if mesh.rank == 1:
        return "returned"
    start = time.monotonic()
    try:
        fzero.checkpoint.save(state, root) if what == "save" else fzero.gather(state)
    except fzero.MeshError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("what, call", [("save", "fzero.checkpoint.save / load"), ("gather", "fzero.gather")])
def test_a_rank_that_returned_before_a_call_every_rank_makes_is_named_as_possibly_finished(tmp_path, what, call):
    """Rank 0 raises before the mesh's timeout: `RankFailed` with what it said before (rank 1
    lost, its process exited, the call rank 0 waited in, world size, restart the job), or, where
    rank 1's process had not yet exited 2 s after its connection closed (a loaded machine: its
    interpreter's teardown), `MeshError` saying the call failed on rank 0. Either now says the
    other possibility too: rank 1 finished its program without calling `call`, which every rank
    must call (not under `if rank == 0:`). Before, the first said only to restart the job, the
    second gave gloo's words alone."""
    out = run_job(2, rank1_returns_first, [(what, str(tmp_path))] * 2, timeout=90)
    assert out[1] == "returned", str(out[1])
    kind, message, seconds = out[0]
    if kind == "RankFailed":
        assert "rank(s) [1] lost: process(es) [" in message and "exited while rank 0 waited in all_gather(" in message
        assert "The group (world size 2) cannot go on without them" in message, message
    else:
        assert kind == "MeshError" and ") failed on rank 0 (world size 2). A rank that left the group" in message, (
            kind, message)
    assert ("either died (a crash or a kill: see its log): restart the job (every rank: a new torchrun, or torchrun "
            "--max-restarts) and resume from fzero.checkpoint.latest(root)" in message), message
    assert (f"or finished its program (returned or exited normally) without calling {call}, which every rank must "
            f"call at the same point of its program (not under `if rank == 0:`" in message), message
    assert "gloo said: " in message and seconds < T, (seconds, message)


# -- 2. an interrupt inside a collective's agreement ---------------------------------------------


def _interrupt_once(where: str) -> None:
    """Make the next fingerprint exchange (`where="agreement"`: its all-gather completes, and the
    interrupt arrives as its wait returns, where Python delivers a signal that came during it) or
    the next data exchange's start (`"start"`: before it is issued) raise `KeyboardInterrupt`, once."""
    armed = [True]
    if where == "agreement":
        real = mesh_impl._all_gather_into

        class Interrupted:
            def __init__(self, work):
                self.work = work

            def wait(self, *args):
                self.work.wait(*args)
                raise KeyboardInterrupt

        def gather(out, x, group, async_op=False):
            work = real(out, x, group, async_op=async_op)
            if armed.pop() if armed else False:
                return Interrupted(work)
            return work

        mesh_impl._all_gather_into = gather
    else:
        move = mesh_impl.DistMesh._move

        def interrupted_move(self, *args, **kwargs):
            if armed.pop() if armed else False:
                raise KeyboardInterrupt
            return move(self, *args, **kwargs)

        mesh_impl.DistMesh._move = interrupted_move


def interrupted_in_agreement(where: str):
    """One all-reduce on both ranks; then rank 0 is interrupted (`_interrupt_once(where)`) in the
    next all-reduce, catches it, and calls two more. Returns, per call after the first, (error
    type or "returned", message, seconds); rank 1 stops at its first error."""
    mesh = fzero.DistMesh(backend="gloo", timeout=T)
    fzero.collectives.all_reduce(torch.ones(1), mesh)
    if mesh.rank == 0:
        _interrupt_once(where)
    seen = []
    for _ in range(3 if mesh.rank == 0 else 2):
        start = time.monotonic()
        try:
            out = fzero.collectives.all_reduce(torch.ones(1), mesh)
            seen.append(("returned", str(out.tolist()), time.monotonic() - start))
        except (KeyboardInterrupt, fzero.MeshError) as e:
            seen.append((type(e).__name__, str(e), time.monotonic() - start))
            if mesh.rank == 1:
                break
    return seen


@pytest.mark.parametrize("where", ["agreement", "start"])
def test_an_interrupt_inside_a_collectives_agreement_makes_the_next_call_raise_at_once(where):
    """Rank 0's interrupted all-reduce raises the `KeyboardInterrupt` itself; its next two calls
    raise `MeshError` at once, saying the rank was interrupted in that all-reduce (collective #1)
    and the mesh must be rebuilt. Rank 1, which went on past the agreement into the data exchange,
    stops once rank 0's process exits (`RankFailed`, or `MeshError` where the process is slow to
    go), before the timeout. Before, rank 0's
    next call met rank 1's out of step and both waited out the whole timeout (`MeshError`: "ranks
    did not all reach ... a rank is stuck")."""
    out = run_job(2, interrupted_in_agreement, [(where,)] * 2, timeout=3 * T)
    first, *later = out[0]
    assert first[0] == "KeyboardInterrupt", first
    assert len(later) == 2, later
    for kind, message, seconds in later:
        assert kind == "MeshError", (kind, message)
        assert ("rank 0 was interrupted (KeyboardInterrupt) in all_reduce(float32[1], sum) (collective #1)"
                in message), message
        assert "construct a new DistMesh on every rank, or restart the job" in message, message
        assert seconds < 1.0, seconds
    (kind, message, seconds), = out[1]
    assert kind in ("RankFailed", "MeshError") and "did not all reach" not in message, (kind, message)
    assert seconds < T, (seconds, message)


def collective_after_destroy():
    mesh = fzero.DistMesh(backend="gloo", timeout=T)
    fzero.collectives.all_reduce(torch.ones(1), mesh)
    torch.distributed.destroy_process_group()
    try:
        fzero.collectives.all_reduce(torch.ones(1), mesh)
    except fzero.MeshError as e:
        return str(e)
    return "returned"


def test_a_collective_after_the_process_group_is_destroyed_says_so():
    """Found in review: torch's "Default process group has not been initialized" (a ValueError)
    from inside the exchange."""
    for words in run_job(2, collective_after_destroy, timeout=3 * T):
        assert isinstance(words, str) and "the process group is gone (torch.distributed.destroy_process_group() was " \
               "called); a DistMesh lives as long as its group" in words, words
