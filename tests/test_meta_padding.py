"""A derivative through a step (a meta-gradient, reverse over reverse) where some rank's shard of a
bucket holds no element the update reads: padding only, or leaves no rank used.

Stages 1-3 reduce a bucket's gradient by a reduce-scatter, whose adjoint (an all-gather) autograd
runs only on a rank whose differentiated result depends on its reduced shard. A rank whose shard is
padding only updates nothing, so before, it skipped that all-gather while the others ran it: a
`CollectiveMismatch` on SimMesh, gloo's "Received data size doesn't match" on DistMesh (found in
review: a 1-element leaf in its own unit at N = 2; `examples/hvp.py --world-size 4`). The update now
ties the reduced shard into its outputs at zero weight on every rank where the ranks differ in
reading it (`Stage.reads_differ`, `update.tied`).

Equalities are `torch.equal`, as in tests/test_func.py: the model is a quadratic over small
integers in float64, a learning rate of 1/4 and N a power of two (exact). As docs/func.md states
them: stages 0-2 hold a copy per rank, whose derivatives summed (times 1/N: F has N terms) give
the derivative with respect to the value; stage 3 holds shards, concatenated.
"""

from __future__ import annotations

import pytest
import torch

import fzero
from fzero import optim
from tests.test_examples import run_example

LR = 0.25
EACH_LEAF = lambda path: path  # noqa: E731 -- a unit (so a bucket) per leaf: "b" (1 element) alone in its own


def _ints(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=g).double()


def _data(n: int, seed: int = 0):
    """`(params, per-rank batches)`: `a[3, 1]`, `b[1]` (its own bucket: at N = 2 rank 1's shard is
    padding only, at N = 4 ranks 1-3's; `a`'s last shard is padding at N = 4)."""
    g = torch.Generator().manual_seed(seed)
    return {"a": _ints(g, 3, 1), "b": _ints(g, 1)}, [(_ints(g, 4, 3), _ints(g, 4, 1)) for _ in range(n)]


def _loss(p, batch):
    x, y = batch
    return 0.5 * ((x @ p["a"] + p["b"] - y) ** 2).sum()


def _with_unused(p, batch):
    """`_loss`, of params that also hold a leaf `u` it does not read."""
    return _loss(p, batch)


def _c(layout, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Per bucket the full `c[N * S]` the derivative weighs the new params with (padding too)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(_ints(g, b.padded_numel) for b in layout.buckets)


def meta(mesh, stage: int, params, batch, optimizer=None, of: str = "params"):
    """grad of `<c (this rank's part), new params>` (or of the sum of the new optimizer state's
    shard fields) w.r.t. the held params, through one step; per bucket."""
    state = fzero.init(params, optimizer or optim.sgd(LR), stage=stage, mesh=mesh, units=EACH_LEAF)
    c = _c(state.layout)
    if state.stage.sharded("params"):
        c = tuple(x.chunk(mesh.world_size)[mesh.rank] for x in c)
    step = fzero.train_step(_loss, engine="func")

    def f(p):
        new, _ = step(state.replace(params=p), batch)
        if of == "params":
            return sum((x * w).sum() for x, w in zip(new.params, c))
        # each element of the state once: stage 0's copies weighed 1/N (sharded from stage 1 on)
        once = 1.0 if state.stage.sharded("optimizer_state") else 1.0 / mesh.world_size
        return sum(t.sum() for s in new.opt_state for t in s) * once

    return torch.func.grad(f)(tuple(state.params))


def _value(stage: int, n: int, got, terms: int | None = None) -> list[torch.Tensor]:
    """Per bucket the derivative with respect to the value (docs/func.md): stage 3's shards
    concatenated, stages 0-2's copies summed and divided by the `terms` (default N) of F."""
    if stage == 3:
        return [torch.cat(bucket) for bucket in zip(*got)]
    return [sum(bucket) * (1.0 / (n if terms is None else terms)) for bucket in zip(*got)]


def _unsharded(params, batches, n: int) -> list[torch.Tensor]:
    """Serially, per bucket: `c - lr H̄ c` on the leaves (H̄ the mean Hessian), `c` on padding."""
    layout = fzero.layout.plan(params, n, units=EACH_LEAF)
    c = _c(layout)
    ct = fzero.layout.unpack(layout, c)

    def mean_grad_dot_c(p):
        grads = [torch.func.grad(_loss)(p, b) for b in batches]
        return sum((sum(g[k] for g in grads) * (1.0 / n) * ct[k]).sum() for k in p)

    hc = torch.func.grad(mean_grad_dot_c)(params)
    leaves = fzero.layout.pack(layout, {k: ct[k] - LR * hc[k] for k in params})
    ones = fzero.layout.pack(layout, {k: torch.ones_like(v) for k, v in params.items()})
    return [w + x * (1 - m) for w, x, m in zip(leaves, c, ones)]


@pytest.mark.parametrize("n", [2, 4])
def test_a_meta_gradient_through_a_shard_of_padding_only_agrees_in_every_stage(n):
    params, batches = _data(n)
    want = _unsharded(params, batches, n)
    mesh = fzero.SimMesh(n)
    for stage in range(4):
        got = mesh.run(lambda b: meta(mesh, stage, params, b), [(b,) for b in batches])
        for x, w in zip(_value(stage, n, got), want):
            assert torch.equal(x, w), stage


def test_a_meta_gradient_through_a_shard_of_unused_leaves_only_agrees_in_every_stage():
    """Buckets `[a]` (rank 1: `a[2]` and padding) and `[b, u]` at N = 2, where no rank's loss reads
    `u[1]`: rank 1's shard of the second bucket is `u` alone, so its update reads none of the
    reduced gradient, as with padding (no shard here is padding only)."""
    params, batches = _data(2)
    params = {**params, "u": torch.full((1,), 3.0, dtype=torch.float64)}
    mesh = fzero.SimMesh(2)
    units = lambda path: "a" if path == "a" else "bu"  # noqa: E731
    out = []
    for stage in range(4):
        def run(b):
            state = fzero.init(params, optim.sgd(LR), stage=stage, mesh=mesh, units=units)
            assert [(s.leaves, s.padded_numel) for s in state.layout.buckets] == [((0,), 4), ((1, 2), 2)]
            c = _c(state.layout)
            if state.stage.sharded("params"):
                c = tuple(x.chunk(2)[mesh.rank] for x in c)
            step = fzero.train_step(_with_unused, engine="func")
            new = lambda p: step(state.replace(params=p), b)[0].params  # noqa: E731
            return torch.func.grad(lambda p: sum((x * w).sum() for x, w in zip(new(p), c)))(tuple(state.params))

        out.append(_value(stage, 2, mesh.run(run, [(b,) for b in batches])))
    for stage in range(1, 4):
        for x, w in zip(out[stage], out[0]):
            assert torch.equal(x, w), stage


@pytest.mark.parametrize("stage", [1, 3])
def test_a_derivative_of_the_new_optimizer_state_through_a_shard_of_padding_only(stage):
    """The derivative of a function of the new momentum buffers (not of the params): the tie
    reaches it too; the same value as stage 0's."""
    params, batches = _data(2)
    mesh = fzero.SimMesh(2)
    sgdm = optim.sgd(LR, momentum=0.5)
    want, got = (_value(s, 2, mesh.run(lambda b: meta(mesh, s, params, b, optimizer=sgdm, of="state"),
                                       [(b,) for b in batches]), terms=1) for s in (0, stage))
    for x, w in zip(got, want):
        assert torch.equal(x, w)


def test_over_gloo_a_meta_gradient_through_a_shard_of_padding_only_agrees_in_every_stage(dist2):
    params, batches = _data(2)
    want = _unsharded(params, batches, 2)
    for stage in range(4):
        got = dist2.run(meta, [(stage, params, b) for b in batches], timeout=60)
        for x, w in zip(_value(stage, 2, got), want):
            assert torch.equal(x, w), stage


def test_the_hvp_example_runs_where_shards_are_padding_only():
    """`examples/hvp.py --world-size 4`: the output layer's bucket (9 elements, `shard[3]`) is
    padding only on rank 3 (before: `CollectiveMismatch`; N = 6 and 8 alike)."""
    out = run_example("hvp.py", "--world-size", "4")
    assert "gradient penalty (double backward): stage 3 equals stage 0 bit for bit" in out
    assert "SimMesh(4, id=1) stage 3 H̄v (reverse over reverse)" in out


# -- a derivative with respect to the optimizer state alone (found in a review of the change) ------


def _adam_state_only(stage, mode, params, loss, batches, mine, with_state=True):
    """grad of F = this rank's part of the new params (`mine`) [+ Σ new exp_avg] with respect to the
    held exp_avg fields alone, through one Adam step (after a first), by `torch.func.grad` or by
    plain autograd, on SimMesh(2): per rank, the tuple of gradients."""
    mesh = fzero.SimMesh(2)

    def body(b):
        state = fzero.init(params, optim.adam(0.25, (0.5, 0.75), 0.25), stage=stage, mesh=mesh, units=lambda p: p)
        step = fzero.train_step(loss, engine="func")
        state, _ = step(state, b)

        def f(ms):
            new, _ = step(state.replace(opt_state=tuple(s._replace(exp_avg=m) for s, m in zip(state.opt_state, ms))),
                          b)
            state_part = sum(s.exp_avg.sum() for s in new.opt_state) if with_state else 0.0
            return sum(mine(p, stage, mesh.rank).sum() for p in new.params) + state_part

        ms = tuple(s.exp_avg for s in state.opt_state)
        if mode == "func":
            return torch.func.grad(f)(ms)
        ms = tuple(m.detach().requires_grad_() for m in ms)
        return torch.autograd.grad(f(ms), ms)

    return mesh.run(body, batches)


def _whole(p, stage, rank):
    return p


def _own(p, stage, rank):
    return p.chunk(2)[rank] if stage in (1, 2) else p


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_derivative_wrt_the_optimizer_state_alone_reaches_the_new_params(stage):
    """Plain autograd with respect to Adam's exp_avg alone: the update's finish at stages 1-2 was
    the detached all-gather (its `overlap` read the gradients and params only), so the new params
    came back not requiring grad and their part of the derivative was silently zero (found in
    review: [0.5, ...], the exp_avg term alone). It equals `torch.func.grad`'s now, bit for bit,
    and the params' part is there (the derivative differs from the exp_avg term alone)."""
    params = {"a": torch.arange(8, dtype=torch.float64)}
    batches = [(torch.full((8,), 0.5 + r, dtype=torch.float64),) for r in range(2)]
    loss = lambda p, b: 0.5 * ((p["a"] - b) ** 2).sum()  # noqa: E731
    by_func = _adam_state_only(stage, "func", params, loss, batches, _own)
    by_autograd = _adam_state_only(stage, "autograd", params, loss, batches, _own)
    for f, a in zip(by_func, by_autograd):
        assert all(torch.equal(x, y) for x, y in zip(f, a)), (f, a)
        assert not all(torch.equal(x, torch.full_like(x, 0.5)) for x in a), a  # (β1 = 0.5: the exp_avg term alone)


def test_a_derivative_wrt_the_optimizer_state_alone_through_a_shard_of_padding_only():
    """`torch.func.grad` with respect to every exp_avg alone, a 1-element leaf in its own unit at
    N = 2 (rank 1's shard of it is padding only): rank 0's new params depended on the state and
    rank 1's did not, and the finish's all-gather parted at stages 1-2 (`CollectiveMismatch`,
    found in review). The update ties the input state in too: it runs, stages 1 and 2 agree bit
    for bit, and the held shards' derivative is twice stage 3's (F sums the whole new params on
    each of the two ranks at stages 1-2, this rank's shard at stage 3)."""
    params = {"a": torch.arange(4, dtype=torch.float64), "b": torch.tensor([1.0], dtype=torch.float64)}
    batches = [((torch.full((4,), 0.5 + r, dtype=torch.float64), torch.full((1,), 0.25 * r, dtype=torch.float64)),)
               for r in range(2)]
    loss = lambda p, b: 0.5 * ((p["a"] - b[0]) ** 2).sum() + 0.5 * ((p["b"] - b[1]) ** 2).sum()  # noqa: E731
    got = {s: _adam_state_only(s, "func", params, loss, batches, _whole, with_state=False) for s in (1, 2, 3)}
    for r in range(2):
        for x1, x2, x3 in zip(got[1][r], got[2][r], got[3][r]):
            assert torch.equal(x1, x2) and torch.equal(x1, 2 * x3), (r, x1, x2, x3)
