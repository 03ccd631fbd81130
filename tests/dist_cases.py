"""Functions the torchrun workers of `fzero.testing.Pool` run as `fn(mesh, *args)`.

Each takes the mesh first, so a test runs the same function on a `SimMesh` too:
`sim.run(functools.partial(fn, sim), per_rank_args)`.
"""

from __future__ import annotations

import warnings

import torch

import fzero


def collectives(mesh, x, y, src):
    """Every collective once: x[S, ...] for all_gather / all_reduce / broadcast, y[N * S, ...]
    for reduce_scatter."""
    return {
        "all_gather": fzero.all_gather(x, mesh),
        "reduce_scatter": fzero.reduce_scatter(y, mesh),
        "sum": fzero.all_reduce(x, mesh, "sum"),
        "max": fzero.all_reduce(x, mesh, "max"),
        "broadcast": fzero.broadcast(x, mesh, src),
    }


def _loss(mesh, x, y, w):
    """L = <AG(x), w> + <RS(y), x> + <bcast(x), x>: every differentiable collective, forward and back."""
    return (fzero.all_gather(x, mesh) * w).sum() + (fzero.reduce_scatter(y, mesh) * x).sum() + (
        fzero.broadcast(x, mesh, mesh.world_size - 1) * fzero.all_reduce(x, mesh)).sum()


def grads(mesh, x, y, w):
    """torch.func.grad of `_loss` with respect to x and y, and plain autograd's."""
    gx, gy = torch.func.grad(lambda x, y: _loss(mesh, x, y, w), argnums=(0, 1))(x, y)
    xa, ya = x.detach().requires_grad_(True), y.detach().requires_grad_(True)
    _loss(mesh, xa, ya, w).backward()
    return gx, gy, xa.grad, ya.grad


def warnings_seen(mesh):
    """Every collective with all warnings recorded (the shim must not warn under torch 2.13)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        x = torch.ones(2)
        collectives(mesh, x, torch.ones(2 * mesh.world_size), 0)
    return [f"{w.category.__name__}: {w.message}" for w in seen]


def gather_shape(mesh, shape):
    return fzero.all_gather(torch.ones(shape), mesh)


def raise_on(mesh, bad):
    """`mesh.run` of a function that raises on rank `bad` only and gathers on the others."""

    def fn():
        fzero.all_reduce(torch.ones(1), mesh)
        if mesh.rank == bad:
            raise ValueError(f"boom on rank {bad}")
        return fzero.all_gather(torch.ones(1), mesh)

    return mesh.run(fn)
