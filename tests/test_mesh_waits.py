"""Two DistMesh error paths of a rank that waits, over gloo at N = 2 (each worker builds a
`DistMesh` on a gloo group of its own with a short timeout, `T` s, so a hang shows as that
timeout):

1. A peer alive but elsewhere (still evaluating, sleeping, in another of fzero's calls) while
   rank 0 waits in `fzero.checkpoint.save`: rank 0's timeout said "ranks did not all reach
   <collective> ... a rank is stuck or took another path" without naming the fzero call it waits
   in, which every rank must make (the message of a peer that left names it: `_exited_without`).
   Now it names it (`mesh.entry_of`).
2. An interrupt (`KeyboardInterrupt`, or an exception a signal handler raises) inside
   `Pending.wait` of a data collective: the wait had cleared its work handle before waiting, so
   the handle was freed with the interrupt's traceback -- and the caller (`Inflight.wait`,
   `Gathering._drop`) had already taken the pending out, so neither `Inflight.settle` nor
   `Gathering.finish` could hand it to `Mesh.abandon`. gloo cancels a point-to-point exchange
   whose handle is freed (the all-gather and reduce-scatter at N = 2): a peer that posted its half
   late waited for it to the timeout. Now an interrupted wait keeps the handle and hands the
   pending to the mesh; the mesh stays usable (the collective was issued on every rank).
"""

from __future__ import annotations

import datetime
import gc
import time

import pytest
import torch

import fzero
from fzero._src import mesh as mesh_module
from fzero._src.stages import Flight
from fzero._src.unit import Inflight

T = 1.5  # the gloo group's and the mesh's timeout, seconds


def _mesh(verify: bool) -> fzero.DistMesh:
    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=T))
    return fzero.DistMesh(group, verify=verify, timeout=T)


# -- 1. a timeout names the fzero call rank 0 waits in ---------------------------------------------


def save_while_the_peer_sleeps(_pool_mesh, root: str, verify: bool):
    """Both ranks make a state; rank 0 calls `fzero.checkpoint.save`, rank 1 sleeps past the
    timeout (alive: no lost process) and returns. Rank 0 returns (error type, message, seconds
    from the call to the raise); rank 1 None."""
    mesh = _mesh(verify)
    state = fzero.init({"w": torch.linspace(-1.0, 1.0, 4)}, fzero.optim.sgd(0.1), stage=1, mesh=mesh)
    if mesh.rank == 1:
        time.sleep(T + 1.0)
        return None
    start = time.monotonic()
    try:
        fzero.checkpoint.save(state, root)
    except Exception as e:  # noqa: BLE001 (the test reads what it was)
        return type(e).__name__, str(e), time.monotonic() - start
    return "returned", "", time.monotonic() - start


@pytest.mark.dist
@pytest.mark.parametrize("verify", [True, False])
def test_a_timeout_names_the_fzero_call_the_rank_waits_in(dist2, tmp_path, verify):
    """Rank 0 in `checkpoint.save`, rank 1 alive elsewhere: rank 0's error comes at the timeout,
    says what it said before, and names the call every rank must make. Before, it named only the
    collective (`all_gather(int64[...], tag='fzero.checkpoint/...')`)."""
    got = dist2.run(save_while_the_peer_sleeps, [(str(tmp_path), verify)] * 2, timeout=60)
    assert got[1] is None, got
    kind, message, seconds = got[0]
    assert "ranks did not all reach" in message and f"within {T:g} s (world size 2)" in message, (kind, message)
    assert "a rank is stuck or took another path (see its log)" in message, message
    assert ("rank 0 waits in fzero.checkpoint.save / load, which every rank must call at the same point of its "
            "program") in message, message
    assert T <= seconds < T + 5.0, (seconds, message)


# -- 2. an interrupted wait keeps its exchange ----------------------------------------------------


class Work:
    """A backend's work handle: `wait()` counts its calls and raises `raises[0]` (then the next)
    while any are left."""

    point_to_point = True  # as DistMesh's exchanges at N = 2 (`Pending.cancelled_if_dropped`)

    def __init__(self, *raises: BaseException) -> None:
        self.raises, self.waits = list(raises), 0

    def wait(self) -> None:
        self.waits += 1
        if self.raises:
            raise self.raises.pop(0)


def test_an_interrupted_wait_keeps_the_handle_hands_it_on_and_waits_again():
    """`Pending.wait` interrupted: the pending is not done, is handed to `abandon` (which a
    DistMesh keeps, `cancelled_if_dropped`), and its next `wait()` waits for the collective.
    Before, the handle was let go before the wait: `done`, nothing handed on, and the next
    `wait()` returned the unfinished result without waiting."""
    handed = []
    pending = mesh_module.Pending(torch.zeros(2), Work(KeyboardInterrupt()), keep=torch.ones(2),
                                  abandon=handed.append)
    with pytest.raises(KeyboardInterrupt):
        pending.wait()
    assert handed == [pending] and not pending.done and pending.holds_more
    assert mesh_module._cancelled_if_dropped(handed) == [pending]
    assert pending.wait() is pending.result and pending._work is None and pending.done
    assert (handed, pending.holds_more) == ([pending], False)


def test_the_mesh_keeps_an_interrupted_pending_once_and_lets_go_of_it_once_waited():
    """An interrupted `Pending.wait` hands itself to the mesh, and the step's bookkeeping then hands
    it again (`Inflight.settle`): `DistMesh.abandon` keeps it once; once a later wait finished it,
    the next abandon lets its entry go, with its buffers (found in review: two entries for one
    collective, and a finished one held for the mesh's life)."""
    mesh = object.__new__(mesh_module.DistMesh)  # `abandon` reads only its deque
    mesh._abandoned = mesh_module.collections.deque(maxlen=mesh_module._ABANDONED)
    pending = mesh_module.Pending(torch.zeros(2), Work(KeyboardInterrupt()), keep=torch.ones(2),
                                  abandon=mesh.abandon)
    with pytest.raises(KeyboardInterrupt):
        pending.wait()
    mesh.abandon([pending])  # as `Inflight.settle` hands on what it holds
    assert [list(entry) for entry in mesh._abandoned] == [[pending]]
    pending.wait()  # a retried wait finishes it
    other = mesh_module.Pending(torch.zeros(2), Work(), keep=torch.ones(2))
    mesh.abandon(other)
    assert [list(entry) for entry in mesh._abandoned] == [[other]]


def test_a_failed_wait_is_done_and_raises_the_meshs_error():
    """A wait that fails (`RuntimeError`) is the mesh's error (`lost`): done, nothing handed on."""
    handed = []
    pending = mesh_module.Pending(torch.zeros(2), Work(RuntimeError("gloo: timed out")),
                                  lost=lambda e: fzero.MeshError(f"lost: {e}"), abandon=handed.append)
    with pytest.raises(fzero.MeshError, match="lost: gloo: timed out"):
        pending.wait()
    assert pending.done and handed == []


def test_an_exchanges_addition_is_made_once_when_an_interrupt_follows_it(monkeypatch):
    """The N = 2 reduce-scatter's wait (`_ThenAdd`) adds this rank's half into the received one,
    in place: interrupted right after the addition (a signal raised once `torch.add` returns) and
    waited again, it must not add this rank's half twice."""
    add, armed = torch.add, [True]

    def add_then_interrupt(*args, **kwargs):
        out = add(*args, **kwargs)
        if armed:
            armed.clear()
            raise KeyboardInterrupt("a signal")
        return out

    mine, received = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    work = mesh_module._ThenAdd(Work(), received, mine, received)
    pending = mesh_module.Pending(received, work, keep=torch.zeros(4))
    monkeypatch.setattr(torch, "add", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        pending.wait()
    assert pending.wait().tolist() == [11.0, 22.0]


def interrupted_wait(_pool_mesh, verify: bool, how: str):
    """Both ranks start an all-gather (gloo at N = 2: an exchange of sends and receives); rank 1
    posts its half 0.5 s late (a slow rank). Rank 0's wait is interrupted at once
    (`KeyboardInterrupt` raised by its first `_Works.wait`, as a signal handler would raise it
    before the send's wait). `how="drop"`: rank 0 drops the pending; `"inflight"`: the pending is
    an `Inflight`'s open flight, whose `wait` is interrupted, and the step's `settle` follows (as
    in `step._grads`): both take the pending out before waiting for it. Rank 1 waits for its
    all-gather; then both run an all-reduce. Returns (what the interrupted wait raised, rank 1's
    all-gather or its error, seconds rank 1 waited, the all-reduce or its error)."""
    mesh = _mesh(verify)
    r = mesh.rank
    if r == 1:
        move = mesh._move

        def late(*args, **kwargs):
            time.sleep(0.5)
            return move(*args, **kwargs)

        mesh._move = late
    pending = mesh.start("all_gather", torch.full((2,), float(r)), tag="interrupted")
    raised = gathered = None
    waited = 0.0
    if r == 0:
        real, armed = mesh_module._Works.wait, [True]

        def interrupt_once(self):
            if armed:
                armed.clear()
                raise KeyboardInterrupt("a signal")
            real(self)

        mesh_module._Works.wait = interrupt_once
        inflight = Inflight(depth=2)
        if how == "inflight":
            inflight.add(Flight(pending))
            del pending
        try:
            inflight.wait() if how == "inflight" else pending.wait()
        except KeyboardInterrupt as e:
            raised = type(e).__name__
            inflight.settle(mesh, e)
        finally:
            mesh_module._Works.wait = real
        del inflight
        pending = None
        gc.collect()
    else:
        start = time.monotonic()
        try:
            gathered = pending.wait().tolist()
        except fzero.MeshError as e:
            gathered = f"{type(e).__name__}: {e}"
        waited = time.monotonic() - start
    try:
        after = mesh.collective("all_reduce", torch.ones(1), arg="sum").tolist()
    except fzero.MeshError as e:
        after = f"{type(e).__name__}: {e}"
    return raised, gathered, waited, after


@pytest.mark.dist
@pytest.mark.parametrize("verify, how", [(True, "drop"), (False, "drop"), (True, "inflight")])
def test_an_interrupted_wait_keeps_its_exchange_and_the_mesh(dist2, verify, how):
    """Rank 0's interrupted all-gather still feeds rank 1, at once, and both ranks' next
    collective runs. Before, the interrupted wait had let go of the exchange: gloo cancelled rank
    0's send, rank 1 waited to the timeout ("ranks did not all reach all_gather ..."), and the next
    all-reduce failed on both ranks."""
    got = dist2.run(interrupted_wait, [(verify, how)] * 2, timeout=60)
    assert got[0][0] == "KeyboardInterrupt", got
    _, gathered, waited, after = got[1]
    assert gathered == [0.0, 0.0, 1.0, 1.0], got
    assert waited < T, got
    assert got[0][3] == got[1][3] == [2.0], got


def test_only_a_closed_connection_is_told_that_a_peer_left():
    """`DistMesh._lost`'s words for a failure that is neither a timeout nor a peer seen exiting: the
    two reasons a peer leaves (`_exited_without`) only where the backend says a connection closed;
    this rank's own failure in the collective's copy (a CUDA out of memory) was told of a peer
    that left (found in review)."""
    assert mesh_module._closed(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:2"))
    assert mesh_module._closed(RuntimeError("NCCL error: remote process exited or there was a network error"))
    assert not mesh_module._closed(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
