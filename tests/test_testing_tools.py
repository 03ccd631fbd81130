"""fzero.testing's own tools: `Pool` after a failed call, `assert_trees_equal` on fzero's nodes and
on bits, and the strategies' bounds (found in review: each failed before its fix)."""

from __future__ import annotations

import collections
import contextlib
import os
import struct
import time

import numpy as np
import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fzero
from fzero import optim
from fzero.testing import Pool, PoolError, assert_trees_equal, float_tensors, pytrees, shapes, world_sizes

# ---------------------------------------------------------------------------------------------
# Functions the pool's workers run (module level: they import this module by name).


def ident(mesh, x):
    return (mesh.rank, x)


def pid(mesh):
    return os.getpid()


def sleep_for(mesh, seconds):
    time.sleep(seconds)
    return mesh.rank


def exit_on_rank1(mesh):
    if mesh.rank == 1:
        os._exit(0)  # no reply, no error: the process is just gone
    time.sleep(300)
    return mesh.rank


def _rebuild_fails():
    raise RuntimeError("this reply cannot be rebuilt in the test process")


class Unloadable:
    """Pickles on the worker; unpickling it raises."""

    def __reduce__(self):
        return (_rebuild_fails, ())


def unloadable_on_rank0(mesh):
    return Unloadable() if mesh.rank == 0 else mesh.rank


def _gone(pids):
    """The pids that are no longer running (zombies count as gone)."""
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().split()[2] == "Z":
                    out.append(p)
        except FileNotFoundError:
            out.append(p)
    return out


# ---------------------------------------------------------------------------------------------
# Pool


@pytest.mark.parametrize("nproc", [0, -1, True, 2.0, "2"])
def test_pool_needs_a_positive_int(nproc):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"Pool: nproc must be an int >= 1"):
        Pool(nproc)
    assert time.monotonic() - t0 < 1  # refused before torchrun starts (Pool(0) used to start one)


@pytest.mark.dist
def test_pool_argument_that_does_not_pickle_sends_nothing():
    """Rank 1's argument does not pickle: before, rank 0's call was already sent, and the next
    call read rank 0's stale reply ("first" for "second")."""
    with Pool(2, timeout=60) as pool:
        with pytest.raises(ValueError, match=r"rank 1's arguments cannot be pickled .* the pool is still open"):
            pool.run(ident, [("first",), (lambda: 0,)])
        assert pool.alive
        assert pool.run(ident, [("second",), ("second",)]) == [(0, "second"), (1, "second")]


@pytest.mark.dist
def test_pool_reply_that_does_not_unpickle_closes_the_pool():
    """Before, the call raised the unpickling error and left the pool open with rank 1's reply
    unread, for the next call to take as its own."""
    pool = Pool(2, timeout=60)
    try:
        with pytest.raises(PoolError, match=r"failed after it was sent .*cannot be rebuilt.* the pool is closed"):
            pool.run(unloadable_on_rank0)
        assert not pool.alive
        with pytest.raises(PoolError, match="is not running"):
            pool.run(ident, [("next",), ("next",)])
    finally:
        pool.close()


@pytest.mark.dist
@pytest.mark.parametrize("fault", ["timeout", "dead worker"])
def test_pool_fault_kills_the_workers_at_once(fault):
    """A timeout or a worker that exits: PoolError within seconds and every process gone (before:
    close() waited a fixed 30 s for busy workers after the timeout; a worker's exit(0) left its
    peer sleeping for those 30 s too)."""
    pool = Pool(2, timeout=60)
    try:
        procs = pool.run(pid) + [pool._proc.pid]
        t0 = time.monotonic()
        with pytest.raises(PoolError, match="the pool is closed"):
            if fault == "timeout":
                pool.run(sleep_for, [(300,), (300,)], timeout=2)
            else:
                pool.run(exit_on_rank1)
        elapsed = time.monotonic() - t0
        assert elapsed < 2 + 2 * Pool.KILL_GRACE + 5, elapsed
        assert not pool.alive and _gone(procs) == procs
    finally:
        pool.close()


# ---------------------------------------------------------------------------------------------
# assert_trees_equal


def _states(n_states=2, same_optimizer=True):
    mesh = fzero.SimMesh(1)
    params = {"w": torch.arange(4.0), "b": torch.ones(2)}
    opt = optim.adam(1e-3)
    return mesh.run(lambda: [fzero.init(params, opt if same_optimizer else optim.adam(1e-3), stage=1, mesh=mesh)
                             for _ in range(n_states)])[0]


def test_assert_trees_equal_on_zero_states():
    """ZeroState is an optree node in fzero's namespace, not a dict / list / tuple: it used to be
    compared with `==`, which raised "Boolean value of Tensor ... is ambiguous"."""
    s1, s2 = _states()
    assert_trees_equal(s1, s2)
    assert_trees_equal(s1, s2, bitwise=True)
    s3 = s1.replace(params=tuple(p.clone().add_(1) for p in s1.params))
    with pytest.raises(AssertionError, match=r"leaf 'params\.0' .* elements differ"):
        assert_trees_equal(s1, s3)
    a, b = _states(same_optimizer=False)
    with pytest.raises(AssertionError, match=r"ZeroState node metadata differ: StateInfo fields \['optimizer'\]"):
        assert_trees_equal(a, b)


class Box:
    """A node registered in fzero's namespace, with metadata."""

    def __init__(self, tag, value):
        self.tag, self.value = tag, value


optree.register_pytree_node(Box, lambda b: ((b.value,), b.tag, ("value",)), lambda tag, kids: Box(tag, *kids),
                            namespace="fzero")


def test_assert_trees_equal_on_registered_nodes():
    x = torch.tensor([1.0, 2.0])
    assert_trees_equal({"k": Box("a", x)}, {"k": Box("a", x.clone())})
    with pytest.raises(AssertionError, match=r"at 'k': Box node metadata differ: 'a' != 'b'"):
        assert_trees_equal({"k": Box("a", x)}, {"k": Box("b", x)})
    with pytest.raises(AssertionError, match=r"leaf 'k\.value'"):
        assert_trees_equal({"k": Box("a", x)}, {"k": Box("a", x + 1)})


def _double(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def test_assert_trees_equal_bitwise_python_floats():
    """Python float leaves were compared with `==` even with bitwise=True: -0.0 == 0.0 passed, and
    any NaN equalled any other."""
    nan, other_nan = _double(0x7FF8000000000000), _double(0x7FF8000000000001)
    assert_trees_equal({"x": nan}, {"x": _double(0x7FF8000000000000)}, bitwise=True)  # same bits
    with pytest.raises(AssertionError, match=r"at 'x': .*bitwise"):
        assert_trees_equal({"x": nan}, {"x": other_nan}, bitwise=True)
    with pytest.raises(AssertionError, match=r"at 'x': 0\.0 != -0\.0"):
        assert_trees_equal({"x": 0.0}, {"x": -0.0}, bitwise=True)
    assert_trees_equal({"x": 0.0}, {"x": -0.0})  # by value, 0.0 == -0.0
    with pytest.raises(AssertionError):
        assert_trees_equal({"x": complex(0.0, 0.0)}, {"x": complex(-0.0, 0.0)}, bitwise=True)


def test_assert_trees_equal_bitwise_complex_tensors():
    """Complex tensors skipped the bit view (not is_floating_point): -0.0 and 0.0 passed."""
    a, b = torch.tensor([1 + 0j, 0j]), torch.tensor([1 + 0j, complex(-0.0, 0.0)])
    assert_trees_equal(a, b)
    with pytest.raises(AssertionError, match=r"1 of 2 elements differ; first at index \[1\]"):
        assert_trees_equal(a, b, bitwise=True)
    assert_trees_equal(a, a.clone(), bitwise=True)
    assert_trees_equal(a.conj(), a.conj().resolve_conj(), bitwise=True)


def test_assert_trees_equal_meta_tensors():
    """Meta tensors hold no values: torch.equal raised NotImplementedError."""
    assert_trees_equal(torch.zeros(2, device="meta"), torch.ones(2, device="meta"))
    assert_trees_equal(torch.zeros(2, device="meta"), torch.zeros(2, device="meta"), bitwise=True)
    with pytest.raises(AssertionError, match="on meta"):
        assert_trees_equal(torch.zeros(2, device="meta"), torch.zeros(3, device="meta"))


# ---------------------------------------------------------------------------------------------
# strategies


def test_shapes_stay_within_their_bounds():
    """The fixed corner shapes ((2, 0), (3, 5), (13,), ...) were drawn whatever the bounds."""
    seen = []

    @settings(max_examples=300, derandomize=True, database=None)
    @given(shapes(max_dims=1, max_side=2))
    def prop(s):
        seen.append(s)
        assert len(s) <= 1 and all(d <= 2 for d in s), s

    prop()
    assert {(), (0,), (1,), (2,)} <= set(seen)
    with pytest.raises(ValueError, match="max_side"):
        shapes(max_side=-1)


def test_pytrees_hold_at_most_max_leaves():
    """`max_leaves` bounded each of up to three subtrees of the root: up to 3x as many leaves."""
    counts = collections.Counter()

    @settings(max_examples=300, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(pytrees(max_leaves=2))
    def prop(tree):
        assert isinstance(tree, (dict, list, tuple))  # the root is a container
        counts[len(optree.tree_leaves(tree, none_is_leaf=False))] += 1

    prop()
    assert set(counts) == {0, 1, 2}
    with pytest.raises(ValueError, match="max_leaves"):
        pytrees(max_leaves=0)


def test_pytrees_are_deterministic_under_derandomize():
    def draw():
        out = []

        @settings(max_examples=30, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
        @given(pytrees())
        def prop(tree):
            leaves, spec = optree.tree_flatten(tree, none_is_leaf=False)
            out.append((spec, [(x.dtype, tuple(x.shape), x.flatten()[:3].tolist()) for x in leaves]))

        prop()
        return out

    assert draw() == draw()


def test_assert_trees_equal_bitwise_reads_torchs_lazy_conjugate_and_negative_views():
    """`z.conj().imag` is a view with torch's negative bit set, which `Tensor.view(dtype)` refuses:
    `bitwise=True` raised torch's RuntimeError on it instead of comparing (found in review). The
    bits compared are what the view reads as, so it equals a plain tensor of those values and
    differs from one of other values with an `AssertionError`. (One element: the view is
    contiguous, so nothing on the way copies it and drops the bit.)"""
    z = torch.tensor([1 + 2j])
    assert z.conj().imag.is_neg() and z.conj().imag.is_contiguous()
    assert_trees_equal({"i": z.conj().imag}, {"i": torch.tensor([-2.0])}, bitwise=True)
    assert_trees_equal(z.conj(), torch.tensor([1 - 2j]), bitwise=True)
    with pytest.raises(AssertionError, match=r"leaf 'i' \(torch.float32\[1\]\): 1 of 1 elements differ"):
        assert_trees_equal({"i": z.conj().imag}, {"i": torch.tensor([2.0])}, bitwise=True)


# ---------------------------------------------------------------------------------------------
# What the strategies promise to draw (the suite's properties rest on it: a strategy that stopped
# drawing the corners, or went back to favouring N = 1, would leave every property passing on
# easier cases; each of these failed under such a mutation of fzero/testing/strategies.py, which
# the rest of the suite passed)


def _drawn(strategy, count: int = 200) -> list:
    """`count` derandomized draws of `strategy` (hypothesis's own generation: what a property sees)."""
    out = []

    @settings(max_examples=count, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(x):
        out.append(x)

    prop()
    return out


def test_world_sizes_shrink_to_two_and_still_draw_one():
    """N = 2 is the simplest world size (what hypothesis draws first and shrinks to), N = 1 is still
    reached, and every size up to `max_n` is drawn. `st.integers(1, max_n)` favours N = 1."""
    from hypothesis import find

    assert find(world_sizes(8), lambda n: True) == 2
    assert find(world_sizes(8), lambda n: n == 1) == 1
    assert set(_drawn(world_sizes(8), 100)) == set(range(1, 9))


def test_shapes_draw_every_corner_within_the_bounds():
    """The fixed corners (0-d, zero-size, one element, a zero dim after a nonzero one, 7 and 3 x 5:
    not divisible by most world sizes) are drawn, not only where the random lists happen to hit
    them (without the corners, (2, 0) and (3, 5) were not among 200 draws); (13,) is past the
    default `max_side` of 9 and never drawn. (hypothesis does not repeat a draw it has made, so
    the draws say which shapes come up, not how often.)"""
    seen = set(_drawn(shapes()))
    assert {(), (0,), (1,), (2, 0), (7,), (3, 5)} <= seen
    assert (13,) not in seen


def test_float_tensors_span_many_magnitudes():
    """Per-tensor scales 2^k, k in [-20, 20] (float16: [-8, 8]): the drawn tensors' largest
    magnitudes span tens of binades, so a sum that rounds is drawn, not only values near 1."""
    exponents = {dtype: [int(torch.frexp(x.abs().max().double())[1]) for x in
                         _drawn(float_tensors(dtypes=[dtype], shape=st.just((64,))), 100)]
                 for dtype in (torch.float32, torch.float16)}
    assert max(exponents[torch.float32]) - min(exponents[torch.float32]) >= 30, sorted(exponents[torch.float32])
    assert 10 <= max(exponents[torch.float16]) - min(exponents[torch.float16]) <= 2 * 8 + 4


def test_pytrees_draw_every_node_kind_unsorted_keys_and_corner_leaves():
    """What `pytrees()` promises: dicts (keys in an insertion order that is not sorted), lists,
    tuples and NamedTuples, nested; 0-d and zero-size leaves; trees of mixed dtypes."""
    from fzero.testing.strategies import Pair, Single

    kinds, leaves, mixed, unsorted = collections.Counter(), collections.Counter(), 0, 0
    for tree in _drawn(pytrees()):
        nodes = [tree]
        dtypes = set()
        while nodes:
            node = nodes.pop()
            if isinstance(node, torch.Tensor):
                dtypes.add(node.dtype)
                leaves["0-d" if node.dim() == 0 else "empty" if node.numel() == 0 else "other"] += 1
                continue
            kinds[type(node).__name__] += 1
            if isinstance(node, dict):
                unsorted += list(node) != sorted(node)
                nodes.extend(node.values())
            else:
                nodes.extend(node)
        mixed += len(dtypes) > 1
    assert all(kinds[t.__name__] >= 10 for t in (dict, list, tuple, Pair, Single)), kinds
    assert leaves["0-d"] >= 10 and leaves["empty"] >= 10, leaves
    assert unsorted >= 10 and mixed >= 10, (unsorted, mixed)


def test_groups_draw_frozen_groups_unless_told_not_to():
    from fzero.testing import groups

    drawn = [g for gs in _drawn(groups(), 100) for g in gs]
    assert sum(g.frozen for g in drawn) >= 10 and sum(not g.weight_decay for g in drawn) >= 10, drawn
    assert {g.lr_scale for g in drawn} == {0.0, 0.5, 1.0, 2.0}
    assert not any(g.frozen for gs in _drawn(groups(frozen=False), 100) for g in gs)


@pytest.mark.parametrize("profile, want", [("ci", 7), ("local", 70), ("a-profile-of-ones-own", 7)])
def test_examples_runs_ten_times_as_many_under_the_local_profile(monkeypatch, profile, want):
    from fzero.testing import example_count, examples

    monkeypatch.setenv("HYPOTHESIS_PROFILE", profile)
    assert example_count(7) == want and examples(7).max_examples == want


# ---------------------------------------------------------------------------------------------
# `assert_trees_equal` on numpy arrays (found in the twenty-ninth review: two empty float arrays,
# which are equal, raised numpy's ValueError, "cannot reshape array of size 0").


@pytest.mark.parametrize("shape", [(0,), (0, 3), (2, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_assert_trees_equal_compares_empty_numpy_float_arrays_bitwise(shape, dtype):
    """Two empty float arrays are equal, bitwise too (before: numpy's ValueError, "cannot reshape
    array of size 0 into shape (0,newaxis)"); one of another shape still differs."""
    assert_trees_equal({"a": np.zeros(shape, dtype)}, {"a": np.zeros(shape, dtype)}, bitwise=True)
    with pytest.raises(AssertionError, match="numpy"):
        assert_trees_equal({"a": np.zeros(shape, dtype)}, {"a": np.zeros((1, *shape), dtype)}, bitwise=True)


def test_assert_trees_equal_still_tells_signed_zeros_apart_in_numpy_arrays():
    """The bitwise numpy comparison after the fix: -0.0 against 0.0 differs, at its index."""
    a, b = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)
    b[1, 2] = -0.0
    assert_trees_equal(a, b)
    with contextlib.suppress(AssertionError):
        assert_trees_equal(a, b, bitwise=True)
        raise RuntimeError("bitwise: -0.0 read as 0.0")
    with pytest.raises(AssertionError, match=r"first at index \[1, 2\]"):
        assert_trees_equal(a, b, bitwise=True)
