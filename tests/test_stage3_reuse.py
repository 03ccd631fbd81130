"""Stage 3 with a unit read again in the same forward (blocks run twice, ALBERT-style weight
sharing): each use's backward frees the unit again, so the gathered bytes live at once stay
within proofs/stage3.md section 5's bound, and the bits stay stage 0's.

Before, a unit's one Function (made at its first read) freed it only after the backward of
every use: a block stayed gathered from its last use's backward to its first use's, and a
forward running blocks 0, 1, 2, 3, 0, 1, 2, 3 held every block at once in backward (the census
at N = 2, k = 0: 9 blocks where the bound allows 3; found in review). Now a re-read after a
release hands the leaves through `gathering._Reread`, whose backward frees the unit: one more
all-gather per extra use.

The census is tests/test_prefetch.py's (`_census_run`, a `GatherCensusMesh`: every storage
allocated inside a unit's all-gather, over all N ranks, plus SimMesh's one transient).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import optim
from fzero.accounting import LiveStorages

from . import prefetch_cases as cases
from .test_no_leaks import _alive, _made
from .test_prefetch import _census_run, _equal, _unit_bytes

N, D, HIDDEN = 2, 8, (12, 12, 12, 12)  # four blocks of one size: L is a block, P the root unit
ORDERS = {"once": (0, 1, 2, 3), "first_again": (0, 1, 2, 3, 0), "twice": (0, 1, 2, 3, 0, 1, 2, 3),
          "reversed": (0, 1, 2, 3, 3, 2, 1, 0), "early": (0, 1, 0)}


def _sizes():
    sizes = _unit_bytes(D, HIDDEN, N)
    return sizes["default"], sizes["blocks.0"]


def _bound(k: int) -> int:
    """Section 5's `N * (P + (1 + k) * L)` plus SimMesh's one transient (a unit)."""
    root, block = _sizes()
    return N * (root + (1 + k) * block) + max(root, block)


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("order", ["once", "first_again", "twice", "reversed", "early"])
def test_a_unit_read_again_stays_within_the_bound_with_stage_0s_bits(order, k):
    """Per rank, the root unit, the block in use and k prefetched: the census over both ranks stays
    within the bound whatever the order (before: 5 blocks for (0, 1, 2, 3, 0) and 9 for the
    twice-run order at k = 0, against 3), at least the forward's 1 + k blocks per rank (not
    vacuous), every gathered storage freed by the end, and the bits of stage 0 on the same order."""
    root, block = _sizes()
    got, peak, after = _census_run(N, 3, D, HIDDEN, order=ORDERS[order], prefetch=k)
    want, _, _ = _census_run(N, 0, D, HIDDEN, order=ORDERS[order])
    _equal(want, got)
    assert N * (root + (1 + k) * block) <= peak <= _bound(k), (peak / block, _bound(k) / block)
    assert after == 0


def _gathers(order, **settings):
    """`{unit: all-gathers of it on rank 0}` in one stage-3 step on `order` (less the one
    `fzero.gather` after it, which `cases.train` returns)."""
    mesh = fzero.SimMesh(N)

    def rank_fn():
        with mesh.record() as log:
            cases.train(mesh, 3, D, HIDDEN, steps=1, order=order, **settings)
        units = [r.tag.split("/")[0] for r in log if r.op == "all_gather" and r.rank == mesh.rank
                 and not r.tag.startswith("fzero.")]
        return {u: units.count(u) - 1 for u in set(units)}

    return mesh.run(rank_fn)[0]


def test_a_reread_unit_costs_one_more_gather_per_extra_use_and_one_read_twice_in_a_row_none():
    """Each use of a block gathers it in forward and again in its backward, but the forward's
    last use, kept for its backward, which comes next; the root unit once. So running the blocks
    twice costs two gathers per block more: the second use's forward gather (as before) and its
    backward's (before, the second use's backward refill stayed gathered for the first use's,
    3 and 2). A block run twice in a row is not released in between (the forward's latest
    release waits, `Gathering.release`): no extra gather, the counts of the plain order."""
    once = _gathers((0, 1, 2, 3))
    assert once == {"default": 1, "blocks.0": 2, "blocks.1": 2, "blocks.2": 2, "blocks.3": 1}
    assert _gathers((0, 1, 2, 3, 0, 1, 2, 3)) == {"default": 1, "blocks.0": 4, "blocks.1": 4, "blocks.2": 4,
                                                  "blocks.3": 3}
    assert _gathers((0, 0, 1, 2, 3)) == once


def test_max_live_bytes_of_the_root_and_two_blocks_fits_blocks_run_twice():
    """A cap of the root unit and two blocks, which the plain order fits: before, the twice-run
    order raised ConfigError ("use finer units", which cannot help) in backward, where three
    blocks were still gathered. Now it fits at k = 0 and 1, the census within N * cap plus the
    transient, the bits those of the uncapped step."""
    root, block = _sizes()
    cap = root + 2 * block
    order = ORDERS["twice"]
    for k in (0, 1):
        free, _, _ = _census_run(N, 3, D, HIDDEN, order=order, prefetch=k)
        capped, peak, after = _census_run(N, 3, D, HIDDEN, order=order, prefetch=k, max_live_bytes=cap)
        _equal(free, capped)
        assert peak <= N * cap + block and after == 0, (k, peak / block)


def test_remat_and_prefetch_2_keep_the_bound_on_blocks_run_twice():
    """Checkpointed blocks (their recompute in backward reads the unit again) and k = 2."""
    order = ORDERS["twice"]
    want, _, _ = _census_run(N, 0, D, HIDDEN, order=order)
    for settings, k in (({"remat": True}, 0), ({"remat": True}, 1), ({}, 2)):
        got, peak, after = _census_run(N, 3, D, HIDDEN, order=order, prefetch=k, **settings)
        _equal(want, got)
        assert peak <= _bound(k) and after == 0, (settings, k, peak, _bound(k))


class _Shared(cases.Tiny):
    """`Tiny` whose loss may drop a second pass (`extra`: blocks run on the embedding and dropped,
    as a loss computing something it then does not return) or break the width before block
    `fail`'s second run (its layer norm raises inside that use, after the unit was read again)."""

    def forward(self, idx, order, extra=(), fail=None):
        x = self.emb(idx)
        seen = set()
        for i in order:
            if i == fail and i in seen:
                x = x[..., :-1]
            seen.add(i)
            x = self.blocks[i](x)
        y = self.emb(idx)
        for i in extra:
            y = self.blocks[i](y)  # computed and dropped
        return self.head(self.ln_f(x))


def _shared_run(stage, order, extra=(), frozen=(), fail=None, k=0):
    """`(per-rank (gathered params, [loss]) or the error's type name, census peak, live after)`,
    one step of `_Shared` with the blocks in `frozen` frozen."""
    torch.manual_seed(0)
    m = _Shared(11, D, HIDDEN)
    for i in frozen:
        m.blocks[i].requires_grad_(False)
    params, apply, info = fzero.from_module(m, units=fzero.units_by_prefix(m, "blocks"))
    mesh = cases.GatherCensusMesh(N)
    census = LiveStorages(count=mesh.inside)

    def loss(p, b):
        return F.cross_entropy(apply(p, b[0], order, extra, fail).flatten(0, 1), b[1].flatten())

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        with census:
            try:
                state, m = fzero.train_step(loss, prefetch=k)(state, cases.batch(mesh.rank))
                out = fzero.gather(state), [m.loss]
            except RuntimeError as e:
                out = type(e).__name__
            gc.collect()
            torch.zeros(1).add_(1)  # one more op: the census re-reads what is live
        return out

    return mesh.run(rank_fn), census.peak, census.current


@pytest.mark.parametrize("k", [0, 1])
def test_frozen_blocks_run_twice_are_freed_after_each_use(k):
    """Blocks 0 and 2 frozen (their inputs need a gradient, so autograd saves their weights): no
    leaf of theirs gets a gradient, and `_Reread`'s backward still runs (through its anchor), so
    the bound and stage 0's bits hold."""
    order, frozen = ORDERS["twice"], (0, 2)
    want, _, _ = _shared_run(0, order, frozen=frozen)
    got, peak, after = _shared_run(3, order, frozen=frozen, k=k)
    _equal(want, got)
    assert peak <= _bound(k) and after == 0, (peak, _bound(k))


def test_a_use_the_loss_drops_changes_no_bit_and_leaves_nothing_gathered():
    """A second pass through blocks 0 and 1 that the loss computes and drops: its `_Reread`
    reaches the loss only by its anchor."""
    order = ORDERS["once"]
    want, _, _ = _shared_run(0, order, extra=(0, 1))
    got, peak, after = _shared_run(3, order, extra=(0, 1))
    _equal(want, got)
    assert peak <= _bound(0) and after == 0, (peak, _bound(0))


def test_an_error_inside_the_second_use_leaves_no_gathered_storage_alive():
    """Block 1's second run raises (a shape error in its layer norm) after the unit was gathered
    again and handed through `_Reread`: every rank raises it, and after the step nothing gathered
    and no `Gathering` is left alive."""
    with _made() as made:
        out, _, after = _shared_run(3, ORDERS["twice"], fail=1)
        gc.collect()
        assert _alive(made) == []
    assert out == ["RuntimeError"] * N and after == 0, (out, after)
