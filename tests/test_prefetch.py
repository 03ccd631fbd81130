"""Stage-3 prefetch (`train_step(..., prefetch=k)`): gathers started ahead of use change no bit,
and the gathered parameter storage live at once stays within the persistent units plus
(1 + k) of the largest unit (proofs/stage3.md, section 5).

The census (`fzero.accounting.LiveStorages`) counts every storage allocated inside a unit's
all-gather on a `GatherCensusMesh` (tests/prefetch_cases.py): SimMesh's concatenation of the
shards and each rank's copy of the result -- the forward's gathered units and backward's refills
-- and nothing else (gradients, activations and the agreement's all-gather are not counted).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import fzero
from fzero.accounting import LiveStorages
from fzero.testing import examples

from . import prefetch_cases as cases


def _equal(a, b):
    """Same losses and same gathered params, bit for bit, on every rank."""
    for (pa, la), (pb, lb) in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(la, lb)), (la, lb)
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def _unit_bytes(d, hidden, n):
    """`{unit: gathered bytes}` of the `Tiny` model at world size n (`UnitProgram.gathered_bytes`)."""
    params, _, info = cases.model(d, hidden)
    mesh = fzero.SimMesh(n)

    def rank_fn():
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        return {u: sum(b.padded_numel * 4 for b in state.layout.buckets if b.unit == u) for u in state.layout.units}

    return mesh.run(rank_fn)[0]


def _census_run(n, stage, d, hidden, **settings):
    """`(per-rank results of cases.train, peak gathered bytes over all ranks, bytes still live
    after the steps)`, one step."""
    mesh = cases.GatherCensusMesh(n)
    census = LiveStorages(count=mesh.inside)

    def rank_fn():
        with census:
            out = cases.train(mesh, stage, d, hidden, steps=1, **settings)
            torch.zeros(1).add_(1)  # one more op: the census re-reads what is live
        return out

    out = mesh.run(rank_fn)
    return out, census.peak, census.current


MODELS = st.tuples(st.integers(1, 5), st.sampled_from([4, 8]), st.lists(st.sampled_from([4, 8, 12, 20]),
                                                                         min_size=5, max_size=5))


@examples(8)
@given(MODELS, st.integers(1, 3), st.integers(2, 3), st.sampled_from(["autograd", "func"]))
def test_prefetch_is_bitwise_equal_to_stage_0(model, k, n, engine):
    """Random depth, width and block sizes; two AdamW steps: stage 3 with prefetch k equals
    stage 0 (and so stage 3 without prefetch) in every loss and parameter bit: gathers started
    early copy the same bits (proofs/stage3.md, the one fact). k >= 1 and N >= 2: at k = 0 nothing
    is prefetched, and at N = 1 nothing is gathered (each unit reads its held shard), so neither
    tests a prefetch; drawn from k in 0..3 and N in 1..3, 5 of the 8 examples were such (3 at
    N = 1, 3 at k = 0)."""
    depth, d, widths = model
    hidden = tuple(widths[:depth])
    mesh0, mesh3 = fzero.SimMesh(n), fzero.SimMesh(n)
    want = mesh0.run(functools.partial(cases.train, mesh0, 0, d, hidden))
    got = mesh3.run(functools.partial(cases.train, mesh3, 3, d, hidden, prefetch=k, engine=engine))
    _equal(want, got)


@examples(8)
@given(MODELS, st.integers(0, 3), st.integers(2, 3))
@example((2, 8, [4, 12, 4, 4, 4]), 1, 1)  # N = 1 once, explicitly: nothing gathered
def test_live_gathered_bytes_stay_within_persistent_plus_1_plus_k_largest_units(model, k, n):
    """The live-storage oracle. Per rank, at any moment of the step: the root unit ("default":
    embedding, final norm, head; read first, freed only after its backward, so persistent for
    the step), the unit in use and at most k prefetched ones: `P + (1 + k) * L` with L the
    largest block. Over the N ranks, add one unit for the only transient: SimMesh builds each
    gather's result as a concatenation before copying it to every rank (a backward refill
    gathers into the freed storage itself; one rank runs at a time, so one such transient
    exists at once). Lower bound, so the census is not vacuous: the forward holds
    min(1 + k, depth) blocks at once on every rank. At N = 1 there is nothing to gather: each unit
    reads its held shard itself (no gathered copy, nothing freed or gathered again)."""
    depth, d, widths = model
    hidden = tuple(widths[:depth])
    sizes = _unit_bytes(d, hidden, n)
    root, blocks = sizes["default"], [v for u, v in sizes.items() if u != "default"]
    out, peak, after = _census_run(n, 3, d, hidden, prefetch=k)
    want, _, _ = _census_run(n, 0, d, hidden)
    _equal(want, out)
    if n == 1:
        assert (peak, after) == (0, 0), (peak, after)
        return
    largest = max(blocks)
    assert peak <= n * (root + (1 + k) * largest) + max(largest, root), (peak, root, blocks, k, n)
    assert peak >= n * (root + sum(sorted(blocks)[: min(1 + k, depth)])), (peak, root, blocks, k, n)
    assert after == 0  # every gathered storage (prefetched ones never read included) is freed


def test_a_prefetched_unit_never_read_is_dropped_and_a_unit_read_out_of_order_is_gathered_on_demand():
    """The forward runs blocks 2, 0 and skips 1 and 3 (every rank): predicted (layout) order
    prefetches blocks the forward does not read next or at all. The bits equal stage 0 on the
    same path, every gathered storage is freed by the end, and each unit is gathered at least as
    often as without prefetch, at most twice more (one dropped forward prefetch and one dropped
    backward prefetch)."""
    n, d, hidden, order = 2, 8, (8, 12, 16, 4), (2, 0)

    def gathers(**settings):
        mesh = cases.GatherCensusMesh(n)
        census = LiveStorages(count=mesh.inside)

        def rank_fn():
            with census, mesh.record() as log:
                out = cases.train(mesh, 3, d, hidden, steps=1, order=order, **settings)
                torch.zeros(1).add_(1)
            units = [r.tag.split("/")[0] for r in log if r.op == "all_gather" and r.rank == mesh.rank
                     and not r.tag.startswith("fzero.")]
            return out, {u: units.count(u) for u in set(units)}

        res = mesh.run(rank_fn)
        return [o for o, _ in res], res[0][1], census.current

    mesh0 = fzero.SimMesh(n)
    want = mesh0.run(functools.partial(cases.train, mesh0, 0, d, hidden, 1, order))
    base, count0, left0 = gathers()
    for k in (1, 2, 3):
        got, count, left = gathers(prefetch=k)
        _equal(want, got)
        _equal(base, got)
        assert left == left0 == 0
        assert all(count0.get(u, 0) <= count[u] <= count0.get(u, 0) + 2 for u in count), (k, count0, count)
        assert count != count0  # non-vacuous: some prefetch was dropped


def test_the_cap_counts_prefetched_units():
    """`max_live_bytes` of two blocks (plus the root unit): with prefetch 3 the forward may hold
    only one prefetched block besides the one in use; the census over both ranks stays within
    N * cap + one unit (SimMesh's concatenation), the bits equal the uncapped step's."""
    n, d, hidden = 2, 8, (12, 12, 12, 12, 12)
    sizes = _unit_bytes(d, hidden, n)
    cap = sizes["default"] + 2 * sizes["blocks.0"]
    free, peak_free, _ = _census_run(n, 3, d, hidden, prefetch=3)
    capped, peak_capped, after = _census_run(n, 3, d, hidden, prefetch=3, max_live_bytes=cap)
    _equal(free, capped)
    assert peak_capped <= n * cap + sizes["blocks.0"], (peak_capped, cap)
    assert peak_free > n * cap + sizes["blocks.0"]  # non-vacuous: uncapped, prefetch 3 holds more
    assert after == 0


def test_prefetch_rejects_bad_settings():
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(fzero.ConfigError, match="prefetch must be None or an int >= 0"):
            fzero.train_step(lambda p, b: 0, prefetch=bad)


@pytest.mark.dist
@pytest.mark.parametrize("k", [1, 2, None])
def test_prefetch_over_gloo_equals_simmesh(dist2, k):
    """DistMesh (gloo, 2 workers): `Mesh.start` issues the gathers asynchronously; the params
    and losses equal SimMesh's, without prefetch, bit for bit (k None: the default, one unit
    ahead on DistMesh). The SimMesh reference runs in the workers too: their kernels (another
    intra-op thread count) may round a matmul differently from this process's, which no mesh
    choice explains."""
    d, hidden = 8, (8, 12, 16)
    got = dist2.run(cases.train_with_prefetch, [(3, d, hidden, 2, None, k)] * 2)
    want = dist2.run(cases.sim_train_with_prefetch, [(3, d, hidden, 2, None, 0)] * 2)
    _equal(want, got)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_evaluate_with_prefetch_returns_the_same_bits_within_the_same_bound(k):
    """`fzero.evaluate(fn, prefetch=k)`: the logits equal those without prefetch, and the census
    of gathered storage over N = 2 ranks peaks within `N * (P + (1 + k) * L) + L` (the forward
    part of the oracle above), at least `N * (P + min(1 + k, depth) * L)` (blocks of one size)."""
    n, d, hidden = 2, 8, (12, 12, 12, 12)
    sizes = _unit_bytes(d, hidden, n)
    root, block = sizes["default"], sizes["blocks.0"]
    params, apply, info = cases.model(d, hidden)

    def run(prefetch):
        mesh = cases.GatherCensusMesh(n)
        census = LiveStorages(count=mesh.inside)

        def rank_fn():
            state = fzero.init(params, fzero.optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
            with census:
                return fzero.evaluate(lambda p, x: apply(p, x), prefetch=prefetch)(state, cases.batch(mesh.rank)[0])

        return mesh.run(rank_fn), census.peak

    (want, _), (got, peak) = run(0), run(k)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert n * (root + min(1 + k, len(hidden)) * block) <= peak <= n * (root + (1 + k) * block) + block, peak


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("orders", [((0, 1, 2), (0, 2, 1)), ((0, 1, 2), (0, 2))], ids=["reorder", "skip"])
def test_ranks_that_take_different_paths_still_stop_with_divergent_paths(orders, k):
    """Prefetch follows the layout's order on every rank, so the gathers of ranks whose forwards
    read blocks in different orders may still match; their backward reduces the units in
    another order, and every rank stops with `DivergentPaths`, never a hang or a silent step."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        return cases.train(mesh, 3, 8, (8, 8, 8), steps=1, order=orders[mesh.rank], prefetch=k)

    with pytest.raises(fzero.DivergentPaths, match="ranks took different paths"):
        mesh.run(rank_fn)


def test_the_default_prefetch_is_one_unit_where_gathers_overlap_compute(dist2):
    """`train_step(prefetch=None)` (the default) prefetches one unit on a mesh whose `start`
    returns before the gather is done (DistMesh over N > 1), none on SimMesh (which completes a
    gather in `start`) or under a torch.func transform; an explicit depth is kept, but not
    under a transform (there every gather runs in place)."""
    sim = fzero.SimMesh(2)
    assert sim.run(lambda: cases.default_prefetch(sim)) == [(False, 0, 2, 0)] * 2
    assert dist2.run(cases.default_prefetch) == [(True, 1, 2, 0)] * 2


@pytest.mark.parametrize("k", [0, 1])
def test_the_forwards_last_unit_stays_gathered_and_the_next_refill_starts_as_the_forward_ends(k):
    """Stage 3, N = 2, four blocks: the last block's forward is the forward's last release, and
    backward starts with it, so it stays gathered (FSDP2 keeps its root's params so; DeepSpeed a
    param reused within `stage3_max_reuse_distance`): one all-gather of it a step against two of
    each block before it (and one more each by the `fzero.gather` after the step; the root's unit
    "default" is gathered for the whole step). With prefetch the refill of block 2, which backward reaches next, is started when
    the forward ends: before the first reduce-scatter of the step, as when block 3 was refilled
    and its refill started block 2's; without, only when backward reaches block 2, after block
    3's gradient is reduced. The bits are stage 0's."""
    n, d, hidden = 2, 8, (8, 12, 16, 4)
    mesh = fzero.SimMesh(n)

    def rank_fn():
        with mesh.record() as log:
            out = cases.train(mesh, 3, d, hidden, steps=1, prefetch=k)
        return out, [r for r in log if r.rank == mesh.rank and not r.tag.startswith("fzero.")]

    got = mesh.run(rank_fn)
    want = mesh.run(functools.partial(cases.train, mesh, 0, d, hidden, steps=1))
    _equal(want, [g for g, _ in got])
    for _, log in got:
        gathers = [r.tag.split("/")[0] for r in log if r.op == "all_gather"]
        assert {u: gathers.count(u) for u in set(gathers)} == {
            "default": 2, "blocks.0": 3, "blocks.1": 3, "blocks.2": 3, "blocks.3": 2}, gathers
        ops = [(r.op, r.tag.split("/")[0]) for r in log]
        refill = [i for i, op in enumerate(ops) if op == ("all_gather", "blocks.2")][1]
        first_reduce = next(i for i, (op, _) in enumerate(ops) if op == "reduce_scatter")
        assert (refill < first_reduce) == (k == 1), ops


class _EmbTwice(torch.nn.Module):
    """An embedding read first (the inputs) and last (the targets: its backward reads no
    weight), four blocks between."""

    def __init__(self, k=4, d=8, vocab=9):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return ((x - self.emb(tgt)) ** 2).mean()


class _ReuseUnused(torch.nn.Module):
    """Four blocks, then block 0 called again on the output, its result unused (a probe)."""

    def __init__(self, k=4, d=8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))

    def forward(self, idx, tgt):
        x = torch.nn.functional.one_hot(idx, 8).float()
        for b in self.blocks:
            x = torch.tanh(b(x))
        self.blocks[0](x)
        return (x - tgt.float()[:, None]).square().mean()


@pytest.mark.parametrize("model", [_EmbTwice, _ReuseUnused])
@pytest.mark.parametrize("k", [0, 1])
def test_a_last_unit_whose_backward_comes_later_is_freed_at_backwards_first_refill(model, k):
    """Found in review: the forward's last unit, kept for its backward, stayed gathered through the
    whole backward where backward reads other units first (an embedding read again last, whose
    backward reads no weight; a block called again, its output unused), holding two blocks' worth
    where a refill holds one. It is freed at backward's first refill of another unit (and gathered
    again if its backward reads it): at each refill the units live are the refilled block and
    the k prefetched, as before the unit was kept; the bits are stage 0's."""
    from fzero._src.gathering import Gathering

    torch.manual_seed(0)
    module = model()
    units = lambda p: ".".join(p.split(".")[:2]) if p.startswith("blocks") else "emb"  # noqa: E731
    params, apply, info = fzero.from_module(module, units=units)
    mesh, seen = fzero.SimMesh(2), []
    real = Gathering.refill

    def refill(self, unit, backward=False):
        real(self, unit, backward)
        if backward:
            seen.append((unit, dict(self.live)))

    def rank_fn(stage):
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        g = torch.Generator().manual_seed(mesh.rank)
        batch = (torch.randint(0, 8, (3,), generator=g), torch.randint(0, 8, (3,), generator=g))
        state, m = fzero.train_step(lambda p, b: apply(p, *b), prefetch=k)(state, batch)
        return fzero.gather(state), [m.loss]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Gathering, "refill", refill)
        got = mesh.run(lambda: rank_fn(3))
    _equal(mesh.run(lambda: rank_fn(0)), got)
    block = 288  # (8 * 8 + 8) float32, N = 2 divides it
    assert seen, "backward refilled no unit"
    for unit, live in seen:
        assert unit in live and sum(live.values()) <= (1 + k) * block, (unit, live)


def test_prefetch_fills_max_live_bytes_exactly(monkeypatch):
    """prefetch=2 under a cap of exactly three blocks: after block 0 is read, blocks 1 and 2 are in
    flight (the read one and two ahead fill the cap, which a unit may reach). A mutant stopping one
    short of the cap (`>=` for `>`) passed the suite, one unit less ahead at every read."""
    from fzero._src import gathering as G

    class Blocks(torch.nn.Module):
        def __init__(self, k, d):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))

        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x

    read, seen = G.Gathering.read, {}

    def spy(self, unit):
        out = read(self, unit)
        if self._programs[unit].mesh.rank == 0:
            seen.setdefault(unit, list(self._ahead))
        return out

    monkeypatch.setattr(G.Gathering, "read", spy)
    k, d = 5, 8
    torch.manual_seed(0)
    model = Blocks(k, d)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    block = (d * d + d) * 4
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        fzero.train_step(lambda p, b: apply(p, b).square().mean(), prefetch=2, max_live_bytes=3 * block)(
            state, torch.ones(2, d))

    mesh.run(rank_fn)
    assert seen["blocks.0"] == ["blocks.1", "blocks.2"], seen


def test_backward_prefetch_asks_for_the_units_in_the_order_backward_reads_them(monkeypatch):
    """Stage 3, six blocks, `prefetch=2`, N = 2: at each backward refill the next units asked for are the
    two backward reads next, nearest first (block k's refill asks for k-1, then k-2), so a cap that
    admits one more unit gathers the one needed next. (A mutant asking in the reverse order
    passed the suite: every test's cap was a forward's, or large enough for both.)"""
    from torch import nn

    from fzero._src import gathering

    asked = {0: [], 1: []}
    prefetch = gathering.Gathering._prefetch
    mesh = fzero.SimMesh(2)

    def spy(self, units, backward):
        if backward:
            asked[mesh.rank].append(list(units))
        return prefetch(self, units, backward)

    monkeypatch.setattr(gathering.Gathering, "_prefetch", spy)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))

    def rank():
        state = fzero.init(params, fzero.optim.sgd(1e-2), stage=3, mesh=mesh, units=info.units)
        fzero.train_step(lambda p, x: apply(p, x).square().mean(), prefetch=2, gather="on_use")(
            state, torch.randn(4, 16, generator=torch.Generator().manual_seed(mesh.rank)))

    mesh.run(rank)
    assert asked[0] == asked[1] == [["4", "3"], ["3", "2"], ["2", "1"], ["1", "0"], ["0"]], asked
