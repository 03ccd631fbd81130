"""What a rank holds at peak during one step: the storages aten ops allocate, counted by
`fzero.accounting.LiveStorages` (it sees only allocations, their sizes and lifetimes, never
fzero's bookkeeping), on SimMesh.

- Stage 2 with `gather="on_use"` holds at most one unit's full gradients at once (its peak of
  gradient-shaped storages does not grow with the number of units K), where stage 1 holds all
  K units' until after backward (README, "Limits today").
- Stage 3 with `gather="on_use"` and the autograd engine frees each block's gathered parameters
  after its forward and gathers them again in backward: its forward holds about one unit where
  eager gathering holds all K, for the same bits and one more all-gather per re-gathered unit
  (the 3Ψ of proofs/communication.md).
- The census itself: it counts the new storages its `count` accepts, per `group`, each at its
  size at the latest op (a storage released by `resize_(0)` counts 0).

Model-state bytes (what `fzero.accounting.estimate` predicts) are tests/test_accounting.py's.
"""

from __future__ import annotations

import threading

import pytest
import torch

import fzero
from fzero import optim
from fzero.accounting import LiveStorages

from .stage_harness import PeakAtBackward


class _Blocks(torch.nn.Module):
    def __init__(self, k: int, d: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))

    def forward(self, x):  # (1, d) -> ()
        for blk in self.blocks:
            x = torch.tanh(blk(x))
        return x.square().mean()


@pytest.mark.parametrize("model_kind", ["module", "pytree"])
@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_stage2_holds_at_most_one_unit_of_full_gradients(engine, model_kind):
    """K blocks of Linear(d, d), one unit each, gather="on_use". Gradient-shaped storages are the
    (d, d) weight gradients (d*d*4 B), the (d,) bias gradients (d*4 B; activations are (2, d))
    and a unit's assembled flat[N * S].
    A rank's census runs from the end of its forward to the step's agreement collective.

    Stage 1 reducing after backward (`accumulate="once"`: its default starts each unit's
    reduce-scatter in the unit's backward too, and on SimMesh that completes at once) keeps every
    unit's full gradient until after backward: >= K units, growing with K.
    Stage 2 reduce-scatters each unit when its backward is done -- the unit's Function runs
    right after the block's backward because it was created, on use, just before the block's
    forward -- so its peak does not grow with K: the per-leaf gradients, the assembled buffer,
    its fl(1/N) copy and SimMesh's reduction accumulator, all of one unit (< 5 units).

    With gather="eager" every unit's Function is created before the loss, the autograd engine
    runs them after every later node, and stage 2 then reduces only after the whole backward
    (README, "Limits today")."""
    n, d = 3, 16
    unit = (d * d + d) * 4
    padded = -(-(d * d + d) // n) * n * 4  # bytes of one unit's flat[N * S], fp32

    def peak(stage, k):
        torch.manual_seed(0)
        model = _Blocks(k, d)
        if model_kind == "module":  # from_module: flat-dict params, apply binds each block in a hook
            params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
            units = info.units
        else:  # a nested pytree and a plain loss: placeholders swapped at first use
            params = {"blocks": [{"w": blk.weight.detach(), "b": blk.bias.detach()} for blk in model.blocks]}
            units = lambda path: ".".join(path.split(".")[:2])  # noqa: E731

            def apply(p, x):  # (2, d) -> ()
                for blk in p["blocks"]:
                    x = torch.tanh(x @ blk["w"].t() + blk["b"])
                return x.square().mean()
        sizes, on = {d * d * 4, d * 4, padded}, set()  # gradient-shaped sizes; the threads counting now
        census = LiveStorages(  # per thread (= SimMesh rank): gradient-shaped storages made while on
            count=lambda t: threading.get_ident() in on and t.untyped_storage().nbytes() in sizes,
            group=lambda t: threading.get_ident())

        class Probe(fzero.SimMesh):  # a rank's census runs from the end of its forward to the agreement
            def collective(self, op, x, *, arg=None, tag=None):
                if tag == "fzero.step/agree":
                    on.discard(threading.get_ident())
                return super().collective(op, x, arg=arg, tag=tag)

        mesh, opt = Probe(n), optim.sgd(0.1)

        def loss_fn(p, x):
            loss = apply(p, x)
            on.add(threading.get_ident())  # forward done: what this rank creates now is backward's
            return loss

        def rank_fn(x):
            state = fzero.init(params, opt, stage=stage, mesh=mesh, units=units)
            step = fzero.train_step(loss_fn, engine=engine, gather="on_use",
                                    accumulate="once" if stage == 1 else "each")
            with census:
                state, _ = step(state, x)
            return state

        mesh.run(rank_fn, [(torch.randn(2, d, generator=torch.Generator().manual_seed(r)),) for r in range(n)])
        assert len(census.peaks) == n, "the census must see every rank's thread"
        return max(census.peaks.values())

    for k in (6, 12):
        assert peak(1, k) >= k * unit, f"stage 1 should hold all {k} full unit gradients"
    p6, p12 = peak(2, 6), peak(2, 12)
    assert p6 == p12, f"stage 2's peak grew with K: {p6} B at K = 6, {p12} B at K = 12"
    assert p12 < 5 * unit, f"stage 2 held {p12} B of full gradients at once; one unit is {unit} B"


def test_gather_on_use_releases_each_unit_after_use_and_regathers_in_backward():
    """Stage 3, engine="autograd", gather="on_use": a block's gathered parameters are freed after
    its forward and gathered again when backward reaches it. The census covers the forward (its
    peak is read at the first reduce-scatter, the start of backward): eager gathering holds all
    K units' parameters there, on-use gathering about one. The numbers stay the same bits, and
    the step moves one more all-gather per released unit that backward reads (up to 3Ψ instead
    of 2Ψ)."""
    k, n, d = 6, 2, 64

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))

        def forward(self, x):  # (1, d)
            for blk in self.blocks:
                x = torch.tanh(blk(x))
            return x.square().mean()

    torch.manual_seed(0)
    model = Blocks()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    opt = optim.sgd(0.1)
    unit_bytes = (d * d + d) * 4  # one block's gathered flat[N * S] (N divides d*d + d)

    def run(gather):
        census = LiveStorages()  # one shared census: the sum over ranks
        mesh = PeakAtBackward(n, census)  # notes the census's peak when backward starts

        def rank_fn(x):
            state = fzero.init(params, opt, stage=3, mesh=mesh, units=info.units)
            step = fzero.train_step(lambda p, x: apply(p, x), gather=gather)
            with census, mesh.record() as log:
                state, m = step(state, x)
            gathers = sum(1 for r in log if r.op == "all_gather" and r.rank == mesh.rank and r.tag.startswith("blocks"))
            return fzero.gather(state), m.loss, gathers

        out = mesh.run(rank_fn, [(torch.randn(1, d, generator=torch.Generator().manual_seed(r)),) for r in range(n)])
        return out, mesh.forward_peak

    (eager, peak_eager), (lazy, peak_lazy) = run("eager"), run("on_use")
    for (pe, le, ge), (pl, ll, gl) in zip(eager, lazy):
        assert torch.equal(le, ll) and all(torch.equal(pe[name], pl[name]) for name in pe)
        # forward gathers every block; backward re-gathers a block only when it reads a tensor saved
        # from the block's storage: every block but the first, whose input needs no gradient, so
        # its weight is not saved
        assert ge == k and gl == 2 * k - 1
    print(f"forward peak: eager {peak_eager} B, on_use {peak_lazy} B, one unit {unit_bytes} B")
    assert peak_eager >= n * k * unit_bytes  # non-vacuous: eager holds every rank's K gathered units
    assert peak_eager - peak_lazy >= n * (k - 2) * unit_bytes, (peak_eager, peak_lazy, unit_bytes)


def test_live_storages_counts_what_count_accepts_per_group_at_its_size_now():
    """The census the tests above rely on: `count` picks the storages, `group` splits `peaks`, a
    view is no new storage, and a storage counts its size at the latest op (after `resize_(0)`,
    0; once freed, nothing)."""
    census = LiveStorages(count=lambda t: t.untyped_storage().nbytes() >= 400, group=lambda t: t.dtype)
    with census:
        a = torch.zeros(100)  # 400 B: counted
        b = torch.zeros(10)  # 40 B: not counted
        c = torch.zeros(100, dtype=torch.float64)  # 800 B: counted, in another group
        v = a[:50]  # a view of a's storage: nothing new
        assert census.current == 1200 and census.peaks == {torch.float32: 400, torch.float64: 800}
        a.untyped_storage().resize_(0)
        torch.zeros(1)  # any op re-reads the sizes
        assert census.current == 800
        del c
        torch.zeros(1)
        assert census.current == 0
    assert census.peak == 1200 and census.peaks == {torch.float32: 400, torch.float64: 800}
    assert b.numel() == 10 and v.shape == (50,)
