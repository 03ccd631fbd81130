"""The hot path keeps the bits: what the step no longer does, and what it must never alias.

- `sum_of_squares` (the one-pass float32 `‖g_shard‖²` of the agreement) gives the same bits for a
  shard held as a slice of a larger buffer (stage 0) and as its own tensor (stages 1-3), lies
  within its derived bound of the exact sum (relative, plus 2^-150 for each square that falls
  below float32's normal range, |x| < 2^-63: met exactly at |x| = 2^-75), and is non-finite where
  an element is;
  `exact_sum_of_squares` (the rare path's) equals the exact sum on integer-valued data for every
  chunk size and is also independent of where the shard sits.
- `_assemble` (the unit's local gradient `flat[N * S]`) equals the concatenation of the per-leaf
  gradients with zeros for unused leaves and padding.
- At N = 1 the reductions and the gathers of gradients and updated params are recorded but move
  nothing (`Mesh.solo`): `reduce_grad` returns its input where no cast is needed. The state a
  step returns never shares storage between params, master and optimizer state, a pure step
  leaves its input untouched, and stage 3's released gathers never reach the held shard.
- At N = 1 a non-finite gradient still names the rank and the bucket (found on the rare path).
- At N = 1 the agreement's shard norms are taken in the backward (`EarlyNorms`), for every shard,
  with the bits of the norms taken after it; a shard written since is read again.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math

import hypothesis.strategies as st
import optree
import pytest
import torch
from hypothesis import given

import fzero
from fzero import optim
from fzero._src import norms as norms_module
from fzero._src import unit as unit_module
from fzero._src import update as update_module
from fzero._src.norms import exact_sum_of_squares, shard_squares, sum_of_squares
from fzero._src.stages import Wire, reduce_grad
from fzero._src.unit import Bucket, _assemble, finite_witness, nonfinite
from fzero.layout import plan
from fzero.testing import examples, world_sizes

CPU = torch.device("cpu")


@examples(30)
@given(sizes=st.lists(st.integers(0, 40), max_size=4), chunk=st.integers(1, 17), seed=st.integers(0, 2**16))
def test_exact_sum_of_squares_is_the_exact_sum_on_integer_values(sizes, chunk, seed):
    """Integers below 2^10 square to below 2^20; at most 160 of them sum below 2^28 < 2^53: every
    float64 addition is exact in any order, so the chunked sum equals the one-pass reference."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(-1000, 1000, (n,), generator=g).float() for n in sizes]
    want = sum((x.double().square().sum() for x in xs), torch.zeros((), dtype=torch.float64))
    assert torch.equal(exact_sum_of_squares(xs, CPU, chunk=chunk), want)


@examples(30)
@given(n=st.integers(1, 5000), offset=st.integers(1, 7), chunk=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_sums_of_squares_of_a_slice_equal_those_of_its_copy(n, offset, chunk, seed):
    """Stage 0 sums a slice of the full buffer where stages 1-3 sum a tensor of their own: the
    same values must give the same bits wherever they sit in memory (random, non-integer values:
    the additions round, so only the same order gives equal bits). Lengths up to 5000 reach the
    vectorised body of the float32 kernel, offsets 1-7 every misalignment of it."""
    big = torch.randn(offset + n + 3, generator=torch.Generator().manual_seed(seed))
    view = big[offset : offset + n]
    assert torch.equal(sum_of_squares([view], CPU), sum_of_squares([view.clone()], CPU))
    assert torch.equal(exact_sum_of_squares([view], CPU, chunk=chunk),
                       exact_sum_of_squares([view.clone()], CPU, chunk=chunk))


DEVICES = [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="needs a GPU"))]


@examples(30)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=5), offsets=st.lists(st.integers(0, 9), min_size=5,
       max_size=5), dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), min_size=5,
       max_size=5), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_shard_squares_of_slices_equal_those_of_copies(device, sizes, offsets, dtypes, seed):
    """`agree`'s one multi-tensor norm over a rank's shards: each shard's `ν²` must not depend on
    where the shard sits (stage 0: slices of full buffers at any offset; stages 1-3: tensors of
    their own) nor on the other shards in the call; nor may `sum_of_squares`, their sum."""
    g = torch.Generator().manual_seed(seed)
    bigs = [torch.randn(o + n + 3, generator=g).to(device, d) for n, o, d in zip(sizes, offsets, dtypes)]
    views = [big[o : o + n] for big, n, o in zip(bigs, sizes, offsets)]
    got = shard_squares(views, device)
    assert torch.equal(got, shard_squares([v.clone() for v in views], device))
    for k, v in enumerate(views):
        assert torch.equal(got[k], shard_squares([v.clone()], device)[0])
    assert torch.equal(sum_of_squares(views, device), sum_of_squares([v.clone() for v in views], device))


TINY = 2.0**-150  # half the spacing of float32's subnormals (2^-149): the most one square loses to underflow


def _norm_bound(xs: list[torch.Tensor], exact: float) -> float:
    """The bound of `test_sum_of_squares_is_within_its_bound_of_the_exact_sum` for shards `xs`
    whose exact `Σ x²`, correctly rounded to float64, is `exact`."""
    u = 2.0**-24
    k = max(x.numel() for x in xs) + 1
    gamma = k * u / (1 - k * u)  # γ_{S+1}, S the longest shard
    tiny = sum(int(((x != 0) & (x.abs() < 2.0**-63)).sum()) for x in xs)  # m: squares below 2^-126
    return (gamma + 2 * u + 2.0**-50) * exact * (1 + 2.0**-52) + (1 + gamma) * (1 + 2.0**-50) * tiny * TINY


@examples(30)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
       scales=st.lists(st.sampled_from([1.0, 1e15, 2.0**-63, 1e-20, 1e-21, 1e-23, 2.0**-80]), min_size=4,
                       max_size=4), seed=st.integers(0, 2**16))
def test_sum_of_squares_is_within_its_bound_of_the_exact_sum(sizes, scales, seed):
    """Per shard of length S (float32, gradual underflow), `ν = fl32(sqrt(s))` with `s` the float32
    sum of the squares: an addition never rounds below 2^-126 (a sum of multiples of 2^-149 there
    is exact), a square at or above 2^-126 rounds by at most u = 2^-24 relative, and one below
    (|x| < 2^-63) by at most 2^-150 absolute, half the subnormal spacing, and at most x² (a square
    below 2^-150 is 0: `test_a_square_at_half_the_smallest_subnormal_is_lost_whole`). So
    |s − Σx²| ≤ γ_S·Σx² + (1 + γ_{S−1})·m·2^-150 with m the number of nonzero |x| < 2^-63
    (Higham 3.5 for the terms ≥ 0, in any order; a fused `acc + x·x` rounds once instead, the
    same bound), the root rounds once (to a normal float), and ν² is exact in float64:

        |ν² − Σx²| ≤ (γ_{S+1} + 2u)·Σx² + (1 + γ_{S+1})·m·2^-150

    ((1 + u)²·γ_S + 2u + u² ≤ γ_{S+1} + 2u and (1 + u)²(1 + γ_{S−1}) ≤ 1 + γ_{S+1}). With S the
    longest shard and m counted over all of them, the float64 sum of the K ≤ 4 parts and the
    reference's own rounding (`math.fsum` of the float64 squares, which are exact: the exact sum
    correctly rounded) add less than 2^-50 relative. Scales from 1e-20 down square below 2^-126,
    2^-63 straddles it, 2^-80 squares to 0: relative bounds alone fail there (the absolute term
    is the fix; before, 1e-20 at S = 2 exceeded `γ_{S+1} + 2u`)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g) * s for n, s in zip(sizes, scales)]
    exact = math.fsum(v * v for x in xs for v in x.double().tolist())
    assert abs(float(sum_of_squares(xs, CPU)) - exact) <= _norm_bound(xs, exact)


@pytest.mark.parametrize("n", [2, 7, 1000])
def test_a_square_at_half_the_smallest_subnormal_is_lost_whole(n):
    """x = 2^-75: x² = 2^-150 is half the smallest float32 subnormal, a tie that rounds to even, 0;
    so ν = 0 where Σx² = n·2^-150, and the absolute term of the bound (2^-150 per square below
    2^-126) is met exactly: with less per square it fails. (n ≥ 2: torch's norm of one element is
    its |x|, no square, exact.)"""
    x = torch.full((n,), 2.0**-75)
    assert float(sum_of_squares([x], CPU)) == 0.0 and float(exact_sum_of_squares([x], CPU)) == n * TINY
    assert n * TINY <= _norm_bound([x], n * TINY) < n * TINY * (1 + 2.0**-10)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_sums_of_squares_are_nonfinite_where_an_element_is(bad):
    x = torch.arange(10.0)
    assert torch.isfinite(sum_of_squares([x, x], CPU)) and torch.isfinite(exact_sum_of_squares([x, x], CPU, chunk=3))
    y = x.clone()
    y[7] = bad
    assert not torch.isfinite(sum_of_squares([x, y], CPU))
    assert not torch.isfinite(exact_sum_of_squares([x, y], CPU, chunk=3))


def test_a_float32_norm_that_overflows_is_decided_exactly():
    """Finite gradients whose float32 sum of squares overflows (|g| = 2^64: g² = 2^128 > the largest
    float32) are not a non-finite step: the agreement's rare path recomputes ‖g‖² in float64, and
    the step reports that norm (2^64 · sqrt(n)) and updates."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init({"w": torch.zeros(4)}, optim.sgd(0.0), stage=2, mesh=mesh)
        return fzero.train_step(lambda p, x: (p["w"] * x).sum())(state, torch.full((4,), 2.0**64))[1]

    for m in mesh.run(rank_fn):
        assert not m.skipped and float(m.grad_norm) == 2.0**64 * 2.0


@examples(30)
@given(shapes=st.lists(st.sampled_from([(), (0,), (3,), (2, 2), (1, 5)]), min_size=1, max_size=5),
       used=st.lists(st.booleans(), min_size=5, max_size=5), n=world_sizes(4), seed=st.integers(0, 2**16))
def test_assemble_equals_concatenation_with_zero_fill(shapes, used, n, seed):
    params = {f"p{i}": torch.zeros(s) for i, s in enumerate(shapes)}
    layout = plan(params, n)
    bucket = Bucket.of(layout, 0)
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=g) if used[i] else None for i, s in enumerate(bucket.shapes)]
    parts = [x.reshape(-1) if x is not None else torch.zeros(s).reshape(-1) for x, s in zip(grads, bucket.shapes)]
    want = torch.cat([*parts, torch.zeros(bucket.size - sum(p.numel() for p in parts))])
    got = _assemble(bucket, grads, torch.float32, CPU)
    assert got.shape == (bucket.size,) and torch.equal(got, want)


def test_reduce_grad_at_one_rank_records_and_returns_its_input():
    """fl(1/1) = 1 and a sum over one rank is its term: no multiply, no copy -- but the collective
    is still recorded (the accounting counts it, with 0 wire bytes)."""
    mesh, g = fzero.SimMesh(1), torch.randn(8)
    with mesh.record() as log:
        out = mesh.run(lambda: reduce_grad(mesh, Wire("t", torch.float32, torch.float32), g))[0]
    assert out is g and [(r.op, r.tag) for r in log] == [("reduce_scatter", "t")]
    two = fzero.SimMesh(2)
    with pytest.raises(fzero.MeshError, match="world-size-1 form"):
        two.run(lambda: two.solo("all_gather", g, tag="t"))


def _params():
    return {"a": torch.linspace(-1, 1, 7), "w": torch.linspace(0, 2, 6).reshape(2, 3)}  # flat: stage 3 releases


def _loss(p, x):
    return (p["a"].sum() * x + (p["w"] * x).square().sum()).square()


def _storages(state) -> list[int]:
    return [t.untyped_storage().data_ptr() for t in optree.tree_leaves((state.params, state.master, state.opt_state))
            if isinstance(t, torch.Tensor) and t.numel() > 0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_one_rank_states_share_no_storage_and_pure_steps_leave_the_input(stage, precision):
    """At N = 1 the gathers of updated params return the optimizer's output itself: it must not
    alias the master copy or the optimizer state (the next step writes them in place with
    `donate`), a pure step must leave its input's tensors as they were, and stage 3's gathered
    buffers (released after use) must not be the held shard. Three steps with the same result as
    the donating step, bit for bit."""
    mesh = fzero.SimMesh(1)
    prec = fzero.Precision(torch.bfloat16, torch.float32) if precision else None
    kw = {} if prec is None else {"precision": prec}

    def run(donate):
        state = fzero.init(_params(), optim.adamw(0.1), stage=stage, mesh=mesh, units=lambda path: path, **kw)
        step = fzero.train_step(_loss, donate=donate)
        for i in range(3):
            before = [t.clone() for t in optree.tree_leaves((state.params, state.master, state.opt_state))]
            new, _ = step(state, torch.tensor(0.5 + i))
            if not donate:
                after = optree.tree_leaves((state.params, state.master, state.opt_state))
                assert all(torch.equal(x, y) for x, y in zip(before, after))
            ptrs = _storages(new)
            assert len(ptrs) == len(set(ptrs)), f"stage {stage}: tensors of one state share storage"
            assert all(t.untyped_storage().size() > 0 for t in new.params)
            state = new
        return fzero.gather(state)

    pure, donated = mesh.run(lambda: run(False))[0], mesh.run(lambda: run(True))[0]
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(pure), optree.tree_leaves(donated)))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_nonfinite_gradient_names_the_bucket(stage):
    """At N = 1 the units skip their local non-finite check; the agreement's non-finite ‖g‖² finds
    the step and the rare path names rank 0 and the one bad bucket of two."""
    mesh = fzero.SimMesh(1)
    params = {"a": torch.ones(4), "b": torch.ones(3)}

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=lambda path: path)
        return fzero.train_step(lambda p, c: (p["a"] * c).sum() + p["b"].sum())(state, torch.tensor([1, float("nan"), 1, 1]))

    match = r"rank\(s\) \[0\] \(rank 0: non-finite loss and local gradient in bucket\(s\) \['a/float32/default'\]\)"
    with pytest.raises(fzero.NonFiniteError, match=match):
        mesh.run(rank_fn)


# -- bucket_bytes: a unit's leaves cut into consecutive buckets ------------------------------------


@examples(30)
@given(shapes=st.lists(st.sampled_from([(), (0,), (3,), (2, 5), (17,)]), min_size=1, max_size=8),
       cap=st.integers(1, 100), n=st.integers(1, 3))
def test_bucket_bytes_cuts_each_unit_into_consecutive_buckets_of_at_most_cap(shapes, cap, n):
    params = {f"p{i}": torch.zeros(s) for i, s in enumerate(shapes)}
    whole, cut = plan(params, n), plan(params, n, bucket_bytes=cap)
    assert [ls.path for ls in cut.leaves] == [ls.path for ls in whole.leaves]
    assert [i for b in cut.buckets for i in b.leaves] == [i for b in whole.buckets for i in b.leaves]
    for b in cut.buckets:
        assert b.numel * 4 <= cap or len(b.leaves) == 1  # whole leaves; a larger leaf alone
        assert [cut.leaves[i].offset for i in b.leaves] == [sum(cut.leaves[j].numel for j in b.leaves[:k])
                                                            for k in range(len(b.leaves))]
    for a, b in zip(cut.buckets, cut.buckets[1:]):  # greedy: the next leaf did not fit
        assert a.numel * 4 + cut.leaves[b.leaves[0]].numel * 4 > cap
    assert len({b.tag for b in cut.buckets}) == len(cut.buckets)


def test_bucket_bytes_rejects_a_bad_cap():
    with pytest.raises(fzero.LayoutError, match="bucket_bytes must be None or an int >= 1"):
        plan({"a": torch.zeros(3)}, 1, bucket_bytes=0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bucket_bytes_changes_no_bit_of_the_params(stage):
    """Reductions and the optimizer are element-wise, so where the buffers are cut cannot change
    an element: two steps at N = 2 with buckets of at most 24 bytes equal those of one bucket per
    unit, bit for bit (the norm's float32 norms per shard follow the cut, so it is not compared,
    and no step clips: the next test)."""
    mesh = fzero.SimMesh(2)
    params = {"a": torch.linspace(-1, 1, 7), "w": torch.linspace(0, 2, 6).reshape(2, 3), "c": torch.ones(5)}

    def run(cap):
        def rank_fn(x):
            state = fzero.init(params, optim.adamw(0.1), stage=stage, mesh=mesh, bucket_bytes=cap)
            step = fzero.train_step(lambda p, x: (p["a"].sum() * x + (p["w"] * x).square().sum() + p["c"].prod()) ** 2)
            for _ in range(2):
                state, _ = step(state, x)
            return fzero.gather(state)
        return mesh.run(rank_fn, [(torch.tensor(0.5),), (torch.tensor(-1.5),)])

    whole, cut = run(None), run(24)
    for p0, p1 in zip(whole, cut):  # Adam's moments enter the second step's params
        assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(p0), optree.tree_leaves(p1)))


@pytest.mark.parametrize("stage", [0, 3])
def test_bucket_bytes_changes_a_clipped_step_only_through_the_norm(stage):
    """Where `clip_norm` clips, the cut shows: the norm adds one float32 norm per bucket shard
    (proofs/stages.md §1.3), so other buckets give other bits of `grad_norm`, and the clipped
    params follow (found in review of feature combinations: the docs said the cut changed no
    bit). Both norms are within ε_f = γ_{S+1} + 2u of the exact norm (proofs/accumulation.md,
    Claim 5), so within 2·ε_f·ν of each other; a `clip_norm` that does not clip (coefficient 1)
    keeps every bit. One SGD step at N = 2 on data whose norm's bits depend on the cut."""
    mesh = fzero.SimMesh(2)
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(37, generator=g), "w": torch.randn(13, 11, generator=g), "c": torch.randn(29, generator=g)}
    xs = [(torch.randn(11, generator=g),), (torch.randn(11, generator=g),)]

    def run(cap, clip):
        def rank_fn(x):
            state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, bucket_bytes=cap)
            step = fzero.train_step(lambda p, x: ((p["w"] @ x).sum() * p["a"].sum() + p["c"].square().sum()) ** 2,
                                    clip_norm=clip)
            state, metrics = step(state, x)
            return fzero.gather(state), float(metrics.grad_norm)
        return mesh.run(rank_fn, xs)[0]

    (whole, nu_whole), (cut, nu_cut) = run(None, 1.0), run(64, 1.0)
    assert nu_whole != nu_cut, "this data's norm no longer depends on the cut: pick other data"
    u, longest = 2.0**-24, (37 + 13 * 11 + 29 + 1) // 2  # one bucket's shard
    eps_f = (longest + 1) * u / (1 - (longest + 1) * u) + 2 * u
    assert abs(nu_whole - nu_cut) <= 2 * eps_f * max(nu_whole, nu_cut)
    assert any(not torch.equal(x, y) for x, y in zip(optree.tree_leaves(whole), optree.tree_leaves(cut)))
    (loose, _), (loose_cut, _) = run(None, 1e12), run(64, 1e12)
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(loose), optree.tree_leaves(loose_cut)))


def test_inflight_keeps_at_most_depth_reductions_open():
    """Each open flight holds a unit's scaled gradient: adding one past `depth` waits the oldest
    first (stage 2's peak stays a few units' gradients), and `wait` closes the rest in order."""
    from fzero._src.mesh import Pending
    from fzero._src.stages import Flight
    from fzero._src.unit import Inflight

    waited = []

    class Seen(Pending):
        def __init__(self, k):
            super().__init__(torch.full((2,), float(k)))
            self.k = k

        def wait(self):
            waited.append(self.k)
            return super().wait()

    inflight = Inflight(depth=2)
    outs = [inflight.add(Flight(Seen(k))) for k in range(4)]
    assert waited == [0, 1] and [float(o[0]) for o in outs] == [0, 1, 2, 3]
    inflight.wait()
    assert waited == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nonfinite_is_true_iff_an_element_is(bad, dtype):
    """The finite checks (a unit's local gradient at N > 1, the updated params) read the minimum and
    maximum: finite values at the top of the range do not overflow them, a NaN or inf shows."""
    x = torch.full((10,), torch.finfo(dtype).max, dtype=dtype)
    x[2] = torch.finfo(dtype).min
    if bad is not None:
        x[6] = bad
    assert bool(nonfinite(x)) == (bad is not None)
    assert not bool(nonfinite(x[:0]))


@examples(60)
@given(n=st.integers(1, 3000), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       big=st.lists(st.tuples(st.integers(0, 2999), st.sampled_from([1.0, -1.0])), max_size=4),
       bad=st.lists(st.tuples(st.integers(0, 2999), st.sampled_from([math.nan, math.inf, -math.inf])), max_size=2),
       seed=st.integers(0, 2**31 - 1))
def test_finite_witness_is_finite_iff_every_element_is(n, dtype, big, bad, seed):
    """`finite_witness` (the CPU's sum where it is finite, else the minimum and maximum): its
    values are all finite exactly when every element is -- with NaN and infinities planted
    anywhere, and finite values at the top of the range whose sum overflows."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    for i, sign in big:
        x[i % n] = sign * torch.finfo(dtype).max
    for i, v in bad:
        x[i % n] = v
    witness = finite_witness(x)
    assert bool(torch.isfinite(torch.stack(witness)).all()) == bool(torch.isfinite(x).all())
    assert bool(nonfinite(x)) == (not bool(torch.isfinite(x).all()))
    if not big and not bad and dtype != torch.bfloat16:  # the sum alone decided
        assert len(witness) == 1


# -- EarlyNorms: the agreement's shard norms taken in the backward ------------------------------


def _three_units(mesh, stage):
    """`{u0, u1, u2: {w[16, 16], b[16]}}` on the mesh's device, drawn from `stage`."""
    gen = torch.Generator().manual_seed(stage)
    tree = {f"u{i}": {"w": torch.randn(16, 16, generator=gen) / 4, "b": torch.randn(16, generator=gen)}
            for i in range(3)}
    return optree.tree_map(lambda t: t.to(mesh.device), tree)


def _early_norm_run(mesh, stage, precision, donate, clip=0.05):
    """Three steps clipped at `clip` (the norm decides the update; None: not clipped) on three
    units; `(params, grad norms, [(shard norms taken early, shards)] per step)`."""
    tree = _three_units(mesh, stage)

    def loss(p, x):
        for i in range(3):
            w = p[f"u{i}"]["w"]
            x = torch.tanh(x.to(w.dtype) @ w + p[f"u{i}"]["b"])
        return x.float().square().mean()

    seen = []
    known = norms_module.EarlyNorms.known

    def counted(self, shards):
        out = known(self, shards)
        seen.append((len(out), len(shards)))
        return out

    kw = {} if precision is None else {"precision": precision}
    state = fzero.init(tree, optim.adamw(0.1), stage=stage, mesh=mesh, units=lambda path: path.split("/")[0], **kw)
    step = fzero.train_step(loss, donate=donate, clip_norm=clip)
    norms = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(norms_module.EarlyNorms, "known", counted)
        for t in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + t)).to(mesh.device)
            state, m = step(state, x)
            norms.append(m.grad_norm)
    return fzero.gather(state), norms, seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("donate", [False, True])
def test_early_norms_are_taken_for_every_shard_and_keep_the_bits(stage, precision, donate, monkeypatch):
    """At N = 1 each bucket's reduced gradient exists in its unit's backward: the step takes its
    norm there (`EarlyNorms`, on CUDA a side stream; here, with the CPU allowed, in line), and the
    agreement reads every shard's norm from it instead of reading the gradient again. Every
    shard's norm is found (6 of 6: 3 units of 2 buckets), and params and clipped norms are
    bitwise those of the step that takes no early norm."""
    mesh = fzero.SimMesh(1)
    prec = fzero.Precision(torch.bfloat16, torch.float32) if precision else None
    monkeypatch.setattr(norms_module.EarlyNorms, "DEVICES", ())
    want = mesh.run(lambda: _early_norm_run(mesh, stage, prec, donate))[0]
    monkeypatch.setattr(norms_module.EarlyNorms, "DEVICES", ("cpu",))
    got = mesh.run(lambda: _early_norm_run(mesh, stage, prec, donate))[0]
    assert want[2] == [] and got[2] == [(6, 6)] * 3
    assert got[1] == want[1]
    assert all(torch.equal(got[0][u][k], want[0][u][k]) for u in want[0] for k in want[0][u])


def test_an_early_norm_is_not_used_for_a_shard_written_since():
    """`EarlyNorms.known` matches a shard to the norm taken of the same tensor only while nothing
    has written it (`_version`): a write after `take` makes the agreement read the shard."""
    early = norms_module.EarlyNorms(CPU)
    x, y = torch.ones(10), torch.ones(10)
    early.take(x)
    early.take(y)
    assert set(early.known([x, y])) == {0, 1}
    assert torch.equal(early.known([x])[0], norms_module.shard_norm(x))
    y.mul_(2)
    assert set(early.known([x, y])) == {0}
    assert early.known([torch.ones(10)]) == {}  # same values, another tensor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream: needs a GPU")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_early_norms_on_a_cuda_side_stream_keep_the_bits(stage, nccl_mesh, monkeypatch):
    """On CUDA the early norms run on a side stream beside the backward, joined before the
    agreement: every shard's norm is found and the clipped steps are bitwise those without."""
    for precision in (None, fzero.Precision(torch.bfloat16, torch.float32)):
        monkeypatch.setattr(norms_module.EarlyNorms, "DEVICES", ())
        want = _early_norm_run(nccl_mesh, stage, precision, True)
        monkeypatch.setattr(norms_module.EarlyNorms, "DEVICES", ("cuda",))
        got = _early_norm_run(nccl_mesh, stage, precision, True)
        assert got[2] == [(6, 6)] * 3 and got[1] == want[1], (stage, precision)
        assert all(torch.equal(got[0][u][k], want[0][u][k]) for u in want[0] for k in want[0][u])


def _held_back_writes(cycles: int) -> tuple:
    """`(write, beside)`: a stand-in for `unit._write` that first sleeps `cycles` GPU cycles on the
    stream it is queued on (the side stream, where the assembly runs beside the backward), and
    the list it appends to per call: whether that stream was not the default one."""
    write, beside = unit_module._write, []

    def held_back(bucket, grads, flat):
        beside.append(torch.cuda.current_stream() != torch.cuda.default_stream())
        torch.cuda._sleep(cycles)
        write(bucket, grads, flat)

    return held_back, beside


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream: needs a GPU")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_assembled_on_a_cuda_side_stream_keep_the_bits(stage, nccl_mesh, monkeypatch):
    """At N = 1 on CUDA each unit's gradient is assembled on the side stream, beside the backward
    of the units below (`unit._assemble`), and the step joins it before reading any gradient.
    Each assembly is held back on the side stream (`torch.cuda._sleep` before its writes), so a
    read that did not wait for the join, or a per-leaf gradient whose memory the allocator gave
    to a later tensor before the copy read it, would read other values. Clipped (the update after
    the agreement's read) and not (launched before it), params and norms are bitwise those of the
    step that assembles in line, and every bucket (6 a step) was assembled on the side stream:
    fp32, and the bf16 policy's at stages 2-3, which widen into the reduce dtype as they copy (at
    stages 0-1 it assembles in bf16, and the step casts: in line)."""
    write = unit_module._write
    held_back, beside = _held_back_writes(20_000_000)  # tens of milliseconds on the side stream
    for precision, clip in itertools.product((None, fzero.Precision(torch.bfloat16, torch.float32)), (0.05, None)):
        monkeypatch.setattr(norms_module.EarlyNorms, "DEVICES", ())
        want = _early_norm_run(nccl_mesh, stage, precision, True, clip)
        monkeypatch.setattr(norms_module.EarlyNorms, "DEVICES", ("cuda",))
        monkeypatch.setattr(unit_module, "_write", held_back)
        beside.clear()
        got = _early_norm_run(nccl_mesh, stage, precision, True, clip)
        monkeypatch.setattr(unit_module, "_write", write)
        assert got[1] == want[1], (stage, precision, clip)
        assert all(torch.equal(got[0][u][k], want[0][u][k]) for u in want[0] for k in want[0][u])
        if precision is None or stage >= 2:  # bf16 at stages 0-1: assembled in bf16, cast by the step
            assert beside == [True] * 18, (stage, precision, clip, beside)


def _accumulated_run(mesh, stage, accumulate):
    """Two steps of k = 3 micro-batches on three units (`accumulate` "each" or "once"); the
    params after them."""
    tree = _three_units(mesh, stage)

    def loss(p, x):
        for i in range(3):
            x = torch.tanh(x @ p[f"u{i}"]["w"] + p[f"u{i}"]["b"])
        return x.square().mean()

    state = fzero.init(tree, optim.adamw(0.1), stage=stage, mesh=mesh, units=lambda path: path.split("/")[0])
    step = fzero.train_step(loss, donate=True, micro_batches=3, accumulate=accumulate)
    for t in range(2):
        g = torch.Generator().manual_seed(10 + t)
        state, _ = step(state, [torch.randn(8, 16, generator=g).to(mesh.device) for _ in range(3)])
    return fzero.gather(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream: needs a GPU")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_of_several_micro_batches_assembled_on_a_cuda_side_stream_keep_the_bits(stage, nccl_mesh):
    """k = 3 micro-batches at N = 1 on CUDA: each micro-batch's units assemble their gradients
    on the side stream (held back there, as above), and the step joins it at the end of that
    micro-batch's backward, before it adds the micro-batch's gradient to the sum ("each") or
    the local sum ("once", stages 0-1). The params are bitwise those of the step that assembles
    in line, and every bucket of every micro-batch (6 x 3 a step) was assembled beside."""
    for accumulate in ("each", "once") if stage < 2 else ("each",):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(norms_module.EarlyNorms, "DEVICES", ())
            want = _accumulated_run(nccl_mesh, stage, accumulate)
        held_back, beside = _held_back_writes(20_000_000)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(unit_module, "_write", held_back)
            got = _accumulated_run(nccl_mesh, stage, accumulate)
        assert beside == [True] * 36, (stage, accumulate, beside)
        assert all(torch.equal(got[u][k], want[u][k]) for u in want for k in want[u]), (stage, accumulate)


def _shared_gradient_run(mesh, stage):
    """Two steps of a loss that differentiates a sum of two units' leaves (`a + b`: autograd hands
    the same gradient tensor to both units' backward) and uses `b` once more, before `a`'s unit
    is entered, so that the engine runs `a`'s unit backward first and then adds `b`'s second
    gradient to the tensor it holds for `b` -- in place, where nothing else holds it; the params
    after them."""
    gen = torch.Generator().manual_seed(stage)
    tree = {"u0": {"a": torch.randn(32, 32, generator=gen) / 8}, "u1": {"b": torch.randn(32, 32, generator=gen) / 8}}
    tree = optree.tree_map(lambda t: t.to(mesh.device), tree)

    def loss(p, x):
        b = p["u1"]["b"]  # u1 is entered first
        y2 = x @ b
        y = x @ (p["u0"]["a"] + b)
        return y.square().mean() + y2.tanh().mean()

    state = fzero.init(tree, optim.adamw(0.1), stage=stage, mesh=mesh, units=lambda path: path.split("/")[0])
    step = fzero.train_step(loss, donate=True)
    for t in range(2):
        state, _ = step(state, torch.randn(64, 32, generator=torch.Generator().manual_seed(t)).to(mesh.device))
    return fzero.gather(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream: needs a GPU")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_gradient_two_units_share_is_not_written_before_the_side_stream_reads_it(stage, nccl_mesh, monkeypatch):
    """The same gradient tensor reaches two units' backward (`_shared_gradient_run`); the first
    unit's assembly reads it on the side stream, held back, while the engine goes on to add the
    second gradient of the other unit's leaf. The assembly keeps the tensor referenced until the
    side stream has read it (`unit.Assembly`), so the engine adds out of place: the params are
    bitwise those of the step that assembles in line, both units assembled on the side stream."""
    held_back, beside = _held_back_writes(20_000_000)
    monkeypatch.setattr(norms_module.EarlyNorms, "DEVICES", ())
    want = _shared_gradient_run(nccl_mesh, stage)
    monkeypatch.setattr(norms_module.EarlyNorms, "DEVICES", ("cuda",))
    monkeypatch.setattr(unit_module, "_write", held_back)
    got = _shared_gradient_run(nccl_mesh, stage)
    assert beside == [True] * 4
    assert all(torch.equal(got[u][k], want[u][k]) for u in want for k in want[u])


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("raised in the backward")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream: needs a GPU")
def test_a_buffer_freed_by_a_step_that_raises_takes_no_side_stream_write_later(nccl_mesh, monkeypatch):
    """A step whose backward raises after a unit above queued its assembly on the side stream
    (held back): the gradient buffer is freed as the exception unwinds, before the side stream
    has written it. The buffer was marked used by the side stream (`unit.Assembly`), so the
    tensors made next on the step's stream do not take its memory: filled right after, they
    hold their values once the side stream is done."""
    held_back, _ = _held_back_writes(1_000_000_000)  # about half a second: longer than the unwinding and collection below
    gen = torch.Generator().manual_seed(0)
    tree = {"u0": {"w": torch.randn(256, 256, generator=gen)}, "u1": {"w": torch.randn(256, 256, generator=gen)}}
    tree = optree.tree_map(lambda t: t.to(nccl_mesh.device), tree)

    def loss(p, x):
        h = _RaisesInBackward.apply(x @ p["u0"]["w"])  # u0's backward, and this one's, run after u1's
        return (h @ p["u1"]["w"]).square().mean()

    state = fzero.init(tree, optim.adamw(0.1), stage=0, mesh=nccl_mesh, units=lambda path: path.split("/")[0])
    step = fzero.train_step(loss, donate=True)
    monkeypatch.setattr(norms_module.EarlyNorms, "DEVICES", ("cuda",))
    monkeypatch.setattr(unit_module, "_write", held_back)
    x = torch.randn(8, 256, device=nccl_mesh.device)

    def error_of_step() -> str:  # the message only: no traceback keeps the step's frames (and buffers) alive
        try:
            step(state, x)
        except RuntimeError as e:
            return str(e)
        return ""

    assert "raised in the backward" in error_of_step()
    gc.collect()
    made = [torch.full((n,), 7.0, device=nccl_mesh.device) for n in (256 * 256, 256 * 256, 65 * 1024) * 4]
    torch.cuda.synchronize()
    assert all(bool((t == 7.0).all()) for t in made)


def _update_check_flags(mesh, stage, lr, side):
    """One donating SGD step of lr `lr` and the next: `(the new state's flag, the buckets whose
    check `Ends` took, in the checks a flag was made of)`, with the check taken bucket by bucket
    (`side`) or after the update. (A step that launches its update before the agreement's read
    takes the checks then, and drops them where the kernels were skipped: not counted.)"""
    tree = {"u0": {"w": torch.ones(64, 8)}, "u1": {"w": torch.ones(8, 4)}}
    taken = []
    joined = update_module.Ends.joined

    def counted(self):
        out = joined(self)
        taken.extend(sorted(out))
        return out

    state = fzero.init(optree.tree_map(lambda t: t.to(mesh.device), tree), optim.sgd(lr), stage=stage, mesh=mesh,
                       units=lambda path: path.split("/")[0])
    step = fzero.train_step(lambda p, x: (x @ p["u0"]["w"] @ p["u1"]["w"]).sum(), donate=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(update_module.Ends, "joined", counted)
        mp.setattr(update_module.Ends, "DEVICES", (mesh.device.type,) if side else ())
        state, _ = step(state, torch.ones(2, 64, device=mesh.device))
        flag = float(state.pending)
        with pytest.raises(fzero.NonFiniteError, match="made the params NaN or inf") if flag else contextlib.nullcontext():
            step(state, torch.ones(2, 64, device=mesh.device))
    return flag, taken


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_update_check_taken_per_bucket_flags_what_the_update_made_nonfinite(stage):
    """A donating update's finite check taken bucket by bucket as each is updated (`Ends`; on CUDA
    on a side stream, here in line) gives the flag the check after the update gives: 0 after a
    finite update, 1 where an update of finite gradients overflowed the params (SGD, lr 3e38),
    and the next step names the broken update (after a finite one, the next step is taken too).
    Both buckets are taken at each update."""
    mesh = fzero.SimMesh(1)
    for lr, flag, taken in ((1e-3, 0.0, [0, 1, 0, 1]), (3e38, 1.0, [0, 1])):
        assert mesh.run(lambda: _update_check_flags(mesh, stage, lr, True))[0] == (flag, taken)
        assert mesh.run(lambda: _update_check_flags(mesh, stage, lr, False))[0] == (flag, [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream: needs a GPU")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_update_check_on_a_cuda_side_stream_flags_what_the_update_made_nonfinite(stage, nccl_mesh):
    """As above, with the checks on a CUDA side stream joined before the flag is made."""
    for lr, flag, taken in ((1e-3, 0.0, [0, 1, 0, 1]), (3e38, 1.0, [0, 1])):
        assert _update_check_flags(nccl_mesh, stage, lr, True) == (flag, taken)
        assert _update_check_flags(nccl_mesh, stage, lr, False) == (flag, [])
