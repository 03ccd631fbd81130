"""Collectives over a mesh's shard axis, differentiable under `torch.func` and plain autograd.

Each collective is a `torch.autograd.Function` in the `forward` + `setup_context` form (the
`ctx`-in-forward form breaks `torch.func`) whose backward is its adjoint, written once:

    all_gather      x[S]      -> y[N * S]     adjoint: reduce_scatter
    reduce_scatter  y[N * S]  -> x[S]         adjoint: all_gather
    all_reduce(sum) x[...]    -> y[...]       adjoint: all_reduce(sum)
    broadcast(src)  x[...]    -> y[...]       adjoint: sum over ranks, kept on src, zero elsewhere

With `L = Σ_r L_r` the sum of every rank's loss, the adjoint identity
`Σ_r <AG(x)_r, y_r> = Σ_r <x_r, RS(y)_r>` is what makes each backward the true gradient of L
(proofs/collectives.md). `all_reduce(max)` has no backward.

Each Function also has a `vmap` staticmethod: collectives have no batching rule, so the batch
dim is folded into dim 0 of the buffer, moved once over the wire, and unfolded.
"""

from __future__ import annotations

from typing import Any

import einops
import torch

from .mesh import Mesh


def all_gather(x: torch.Tensor, mesh: Mesh, *, tag: str | None = None) -> torch.Tensor:
    """`x[S, ...] -> y[N * S, ...]`: rank r's rows land at `[r * S, (r + 1) * S)` on every rank."""
    return _AllGather.apply(x, mesh, tag)


def reduce_scatter(y: torch.Tensor, mesh: Mesh, *, tag: str | None = None) -> torch.Tensor:
    """`y[N * S, ...] -> x[S, ...]`: rank r gets rows `[r * S, (r + 1) * S)` of `Σ_s y_s`."""
    return _ReduceScatter.apply(y, mesh, tag)


def all_reduce(x: torch.Tensor, mesh: Mesh, op: str = "sum", *, tag: str | None = None) -> torch.Tensor:
    """`x[...] -> Σ_s x_s` (op "sum") or the element-wise max (op "max"), on every rank."""
    return _AllReduce.apply(x, mesh, op, tag)


def broadcast(x: torch.Tensor, mesh: Mesh, src: int = 0, *, tag: str | None = None) -> torch.Tensor:
    """`x[...] -> x_src` on every rank."""
    return _Broadcast.apply(x, mesh, src, tag)


def _fold(x: torch.Tensor, bdim: int) -> tuple[torch.Tensor, int]:
    """`x` with batch dim `bdim` -> `(rows[B * S, ...], B)`, batch outermost."""
    x = x.movedim(bdim, 0)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), x.shape[0]


class _AllGather(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, tag: str | None) -> torch.Tensor:
        return mesh.collective("all_gather", x, tag=tag)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.tag = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return reduce_scatter(grad, ctx.mesh, tag=ctx.tag), None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, tag: str | None) -> tuple:
        if in_dims[0] is None:
            return all_gather(x, mesh, tag=tag), None
        rows, b = _fold(x, in_dims[0])  # (B * S, ...)
        y = all_gather(rows, mesh, tag=tag)  # (N * B * S, ...)
        return einops.rearrange(y, "(n b s) ... -> b (n s) ...", n=mesh.world_size, b=b), 0


class _ReduceScatter(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(y: torch.Tensor, mesh: Mesh, tag: str | None) -> torch.Tensor:
        return mesh.collective("reduce_scatter", y, tag=tag)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.tag = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return all_gather(grad, ctx.mesh, tag=ctx.tag), None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, y: torch.Tensor, mesh: Mesh, tag: str | None) -> tuple:
        if in_dims[0] is None:
            return reduce_scatter(y, mesh, tag=tag), None
        y = y.movedim(in_dims[0], 0)  # (B, N * S, ...)
        rows = einops.rearrange(y, "b (n s) ... -> (n b s) ...", n=mesh.world_size)
        x = reduce_scatter(rows, mesh, tag=tag)  # (B * S, ...)
        return einops.rearrange(x, "(b s) ... -> b s ...", b=y.shape[0]), 0


class _AllReduce(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, op: str, tag: str | None) -> torch.Tensor:
        return mesh.collective("all_reduce", x, arg=op, tag=tag)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.op, ctx.tag = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.op != "sum":
            raise RuntimeError(f"all_reduce(op={ctx.op!r}) is not differentiable; only op='sum' is")
        return all_reduce(grad, ctx.mesh, "sum", tag=ctx.tag), None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, op: str, tag: str | None) -> tuple:
        return all_reduce(x, mesh, op, tag=tag), in_dims[0]


class _Broadcast(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, src: int, tag: str | None) -> torch.Tensor:
        return mesh.collective("broadcast", x, arg=src, tag=tag)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.src, ctx.tag = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        total = all_reduce(grad, ctx.mesh, "sum", tag=ctx.tag)
        keep = ctx.mesh.rank == ctx.src
        return (total if keep else torch.zeros_like(total)), None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, src: int, tag: str | None) -> tuple:
        return broadcast(x, mesh, src, tag=tag), in_dims[0]
