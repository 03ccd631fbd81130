"""Ranks whose inputs to a differentiable collective differ in requires_grad, and ranks that go on
after a mismatch.

- `all_gather`, `reduce_scatter` and a sum `all_reduce` have a backward that is a collective every
  rank must join, run only where the input required grad (under grad mode). Ranks compare that
  with the rest of the call, as `broadcast` does: a difference is `CollectiveMismatch` at the call,
  on every rank (SimMesh, and DistMesh over gloo), in plain autograd, under `torch.func.grad` and
  under `vmap`. Before, the forward passed and the differentiating rank's backward met the other
  rank's return from `mesh.run`, its next collective (an all_reduce alike: silently paired, a
  wrong sum), or waited until the timeout.
- Calls made inside a backward (an adjoint, stages 2-3's reduce-scatter in a unit's backward)
  are not compared: there requires_grad follows `create_graph` (which `torch.func.grad` always
  sets) and each rank's own loss, and ranks that differentiate alike may differ in it.
- A max `all_reduce` has no backward: not compared.
- SimMesh: a mismatch is raised by every rank of that collective and the mesh goes on, as
  DistMesh's does; ranks that catch it (or `DivergentPaths`) run on as on DistMesh.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fzero
from fzero import optim

from .test_collectives import call_with_timeout, run_with_timeout

C = fzero.collectives
N2 = 2

OPS = {
    "all_gather": lambda x, mesh: C.all_gather(x, mesh),
    "reduce_scatter": lambda x, mesh: C.reduce_scatter(x, mesh),
    "all_reduce": lambda x, mesh: C.all_reduce(x, mesh, "sum"),
}
CALLS = {  # each op's call in words, for an input of `_input`'s shape (2 rows per rank; vmap: a batch of 3)
    ("all_gather", False): "all_gather(float32[2]", ("all_gather", True): "all_gather(float32[2, 3]",
    ("reduce_scatter", False): "reduce_scatter(float32[{rows}]",
    ("reduce_scatter", True): "reduce_scatter(float32[{rows}, 3]",
    ("all_reduce", False): "all_reduce(float32[2], sum", ("all_reduce", True): "all_reduce(float32[3, 2], sum",
}


def _input(op: str, n: int, batched: bool) -> torch.Tensor:
    """A rank's input: `[2]` (`[2 * n]` for reduce_scatter), with a leading batch of 3 under vmap."""
    rows = 2 * n if op == "reduce_scatter" else 2
    return torch.ones((3, rows) if batched else (rows,))


def differentiate(mesh, op, mode, grad):
    """This rank's gradient of `op(x).sum()` (every rank's loss), where `grad` says whether it
    differentiates: `"plain"` autograd (x requires grad), `"func"` (`torch.func.grad`, else the call
    on a plain x) or `"vmap"` (a vmapped call of an x that requires grad). None where it does not."""
    f = functools.partial(OPS[op], mesh=mesh)
    x = _input(op, mesh.world_size, mode == "vmap")
    if mode == "func" and grad:
        return torch.func.grad(lambda x: f(x).sum())(x)
    if mode == "func":
        f(x)
        return None
    x.requires_grad_(grad)
    y = torch.func.vmap(f)(x) if mode == "vmap" else f(x)
    if y.requires_grad:
        y.sum().backward()
    return x.grad


def differentiate_then_sum(mesh, op, mode, grad):
    """`differentiate`, then one sum all_reduce of ones(2) that every rank calls (the next collective,
    which a rank's pending backward all_reduce would have paired with), under a short timeout."""
    mesh = fzero.DistMesh(timeout=5.0)  # over the worker's group: its own short timeout
    try:
        g = differentiate(mesh, op, mode, grad)
        return "ok", g, C.all_reduce(torch.ones(2), mesh)
    except fzero.MeshError as e:
        return type(e).__name__, str(e), None


@pytest.mark.parametrize("mode", ["plain", "func", "vmap"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("n,grad_ranks", [(2, [0]), (2, [1]), (3, [0, 2])])
def test_an_input_that_requires_grad_on_some_ranks_only_raises_on_every_rank(op, mode, n, grad_ranks):
    """The backward of all_gather / reduce_scatter / sum all_reduce is a collective a rank whose
    input does not require grad never runs: every rank raises `CollectiveMismatch` at the call,
    naming each rank's call and the ranks on each side. Before: the differentiating ranks' backward
    met the other ranks' return ("rank 1 returned from mesh.run while rank(s) [0] wait in
    reduce_scatter"). The way out (every rank's input requires grad, or none's) gives the adjoint."""
    mesh, seen = fzero.SimMesh(n), {}

    def fn(r, grad):
        try:
            return differentiate(mesh, op, mode, grad)
        except fzero.MeshError as e:
            seen[r] = e
            raise

    with pytest.raises(fzero.CollectiveMismatch) as info:
        run_with_timeout(mesh, fn, [(r, r in grad_ranks) for r in range(n)])
    assert sorted(seen) == list(range(n)) and {str(e) for e in seen.values()} == {str(info.value)}
    message, call = str(info.value), CALLS[op, mode == "vmap"].format(rows=2 * n)
    for r in range(n):
        assert f"rank {r}: {call}{', requires_grad' if r in grad_ranks else ''})\n" in message, message
    off = [r for r in range(n) if r not in grad_ranks]
    assert f"rank(s) {grad_ranks} differentiate through this {op}" in message, message
    assert f"rank(s) {off} do not" in message and "torch.empty_like" not in message, message  # broadcast's alone
    # the way out: every rank differentiates (the adjoint of Σ_r sum(y_r): N for a gather or a sum, 1 for a scatter)
    want = _input(op, n, mode == "vmap") * (1.0 if op == "reduce_scatter" else float(n))
    assert all(torch.equal(g, want) for g in run_with_timeout(mesh, fn, [(r, True) for r in range(n)]))
    assert run_with_timeout(mesh, fn, [(r, False) for r in range(n)]) == [None] * n


def test_all_reduce_compares_requires_grad_for_a_sum_only():
    """A max all_reduce has no backward (differentiating through it raises on that rank, before
    any collective): a max of a tensor that requires grad on one rank only is no mismatch; the
    same sum is."""
    mesh = fzero.SimMesh(2)

    def fn(r, op):
        return C.all_reduce(torch.tensor([float(r), 1.0 - r], requires_grad=r == 0), mesh, op).detach()

    assert all(torch.equal(y, torch.ones(2)) for y in run_with_timeout(mesh, fn, [(0, "max"), (1, "max")]))
    with pytest.raises(fzero.CollectiveMismatch, match=r"rank 0: all_reduce\(float32\[2\], sum, requires_grad\)"):
        run_with_timeout(mesh, fn, [(0, "sum"), (1, "sum")])


def test_requires_grad_is_compared_at_the_call_not_inside_a_backward():
    """The input's requires_grad is compared at the call; a collective called inside a backward
    is not compared. There requires_grad follows the backward's `create_graph` (which
    `torch.func.grad` always sets) and the rank's own loss: under `torch.func.grad`, a loss
    quadratic in the gathered tensor on rank 0 and linear on rank 1 sends a cotangent that requires
    grad on rank 0 only into the adjoint's collective, and stages 2-3 reduce-scatter such a
    gradient in each unit's backward (`engine="func"`). Both run, with the adjoint's values and
    the autograd engine's bits; comparing there would have stopped them."""
    mesh = fzero.SimMesh(2)
    # 1. at the call: a rank whose input requires grad where the other's does not
    with pytest.raises(fzero.CollectiveMismatch, match=r"rank 0: all_gather\(float32\[2\], requires_grad\)"):
        run_with_timeout(mesh, lambda r: differentiate(mesh, "all_gather", "plain", r == 0), [(0,), (1,)])

    # 2. inside the backward: L = Σ y² (rank 0) + 3 Σ y (rank 1), every rank's input wrapped by torch.func.grad
    def grad_of(r, op, x):
        f = OPS[op]
        return torch.func.grad(lambda x: (f(x, mesh) ** 2).sum() if r == 0 else 3.0 * f(x, mesh).sum())(x)

    xs = {"all_gather": [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])],
          "reduce_scatter": [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0, 7.0, 8.0])],
          "all_reduce": [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]}
    want = {"all_gather": [torch.tensor([5.0, 7.0]), torch.tensor([9.0, 11.0])],  # 2 x_r + 3
            "reduce_scatter": [torch.tensor([12.0, 16.0, 3.0, 3.0])] * 2,  # [2 RS_0, 3] on every rank
            "all_reduce": [torch.tensor([11.0, 15.0])] * 2}  # 2 Σ x + 3
    for op in OPS:
        got = run_with_timeout(mesh, grad_of, [(r, op, xs[op][r]) for r in range(2)])
        assert all(torch.equal(g, w) for g, w in zip(got, want[op])), (op, got)

    # 3. a step, stages 2-3, engine="func": rank 0's loss quadratic in "a" and reads "b", rank 1's linear in "a"
    params = {"a": torch.linspace(-1, 1, 6), "b": torch.linspace(0, 2, 6)}

    def step(r, stage, engine):
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=lambda path: "u")
        loss = (lambda p, x: (p["a"] ** 2 * x).sum() + (p["b"] ** 2).sum()) if r == 0 else (
            lambda p, x: (p["a"] * x).sum())
        state, _ = fzero.train_step(loss, engine=engine)(state, torch.full((6,), r + 1.0))
        return fzero.gather(state)

    for stage in (2, 3):
        by_func, by_autograd = (run_with_timeout(mesh, step, [(r, stage, e) for r in range(2)])
                                for e in ("func", "autograd"))
        assert all(torch.equal(f[k], a[k]) for f, a in zip(by_func, by_autograd) for k in params), stage
        assert not torch.equal(by_func[0]["b"], params["b"])


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["plain", "func", "vmap"])
def test_over_gloo_an_input_that_requires_grad_on_one_rank_only_raises_at_the_call(dist2, mode):
    """DistMesh (verify=True) carries the flag in each call's fingerprint: both ranks raise
    `CollectiveMismatch` at the call, at once. Before, rank 0's backward collective met rank 1's
    next all_reduce: a mismatch at collective #1 (gather, scatter), or -- an all_reduce alike --
    paired silently, rank 1 getting 1 + 2 for its sum of ones and rank 0 then waiting until the
    timeout."""
    for op in OPS:
        out = dist2.run(differentiate_then_sum, [(op, mode, r == 0) for r in range(N2)], timeout=60)
        call = CALLS[op, mode == "vmap"].format(rows=2 * N2)
        for r, (kind, message, _) in enumerate(out):
            assert kind == "CollectiveMismatch", (op, r, kind, message)
            assert f"rank 0: {call}, requires_grad) collective #0" in message, message
            assert f"rank 1: {call}) collective #0" in message, message
            assert f"rank(s) [0] differentiate through this {op}" in message, message
    # the way out: both differentiate; the next collective then pairs with the next
    for kind, g, after in dist2.run(differentiate_then_sum, [("all_reduce", mode, True)] * N2, timeout=60):
        assert kind == "ok" and torch.equal(g, 2.0 * _input("all_reduce", N2, mode == "vmap"))
        assert torch.equal(after, torch.full((2,), 2.0))


# -- SimMesh goes on after a mismatch, as DistMesh does ---------------------------------------------


def evaluate_diverging(mesh, go_on):
    """Rank 0 reads unit "b" in `evaluate`, rank 1 does not: every rank catches the `DivergentPaths`
    and returns its name, or (`go_on`) then evaluates alike again and returns that too."""

    def fn():
        r = mesh.rank
        state = fzero.init({"a": torch.ones(4), "b": torch.ones(4)}, optim.sgd(0.1), stage=3, mesh=mesh,
                           units=lambda path: path)
        try:
            fzero.evaluate(lambda p, r: p["a"].sum() + (p["b"].sum() if r == 0 else 0.0))(state, r)
            caught = None
        except fzero.DivergentPaths as e:
            caught = type(e).__name__
        if not go_on:
            return caught
        return caught, float(fzero.evaluate(lambda p, r: p["a"].sum() * (r + 1))(state, r))

    return mesh.run(fn)


@pytest.mark.dist
@pytest.mark.parametrize("go_on", [False, True])
def test_ranks_that_catch_divergent_paths_go_on_on_sim_mesh_as_on_dist_mesh(dist2, go_on):
    """Every rank catches the `DivergentPaths` its evaluate raised and returns, or evaluates again
    alike: SimMesh returns what each rank returned, as DistMesh does. Before, SimMesh kept the
    mismatch: it raised it again at the next collective (the next evaluate raised
    `DivergentPaths` once more, though the ranks agreed) and `mesh.run` raised the raw
    `CollectiveMismatch` ("ranks called different collectives at collective #7") where every
    rank had handled it."""
    want = ["DivergentPaths", "DivergentPaths"] if not go_on else [("DivergentPaths", 4.0), ("DivergentPaths", 8.0)]
    assert call_with_timeout(evaluate_diverging, fzero.SimMesh(N2), go_on) == want
    assert [got for [got] in dist2.run(evaluate_diverging, [(go_on,)] * N2, timeout=60)] == want


def test_a_rank_that_goes_on_after_a_mismatch_the_other_raised_stops_with_rank_failed():
    """Rank 0 catches a mismatch and calls its next collective; rank 1 lets it propagate. Rank 0
    stops with `RankFailed` naming rank 1 and the call it waits in (it would otherwise wait for a
    rank that has left), and `mesh.run` raises rank 1's mismatch: what happened first. Before,
    rank 0's next call raised the old mismatch again."""
    mesh, seen = fzero.SimMesh(2), {}

    def fn(r):
        try:
            C.all_reduce(torch.ones(2), mesh, tag=f"t{r}")
        except fzero.CollectiveMismatch:
            if r == 1:
                raise
        try:
            return C.all_reduce(torch.ones(2), mesh, tag="next")
        except fzero.MeshError as e:
            seen[r] = e
            raise

    with pytest.raises(fzero.CollectiveMismatch, match="rank 0: all_reduce.*tag='t0'.*\n  rank 1: .*tag='t1'"):
        run_with_timeout(mesh, fn, [(0,), (1,)])
    assert list(seen) == [0] and isinstance(seen[0], fzero.RankFailed), seen
    assert "rank 1 raised CollectiveMismatch while rank(s) [0] wait in all_reduce(float32[2], sum, tag='next')" \
        in str(seen[0]), seen[0]


def test_a_requires_grad_mismatch_in_a_step_is_not_called_divergent_paths():
    """A meta-gradient through a stage-0 step (`engine="func"`) whose loss is quadratic in "a" on
    rank 0 and linear on rank 1: rank 1's local gradient does not depend on the params, so its
    reduction's input requires grad on rank 0 only, and the call raises at once on both ranks.
    The step's `same_paths` passed it on as `DivergentPaths`, "ranks took different paths
    through the model" (its words read the tag as the last field, and `requires_grad` comes
    after it; found in review), where every rank called the same collective: it is the mesh's
    `CollectiveMismatch`, naming requires_grad and the way out."""
    mesh = fzero.SimMesh(2)
    params = {"a": torch.linspace(-1, 1, 6, dtype=torch.float64)}

    def meta(r):
        state = fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh)
        loss = (lambda p, x: (p["a"] ** 2 * x).sum()) if r == 0 else (lambda p, x: (p["a"] * x).sum())
        step = fzero.train_step(loss, engine="func")
        return torch.func.grad(lambda ps: step(state.replace(params=ps), torch.ones(6, dtype=torch.float64))[0]
                               .params[0].sum())(state.params)

    with pytest.raises(fzero.CollectiveMismatch) as info:
        run_with_timeout(mesh, meta, [(0,), (1,)])
    assert not isinstance(info.value, fzero.DivergentPaths), info.value
    assert "the calls differ only in requires_grad: rank(s) [0] differentiate" in str(info.value), info.value
