"""Edges of a step found in review: what a loss that raises (or drops a result) leaves behind in
stage 3, when a donating step refuses a derivative through it, and what an error of the loss says
where `micro_batches=k` read a batch `(x, y)` as the micro-batches x and y.

- A stage-3 step that frees units after use (`gather="on_use"`, flat-dict params, N > 1) packs
  every tensor the loss saves for backward (`gathering._Unpacking`). A saved output (softmax,
  exp, tanh: the op saves its own result) was held with its `grad_fn`, whose node held it back:
  a cycle through C++ the collector cannot free. Where no backward ran through that node -- a
  loss that raised in its forward, a result computed in grad mode and dropped -- the step's
  `Gathering` (its gathered units, prefetches, the input state's buffers) and the graph leaked,
  every such step. And a loss that raised after reading unit u (prefetch on) left the gather of
  the unit after it unwaited (`Gathering.finish` dropped only backward's refills on an error).
- A donating step differentiated through refused only after its whole forward and backward.
- `step(state, (x, y))` with `micro_batches=2`, x and y int64 [B, T], passes `_check_alike` and
  the loss's `x, y = mb` raised "too many values to unpack", naming no step setting.
"""

from __future__ import annotations

import contextlib
import gc
import re
import weakref

import pytest
import torch
import torch.nn.functional as F

import fzero
import fzero.testing
from fzero import optim
from fzero._src.gathering import Gathering
from fzero._src.stages import Flight

from . import prefetch_cases as cases

D, HIDDEN = 8, (8, 12, 16)  # units "default", "blocks.0", "blocks.1", "blocks.2"


# -- a stage-3 loss that raises in its forward, or drops a saved output ---------------------------


@contextlib.contextmanager
def _census():
    """Yield `(made, unwaited)`: after the body, `made` holds a weak reference to each `Gathering`
    made in it, and `unwaited` the unit of each flight `Gathering._start` started in it that nobody
    waited for (`Flight.wait`). The flights are held weakly too, so that what the step lets go of
    is freed as it would be."""
    made: list[weakref.ref] = []
    started: list[tuple[str, int]] = []
    waited: set[int] = set()
    init, start, wait = Gathering.__init__, Gathering._start, Flight.wait

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    def spy_start(self, unit):
        flights = start(self, unit)
        started.extend((unit, id(f)) for f in flights)
        return flights

    def spy_wait(self):
        waited.add(id(self))
        return wait(self)

    unwaited: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Gathering, "__init__", spy_init)
        mp.setattr(Gathering, "_start", spy_start)
        mp.setattr(Flight, "wait", spy_wait)
        try:
            yield made, unwaited
        finally:
            unwaited.extend(u for u, i in started if i not in waited)


def raise_then_step(mesh, raising: bool, dropped: bool = False):
    """On one rank (SimMesh thread or pool worker): stage 3, prefetch 1. Where `raising`, a first
    step whose loss raises `ValueError` after reading the units "default" and "blocks.0" (prefetch
    has started "blocks.1"'s gather), caught; then one step of the same state on another batch,
    whose loss, where `dropped`, also computes a softmax of the logits in grad mode and drops it.
    Returns `(the error's text or None, loss, gathered params)`."""
    params, apply, info = cases.model(D, HIDDEN)
    seen: list[int] = []

    def loss(p, b):
        if raising and not seen:
            seen.append(1)
            apply(p, b[0], [0])  # the embedding and blocks.0
            raise ValueError("refused in the forward")
        logits = apply(p, b[0])
        if dropped:
            logits.softmax(-1)  # a statistic computed in grad mode, dropped: its node saved its output
        return F.cross_entropy(logits.flatten(0, 1), b[1].flatten())

    state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units)
    step = fzero.train_step(loss, prefetch=1)
    error = None
    if raising:
        try:
            step(state, cases.batch(mesh.rank))
        except ValueError as e:
            error = str(e)
    state, metrics = step(state, cases.batch(mesh.rank + 2))
    return error, metrics.loss, fzero.gather(state)


def _censused(run):
    """`(run()'s result, [each Gathering made in it alive after it], [units of flights started in
    it that nobody waited for])`, the census taken around the whole run (SimMesh's ranks are
    threads of this process: one patch for all)."""
    with _census() as (made, unwaited):
        out = run()
        gc.collect()
        alive = [r() is not None for r in made]
    return out, alive, unwaited


def _same(a, b):
    """Same loss and gathered params, bit for bit."""
    assert torch.equal(a[1], b[1]), (a[1], b[1])
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def _run_sim(raising: bool, dropped: bool = False):
    mesh = fzero.SimMesh(2)
    return _censused(lambda: mesh.run(lambda: raise_then_step(mesh, raising, dropped)))


def test_a_loss_that_raises_in_its_forward_leaves_no_gather_in_flight_and_frees_its_gathering():
    """SimMesh(2), stage 3, prefetch 1: the loss raises after reading blocks.0, whose read started
    blocks.1's gather. That gather is waited for (before: never, `finish` dropped refills only),
    the failed step's `Gathering` is freed (before: kept forever by the saved-output cycle, with
    its gathered units and that gather), and the next step of the same state has the bits of a
    run whose loss never raised."""
    (got, alive, unwaited), (want, _, _) = _run_sim(raising=True), _run_sim(raising=False)
    for g, w in zip(got, want):
        assert g[0] == "refused in the forward"
        _same(g, w)
    assert unwaited == [], unwaited
    assert alive == [False] * 4, alive  # two steps on two ranks


def test_a_result_the_loss_drops_does_not_keep_the_steps_gathering():
    """A loss that computes `logits.softmax(-1)` in grad mode and drops it (a metric): no backward
    runs through the softmax's node, which saved its output. Before, every such stage-3 step kept
    its `Gathering` (and the input state's buffers, the dropped graph) for good."""
    _, alive, _ = _run_sim(raising=False, dropped=True)
    assert alive == [False, False], alive


def raise_then_step_over_gloo(mesh):
    """On a pool worker: `raise_then_step` with the raising first step, under the census, and
    without it."""
    return _censused(lambda: raise_then_step(mesh, True)), raise_then_step(mesh, False)


@pytest.mark.dist
def test_over_gloo_a_loss_that_raises_in_its_forward_leaves_no_gather_in_flight(dist2):
    """DistMesh (gloo, 2 workers), where prefetch is asynchronous: the failed step waits for the
    gather it started ahead (no hang: every rank started it), frees its `Gathering`, and the next
    step has the bits of a run whose loss never raised."""
    for (got, alive, unwaited), want in dist2.run(raise_then_step_over_gloo, timeout=60):
        assert got[0] == "refused in the forward"
        _same(got, want)
        assert unwaited == [], unwaited
        assert alive == [False, False], alive


def raise_in_evaluate(mesh):
    """On one rank: stage 3, prefetch 1, an `evaluate` whose function raises after reading the
    embedding and blocks.0 (prefetch has started blocks.1's gather), caught; then the same
    evaluation whole. Returns `(the error's text, its output)`."""
    params, apply, info = cases.model(D, HIDDEN)
    state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units)
    batch = cases.batch(mesh.rank)

    def failing(p, b):
        apply(p, b[0], [0])
        raise ValueError("refused in the evaluation")

    try:
        fzero.evaluate(failing, prefetch=1)(state, batch)
    except ValueError as e:
        error = str(e)
    return error, fzero.evaluate(lambda p, b: apply(p, b[0]), prefetch=1)(state, batch)


def test_an_evaluation_that_raises_leaves_no_gather_in_flight():
    """`fzero.evaluate` as the step: the gather its function's read started ahead is waited for
    (before: `Gathering.call` drains only where the function returns, and nothing else did), and
    the next evaluation has the bits of the model on the full params."""
    mesh = fzero.SimMesh(2)
    (got, _, unwaited) = _censused(lambda: mesh.run(lambda: raise_in_evaluate(mesh)))
    params, apply, _ = cases.model(D, HIDDEN)
    for rank, (error, out) in enumerate(got):
        assert error == "refused in the evaluation"
        assert torch.equal(out, apply(params, cases.batch(rank)[0]))
    assert unwaited == [], unwaited


def raise_at_different_units_unverified(mesh, group_timeout: float):
    """On a pool worker: stage 3, prefetch 1, over a `DistMesh(verify=False)` on a gloo group of
    its own (its timeout `group_timeout`): rank 0's loss raises after reading blocks.0 and
    blocks.1 (so it started blocks.2's gather), rank 1's after blocks.0 (it never starts
    blocks.2's). Returns `(the error's text, seconds the step took)`."""
    import datetime
    import time

    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout))
    m = fzero.DistMesh(group, verify=False, timeout=group_timeout)
    params, apply, info = cases.model(D, HIDDEN)
    read = [0, 1] if m.rank == 0 else [0]

    def loss(p, b):
        apply(p, b[0], read)
        raise ValueError(f"rank {m.rank} refused")

    state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=m, units=info.units)
    start = time.monotonic()
    try:
        fzero.train_step(loss, prefetch=1)(state, cases.batch(m.rank))
    except ValueError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.dist
def test_unverified_ranks_that_raise_at_different_units_do_not_wait_for_each_others_prefetch():
    """Over `DistMesh(verify=False)` a rank cannot know its peers started the gather it started
    ahead: a peer that raised earlier never did. The rank that raised later gets its error at
    once (`Mesh.starts_agreed`), not at the group's timeout (found in review of the change that
    made `finish` wait for the forward's prefetches: it waited the 8 s out)."""
    with fzero.testing.Pool(2, timeout=60) as pool:  # a pool of its own: the unmatched gather stays behind
        got = pool.run(raise_at_different_units_unverified, [(8.0,)] * 2)
    for rank, (error, seconds) in enumerate(got):
        assert error == f"rank {rank} refused"
        assert seconds < 4.0, (rank, seconds)



def one_sided_exchange_then_a_shared_one(mesh, group_timeout: float):
    """On a pool worker, over `DistMesh(verify=False)` on a gloo group of its own: rank 0 starts an
    all-gather rank 1 never starts, and keeps its handle (as a rank that raised keeps the gathers
    it prefetched, `Mesh.abandon`); then both all-gather. Returns what the shared all-gather gave
    (a list of floats) or the error's type name."""
    import datetime

    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout))
    m = fzero.DistMesh(group, verify=False, timeout=group_timeout)
    held = m.start("all_gather", torch.full((2,), 100.0 + m.rank), tag="one-sided") if m.rank == 0 else None
    try:
        return m.collective("all_gather", torch.full((2,), 10.0 + m.rank), tag="shared").tolist()
    except fzero.MeshError as e:
        return type(e).__name__ + (" (held)" if held is not None else "")


@pytest.mark.dist
def test_an_exchange_only_one_rank_started_never_feeds_the_next_one():
    """gloo's point-to-point exchanges (DistMesh's all-gather and reduce-scatter at N = 2) each carry
    a tag of their own (`DistMesh._p2p_tag`: the collective and its count). Before, all used tag 0
    and gloo matched them first in, first out: rank 1's shared all-gather received the one-sided
    gather's 100.0 where rank 0 had sent 10.0 -- wrong bits, silently (found in review). Now the
    one-sided exchange matches nothing and the shared one gives both ranks the right values."""
    with fzero.testing.Pool(2, timeout=60) as pool:  # a pool of its own: the one-sided gather stays behind
        got = pool.run(one_sided_exchange_then_a_shared_one, [(2.0,)] * 2)
    assert got == [[10.0, 10.0, 11.0, 11.0]] * 2, got


def a_gather_one_rank_lets_go_of(mesh, group_timeout: float):
    """On a pool worker, over `DistMesh(verify=False)`: both ranks start an all-gather; rank 1 lets
    go of its handle at once -- first through `Mesh.abandon`, then by dropping it (what a rank
    that raised did before) -- while rank 0 waits for it half a second later. Returns rank 0's
    results (the gathered floats, or the error's type name) for the two, in that order."""
    import datetime
    import gc
    import time

    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout))
    m = fzero.DistMesh(group, verify=False, timeout=group_timeout)
    got = []
    for how in ("abandon", "drop"):
        pending = m.start("all_gather", torch.full((2,), 10.0 + m.rank), tag=how)
        if m.rank == 1:
            if how == "abandon":
                m.abandon(pending)
            del pending
            gc.collect()
            continue
        time.sleep(0.5)
        try:
            got.append(pending.wait().tolist())
        except fzero.MeshError as e:
            got.append(type(e).__name__)
    return got


@pytest.mark.dist
def test_a_gather_a_rank_abandons_still_reaches_the_peer_that_waits_for_it():
    """gloo cancels a point-to-point exchange whose work handle is freed: the peer that waits for
    it waits out the timeout (rank 0's "drop" result). `DistMesh.abandon` keeps the handle, so
    the peer gets the data; `Gathering.finish` hands it the gathers a rank that raised leaves
    unwaited over `DistMesh(verify=False)` (before, it dropped them: the test above failed about
    one run in eight on a loaded machine, rank 0 timing out on blocks.1; found in review)."""
    with fzero.testing.Pool(2, timeout=60) as pool:
        got = pool.run(a_gather_one_rank_lets_go_of, [(2.0,)] * 2)
    assert got == [[[10.0, 10.0, 11.0, 11.0], "MeshError"], []], got

# -- a donating step differentiated through: refused before its forward ---------------------------


def _donating_refusal(mesh, stage: int, how: str):
    """On one rank: `(the error's text, how many times the loss ran)` for a donating step
    differentiated through its params, by `torch.func.grad` ("func") or by plain autograd
    ("autograd": params that require grad)."""
    calls: list[int] = []

    def loss(p, b):
        calls.append(1)
        return 0.5 * ((p["a"] - b) ** 2).sum()

    state = fzero.init({"a": torch.linspace(-1.0, 1.0, 6)}, optim.sgd(0.25), stage=stage, mesh=mesh)
    step = fzero.train_step(loss, engine="func", donate=True)
    batch = torch.ones(6) * mesh.rank
    try:
        if how == "func":
            torch.func.grad(lambda p: step(state.replace(params=p), batch)[0].params[0].sum())(state.params)
        else:
            tracked = state.replace(params=[p.detach().requires_grad_() for p in state.params])
            step(tracked, batch)
    except fzero.ConfigError as e:
        return str(e), len(calls)
    return None, len(calls)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("how", ["func", "autograd"])
def test_a_donating_step_refuses_a_derivative_through_it_before_calling_the_loss(stage, how):
    """The same `ConfigError` as before, on every rank, but the loss never runs (before: the whole
    forward and backward ran, and the update refused)."""
    mesh = fzero.SimMesh(2)
    for rank, (msg, calls) in enumerate(mesh.run(lambda: _donating_refusal(mesh, stage, how))):
        assert msg is not None and msg.startswith("train_step(..., donate=True) is being differentiated through"), msg
        assert f"rank {rank}, stage {stage}" in msg and "Use donate=False" in msg, msg
        assert calls == 0, calls


# -- micro_batches=k with one batch (x, y): a note on the loss's error -------------------------------


def _unpacking_loss(p, mb):
    x, y = mb  # a micro-batch (x, y)
    return F.cross_entropy(p["emb"][x].flatten(0, 1), y.flatten())


def _step_error(k: int, batch, loss=_unpacking_loss) -> BaseException:
    """The exception a stage-0 step at N = 1 with `micro_batches=k` raises on `batch`."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init({"emb": torch.linspace(-1.0, 1.0, 40).reshape(5, 8)}, optim.sgd(0.1), stage=0, mesh=mesh)
        fzero.train_step(loss, micro_batches=k)(state, batch)

    with pytest.raises(Exception) as info:
        mesh.run(rank_fn)
    return info.value


def _ids(*shape, seed=0):
    return torch.randint(0, 5, shape, generator=torch.Generator().manual_seed(seed))


def _fzero_notes(e: BaseException) -> list[str]:
    return [n for n in getattr(e, "__notes__", []) if n.startswith("fzero: ")]


@pytest.mark.parametrize("stage", [0, 2])
def test_a_tuple_of_tensors_given_as_micro_batches_is_warned_and_a_list_is_not(stage):
    """docs/bad-input.md row 273: a float regression's batch `(x, y)`, x and y float32 [2, 3],
    passed as it is to a step with `micro_batches=2`, reads as the micro-batches x and y, and a
    loss that indexes `b[0]`, `b[1]` trains on their rows with no error (found in review of
    accumulation). The tuple is warned, `AmbiguousMicroBatches`, naming k, the tensors and both
    ways out; the same tensors in a list (micro-batches said so) are not."""
    x = torch.linspace(-1.0, 1.0, 6).reshape(2, 3)
    y = torch.linspace(0.5, 2.0, 6).reshape(2, 3)
    mesh = fzero.SimMesh(1)

    def rank_fn(batch):
        state = fzero.init({"w": torch.eye(3)}, optim.sgd(0.1), stage=stage, mesh=mesh)
        _, metrics = fzero.train_step(lambda p, b: F.mse_loss(b[0] @ p["w"], b[1]), micro_batches=2)(state, batch)
        return float(metrics.loss)

    with pytest.warns(fzero.AmbiguousMicroBatches, match=re.escape(
            "micro_batches=2: the step reads this tuple of 2 tensors (float32[2, 3], float32[2, 3]) as 2 "
            "micro-batches, each a bare tensor the loss is given alone. If it is one batch (x, y), the loss trains "
            "on x and y as micro-batches: pass [(x0, y0), (x1, y1), ...]. If they are micro-batches, pass them as "
            "a list (list(x.chunk(2))), which is not warned")):
        mesh.run(rank_fn, [((x, y),)])
    mesh.run(rank_fn, [([x, y],)])  # a list: no warning (the suite makes one an error)
    chunks = mesh.run(rank_fn, [([(x[:1], y[:1]), (x[1:], y[1:])],)])[0]
    assert chunks == pytest.approx(F.mse_loss(x, y).item(), rel=1e-6)

def test_a_batch_read_as_micro_batches_says_so_on_the_losss_error_and_only_there():
    """`step(state, (x, y))` with micro_batches=2, x and y int64 [3, 4]: the loss's `x, y = mb`
    raises torch's "too many values to unpack" as before, with a note naming micro_batches=2, the
    micro-batch it raised on and what it is, and the form step takes. No note at k = 1, nor on an
    error of fzero's own class at k = 2. (The tuple is warned first, row 273.)"""
    with pytest.warns(fzero.AmbiguousMicroBatches):
        e = _step_error(2, (_ids(3, 4), _ids(3, 4, seed=1)))
    assert isinstance(e, ValueError) and "too many values to unpack" in str(e), e
    notes = _fzero_notes(e)
    assert len(notes) == 1, getattr(e, "__notes__", None)
    assert "micro_batches=2" in notes[0] and "micro-batch 0, a tensor int64[3, 4]" in notes[0], notes[0]
    assert "[(x0, y0), (x1, y1), ...]" in notes[0], notes[0]

    well_formed = [(_ids(3, 4), _ids(3, 4)), (_ids(3, 4), _ids(3, 4))]

    def broken_model(p, mb):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    e = _step_error(2, well_formed, loss=broken_model)  # the model's own error: one line, no advice
    assert _fzero_notes(e) == ["fzero: the loss raised on micro-batch 0 of 2 (micro_batches=2)"], e.__notes__

    e = _step_error(1, _ids(3, 4))
    assert isinstance(e, ValueError) and "too many values to unpack" in str(e), e
    assert _fzero_notes(e) == [], e.__notes__

    def refusing(p, mb):
        raise fzero.ConfigError("refused by the loss")

    e = _step_error(2, [(_ids(3, 4), _ids(3, 4)), (_ids(3, 4), _ids(3, 4))], loss=refusing)
    assert isinstance(e, fzero.ConfigError) and "refused by the loss" in str(e), e
    assert _fzero_notes(e) == [], e.__notes__
