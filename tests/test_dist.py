"""DistMesh on real gloo process groups (persistent pools of 2 and 4 torchrun workers) against
SimMesh: values, derivatives, the compatibility shim's warnings, and failures that must not hang.

Draws are generated here and shipped to the workers (tests/dist_cases.py); no process is
started per draw. Workers run with warnings as errors.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.testing import FLOAT_DTYPES, examples, float_tensors, integer_valued

from . import dist_cases

pytestmark = pytest.mark.dist

SIDE = st.integers(1, 5)
TRAIL = st.sampled_from([(), (), (3,), (2, 2)])
OPS = ("all_gather", "reduce_scatter", "sum", "max", "broadcast")
EPS = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def sim_run(n, fn, args):
    mesh = fzero.SimMesh(n)
    return mesh.run(functools.partial(fn, mesh), args)


@st.composite
def collective_args(draw, n, *, integer):
    s, trail, dtype = draw(SIDE), draw(TRAIL), draw(st.sampled_from(FLOAT_DTYPES))
    make = integer_valued if integer else float_tensors
    draw_t = lambda shape: draw(make(dtypes=[dtype], shape=st.just(shape)))  # noqa: E731
    src = draw(st.integers(0, n - 1))
    return [(draw_t((s, *trail)), draw_t((n * s, *trail)), src) for _ in range(n)]


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def assert_same(got, want, ops):
    for r, (g, w) in enumerate(zip(got, want)):
        for op in ops:
            assert g[op].dtype == w[op].dtype and g[op].shape == w[op].shape, (r, op)
            assert torch.equal(_bits(g[op]), _bits(w[op])), (r, op, g[op], w[op])


@examples(25)
@given(collective_args(2, integer=False))
def test_n2_every_collective_equals_sim_bitwise(dist2, args):
    """N = 2: a sum of two floats does not depend on the order, so even sums are bitwise."""
    assert_same(dist2.run(dist_cases.collectives, args), sim_run(2, dist_cases.collectives, args), OPS)


@examples(25)
@given(collective_args(4, integer=True))
def test_n4_integer_valued_collectives_equal_sim_bitwise(dist4, args):
    """N = 4, integers |v| <= 16: every partial sum is exact in every dtype, so any order agrees."""
    assert_same(dist4.run(dist_cases.collectives, args), sim_run(4, dist_cases.collectives, args), OPS)


@examples(25)
@given(collective_args(4, integer=False))
def test_n4_random_float_sums_within_the_summation_bound(dist4, args):
    """N = 4, random floats: gather, broadcast and max move or compare values (bitwise); sums may
    add in another order than SimMesh's 0, 1, 2, 3.

    Bound: any order of N - 1 floating additions of x_0 .. x_{N-1} (each result rounded with
    unit roundoff u, |δ| <= u) gives ŝ with |ŝ - s| <= γ_{N-1} Σ_r |x_r|, γ_k = k u / (1 - k u)
    (Higham, Accuracy and Stability, eq. 4.4 for any summation tree); to first order
    (N - 1) u Σ_r |x_r|. Accumulating in a wider type and rounding once is within it too. Both
    gloo's and SimMesh's sums satisfy it, so |gloo - sim| <= 2 γ_{N-1} Σ_r |x_r|. Σ_r |x_r| is
    computed in float64 (exact for the narrower dtypes; for float64 a relative error of at most
    γ_3(2^-53), covered by the factor (1 + 2^-50)).
    """
    n = 4
    got, want = dist4.run(dist_cases.collectives, args), sim_run(n, dist_cases.collectives, args)
    assert_same(got, want, ("all_gather", "max", "broadcast"))
    dtype = args[0][0].dtype
    u = EPS[dtype]
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    for op, k in (("sum", 0), ("reduce_scatter", 1)):
        abs_sum = sum(a[k].double().abs() for a in args)
        for r in range(n):
            bound = abs_sum.chunk(n)[r] if op == "reduce_scatter" else abs_sum
            diff = (got[r][op].double() - want[r][op].double()).abs()
            assert bool((diff <= 2 * gamma * bound * (1 + 2.0**-50)).all()), (op, r, diff.max())


@pytest.mark.parametrize("n", [2, 4])
@examples(10)
@given(data=st.data())
def test_gradients_on_dist_mesh_equal_sim_mesh(dist2, dist4, n, data):
    """torch.func.grad and plain autograd through every differentiable collective: bitwise at
    N = 2 with random floats, at N = 4 with integer values (every sum exact)."""
    pool = {2: dist2, 4: dist4}[n]
    s, trail = data.draw(SIDE), data.draw(TRAIL)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    make = float_tensors if n == 2 else integer_valued
    t = lambda shape: data.draw(make(dtypes=[dtype], shape=st.just(shape)))  # noqa: E731
    args = [(t((s, *trail)), t((n * s, *trail)), t((n * s, *trail))) for _ in range(n)]
    got, want = pool.run(dist_cases.grads, args), sim_run(n, dist_cases.grads, args)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.equal(_bits(a), _bits(b))
        assert torch.equal(g[0], g[2]) and torch.equal(g[1], g[3])  # func.grad == autograd


def test_no_warnings_from_the_compat_shim(dist2, dist4):
    assert dist2.run(dist_cases.warnings_seen) == [[], []]
    assert dist4.run(dist_cases.warnings_seen) == [[]] * 4


# Failures last; the pools stay usable afterwards (checked).


@pytest.mark.parametrize("n", [2, 4])
def test_mismatched_shapes_raise_on_every_rank(dist2, dist4, n):
    pool = {2: dist2, 4: dist4}[n]
    out = pool.run(dist_cases.gather_shape, [((2 + (r == 1),),) for r in range(n)], return_exceptions=True)
    for r, e in enumerate(out):
        assert isinstance(e, fzero.testing.RemoteError), (r, e)
        assert isinstance(e.exception, fzero.CollectiveMismatch), e
        assert "float32[3]" in e.message and "float32[2]" in e.message
        assert all(f"rank {s}: all_gather" in e.message for s in range(n))
    assert all(torch.equal(t, torch.ones(n)) for t in pool.run(dist_cases.gather_shape, [((1,),)] * n))


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_that_raises_stops_every_rank(dist2, dist4, n):
    pool = {2: dist2, 4: dist4}[n]
    bad = n - 1
    out = pool.run(dist_cases.raise_on, [(bad,)] * n, return_exceptions=True)
    assert isinstance(out[bad].exception, ValueError) and "boom" in out[bad].message
    for r in range(n - 1):
        assert isinstance(out[r].exception, fzero.RankFailed), out[r]
        assert f"rank(s) [{bad}] raised" in out[r].message
    with pytest.raises(fzero.testing.WorkerError, match=rf"rank {bad} raised builtins.ValueError: boom"):
        pool.run(dist_cases.raise_on, [(bad,)] * n)
    assert all(torch.equal(t, torch.ones(n)) for t in pool.run(dist_cases.gather_shape, [((1,),)] * n))


def test_pool_rejects_functions_workers_cannot_import(dist2):
    with pytest.raises(ValueError, match="module-level function"):
        dist2.run(lambda mesh: None)
