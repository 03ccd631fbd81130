"""Worker functions for tests/test_func.py: each takes the mesh first, so the same function runs
on a `DistMesh` (the torchrun pool: forward mode needs one process per rank) and on a `SimMesh`.

The model is exact on purpose: a quadratic loss over small integer-valued float64 data, a
learning rate of 1/4 and N a power of two, so every gradient, Hessian-vector product and step
is a dyadic rational far below 2^53 and every order of summation gives the same bits; a
distributed result can then be compared with a serial reference by `torch.equal`.
"""

from __future__ import annotations

import warnings

import torch

import fzero
from fzero import optim

LR = 0.25

# torch 2.13 loads its forward-AD decompositions through torch.jit.script on the first jvp of a
# process, which warns (torch's own deprecation, not fzero's): load them once here, quietly.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=DeprecationWarning)
    torch.func.jvp(torch.sin, (torch.zeros(1),), (torch.ones(1),))


def quadratic(p, batch):
    """`L_r = ½ Σ (x a + b - y)²` on rank r's batch `(x[B, 3], y[B, 2])`."""
    x, y = batch
    return 0.5 * ((x @ p["a"] + p["b"] - y) ** 2).sum()


def data(n: int, seed: int = 0):
    """`(params, per-rank batches, c[N * S])`: small integers as float64."""
    g = torch.Generator().manual_seed(seed)
    ints = lambda *shape: torch.randint(-2, 3, shape, generator=g).double()  # noqa: E731
    params = {"a": ints(3, 2), "b": ints(2)}
    batches = [(ints(4, 3), ints(4, 2)) for _ in range(n)]
    return params, batches, ints(8 + (-8) % n)


def step_of(state, engine: str = "func", prefetch: int | None = None):
    """The step as a function of the state's params: `params (per bucket) -> new params`."""
    step = fzero.train_step(quadratic, engine=engine, prefetch=prefetch)

    def f(params, batch):
        new, _ = step(state.replace(params=params), batch)
        return new.params

    return f


def init(mesh, stage: int, params):
    return fzero.init(params, optim.sgd(LR), stage=stage, mesh=mesh)


def step_jvp(mesh, stage: int, params, batch, t_full):
    """`torch.func.jvp` of the step's new params along the tangent `t` (this rank's part of
    `t_full[N * S]` where the stage shards params): forward over the step's reverse-mode gradient."""
    state = init(mesh, stage, params)
    tangent = t_full if not state.stage.sharded("params") else t_full.chunk(mesh.world_size)[mesh.rank]
    _, new_t = torch.func.jvp(lambda p: step_of(state)(p, batch), (state.params,), ((tangent,),))
    return new_t[0]


def step_jacfwd(mesh, stage: int, params, batch, prefetch: int | None = None):
    """`torch.func.jacfwd` of the step's new params (rank's part) w.r.t. the rank's held params."""
    state = init(mesh, stage, params)
    return torch.func.jacfwd(lambda x: step_of(state, prefetch=prefetch)((x,), batch)[0])(state.params[0])


def collective_jvps(mesh, x, t, y, u):
    """`(jvp of each collective, the collective of the tangent)` for AG, RS, all_reduce, broadcast."""
    c = fzero.collectives
    ops = [lambda v: c.all_gather(v, mesh), lambda v: c.all_reduce(v, mesh), lambda v: c.broadcast(v, mesh, 1)]
    rs = lambda v: c.reduce_scatter(v, mesh)  # noqa: E731
    got = [torch.func.jvp(op, (x,), (t,)) for op in ops] + [torch.func.jvp(rs, (y,), (u,))]
    want = [(op(x), op(t)) for op in ops] + [(c.reduce_scatter(y, mesh), c.reduce_scatter(u, mesh))]
    return got, want


def collective_hessian(mesh, x, w):
    """`torch.func.hessian` (forward over reverse) of `L(x) = Σ AG(x)³ · w` and `jacrev(jacrev)`."""
    loss = lambda v: (fzero.collectives.all_gather(v, mesh) ** 3 * w).sum()  # noqa: E731
    return torch.func.hessian(loss)(x), torch.func.jacrev(torch.func.jacrev(loss))(x)
