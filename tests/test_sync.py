"""The step's host synchronisation: one agreement per step and nothing else on the donating path.

- A donating step (`train_step(donate=True)`) does not read its update's finite flag on the host:
  the flag rides in the new state (`ZeroState.pending`) to the next step's agreement row, so an
  update that overflows raises `NonFiniteError` on every rank at the next step, naming the step
  and the leaves -- also where only one rank's shard broke -- and every other reader (`gather`,
  `checkpoint.save`, `evaluate`) raises the same before reading anything; `checkpoint.load` into
  the broken state restores it. SimMesh and gloo.
- `donate=False` keeps the immediate check: the step that would break the state raises (or
  skips) and returns the input state unchanged.
- Counted on the CPU: the donating step's host reads of tensors (`item`, `tolist`, `cpu`, `bool`,
  `float`, ...) other than the ones the host owns by contract (the step counter, the optimizer's
  per-leaf step counts) are exactly one, the agreement's; the pure step has one more (its finite
  flag). The collectives are counted too: one agreement, no update flag.
"""

from __future__ import annotations

import collections
import functools
import math
import sys
import threading
from unittest import mock

import optree
import pytest
import torch

import fzero
from fzero import optim
from fzero._src import step as step_module
from fzero._src import update as update_module
from fzero._src.mesh import Pending
from fzero._src.optim import base as optim_base
from fzero._src.optim.base import spec_of
from fzero._src.unit import finite_witness

from . import sync_cases
from .allreduce_cases import SplitSimMesh


def _check_broken(out: dict, rank: int, stage: int) -> None:
    loss, norm, skipped = out["metrics"]
    assert out["pending"] and not skipped and loss == loss and norm == norm  # the broken step itself returns
    ranks = "[0, 1]" if stage == 0 else "[1]"  # stage 0: every rank updates `b`; else its owner only
    for reader in ("step", "gather", "save", "evaluate"):
        text = out[reader]
        assert text.startswith("step 0: the update of a donating step"), (rank, reader, text)
        assert f"on rank(s) {ranks} in 'b' (" in text and "1 leaves" in text, (rank, reader, text)
        assert "fzero.checkpoint.load" in text, (rank, reader, text)
    assert out["saved"] == ["step-0"], out["saved"]  # save raised before writing anything
    assert out["restored"] == {k: v.tolist() for k, v in sync_cases.params().items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_broken_donated_update_raises_at_the_next_read_on_every_rank(stage, tmp_path):
    mesh = fzero.SimMesh(2)
    outs = mesh.run(functools.partial(sync_cases.broken_then_read, mesh, stage, str(tmp_path)))
    for r, out in enumerate(outs):
        _check_broken(out, r, stage)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_broken_donated_update_is_found_from_the_sums_of_its_blocks(stage, tmp_path):
    """The same, with the CPU update cut into blocks of a few elements (`optim.base.CPU_BLOCK`):
    the flag comes from the sums the update took of each block just after writing it
    (`update.BlockEnds`), which a spy sees taken."""
    mesh, real, seen = fzero.SimMesh(2), update_module._block_witness, []

    def spy(p, sums):
        seen.append(len(sums))
        return real(p, sums)

    threads = torch.get_num_threads()  # a block is CPU_BLOCK elements per thread: one thread, blocks of one
    torch.set_num_threads(1)
    try:
        with mock.patch.object(optim_base, "CPU_BLOCK", 1), mock.patch.object(update_module, "_block_witness", spy):
            outs = mesh.run(functools.partial(sync_cases.broken_then_read, mesh, stage, str(tmp_path)))
    finally:
        torch.set_num_threads(threads)
    assert seen and max(seen) > 1
    for r, out in enumerate(outs):
        _check_broken(out, r, stage)


def _witness_finite(w) -> bool:
    return bool(torch.isfinite(torch.stack([t.reshape(-1) for t in w]).reshape(-1)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_block_witness_is_finite_exactly_where_every_element_is(dtype):
    """`update._block_witness` from the sums of blocks of a buffer (gaps between them, where the
    update wrote nothing, read afresh): finite where every element is; not where a NaN or inf is
    in a block or a gap; finite where a block's elements are finite but their sum overflows (the
    minimum and maximum decide); and `finite_witness` itself where a view is not of the buffer."""
    big = torch.finfo(dtype).max

    def witness(p, blocks):
        return update_module._block_witness(p, [(p[a:b], p[a:b].sum()) for a, b in blocks])

    blocks = [(2, 5), (5, 9), (12, 16)]  # gaps: [0, 2), [9, 12), [16, 20)
    p = torch.randn(20, dtype=dtype)
    assert _witness_finite(witness(p, blocks))
    for at in (0, 3, 10, 19):
        for bad in (math.nan, math.inf, -math.inf):
            q = p.clone()
            q[at] = bad
            assert not _witness_finite(witness(q, blocks)), (at, bad)
    q = p.clone()
    q[5:9] = big  # finite elements, a sum that overflows
    assert not torch.isfinite(q[5:9].sum()) and _witness_finite(witness(q, blocks))
    other = torch.randn(20, dtype=dtype)
    q = p.clone()
    q[10] = math.inf
    w = update_module._block_witness(q, [(other[2:5], other[2:5].sum())])
    assert [t.tolist() for t in w] == [t.tolist() for t in finite_witness(q)]
    assert not _witness_finite(w)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 2])
def test_a_broken_donated_update_raises_at_the_next_read_on_every_gloo_rank(dist2, stage, tmp_path):
    root = tmp_path / f"gloo-{stage}"
    root.mkdir()
    outs = dist2.run(sync_cases.broken_then_read, [(stage, str(root))] * 2)
    for r, out in enumerate(outs):
        _check_broken(out, r, stage)


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_the_pure_step_checks_its_update_at_once(on_nonfinite):
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = sync_cases.fresh(mesh, 1)
        step = fzero.train_step(sync_cases.loss, on_nonfinite=on_nonfinite)
        if on_nonfinite == "raise":
            with pytest.raises(fzero.NonFiniteError, match=r"^step 0: .* in 'b' .*the state is unchanged"):
                step(state, torch.full((4,), 10.0))
            return True
        new, m = step(state, torch.full((4,), 10.0))
        return new is state and m.skipped and new.pending is None

    assert mesh.run(rank_fn) == [True, True]


def test_a_finite_donated_state_is_checked_once_per_reader():
    """A healthy pending flag costs a reader one small all-gather and nothing else; the next
    step reads it in its agreement row (no collective of its own)."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(sync_cases.params(), optim.sgd(0.1), stage=2, mesh=mesh)
        step = fzero.train_step(sync_cases.loss, donate=True)
        state, _ = step(state, torch.ones(4))
        assert state.pending is not None and state.pending.shape == () and float(state.pending) == 0
        with mesh.record() as log:
            fzero.gather(state)
        gather_tags = [c.tag for c in log if c.rank == mesh.rank]
        with mesh.record() as log:
            state, _ = step(state, torch.ones(4))
        return gather_tags, sorted({c.tag for c in log if c.rank == mesh.rank and (c.tag or "").startswith("fzero.")})

    for gather_tags, step_tags in mesh.run(rank_fn):
        assert gather_tags.count("fzero.state/pending") == 1
        assert step_tags == ["fzero.step/agree"]


# -- counting host reads ---------------------------------------------------------------------

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class HostReads:
    """Counts, per thread (SimMesh ranks are threads), the calls of `READS` on tensors while a
    `run_step` is running, by the name of the calling function; tensors the host owns by
    contract (`ZeroState.step`, CPU int64; the optimizer's "leaf" fields, CPU float32 step
    counts) are left out: on a GPU reading them is no synchronisation."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self._host = threading.local()
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        run_step = step_module.run_step
        monkeypatch.setattr(step_module, "run_step", lambda config, state, batch: self._within(
            run_step, config, state, batch))

    def _within(self, run_step, config, state, batch):
        host = {id(state.step)}
        for s in state.opt_state:
            if s is not None:
                host |= {id(t) for t, kind in zip(s, spec_of(state.optimizer, s)) if kind == "leaf"}
        self._host.ids = host
        try:
            return run_step(config, state, batch)
        finally:
            self._host.ids = None

    def _counted(self, name, method):
        def counted(t, *args, **kwargs):
            ids = getattr(self._host, "ids", None)
            if ids is not None and id(t) not in ids:
                self.counts[threading.get_ident()][f"{sys._getframe(1).f_code.co_name}.{name}"] += 1
            return method(t, *args, **kwargs)

        return counted


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("donate", [True, False])
def test_one_host_read_per_donating_step(stage, donate, monkeypatch):
    steps, n = 3, 2
    mesh = fzero.SimMesh(n)
    reads = HostReads(monkeypatch)
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(13, generator=g), "b": {"w": torch.randn(3, 5, generator=g)}}

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0])
        step = fzero.train_step(lambda p, x: torch.tanh(p["a"][:5] * x).sum() + (p["b"]["w"] @ x).square().mean(),
                                donate=donate)
        with mesh.record() as log:
            for t in range(steps):
                state, m = step(state, torch.ones(5) * (t + 1) * (mesh.rank + 1))
        return [c.tag for c in log if c.rank == mesh.rank and (c.tag or "").startswith("fzero.")]

    for tags in mesh.run(rank_fn):
        assert tags.count("fzero.step/agree") == steps and len(tags) == steps * (1 if donate else 2), tags
    want = {"agree.tolist": steps} | ({} if donate else {"_agreed_nonfinite.item": steps})
    assert len(reads.counts) == n
    for counts in reads.counts.values():
        # the CPU's finite checks read their CPU sum (`unit.finite_witness`): a CPU value waits
        # for no device; on any other device they read nothing (next test)
        assert {k: v for k, v in counts.items() if not k.startswith("finite_witness.")} == want


def test_finite_witness_reads_nothing_on_the_host_off_the_cpu():
    """Off the CPU `finite_witness` is the minimum and maximum, read by nobody in the step: on
    the meta device, where any host read raises, it returns the two 0-d tensors."""
    lo_hi = finite_witness(torch.empty(1000, device="meta"))
    assert len(lo_hi) == 2 and all(t.device.type == "meta" and t.dim() == 0 for t in lo_hi)


# -- stages 0-1 start their reduction in backward ---------------------------------------------


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_1_start_each_reduce_scatter_in_the_units_backward(stage, split):
    """With the autograd engine and accumulate="each", stages 0-1 start each bucket's
    reduce-scatter in its unit's backward (as stages 2-3), so they come in backward order (the
    loss reads a, b, c: backward reaches c first); stage 0 starts each bucket's gradient
    all-gather once the next bucket's reduce-scatter has started (`reduce.Chained`), the last after
    backward. With accumulate="once" (the sum is reduced after the last micro-batch) they come
    after backward, in bucket order, each all-gather after every reduce-scatter. On a mesh whose
    all-reduce has the bits of its reduce-scatter + all-gather
    (`Mesh.all_reduce_is_reduce_scatter_gather`: SimMesh, gloo) stage 0 issues one all-reduce per
    bucket instead, in the reduce-scatter's place; `SplitSimMesh` claims nothing, so stage 0 takes
    the two-collective path there. The bits are the same: tests/test_stages.py holds stages 0-1
    bitwise equal to stages 2-3, tests/test_allreduce.py the one all-reduce equal to the two
    collectives, and tests/test_ddp.py both to torch DDP over gloo."""
    mesh = (SplitSimMesh if split else fzero.SimMesh)(2)
    params = {"a": torch.randn(6), "b": torch.randn(5), "c": torch.randn(4)}

    def loss(p, x):
        return (torch.tanh(p["a"][:4] * x) * p["b"][:4] * p["c"]).sum()

    def order(accumulate):
        def rank_fn():
            state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=lambda path: path)
            tags = {b.tag: b.unit for b in state.layout.buckets}
            with mesh.record() as log:
                fzero.train_step(loss, accumulate=accumulate)(state, torch.ones(4))
            mine = [c for c in log if c.rank == mesh.rank]
            before = mine[: [c.tag for c in mine].index("fzero.step/agree")]  # the gradients' collectives
            return [(c.op, tags[c.tag]) for c in before if c.tag in tags]

        out = mesh.run(rank_fn)
        assert out[0] == out[1]
        return out[0]

    rs, ag, ar = ("reduce_scatter",), ("all_gather",), ("all_reduce",)
    if stage == 0 and not split:
        assert order("each") == [ar + (u,) for u in "cba"]
        assert order("once") == [ar + (u,) for u in "abc"]
        return
    chained = [rs + ("c",), rs + ("b",), ag + ("c",), rs + ("a",), ag + ("b",), ag + ("a",)]
    assert order("each") == (chained if stage == 0 else [rs + (u,) for u in "cba"])
    assert order("once") == [rs + (u,) for u in "abc"] + ([ag + (u,) for u in "abc"] if stage == 0 else [])


class _HeldSimMesh(fzero.SimMesh):
    """A SimMesh whose started collectives stay open until waited, holding their input beside
    their result where the result is not written into it -- as DistMesh's reduce-scatter holds the
    local gradient (and gloo's staging): `events` notes, per rank, each start and each wait of a
    collective with a tag."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.events: dict[int, list[tuple[str, str, str]]] = collections.defaultdict(list)

    def _start(self, call, x, donate=False, out=None):
        done = super()._start(call, x, donate, out)
        log = self.events[self.rank]
        log.append(("start", call.op, call.tag))

        class Work:
            def wait(self):
                log.append(("wait", call.op, call.tag))

        return Pending(done.wait(), Work(), keep=x)


@pytest.mark.parametrize("stage", [0, 1])
def test_stage_1_waits_each_reduce_scatter_once_the_next_has_started(stage):
    """Stage 1's reduce-scatter holds the unit's local gradient `flat[N * S]` (and, over gloo, a
    staging copy of it) until waited: `reduce.Chained` waits each one once the next bucket's has
    started (`Flight.advance` of a last phase that `Pending.holds_more`), so a step holds one or
    two of them at a time, not every unit's until the backward ends. Stage 0's all-reduce runs in
    its donated buffer (the result is the input: nothing more held), so it is waited after the
    backward, as before. The bits are the same either way: the state after two steps equals the
    plain SimMesh's (every collective completes before returning there)."""
    n, units = 2, "abcd"
    params = {u: torch.randn(8, generator=torch.Generator().manual_seed(i)) for i, u in enumerate(units)}

    def loss(p, x):
        h = x
        for u in units:
            h = torch.tanh(p[u] * h)
        return h.sum()

    def run(mesh):
        def rank_fn():
            state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda path: path)
            tags = {b.tag: b.unit for b in state.layout.buckets}
            step = fzero.train_step(loss)
            for t in range(2):
                state, _ = step(state, torch.full((8,), float(t + mesh.rank + 1)))
            return fzero.gather(state), tags

        return mesh.run(rank_fn)

    held = _HeldSimMesh(n)
    out, plain = run(held), run(fzero.SimMesh(n))
    tags = out[0][1]
    for r in range(n):
        for a, b in zip(optree.tree_leaves(out[r][0]), optree.tree_leaves(plain[r][0])):
            assert torch.equal(a, b)
        step1 = held.events[r][: len(held.events[r]) // 2]
        got = [(what, tags[tag]) for what, op, tag in step1 if tag in tags and op != "all_gather"]
        if stage == 1:  # backward reaches d first; d's wait follows c's start, ..., a's after backward
            assert got == [("start", "d"), ("start", "c"), ("wait", "d"), ("start", "b"), ("wait", "c"),
                           ("start", "a"), ("wait", "b"), ("wait", "a")], got
        else:
            assert got == [("start", u) for u in "dcba"] + [("wait", u) for u in "abcd"], got


def test_reduce_starts_every_buckets_all_gather_before_it_waits_for_one(monkeypatch):
    """Stage 0 on a mesh whose all-reduce is a reduce-scatter then an all-gather (`SplitSimMesh`,
    NCCL at N > 2), reducing after the micro-batches (`accumulate="once"`: `reduce.reduce`): every
    bucket's all-gather is started (`Flight.advance`) before the first wait, so they overlap. A
    mutation audit's survivor dropped the advance: the same bits, each all-gather started only
    after the one before it was waited for."""
    from fzero._src import stages

    events = []
    advance, wait = stages.Flight.advance, stages.Flight.wait

    def spied_advance(self):
        if self.then is not None and mesh.rank == 0:  # a flight with an all-gather to start
            events.append(("start", id(self)))
        return advance(self)

    def spied_wait(self):
        out = wait(self)
        if mesh.rank == 0:
            events.append(("waited", id(self)))
        return out

    monkeypatch.setattr(stages.Flight, "advance", spied_advance)
    monkeypatch.setattr(stages.Flight, "wait", spied_wait)
    mesh = SplitSimMesh(2)

    def run():
        state = fzero.init({f"l{i}": torch.ones(64) for i in range(3)}, optim.sgd(0.1), stage=0, mesh=mesh,
                           bucket_bytes=256)
        step = fzero.train_step(lambda p, x: sum((v * x).sum() for v in p.values()), accumulate="once",
                                micro_batches=2)
        if mesh.rank == 0:
            events.clear()
        step(state, [torch.ones(64), torch.ones(64)])

    mesh.run(run)
    kinds = [kind for kind, _ in events]
    assert kinds.count("start") >= 3 and "waited" in kinds, events
    first_wait = kinds.index("waited")
    assert kinds[:first_wait].count("start") >= 3, events
