"""torch.func through fzero's collectives, unit Function and step (docs/func.md).

- forward mode: each collective's jvp is the collective of the tangent; `torch.func.hessian`
  (forward over reverse) through an all-gather; forward over a step's reverse-mode gradient
  (`jvp` of `step`) equals the unsharded Hessian-vector product, in stages 0 and 3 -- on a
  DistMesh, since forward mode needs one process per rank; on a SimMesh it raises
  `ForwardModeOnSimMesh`;
- reverse over reverse: a meta-gradient through `step` (`engine="func"`) is the same in stages
  0-3 and equals the unsharded one (the fl(1/N) of the mean loss is carried once per order);
- vmap: a unit first read inside `vmap` (on-use gathering), per-example gradients through
  stage 3 (the DP-SGD example is tests/test_examples.py);
- the autograd engine's stage-3 release under a transform is a clear error.

Equalities are `torch.equal`: the model (tests/func_cases.py) is a quadratic over small
integers in float64 with a dyadic learning rate and N a power of two, so every value is an
exactly representable dyadic rational and no order of summation rounds.
"""

from __future__ import annotations

import pytest
import torch

import fzero
from tests import func_cases as cases


def _flat(p: dict) -> torch.Tensor:
    """`{"a": [3, 2], "b": [2]} -> flat[8]` in the layout's order (one unit, leaves in path order)."""
    return torch.cat([p["a"].reshape(-1), p["b"].reshape(-1)])


def _mean_hvp(params: dict, batches: list, t: torch.Tensor) -> torch.Tensor:
    """Serially: `(1/N) Σ_r H_r t` of the quadratic loss, flat (float64, exact)."""
    n = len(batches)
    a, b = t[:6].view(3, 2), t[6:8]
    out = 0
    for batch in batches:
        grad = lambda p: torch.func.grad(cases.quadratic)(p, batch)  # noqa: E731
        _, hv = torch.func.jvp(grad, (params,), ({"a": a, "b": b},))
        out = out + _flat(hv) * (1.0 / n)
    return out


def test_jvp_of_each_collective_is_the_collective_of_its_tangent(dist2):
    g = torch.Generator().manual_seed(0)
    args = [tuple(torch.randn(shape, generator=g) for shape in ((3,), (3,), (6,), (6,))) for _ in range(2)]
    for got, want in dist2.run(cases.collective_jvps, args):
        for (out, tan), (out_w, tan_w) in zip(got, want):
            assert torch.equal(out, out_w) and torch.equal(tan, tan_w)


def test_hessian_through_all_gather_is_forward_over_reverse(dist2):
    """F = Σ_r L_r with L_r = Σ AG(x)³ w (the same w on both ranks): rank r's Hessian block is
    diag(6 N x_r w_r), from hessian (jacfwd of jacrev) and jacrev of jacrev alike."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(-3, 4, (3,), generator=g).double() for _ in range(2)]
    w = torch.randint(-3, 4, (6,), generator=g).double()
    for r, (hess, rev) in enumerate(dist2.run(cases.collective_hessian, [(x, w) for x in xs])):
        want = torch.diag(6 * 2 * xs[r] * w[3 * r : 3 * r + 3])
        assert torch.equal(hess, want) and torch.equal(rev, want)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_jvp_of_a_step_is_the_unsharded_hvp(dist2, stage):
    """new = p - lr ḡ(p), so jvp(step)(t) = t - lr H̄ t: forward over the step's reverse mode
    (stages 1-2 too: a review found the docs named stages 0 and 3 only)."""
    params, batches, t = cases.data(2, seed=2)
    got = dist2.run(cases.step_jvp, [(stage, params, b, t) for b in batches])
    want = t - cases.LR * _mean_hvp(params, batches, t)
    full = got if stage < 3 else [torch.cat(got)]  # stages 0-2 hold the whole params on every rank
    for g in full:
        assert torch.equal(g, want)


def test_forward_mode_on_sim_mesh_raises_a_clear_error():
    mesh = fzero.SimMesh(2)
    ag = lambda x: fzero.collectives.all_gather(x, mesh)  # noqa: E731
    with pytest.raises(fzero.ForwardModeOnSimMesh, match="threads of one process.*DistMesh"):
        mesh.run(lambda: torch.func.jvp(ag, (torch.ones(2),), (torch.ones(2),)))

    def dual():
        with torch.autograd.forward_ad.dual_level():
            return ag(torch.autograd.forward_ad.make_dual(torch.ones(2), torch.ones(2)))

    with pytest.raises(fzero.ForwardModeOnSimMesh, match="forward-AD level"):
        mesh.run(dual)


def test_forward_mode_on_one_rank_sim_mesh_works():
    params, batches, t = cases.data(1, seed=3)
    mesh = fzero.SimMesh(1)
    (got,) = mesh.run(lambda: cases.step_jvp(mesh, 3, params, batches[0], t))
    assert torch.equal(got, t - cases.LR * _mean_hvp(params, batches, t))


def _meta(mesh, stage, params, batch, c):
    """grad of `<c (this rank's part), new params>` w.r.t. the held params, through one step."""
    state = cases.init(mesh, stage, params)
    part = c if not state.stage.sharded("params") else c.chunk(mesh.world_size)[mesh.rank]
    f = cases.step_of(state)
    return torch.func.grad(lambda p: (f(p, batch)[0] * part).sum())(state.params)[0]


@pytest.mark.parametrize("n", [2, 4])
def test_meta_gradient_through_a_step_agrees_in_every_stage(n):
    """F = Σ_r <c, new_r>: dF/dp = c - lr H̄ c unsharded. Replicated stages (0-2) give each
    rank's copy its part (Σ_r / N of copies of F's N terms); stage 3 gives the rank's shard.
    Before fzero carried fl(1/N) once per order, stage 3's curvature term came out divided by N."""
    params, batches, c = cases.data(n, seed=4)
    want = c - cases.LR * _mean_hvp(params, batches, c)
    mesh = fzero.SimMesh(n)
    for stage in range(4):
        got = mesh.run(lambda b: _meta(mesh, stage, params, b, c), [(b,) for b in batches])
        full = torch.cat(got) if stage == 3 else sum(got) * (1.0 / n)
        assert torch.equal(full, want), stage


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(3, 3, dtype=torch.float64) for _ in range(2))

    def forward(self, x):  # (B, 3) -> (B, 3)
        for blk in self.blocks:
            x = blk(x) * 0.5
        return x


def _exact_model():
    model = _Model()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).double())
    return model


def test_per_example_gradients_through_stage_3_equal_a_loop_over_examples():
    """Inside a stage-3 loss, `vmap(grad)` over the gathered leaves gives each example's full
    gradient before any reduction: the same bits as `grad` example by example, in every stage."""
    model = _exact_model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    g = torch.Generator().manual_seed(6)
    batches = [torch.randint(-2, 3, (4, 3), generator=g).double() for _ in range(2)]
    per = lambda w, xi: (apply(w, xi[None]) ** 2).sum()  # noqa: E731
    mesh = fzero.SimMesh(2)

    def rank_fn(stage, x):
        seen = {}

        def loss_fn(p, x):
            w = dict(p)  # reads (gathers) every unit
            seen["vmap"] = {k: v.detach() for k, v in torch.func.vmap(torch.func.grad(per), (None, 0))(w, x).items()}
            seen["loop"] = [{k: v.detach() for k, v in torch.func.grad(per)(w, xi).items()} for xi in x]
            return torch.func.vmap(per, (None, 0))(w, x).mean()

        state = fzero.init(params, fzero.optim.sgd(cases.LR), stage=stage, mesh=mesh, units=info.units)
        fzero.train_step(loss_fn, engine="func")(state, x)
        return seen

    results = [mesh.run(lambda x: rank_fn(stage, x), [(x,) for x in batches]) for stage in range(4)]
    for stage in range(4):
        for r, seen in enumerate(results[stage]):
            for k, v in seen["vmap"].items():
                assert torch.equal(v, torch.stack([ex[k] for ex in seen["loop"]])), (stage, r, k)
                assert torch.equal(v, results[0][r]["vmap"][k]), (stage, r, k)


def test_a_unit_first_read_inside_vmap_gathers_unbatched():
    """On-use gathering with a nested pytree: the first torch op on a placeholder runs inside
    vmap, so the unit's Function is applied under vmap (its vmap rule); same bits as eager."""
    g = torch.Generator().manual_seed(7)
    params = {"enc": {"w": torch.randint(-2, 3, (3, 3), generator=g).double()},
              "dec": {"w": torch.randint(-2, 3, (3, 2), generator=g).double()}}
    xs = [torch.randint(-2, 3, (4, 3), generator=g).double() for _ in range(2)]
    def loss(p, x):  # the first torch op on a placeholder runs inside vmap
        return torch.func.vmap(lambda xi: ((xi @ p["enc"]["w"] @ p["dec"]["w"]) ** 2).sum())(x).mean()
    mesh = fzero.SimMesh(2)

    def run(gather, engine):
        def rank_fn(x):
            state = fzero.init(params, fzero.optim.sgd(cases.LR), stage=3, mesh=mesh, units=lambda p: p)
            state, m = fzero.train_step(loss, engine=engine, gather=gather)(state, x)
            return fzero.gather(state), m.loss
        return mesh.run(rank_fn, [(x,) for x in xs])

    for engine in ("autograd", "func"):
        for (pe, le), (po, lo) in zip(run("eager", engine), run("on_use", engine)):
            assert torch.equal(le, lo)
            assert all(torch.equal(pe[k]["w"], po[k]["w"]) for k in pe)


def test_a_transform_under_the_autograd_engines_stage_3_release_is_a_clear_error():
    model = _exact_model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    mesh = fzero.SimMesh(2)

    def loss_fn(p, x):
        w = dict(p)
        return torch.func.vmap(torch.func.grad(lambda w, xi: apply(w, xi[None]).sum()), (None, 0))(w, x)[
            "blocks.0.weight"].sum()

    def rank_fn():
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        return fzero.train_step(loss_fn, engine="autograd")(state, torch.ones(2, 3, dtype=torch.float64))

    with pytest.raises(fzero.ConfigError, match="saved-tensor hooks.*engine='func'"):
        mesh.run(rank_fn)


def test_vmap_over_a_step_is_a_clear_error():
    params, batches, _ = cases.data(2)
    mesh = fzero.SimMesh(2)

    def rank_fn(b):
        state = cases.init(mesh, 3, params)
        f = cases.step_of(state)
        xs, ys = torch.stack([b[0]] * 2), torch.stack([b[1]] * 2)
        return torch.func.vmap(lambda x, y: f(state.params, (x, y))[0])(xs, ys)

    with pytest.raises(fzero.ConfigError, match="vmap over a step.*vmap inside the loss"):
        mesh.run(rank_fn, [(b,) for b in batches])

    def over_states(b):  # batched params: the unit Function's vmap rule refuses at the gather
        state = cases.init(mesh, 3, params)
        f = cases.step_of(state)
        return torch.func.vmap(lambda p: f((p,), b)[0])(torch.stack([state.params[0]] * 2))

    with pytest.raises(fzero.ConfigError, match="params are batched.*vmap inside the loss"):
        mesh.run(over_states, [(b,) for b in batches])

    def stacked(b):  # the first move before a vmap over whole states (found in review: told to call .contiguous())
        state = cases.init(mesh, 3, params)
        return torch.utils._pytree.tree_map(lambda t: torch.stack([t, t]), state)

    with pytest.raises(fzero.FzeroError, match=r"state.params\[0\] .* is a tensor of shape \[2, \d+\]: 2 buffers of "
                                               r"\d+ stacked .*not vmapped over states: loop over the states, or vmap "
                                               r"inside the loss"):
        mesh.run(stacked, [(b,) for b in batches])


def test_a_transform_through_an_autograd_engine_step_is_refused():
    """docs/func.md, the table row "a transform through a step with engine=autograd": refused
    before the step, naming `engine="func"`, the way (before: torch's own `requires_grad_` error
    from inside the step; a loud error either way, never a silent wrong derivative)."""
    params, batches, c = cases.data(1)
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = cases.init(mesh, 3, params)
        f = cases.step_of(state, engine="autograd")
        return torch.func.grad(lambda p: (f(p, batches[0])[0] * c).sum())(state.params)

    with pytest.raises(fzero.ConfigError, match="engine='autograd' inside a torch.func transform.*engine='func'"):
        mesh.run(rank_fn)


def test_a_grad_of_the_lazy_params_mapping_inside_the_loss_is_a_clear_error():
    """`torch.func.grad(f)(params)` with the on-use mapping: grad flattens its argument inside its
    own level, where a first gather would make that level's tensors the step's cached leaves
    (torch then fails with an internal assert). fzero says so and names dict(params); vmap,
    which flattens before its level, works (the per-example test above)."""
    model = _exact_model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    mesh = fzero.SimMesh(2)

    def loss_fn(p, x):
        g = torch.func.grad(lambda w: apply(w, x).sum())(p)
        return sum(v.sum() for v in g.values()) + apply(p, x).sum()

    def rank_fn(p_first):
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        step = fzero.train_step((lambda p, x: loss_fn(dict(p), x)) if p_first else loss_fn, engine="func")
        return step(state, torch.ones(2, 3, dtype=torch.float64))[1].loss

    with pytest.raises(fzero.FzeroError, match=r"not gathered yet.*dict\(params\)"):
        mesh.run(lambda: rank_fn(False))
    assert all(torch.isfinite(l) for l in mesh.run(lambda: rank_fn(True)))


@pytest.mark.parametrize("prefetch", [None, 2])
def test_jacfwd_of_a_stage_3_step_is_the_unsharded_jacobian_seen_by_every_rank(dist2, prefetch):
    """jacfwd = vmap of jvp: column i pushes tangent e_i into every rank's shard at once, so rank
    r's column i is its shard of `E_i - lr H̄ E_i`, `E_i = Σ_s e_{s S + i}` (docs/func.md). Over
    gloo with the default prefetch (1 on DistMesh) and an explicit one: under a transform every
    gather runs in place (a started gather under jvp stopped the step with a StopIteration)."""
    params, batches, _ = cases.data(2, seed=8)
    n, s = 2, 4  # flat[8] in two shards
    got = dist2.run(cases.step_jacfwd, [(3, params, b, prefetch) for b in batches])
    for r, jac in enumerate(got):
        for i in range(s):
            e = torch.zeros(n * s, dtype=torch.float64)
            e[i::s] = 1.0
            want = (e - cases.LR * _mean_hvp(params, batches, e))[r * s : (r + 1) * s]
            assert torch.equal(jac[:, i], want), (r, i)


def test_a_derivative_through_a_clipped_step_holds_the_clip_coefficient_fixed():
    """docs/func.md: with `clip_norm` the coefficient κ = clip_norm / (‖ḡ‖ + 1e-6) is a Python
    float made from the agreed norm, so `grad_p <c, step(p)>` is `c − lr κ H c` (κ held fixed),
    not the derivative of the clipped update as a function of the norm. Loss ½‖A p − b‖² over
    float64 (H = AᵀA), SGD, SimMesh(1); the two candidates differ by order 0.1 here, and the
    step's derivative is within float64 rounding (1e-12) of the fixed-κ one."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64),
               torch.randn(4, generator=g, dtype=torch.float64))
    p0, lr, clip = torch.randn(4, generator=g, dtype=torch.float64), 0.1, 0.5
    mesh = fzero.SimMesh(1)

    def run():
        state = fzero.init({"w": p0.clone()}, fzero.optim.sgd(lr), stage=0, mesh=mesh)
        step = fzero.train_step(lambda p, batch: 0.5 * ((a @ p["w"] - b) ** 2).sum(), engine="func", clip_norm=clip)
        return torch.func.grad(lambda ps: (step(state.replace(params=ps), None)[0].params[0] * c).sum())(
            state.params)[0][:4]

    got = mesh.run(run)[0]
    grad = a.T @ (a @ p0 - b)
    kappa = clip / (grad.norm().item() + 1e-6)
    assert kappa < 1.0  # clipping is on
    fixed = c - lr * kappa * (a.T @ a) @ c

    def clipped_update(p):
        gp = a.T @ (a @ p - b)
        return (p - lr * clip / (gp.norm() + 1e-6) * gp) @ c

    moving = torch.func.grad(clipped_update)(p0)
    assert (moving - fixed).abs().max() > 1e-2  # the two readings differ: the test can tell them apart
    assert (got - fixed).abs().max() < 1e-12, (got, fixed)
