"""Stages 1-3 equal stage 0 bit for bit, and stage 0 equals a serial reference, on SimMesh.

One property per world size N (1..8); each draw picks a pytree (nested dicts/lists, shapes not
divisible by N, smaller than N, 0-d, zero-size), units, parameter groups (weight-decay mask,
lr scale, frozen), an optimizer and its hyper-parameters, several steps with a different batch
per rank, tied leaves (used twice by the loss) and unused leaves (used by no rank), and one
stage s in {1, 2, 3}, one engine and one gather mode. It runs stage 0 and stage s and compares
after every step, with `torch.equal`:

- stage s's params, optimizer state (shards concatenated over ranks) and loss == stage 0's;
- stage 0's params == the serial reference: per-rank gradients from `torch.func.grad` on the
  plain pytree, reduced as `((g_0 * fl(1/N)) + g_1 * fl(1/N)) + ...` in rank order (the
  order SimMesh sums in), then `torch.optim` with `foreach=False`, param groups mirrored, and
  `p.grad = None` for unused and frozen leaves.

The draws, the runs, the serial reference and the comparison are tests/stage_harness.py. Two
more cases every stage agrees on: a leaf some ranks use and others do not (reduced on every
rank, as DDP with `find_unused_parameters`), and units of several dtypes.

Why equality (not a tolerance) is right: proofs/stages.md.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import fzero
from fzero import optim
from fzero.testing.strategies import example_count, seed_per_case

from .stage_harness import check, problems


@pytest.mark.filterwarnings("ignore::fzero.GroupHoldsNoLeaf")  # drawn groups may take no leaf of a drawn tree
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_stages_equal_stage0_and_serial_reference(n):
    @seed_per_case(n)  # derandomized, each N draws its own problems (not N = 1's again)
    @settings(max_examples=example_count(100 if n <= 4 else 40))
    @given(problems(n))
    def prop(pb):
        check(pb)

    prop()


@pytest.mark.parametrize("gather", ["eager", "on_use"])
def test_leaf_used_by_some_ranks_only_is_reduced_on_every_rank(gather):
    """DDP with find_unused_parameters: a leaf used on rank 0 only still gets rank 1's zero
    contribution and is updated. In stages 2-3 the unit's reduce-scatter runs in its backward,
    which every rank now runs (the unit's anchor), so all stages agree. With gather="on_use" a
    unit only rank 0 reads is gathered (stage 3) and reduced only there: every rank must read the
    same units in the same order, and otherwise every rank stops with CollectiveMismatch (where
    the ranks' steps took different paths: its subclass DivergentPaths, the README's word)."""
    if gather == "on_use":
        mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)

        def fails(r):
            state = fzero.init({"a": torch.ones(4), "b": torch.ones(4)}, opt, stage=3, mesh=mesh, units=lambda p: p)
            loss = lambda p, r: p["a"].sum() + (p["b"].sum() if r == 0 else 0)  # noqa: E731
            fzero.train_step(loss, gather="on_use")(state, r)

        with pytest.raises(fzero.CollectiveMismatch, match="tag='b/float32/default'"):
            mesh.run(fails, [(0,), (1,)])
        return
    params = {"a": torch.ones(4), "b": torch.ones(4)}
    finals = {}
    for stage in range(4):
        mesh, opt = fzero.SimMesh(3), optim.adamw(0.1)

        def rank_fn(r):
            state = fzero.init(params, opt, stage=stage, mesh=mesh, units=lambda p: p)
            loss = lambda p, r: p["a"].sum() + (p["b"].square().sum() if r == 0 else 0)  # noqa: E731
            state, _ = fzero.train_step(loss, gather=gather)(state, r)
            return fzero.gather(state)

        finals[stage] = mesh.run(rank_fn, [(r,) for r in range(3)])
    assert not torch.equal(finals[0][0]["b"], params["b"])  # updated: rank 0 used it
    for stage in (1, 2, 3):
        for r in range(3):
            assert all(torch.equal(finals[stage][r][k], finals[0][0][k]) for k in params)


def test_units_of_different_dtypes_all_stages_agree():
    """bf16, fp32 and fp64 units in one model (each unit's anchor is fp32, whatever its dtype)."""
    params = {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.ones(3), "c": torch.ones(2, dtype=torch.float64)}
    finals = []
    for stage in range(4):
        mesh, opt = fzero.SimMesh(2), optim.adamw(0.1)

        def rank_fn(x):
            state = fzero.init(params, opt, stage=stage, mesh=mesh, units=lambda p: p)
            loss = lambda p, x: (p["a"].float() * x).sum() + p["b"].sum() + p["c"].sum().float()  # noqa: E731
            state, _ = fzero.train_step(loss)(state, x)
            return fzero.gather(state)

        finals.append(mesh.run(rank_fn, [(torch.full((4,), 1.0 + r),) for r in range(2)])[0])
    for final in finals:
        assert {k: v.dtype for k, v in final.items()} == {k: v.dtype for k, v in params.items()}
        assert all(torch.equal(final[k], finals[0][k]) for k in params)
    assert not torch.equal(finals[0]["a"], params["a"])
