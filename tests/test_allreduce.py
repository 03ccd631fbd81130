"""`Mesh.all_reduce_is_reduce_scatter_gather`: where a mesh says its sum all-reduce has exactly the
bits of all-gather(reduce-scatter), it does -- over real gloo processes at N = 2 and N = 3 on
values whose sum depends on the order of the additions (and the test shows that it does), on
SimMesh at every N -- and stage 0, which then reduces each bucket with one all-reduce, still gives
the bits of stages 1-3 and of the two-collective path it replaces (proofs/communication.md,
"One all-reduce for stage 0")."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero._src.mesh import Mesh
from fzero._src.tree import flatten_with_paths
from fzero.testing import examples, seed_per_case

from . import allreduce_cases as cases
from .conftest import LazyPool
from .stage_harness import assert_equal_leaves

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def dist3():
    """3 torchrun gloo workers for this module (N = 3: the smallest N where the order of a sum over
    ranks can change its bits)."""
    pool = LazyPool(3)
    yield pool
    pool.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _check_forms(out: list[dict], xs: list[torch.Tensor]) -> None:
    """Every rank: all_reduce == all_gather(reduce_scatter) bit for bit, blocking and started, the
    same on every rank; and the check has power: on each rank's chunk, some left-to-right order of
    the ranks gives other bits than the collective did (so a reduce-scatter that summed in another
    order than the all-reduce would show)."""
    n = len(xs)
    want = out[0]["blocking"]["all_reduce"]
    for r, o in enumerate(out):
        assert o["claim"] is True, r
        for form in ("blocking", "started"):
            assert _same_bits(o[form]["all_reduce"], o[form]["rs_ag"]), (r, form)
            assert _same_bits(o[form]["all_reduce"], want), (r, form)
        assert _same_bits(o["started"]["donated"], want), r  # `donate=True`: the same bits
    if n < 3:
        return
    orders = cases.every_order(xs)
    for c, got in enumerate(want.chunk(n)):
        assert any(not _same_bits(s.chunk(n)[c], got) for s in orders.values()), c
    assert len({_bits(s).numpy().tobytes() for s in orders.values()}) > 1  # the values are order-sensitive


@pytest.mark.dist
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [1, 6, 4099])
def test_gloo_n3_all_reduce_is_all_gather_of_reduce_scatter_bitwise(dist3, dtype, s):
    """gloo's reduce-scatter is its all-reduce of the whole buffer, then this rank's chunk (torch's
    ProcessGroupGloo): the same bits, here at N = 3 where the orders disagree."""
    xs = cases.order_sensitive(3, s, dtype, seed=s)
    out = dist3.run(cases.reduce_forms, [(x,) for x in xs])
    _check_forms(out, xs)
    assert all(o["in_place"] for o in out)  # a donated all-reduce sums in the caller's buffer: no copy



@pytest.mark.dist
@pytest.mark.parametrize("dtype", DTYPES)
def test_gloo_n3_large_buffer_all_reduce_is_all_gather_of_reduce_scatter_bitwise(dist3, dtype):
    """The same over a buffer of 3 (2^19 + 5) elements (1.5-12 MiB, a hundred times the buffers
    above: whatever pieces gloo cuts a large buffer into, both forms cut the same buffer), chunk
    boundaries off any power of two, with infinities and NaNs among the values, on every rank;
    some order of the ranks differs in every chunk."""
    xs = cases.wide(3, 2**19 + 5, dtype, seed=3)
    _check_forms(dist3.run(cases.reduce_forms, [(x,) for x in xs]), xs)


@pytest.mark.dist
@pytest.mark.parametrize("dtype", DTYPES)
def test_gloo_n2_all_reduce_is_all_gather_of_reduce_scatter_bitwise(dist2, dtype):
    xs = cases.order_sensitive(2, 257, dtype, seed=2)
    _check_forms(dist2.run(cases.reduce_forms, [(x,) for x in xs]), xs)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_sim_mesh_all_reduce_is_all_gather_of_reduce_scatter_bitwise(n):
    """SimMesh sums both through one accumulator in rank order, so at every N (and that order is
    the left-to-right one, which the other orders do not all share). Every N, two draws each
    (`seed_per_case`): one property of 10 over `st.integers(1, 6)` drew N = 5, 1, 2 and 6 only
    (N = 1 four times), never N = 3 or 4, where the order of three or more terms first matters."""

    @seed_per_case(n)
    @examples(2)
    @given(s=st.integers(1, 9), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
    def prop(s, dtype, seed):
        xs = cases.order_sensitive(n, s, dtype, seed)
        mesh = fzero.SimMesh(n)
        out = mesh.run(functools.partial(cases.reduce_forms, mesh), [(x,) for x in xs])
        _check_forms(out, xs)
        assert _same_bits(out[0]["blocking"]["all_reduce"], cases.left_to_right(xs, tuple(range(n))))

    prop()


class _Bare(Mesh):
    """A mesh of no backend: what the base class claims (any backend)."""

    rank = 0

    def run(self, fn, per_rank_args=()):
        raise NotImplementedError

    def _exchange(self, call, x):
        raise NotImplementedError


def test_the_claim_per_mesh():
    """Any backend: N <= 2 (one or two terms: a + b == b + a). SimMesh: every N. gloo: every N (the
    workers' DistMesh, above); NCCL at N > 2 claims nothing (the base rule)."""
    assert [_Bare(n).all_reduce_is_reduce_scatter_gather for n in (1, 2, 3, 8)] == [True, True, False, False]
    assert all(fzero.SimMesh(n).all_reduce_is_reduce_scatter_gather for n in (1, 2, 3, 8))
    assert not cases.SplitSimMesh(3).all_reduce_is_reduce_scatter_gather



def _dist_mesh(backend: str, n: int) -> fzero.DistMesh:
    """A DistMesh of `backend` over `n` ranks without a process group: the claim reads only these."""
    mesh = object.__new__(fzero.DistMesh)
    Mesh.__init__(mesh, n)
    mesh.backend = backend
    return mesh


@pytest.mark.parametrize("backend", ["gloo", "nccl", "mpi"])
def test_the_dist_mesh_claim_is_its_backend_and_world_size(backend):
    """DistMesh claims by its backend and N alone (the same on every rank of a group): gloo at every
    N (reduce-scatter is its all-reduce plus a chunk); NCCL and any other backend only at N <= 2,
    where a sum of two terms cannot depend on the order (proofs/communication.md)."""
    got = [_dist_mesh(backend, n).all_reduce_is_reduce_scatter_gather for n in (1, 2, 3, 8)]
    assert got == ([True] * 4 if backend == "gloo" else [True, True, False, False])


@pytest.mark.dist
def test_gloo_donated_broadcast_has_the_bits_in_the_callers_buffer(dist3):
    """`Mesh.start("broadcast", x, donate=True)` over gloo: the source's bits on every rank, in the
    caller's own buffer (no copy); without `donate` the caller's `x` is left as it was."""
    xs = cases.order_sensitive(3, 5, torch.float32, seed=7)
    for blocking, started, donated, in_place, untouched in dist3.run(cases.broadcast_forms, [(x, 1) for x in xs]):
        assert all(_same_bits(t, xs[1]) for t in (blocking, started, donated))
        assert in_place and untouched


def _run(mesh, stage, engine="autograd"):
    return mesh.run(functools.partial(cases.stage_steps, mesh, stage, engine))


@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize("n", [2, 3])
def test_stage0_all_reduce_equals_its_two_collective_path_and_stage1(n, engine):
    """Stage 0 on SimMesh (one all-reduce per bucket) gives the bits of stage 0 on a mesh that
    claims nothing (reduce-scatter, then all-gather: with the autograd engine the all-gather of
    each bucket starts in backward, `reduce.Chained`) and of stage 1, on every rank after every step."""
    fused, split, one = _run(fzero.SimMesh(n), 0, engine), _run(cases.SplitSimMesh(n), 0, engine), \
        _run(fzero.SimMesh(n), 1, engine)
    for r in range(n):
        for t, (a, b, c) in enumerate(zip(fused[r][0], split[r][0], one[r][0])):
            assert_equal_leaves(a, b, f"stage 0, all-reduce vs RS + AG, rank {r}, step {t}")
            assert_equal_leaves(a, c, f"stage 0 vs stage 1, rank {r}, step {t}")
    # 3 units of one fp32 bucket each (w and b), 2 steps: one all-reduce per bucket and step, or two
    assert fused[0][1] == ["all_reduce"] * 6
    assert sorted(split[0][1]) == ["all_gather"] * 6 + ["reduce_scatter"] * 6



@pytest.mark.parametrize("engine,micro,accumulate", [("autograd", 1, "each"), ("func", 1, "each"),
                                                      ("autograd", 2, "each"), ("autograd", 2, "once"),
                                                      ("func", 2, "once")])
def test_stage0_reads_no_gradient_buffer_it_donated(engine, micro, accumulate):
    """Stage 0 donates each bucket's gradient buffer to its all-reduce (`_start_all_reduce`), which
    on DistMesh and SimMesh sums in it. On SimMesh (`DonatedSimMesh` counts the donations), stage 0 still gives
    stage 1's bits at N = 3 after every step with both engines, micro-batches reduced each or once,
    a frozen group and a bucket only rank 0 differentiates (the others reduce fresh zeros): no
    buffer is read, or reused, after it was donated."""
    n, out, donated = 3, {}, {}
    for stage in (0, 1):
        mesh = cases.DonatedSimMesh(n)
        out[stage] = mesh.run(functools.partial(cases.donation_steps, mesh, stage, engine, micro, accumulate))
        donated[stage] = len(mesh.donated)
    # 2 steps, 4 trainable buckets (l0-l2, extra), every rank: one donation per reduction
    assert donated == {0: 2 * 4 * n * (micro if accumulate == "each" else 1), 1: 0}
    for r in range(n):
        for t, (a, b) in enumerate(zip(out[0][r], out[1][r])):
            assert_equal_leaves(a, b, f"stage 0 (donated all-reduce) vs stage 1, rank {r}, step {t}")


def _check_in_place(runs, what):
    for r, steps in enumerate(runs):
        for t, (same, want, got) in enumerate(steps):
            assert same, f"{what}, rank {r}, step {t}: the donating step's params are a new buffer"
            assert_equal_leaves(got, want, f"{what}, rank {r}, step {t}: donated vs pure")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bf16", [False, True])
def test_a_donating_stage_1_2_step_gathers_the_params_into_the_buffer_it_held(n, stage, bf16):
    """A donating step of stages 1-2 (params replicated, updated in shards) all-gathers the new
    params into the params buffer its input held -- each rank's own chunk already written there by
    the update, or the master's cast copied in -- so it never holds two copies of them; the bits
    are the pure step's, which gathers into a new buffer and leaves its input as it was."""
    mesh = fzero.SimMesh(n)
    _check_in_place(mesh.run(functools.partial(cases.params_gathered_in_place, mesh, stage, bf16)),
                    f"SimMesh({n}), stage {stage}, bf16 {bf16}")


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bf16", [False, True])
def test_gloo_donating_stage_1_2_steps_gather_the_params_in_place(dist2, dist3, stage, bf16):
    """Over real gloo, at N = 2 (the all-gather by one exchange, `into` the held params, whose own
    half the update wrote) and N = 3 (gloo's all-gather, given a copy of the chunk it would
    otherwise read from the buffer it writes): the donating step's params stay in the buffer the
    input held, with the pure step's bits."""
    for pool, n in ((dist2, 2), (dist3, 3)):
        runs = pool.run(cases.params_gathered_in_place, [(stage, bf16)] * n)
        _check_in_place(runs, f"gloo N = {n}, stage {stage}, bf16 {bf16}")


@pytest.mark.dist
def test_gloo_n3_stage0_all_reduce_equals_stages_1_to_3(dist3):
    """Over real gloo at N = 3 (where the order of a sum can change its bits), stage 0's one
    all-reduce per bucket and stages 1-3's reduce-scatters give the same params, bit for bit; and
    those bits are gloo's, not SimMesh's rank-order sum (which differs somewhere)."""
    runs = {s: dist3.run(cases.stage_steps, [(s,)] * 3) for s in range(4)}
    assert runs[0][0][1] == ["all_reduce"] * 6
    for s in (1, 2, 3):
        for r in range(3):
            for t, (a, b) in enumerate(zip(runs[0][r][0], runs[s][r][0])):
                assert_equal_leaves(b, a, f"gloo, stage {s} vs stage 0, rank {r}, step {t}")
    sim = flatten_with_paths(_run(fzero.SimMesh(3), 0)[0][0][-1])[1]
    gloo = flatten_with_paths(runs[0][0][0][-1])[1]
    assert not all(torch.equal(a, b) for a, b in zip(sim, gloo))  # the order of the sums matters here


@pytest.mark.dist
@pytest.mark.parametrize("dtype", DTYPES)
def test_gloo_n2_reduce_scatter_is_gloos_own_bitwise(dist2, dtype):
    """At N = 2 DistMesh reduce-scatters over gloo by one send and one receive of halves and one addition
    (half the traffic of gloo's reduce-scatter, which all-reduces the whole buffer): the bits of
    gloo's own reduce-scatter, over 2 (2^19 + 5) elements with infinities and NaNs among values of
    every magnitude (each element is one correctly rounded addition of the same two terms).
    bfloat16 keeps gloo's own reduce-scatter: its NaNs would differ in sign and payload."""
    xs = cases.wide(2, 2**19 + 5, dtype, seed=5)
    for ours, theirs, ran in dist2.run(cases.reduce_scatter_vs_torch, [(x,) for x in xs]):
        assert ran == (0 if dtype == torch.bfloat16 else 6)  # the exchange ran for each reduce-scatter
        assert len(ours) == len(theirs) == 7
        for k, (a, b) in enumerate(zip(ours, theirs)):
            assert _same_bits(a, b), f"collective {k} of 7 (blocking, started, 4 in flight together, all-gather)"


@pytest.mark.dist
@pytest.mark.parametrize("dtype", DTYPES)
def test_gloo_n2_all_gather_is_gloos_own_bitwise(dist2, dtype):
    """At N = 2 DistMesh all-gathers over gloo by one send and one receive (gloo's own all-gather
    stages the result and copies it out: a copy of the whole output more): the bits of gloo's own
    all-gather, every dtype (only bits move: NaN payloads too), for a [2^19 + 5] buffer with
    infinities and NaNs and a [S, 3] one, blocking, started, four started before any is waited
    for (matched in order on the pair), and one into the caller's tensor (`Mesh.start`'s `out`,
    a stage-3 refill's storage)."""
    xs = cases.wide(2, 2**19 + 5, dtype, seed=6)
    halves = [x[: 2**19 + 5] for x in xs]
    for shaped in (False, True):
        args = [(h.reshape(-1, 1).expand(-1, 3).contiguous() if shaped else h,) for h in halves]
        for ours, theirs, ran in dist2.run(cases.all_gather_vs_torch, args):
            assert ran == 7  # the exchange ran, for every gather
            assert len(ours) == len(theirs) == 7
            assert all(_same_bits(a, b) for a, b in zip(ours, theirs))


@pytest.mark.dist
def test_a_distmesh_over_a_subgroup_addresses_its_peers_by_global_rank(dist3):
    """`DistMesh(new_group([1, 2]))` on a 3-process world: all_gather, reduce_scatter (the N = 2
    exchange) and broadcast from group rank 1 give the two ranks' results (see
    `allreduce_cases.subgroup_collectives`). Its repr names each rank's global rank, which every
    message quoting the mesh then shows (found in review: a failure on global rank 1 read "rank 0"
    with nothing to map it); global rank 0, outside the group, gets a `MeshError` saying so (it got
    torch's bare "Invalid process group specified")."""
    out = dist3.run(cases.subgroup_collectives, [()] * 3)
    assert "global rank 0 is not a member of this process group" in out[0]
    for r, (rank, gathered, scattered, sent, shown) in zip((1, 2), out[1:]):
        assert rank == r - 1
        assert f"rank={rank}, global ranks [1, 2] (this rank {r})" in shown
        assert torch.equal(gathered, torch.tensor([0.0, 1.0, 10.0, 11.0]))
        assert torch.equal(scattered, torch.tensor([1.0, 3.0]) if rank == 0 else torch.tensor([5.0, 7.0]))
        assert torch.equal(sent, torch.tensor([10.0, 11.0]))
