"""A researcher composing torch.func with fzero: the refusals say which leaf and what runs instead.

- `fzero.evaluate` under a torch.func transform is refused; its message named
  `fn(fzero.gather(state), batch)` as the way out, which is itself refused under a transform
  (README, docs/func.md). It now names `fzero.layout.unpack` (and, for `vmap`, a vmap inside
  `fn`), and each way out runs as written, with the plain computation's bits.
- An on-use placeholder read where fzero's swap does not reach (a transform given the params
  pytree itself, `grad(per_example)(params, x)` inside the loss) named the op only; it now names
  the leaf's path and shape, and the way out for a whole pytree runs with the plain bits.
"""

from __future__ import annotations

import optree
import pytest
import torch

import fzero
from fzero import optim


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"l1": {"w": torch.randn(3, 4, generator=g, dtype=torch.float64),
                   "b": torch.randn(4, generator=g, dtype=torch.float64)},
            "l2": [torch.randn(4, 2, generator=g, dtype=torch.float64)]}


def _fn(p, x):
    return (torch.tanh(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"][0]).pow(3).sum()


def _batch() -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("stage", [0, 3])
def test_evaluate_under_grad_names_a_way_out_that_runs(stage):
    """The refusal names `fzero.layout.unpack`, not `fzero.gather` (refused under a transform
    too); the way out, as the message words it, gives torch's derivative."""
    params, x, mesh = _params(), _batch(), fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh)
        with pytest.raises(fzero.ConfigError) as refused:
            torch.func.grad(lambda ps: fzero.evaluate(_fn)(state.replace(params=ps), x))(state.params)

        def way_out(ps):
            if stage == 3:  # "stage 3, N > 1: all-gather each bucket first"
                ps = [fzero.collectives.all_gather(p, mesh) for p in ps]
            return _fn(fzero.layout.unpack(state.layout, ps), x)

        return str(refused.value), torch.func.grad(way_out)(state.params), state.layout

    outs = mesh.run(rank_fn)
    message = outs[0][0]
    assert "fzero.layout.unpack(state.layout, state.params)" in message
    assert "fn(fzero.gather(state), batch)" not in message
    layout = outs[0][2]
    full = [torch.cat([o[1][b] for o in outs]) if stage == 3 else outs[0][1][b] for b in range(len(layout.buckets))]
    got = fzero.layout.unpack(layout, full)
    want = torch.func.grad(_fn)(params, x)
    ranks = 2 if stage == 3 else 1  # stage 3: the derivative of Σ_r fn(all_gather(shards)) (docs/func.md)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        assert torch.equal(a, b * ranks)


def test_evaluate_under_vmap_names_a_vmap_inside_fn_that_runs():
    """vmap differentiates nothing: the refusal says vmap is refused too and names a vmap inside
    `fn`, which gives the bits of vmapping the plain function."""
    params, mesh = _params(), fzero.SimMesh(2)
    xs = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh)
        with pytest.raises(fzero.ConfigError) as refused:
            torch.func.vmap(lambda x: fzero.evaluate(_fn)(state, x))(xs)
        inside = fzero.evaluate(lambda p, xs: torch.func.vmap(_fn, in_dims=(None, 0))(p, xs))(state, xs)
        return str(refused.value), inside

    for message, inside in mesh.run(rank_fn):
        assert "vmap" in message.split(":")[0] and "torch.func.vmap(fn, in_dims=(None, 0))" in message
        assert torch.equal(inside, torch.func.vmap(_fn, in_dims=(None, 0))(params, xs))


def _per_example(p, xi):
    return _fn(p, xi[None])


def test_a_transform_given_the_params_pytree_names_the_leaf_and_its_way_out_runs():
    """`grad(per_example)(params, x)` inside a loss over nested params (on-use placeholders): the
    error names the leaf's path and shape (before: the op only), and the way out it names for a
    whole pytree trains with the plain per-example computation's bits."""
    params, mesh = _params(), fzero.SimMesh(2)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2)]

    def loss_of(p, x):
        per = torch.func.vmap(torch.func.grad(_per_example), in_dims=(None, 0))(p, x)
        return sum(v.square().sum() for v in optree.tree_leaves(per)) * 1e-3 + _fn(p, x)

    def rank_fn(loss_fn, x):
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=lambda path: path.split(".")[0])
        return fzero.gather(fzero.train_step(loss_fn)(state, x)[0])

    with pytest.raises(fzero.ConfigError, match=r"holds zeros; the leaf 'l1\.w' \[3, 4\]\).*"
                                                r"optree\.tree_map\(lambda w: w\.view_as\(w\), params\)"):
        mesh.run(rank_fn, [(loss_of, x) for x in batches])
    viewed = lambda p, x: loss_of(optree.tree_map(lambda w: w.view_as(w), p), x)  # noqa: E731
    got = mesh.run(rank_fn, [(viewed, x) for x in batches])[0]

    grads = [torch.func.grad(loss_of)(params, x) for x in batches]
    mean = optree.tree_map(lambda a, b: a * 0.5 + b * 0.5, *grads)
    leaves = [t.clone() for t in optree.tree_leaves(params)]
    opt = torch.optim.SGD(leaves, lr=0.1, foreach=False)
    for t, gr in zip(leaves, optree.tree_leaves(mean)):
        t.grad = gr
    opt.step()
    for a, b in zip(optree.tree_leaves(got), leaves):
        assert torch.equal(a, b)


# -- hypergradients through a step with respect to what the loss reads besides the params ---------

HYPER_W = torch.tensor([1.0, -2.0], dtype=torch.float64)
HYPER_X = [torch.tensor([0.5, 1.5], dtype=torch.float64), torch.tensor([-1.0, 2.0], dtype=torch.float64)]


def _hyper_loss(p, x, lam):
    return (p["w"] * x).sum() ** 2 * lam.sum()


def _unsharded_hypergradients(lr: float = 0.1):
    """d sum(new w) / d(lam, batch of rank r) of one SGD step on the mean over the ranks' losses,
    in one process: the numbers every stage should give (each rank's meta-objective is this one)."""
    def meta(lam, xs):
        g = sum(torch.func.grad(_hyper_loss)({"w": HYPER_W}, x, lam)["w"] * 0.5 for x in xs)
        return (HYPER_W - lr * g).sum()

    return torch.func.grad(meta, argnums=(0, 1))(torch.tensor([1.0], dtype=torch.float64), HYPER_X)


def _sum_new_w(new, stage, mesh):
    held = [fzero.collectives.all_gather(b, mesh) if stage == 3 else b for b in new.params]
    return fzero.layout.unpack(new.layout, held)["w"].sum()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_hypergradient_wrt_the_batch_or_a_closed_over_tensor_is_the_unsharded_one(stage):
    """A reverse-mode derivative through a step with respect to a tensor the loss closes over (a
    hyperparameter) and to the batch (dataset distillation) is the unsharded one at every stage,
    bit for bit on exact data. Before (found in review): N times too large at stages 2-3,
    silently -- `mean_of_ranks` passed cotangents unchanged and only a path back to the params
    (or a frozen leaf) through the unit's backward met the fl(1/N) (docs/func.md)."""
    want_lam, want_xs = _unsharded_hypergradients()
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init({"w": HYPER_W}, optim.sgd(0.1), stage=stage, mesh=mesh)

        def meta(lam, x):
            step = fzero.train_step(lambda p, b: _hyper_loss(p, b, lam), engine="func")
            return _sum_new_w(step(state, x)[0], stage, mesh)

        return torch.func.grad(meta, argnums=(0, 1))(torch.tensor([1.0], dtype=torch.float64), HYPER_X[mesh.rank])

    outs = mesh.run(rank_fn)
    assert torch.equal(sum(lam for lam, _ in outs), 2 * want_lam)  # each rank's objective: the same function
    for r, (_, x) in enumerate(outs):
        assert torch.equal(x, 2 * want_xs[r]), (r, x, want_xs[r])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_hyperparameter_kept_as_a_frozen_leaf_has_the_unsharded_hypergradient_at_every_stage(stage):
    """The hyperparameter as a frozen leaf of the params (`ParamGroup(frozen=True)`),
    differentiated through the state's held tensors (its path passes through the unit's backward
    at the outer level, the gather's plain adjoint, since the fix above), gets
    the unsharded hypergradient at every stage (summed over the ranks' copies at stages 0-2, its
    shards concatenated at stage 3), bit for bit on exact data."""
    want_lam, _ = _unsharded_hypergradients()
    mesh = fzero.SimMesh(2)
    params = {"w": HYPER_W, "lam": torch.tensor([1.0], dtype=torch.float64)}
    frozen = [fzero.ParamGroup("hyper", match=lambda path: path == "lam", frozen=True)]

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, groups=frozen, units=lambda p: p)
        step = fzero.train_step(lambda p, x: _hyper_loss(p, x, p["lam"]), engine="func")
        held = torch.func.grad(lambda h: _sum_new_w(step(state.replace(params=h), HYPER_X[mesh.rank])[0],
                                                    stage, mesh))(state.params)
        return held, state.layout

    outs = mesh.run(rank_fn)
    layout = outs[0][1]
    full = [torch.cat([h[b] for h, _ in outs]) if stage == 3 else sum(h[b] for h, _ in outs)
            for b in range(len(layout.buckets))]
    assert torch.equal(fzero.layout.unpack(layout, full)["lam"], 2 * want_lam)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("stage", [0, 3])
def test_an_autograd_engine_step_inside_a_transform_names_engine_func(stage, transform):
    """The default `engine="autograd"` inside a torch.func transform: `ConfigError` on every rank,
    before the step runs, naming the level, the mesh and `engine='func'`. Before: torch's own
    `Tensor.requires_grad_()` error from inside the step (found in review)."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init({"w": HYPER_W}, optim.sgd(0.1), stage=stage, mesh=mesh)
        step = fzero.train_step(lambda p, x: (p["w"] * x).sum() ** 2)  # engine="autograd", the default
        new_w = lambda x: step(state, x)[0].params[0].sum()  # noqa: E731
        x = HYPER_X[mesh.rank]
        with pytest.raises(fzero.ConfigError) as refused:
            torch.func.grad(new_w)(x) if transform == "grad" else torch.func.vmap(new_w)(torch.stack([x, x]))
        return str(refused.value), state.step

    for r, (message, steps) in enumerate(mesh.run(rank_fn)):
        assert message.startswith(f"a step with engine='autograd' inside a torch.func transform (level 1; SimMesh(2, "
                                  f"id="), message
        assert f"rank {r})" in message and "use train_step(..., engine='func')" in message, message
        assert int(steps) == 0  # refused before the step ran
