"""Stage 3 at its promise: forward-only evaluation, rank divergence named, persistent units.

- `evaluate(fn)(state, batch)` returns `fn(fzero.gather(state), batch)` bit for bit in every
  stage and world size, builds no autograd graph, and in stage 3 with `from_module` holds one
  gathered block at a time (a `LiveStorages` census);
- a rank whose forward skips or reorders a unit stops every rank with `DivergentPaths` naming
  the units each rank gathered, in the step and in `evaluate`;
- `train_step(persist_bytes=...)` keeps small units gathered for the step: the same bits as
  stage 0, no backward re-gather of those units (proofs/stage3.md).
"""

from __future__ import annotations

import pytest
import torch

import fzero
from fzero import optim
from fzero._src.evaluate import evaluate  # re-exported as fzero.evaluate by the run API
from fzero._src.gathering import DivergentPaths
from fzero.accounting import LiveStorages


class _Blocks(torch.nn.Module):
    """K tanh(Linear(d, d)) blocks, then a head Linear(d, 3); `order` picks which blocks run."""

    def __init__(self, k: int = 4, d: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x, order=None):  # (B, d) -> (B, 3)
        for i in order if order is not None else range(len(self.blocks)):
            x = torch.tanh(self.blocks[i](x))
        return self.head(x)


def _module(k: int = 4, d: int = 8):
    torch.manual_seed(0)
    model = _Blocks(k, d)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    return params, apply, info


def _batch(r: int, d: int = 8):
    g = torch.Generator().manual_seed(10 + r)
    return torch.randn(2, d, generator=g), torch.randint(0, 3, (2,), generator=g)


# -- 1. evaluate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_evaluate_returns_fn_of_the_gathered_params_bit_for_bit(stage, n):
    """After one training step (so the state is not its init), `evaluate` returns what `fn`
    returns on `fzero.gather(state)`, in both gathering modes, for `from_module` params (a
    `LazyParams`, released per block in stage 3) and for a nested pytree (placeholders): the
    same values enter the same ops, so `torch.equal`. Nothing is differentiable afterwards."""
    params, apply, info = _module()
    nested = {"w": torch.randn(5, 3, generator=torch.Generator().manual_seed(3)), "b": {"c": torch.ones(3)}}
    mesh, opt = fzero.SimMesh(n), optim.adamw(1e-2, weight_decay=0.1)

    def logits(p, batch):
        return apply(p, batch[0])

    def nested_fn(p, x):
        return torch.tanh(x @ p["w"] + p["b"]["c"]), (x @ p["w"]).sum()

    def rank_fn(r):
        batch = _batch(r)
        state = fzero.init(params, opt, stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        state, _ = fzero.train_step(lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0]), b[1]))(state, batch)
        tree = fzero.init(nested, opt, stage=stage, mesh=mesh, units=lambda path: path.split(".")[0])
        x = batch[0][:, :5]
        outs = [evaluate(logits, gather=g)(state, batch) for g in ("on_use", "eager")]
        outs += [o for g in ("on_use", "eager") for o in evaluate(nested_fn, gather=g)(tree, x)]
        refs = [logits(fzero.gather(state), batch)] * 2 + [*nested_fn(fzero.gather(tree), x)] * 2
        grads = [t.grad for s in (state, tree) for t in s.params]
        return outs, refs, grads

    for outs, refs, grads in mesh.run(rank_fn, [(r,) for r in range(n)]):
        for out, ref in zip(outs, refs):
            assert torch.equal(out, ref)
            assert not out.requires_grad and out.grad_fn is None
        assert all(g is None for g in grads)


def test_evaluate_holds_one_gathered_block_at_a_time_in_stage_3():
    """Stage 3, `from_module`, on use: each block is freed after its forward, so the census of
    block-sized storages (a block's gathered `flat[N * S]`: (d² + d) · 4 bytes; the root unit,
    the head, has another size) peaks at N + 1 over both ranks: each rank's current block, plus
    SimMesh's concatenation of the ranks' shards while it completes an all-gather (the previous
    block is released before the next is gathered). Eager gathering holds all N · K blocks."""
    k, d, n = 6, 8, 2
    params, apply, info = _module(k, d)
    block = (d * d + d) * 4

    def peak(gather):
        mesh = fzero.SimMesh(n)
        census = LiveStorages(count=lambda t: t.untyped_storage().nbytes() == block)

        def rank_fn(r):
            state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
            with census:
                return evaluate(lambda p, x: apply(p, x), gather=gather)(state, _batch(r)[0])

        outs = mesh.run(rank_fn, [(r,) for r in range(n)])
        return census.peak, outs

    (eager, out_e), (on_use, out_u) = peak("eager"), peak("on_use")
    assert all(torch.equal(a, b) for a, b in zip(out_e, out_u))
    assert eager >= n * k * block  # non-vacuous: the census sees every gathered block
    assert on_use <= (n + 1) * block, (on_use, block)


def test_evaluate_rejects_bad_settings():
    with pytest.raises(fzero.ConfigError, match="gather must be one of"):
        evaluate(lambda p, b: 0, gather="lazy")
    with pytest.raises(fzero.ConfigError, match="callable"):
        evaluate(3)


# -- 2. ranks that take different paths ------------------------------------------------------------


def _diverge(n: int, run, orders):
    """Run `run(state, batch, order)` on every rank with its order; return each rank's error."""
    params, apply, info = _module()
    mesh, errors = fzero.SimMesh(n), {}

    def rank_fn(r):
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        try:
            run(apply, state, _batch(r), orders[r])
        except fzero.MeshError as e:
            errors[r] = e
            raise

    with pytest.raises(fzero.CollectiveMismatch):
        mesh.run(rank_fn, [(r,) for r in range(n)])
    return errors


def _train(apply, state, batch, order):
    loss = lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0], order), b[1])  # noqa: E731
    fzero.train_step(loss)(state, batch)


def _evaluate(apply, state, batch, order):
    evaluate(lambda p, x: apply(p, x, order))(state, batch[0])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("run", [_train, _evaluate], ids=["train_step", "evaluate"])
@pytest.mark.parametrize("case", ["skip", "reorder", "skip_last"])
def test_a_rank_that_takes_another_path_stops_every_rank_naming_the_units(n, run, case):
    """The last rank skips block 1, or runs blocks 2 and 1 swapped, or skips the last block
    (in `evaluate` it then reaches the paths agreement while the others gather): every rank
    raises `DivergentPaths` saying which unit each rank gathered there."""
    normal = [0, 1, 2, 3]
    odd = {"skip": [0, 2, 3], "reorder": [0, 2, 1, 3], "skip_last": [0, 1, 2]}[case]
    errors = _diverge(n, run, [normal] * (n - 1) + [odd])
    assert sorted(errors) == list(range(n))
    for r, e in errors.items():
        assert isinstance(e, DivergentPaths), (r, type(e), e)
        msg = str(e)
        assert "ranks took different paths through the model" in msg
        if case in ("skip", "reorder"):
            assert "rank 0 gathered unit 'blocks.1'" in msg
            assert f"rank {n - 1} gathered unit 'blocks.2'" in msg
        else:
            assert "rank 0 gathered unit 'blocks.3'" in msg


def test_evaluate_a_rank_that_reads_one_unit_fewer_stops_every_rank():
    """Rank 1 never reads unit "b" (a nested pytree: placeholders, no release): it reaches the
    paths agreement at the end of `evaluate` while rank 0 gathers "b"; both raise, naming it."""
    mesh, errors = fzero.SimMesh(2), {}

    def rank_fn(r):
        state = fzero.init({"a": torch.ones(4), "b": torch.ones(4)}, optim.sgd(0.1), stage=3, mesh=mesh,
                           units=lambda path: path)
        try:
            evaluate(lambda p, r: p["a"].sum() + (p["b"].sum() if r == 0 else 0))(state, r)
        except fzero.MeshError as e:
            errors[r] = e
            raise

    with pytest.raises(fzero.CollectiveMismatch):
        mesh.run(rank_fn, [(0,), (1,)])
    assert sorted(errors) == [0, 1]
    for e in errors.values():
        assert isinstance(e, DivergentPaths)
        assert "rank 0 gathered unit 'b', rank 1 had finished its forward" in str(e)
