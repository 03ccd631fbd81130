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
dim is moved beside each entry's rows (`[S, B, ...]`: the collective runs along dim 0, the whole
batch moved once over the wire, and each rank's entry shape still checked; it calls the public
function again, which reads again from the unbatched tensor whether the call has a backward). And a
`jvp` staticmethod (forward mode: `torch.func.jvp`, `jacfwd`, `hessian`): each collective is linear,
so the tangent of its output is the same collective of the input's tangent (all_reduce(max)
has none). Forward mode across ranks needs one process per rank (`DistMesh`): torch keeps one
forward-AD level stack per process, which `SimMesh`'s ranks (threads) would share; there a
collective under forward mode raises `ForwardModeOnSimMesh` instead (docs/func.md).

A rank runs a collective's backward (a collective too) only where its input required grad at
the call, so ranks compare that with the rest of the call (`has_backward`, `Mesh.collective`'s
`grad`): a rank whose input requires grad where another's does not raises `CollectiveMismatch` on
every rank at the call itself, instead of its backward meeting the other ranks' next collective
(or waiting until the timeout). Nothing more moves: it is a bit of the call ranks compare anyway.

`mean_of_ranks` is the fl(1/N) of the mean loss over ranks that stages 2-3 apply inside a
unit's backward, before its reduce-scatter (proofs/collectives.md, "Derivatives of a gradient").
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import FzeroError, MeshError
from .mesh import Mesh, SimMesh, found_here
from .layout import is_stand_in, stand_in_words, unwrapped


class ForwardModeOnSimMesh(FzeroError):
    """Forward-mode AD (a dual level) reached a collective on a SimMesh of N > 1 ranks."""


def func_level() -> int | None:
    """The torch.func transform level running now, or None outside every transform. torch keeps it
    privately (`torch._C._functorch.maybe_current_level`, in 2.11 and 2.13): this is the one place
    fzero reads it."""
    return torch._C._functorch.maybe_current_level()


def in_backward() -> bool:
    """Whether the autograd engine runs a backward on this thread now (a Function's backward, a
    hook, a checkpoint's recompute): torch's id of the running graph task, -1 outside every
    backward. Private (`torch._C._current_graph_task_id`, in 2.11 and 2.13; torch.utils.checkpoint
    reads it too)."""
    return torch._C._current_graph_task_id() != -1


def has_backward(x: Any) -> bool:
    """Whether this rank's call of a differentiable collective on `x` has a backward -- a collective
    every rank must join -- as ranks compare it (`Mesh.collective`'s `grad`): `x` requires grad
    (a torch.func transform's wrapped tensor: where it depends on the transformed input), under
    grad mode, and the call is not made inside a backward.

    Inside a backward nothing is compared (an adjoint's collective; stages 2-3's reduce-scatter in
    a unit's backward): there `requires_grad` says whether the backward records a graph
    (`create_graph`, which `torch.func.grad` always sets) and whether this rank's cotangent
    depends on the differentiated inputs, which ranks that differentiate alike may answer
    differently -- a loss quadratic in the gathered tensor on one rank, linear on another; a unit
    leaf one rank's loss does not read -- with no further derivative ever taken. A difference
    there matters only to a derivative through the backward itself, which meets the other ranks'
    next collective, as before ranks compared anything."""
    return isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled() and not in_backward()


def check_forward_mode(mesh: Mesh) -> None:
    """Raise `ForwardModeOnSimMesh` where a collective on a multi-rank SimMesh runs inside a
    forward-AD level (`torch.func.jvp`, `jacfwd`, `hessian`, `forward_ad.dual_level`).

    torch numbers forward-AD levels per process and exits them last-in first-out; SimMesh's ranks
    are threads that switch at each collective, so rank 1 would enter a level while rank 0's is
    open and rank 0 would then close rank 1's. The check runs before the first collective, while
    one rank alone holds a level, so every rank stops with this error instead of torch's."""
    if isinstance(mesh, SimMesh) and mesh.world_size > 1 and torch.autograd.forward_ad._current_level >= 0:
        raise ForwardModeOnSimMesh(
            f"{mesh!r}: a collective ran under forward-mode AD (torch.func.jvp / jacfwd / hessian / "
            f"forward_ad.dual_level) on rank {mesh.rank} of {mesh.world_size}. SimMesh's ranks are threads of one "
            f"process, and torch keeps one forward-AD level stack per process, which they would share. Use a "
            f"DistMesh (one process per rank: torchrun, or fzero.testing.pool), a SimMesh(1), or reverse mode "
            f"(an HVP as torch.func.grad of <grad, v>, jacrev instead of jacfwd), which works on SimMesh; for a "
            f"forward-mode transform inside a stage-3 loss (a jvp with respect to the input), read the params first "
            f"(w = dict(params)), so that their gathers run before the forward-mode level, and transform over w")


def _check_call(op: str, x: Any, mesh: Any) -> None:
    """`MeshError` unless `mesh` is a `Mesh` and `x` a tensor, before autograd sees them (found in
    review: a list gave torch's `is_functorch_wrapped_tensor` TypeError, a None mesh an
    AttributeError). A bad `x` is this rank's own finding (`found_here`: the others are told)."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"{op}: mesh must be a fzero mesh (SimMesh, DistMesh), got {type(mesh).__name__}")
    if not isinstance(x, torch.Tensor):
        with found_here():
            raise MeshError(f"{op} (rank {mesh.rank}): expected one tensor, got {type(x).__name__}; a collective "
                            f"moves one tensor: call it per tensor (optree.tree_map over a pytree)")


def all_gather(x: torch.Tensor, mesh: Mesh, *, tag: str | None = None) -> torch.Tensor:
    """`x[S, ...] -> y[N * S, ...]`: rank r's rows land at `[r * S, (r + 1) * S)` on every rank.

    `mesh` is the mesh of N ranks (every rank calls with the same shape and dtype); `tag`, here
    and in every collective, a label recorded with the call (`CollectiveRecord.tag`) and compared
    between ranks, or None.

    Differentiable: the backward is a reduce-scatter every rank must join, which a rank runs only
    where its `x` requires grad (under grad mode): so every rank's `x` must require grad, or
    none's (`x.detach()` where nothing is differentiated). Ranks that differ raise
    `CollectiveMismatch` on every rank at the call, naming the ranks on each side (DistMesh with
    `verify=False` compares no calls: there one side's backward meets whatever collective the
    other side calls next, or waits until the timeout). The same holds for `reduce_scatter` and a
    sum `all_reduce`.

    A stand-in of the NVMe tier's swap files (`state.params` under `Offload(params="nvme")`,
    `layout.is_stand_in`: one attribute read for a view) raises `MeshError` before the call: its
    all-gather is real zeros, which `fzero.layout.unpack` could not tell from values (found in
    review: the README's differentiable read at stage 3, N > 1, gave zeros, silently). Not where
    dynamo traces the call (a compiled function: the check would add a graph of its own)."""
    _check_call("all_gather", x, mesh)
    if not torch.compiler.is_compiling() and is_stand_in(x):
        with found_here():  # this rank's own finding: a guard tells the other ranks
            raise MeshError(stand_in_words(f"all_gather's input ({x.dtype}{list(x.shape)}, rank {mesh.rank})"))
    return _AllGather.apply(x, mesh, tag, has_backward(x))


def reduce_scatter(y: torch.Tensor, mesh: Mesh, *, tag: str | None = None) -> torch.Tensor:
    """`y[N * S, ...] -> x[S, ...]`: rank r gets rows `[r * S, (r + 1) * S)` of `Σ_s y_s`, over
    `mesh` (`tag` as for `all_gather`). Its backward, an all-gather, needs `y` to require grad on
    every rank or none (`all_gather`)."""
    _check_call("reduce_scatter", y, mesh)
    return _ReduceScatter.apply(y, mesh, tag, has_backward(y))


def all_reduce(x: torch.Tensor, mesh: Mesh, op: str = "sum", *, tag: str | None = None) -> torch.Tensor:
    """`x[...] -> Σ_s x_s` (`op` "sum") or the element-wise max (`op` "max"), on every rank of
    `mesh` (`tag` as for `all_gather`); another `op` raises `MeshError`.

    A sum's backward, an all-reduce, needs `x` to require grad on every rank or none
    (`all_gather`). A max has no backward -- differentiating through it raises on the rank that
    tries, before any collective, which stops the others as any error does -- so its calls are
    not compared on requires_grad: a max of a tensor that requires grad on some ranks only (a
    statistic, a flag) is no mismatch."""
    _check_call("all_reduce", x, mesh)
    return _AllReduce.apply(x, mesh, op, tag, op == "sum" and has_backward(x))


def broadcast(x: torch.Tensor, mesh: Mesh, src: int = 0, *, tag: str | None = None) -> torch.Tensor:
    """`x[...] -> x_src` on every rank of `mesh`: rank `src`'s tensor (`0 <= src < N`, else
    `MeshError`; `tag` as for `all_gather`).

    Differentiable: the backward sums every rank's cotangent onto the source (zero elsewhere),
    an all_reduce that every rank must join. A rank runs it only where its own `x` requires grad
    (under grad mode), even though the output does not depend on a receiving rank's `x`: so
    every rank's `x` must require grad, or none's. On a receiving rank pass
    `torch.empty_like(x).requires_grad_()` to differentiate through what it receives; `x.detach()`
    on every rank where nothing is differentiated. Ranks that differ raise `CollectiveMismatch`
    on every rank at the broadcast itself, naming the ranks on each side (DistMesh with
    `verify=False` compares no calls: there one side's backward all_reduce meets whatever
    collective the other side calls next, or waits until the timeout).
    """
    _check_call("broadcast", x, mesh)
    return _Broadcast.apply(x, mesh, src, tag, has_backward(x))


def _batch_second(x: torch.Tensor, bdim: int, op: str) -> torch.Tensor:
    """`x` with vmap's batch dim `bdim` moved to dim 1: `[S, B, ...]`, so that the collective runs
    on each entry's rows along dim 0 with the batch beside them. (Folded into dim 0 as `[B * S]`,
    ranks whose entries differed in shape -- `[2, 3]` on one, `[3, 2]` on the other -- passed the
    shape check and mixed each other's examples, found in review; a batch of 0 could not be
    unfolded.) An entry without a dim 0 is the unbatched call's `MeshError`."""
    if x.dim() < 2:
        with found_here():  # this rank's own finding: a guard tells the other ranks
            raise MeshError(f"{op}: needs a tensor with a dim 0, got a 0-d tensor (per vmap entry)")
    return x.movedim(bdim, 1)


class _AllGather(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, tag: str | None, grad: bool) -> torch.Tensor:
        check_forward_mode(mesh)
        return mesh.collective("all_gather", x, tag=tag, grad=grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.tag, _ = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return reduce_scatter(grad, ctx.mesh, tag=ctx.tag), None, None, None

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor, *_: Any) -> torch.Tensor:
        return all_gather(x_t, ctx.mesh, tag=ctx.tag)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, tag: str | None, grad: bool) -> tuple:
        if in_dims[0] is None:
            return all_gather(x, mesh, tag=tag), None
        return all_gather(_batch_second(x, in_dims[0], "all_gather"), mesh, tag=tag), 1  # (N * S, B, ...)


class _ReduceScatter(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(y: torch.Tensor, mesh: Mesh, tag: str | None, grad: bool) -> torch.Tensor:
        check_forward_mode(mesh)
        return mesh.collective("reduce_scatter", y, tag=tag, grad=grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.tag, _ = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return all_gather(grad, ctx.mesh, tag=ctx.tag), None, None, None

    @staticmethod
    def jvp(ctx: Any, y_t: torch.Tensor, *_: Any) -> torch.Tensor:
        return reduce_scatter(y_t, ctx.mesh, tag=ctx.tag)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, y: torch.Tensor, mesh: Mesh, tag: str | None, grad: bool) -> tuple:
        if in_dims[0] is None:
            return reduce_scatter(y, mesh, tag=tag), None
        return reduce_scatter(_batch_second(y, in_dims[0], "reduce_scatter"), mesh, tag=tag), 1  # (S, B, ...)


def _check_differentiable(ctx: Any) -> None:
    """`MeshError` (this rank's own finding, `found_here`) where a max all-reduce is differentiated
    (found in review: a plain RuntimeError with no way out)."""
    if ctx.op != "sum":
        with found_here():
            raise MeshError(f"all_reduce(op={ctx.op!r}, tag={ctx.tag!r}) is not differentiable (only op='sum' is): "
                            f"pass x.detach() where the result is a statistic or a flag, or use op='sum'")


class _AllReduce(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, op: str, tag: str | None, grad: bool) -> torch.Tensor:
        check_forward_mode(mesh)
        return mesh.collective("all_reduce", x, arg=op, tag=tag, grad=grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.op, ctx.tag, _ = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        _check_differentiable(ctx)
        return all_reduce(grad, ctx.mesh, "sum", tag=ctx.tag), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor, *_: Any) -> torch.Tensor:
        _check_differentiable(ctx)
        return all_reduce(x_t, ctx.mesh, "sum", tag=ctx.tag)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, op: str, tag: str | None, grad: bool
             ) -> tuple:
        return all_reduce(x, mesh, op, tag=tag), in_dims[0]


class _Broadcast(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(x: torch.Tensor, mesh: Mesh, src: int, tag: str | None, grad: bool) -> torch.Tensor:
        check_forward_mode(mesh)
        return mesh.collective("broadcast", x, arg=src, tag=tag, grad=grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.src, ctx.tag, _ = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        total = all_reduce(grad, ctx.mesh, "sum", tag=ctx.tag)
        keep = torch.tensor(ctx.mesh.rank == ctx.src, device=total.device)
        # zeros off the source, still a function of `total`: a second backward (an HVP by double
        # backward) then runs the all_reduce's adjoint on every rank (found in review: with
        # zeros_like the other ranks' graph was cut, and the source waited alone)
        return torch.where(keep, total, torch.zeros((), dtype=total.dtype, device=total.device)), None, None, None, None

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor, *_: Any) -> torch.Tensor:
        return broadcast(x_t, ctx.mesh, ctx.src, tag=ctx.tag)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, mesh: Mesh, src: int, tag: str | None, grad: bool) -> tuple:
        return broadcast(x, mesh, src, tag=tag), in_dims[0]


def mean_of_ranks(g: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """`g * fl(1/N)`: a plain multiply, whose backward and jvp scale by fl(1/N) as well.

    Stages 2-3 multiply a unit's local gradient by fl(1/N) inside the unit's backward, before
    the reduce-scatter, as DDP does: that factor is the mean over ranks of the loss. A
    derivative of that gradient (a meta-gradient through a step, an HVP by double backward)
    sends its cotangent from the gradient back to whatever the loss read: the params, through
    the same unit Function, whose backward at that outer level is the gather's plain adjoint
    (`stages._sum_in_unit`), and the batch or a tensor the loss closes over, which no unit
    backward meets again. So the factor is here, once per derivative order, on every path, as in
    the unsharded `(1/N) Σ_r L_r`. (Before, this multiply passed cotangents unchanged and the
    unit's outer backward applied the factor instead: right for the params, N times too large
    for every other input; found in review.)
    """
    return g * (1.0 / mesh.world_size)


def gather_rows(mesh: Mesh, row: list[int], tag: str) -> list[list[int]]:
    """Every rank's `row` (int64, one length on every rank) in rank order: one all-gather."""
    if mesh.world_size == 1:
        return [row]
    mine = torch.tensor(row, dtype=torch.int64, device=mesh.device)
    return mesh.collective("all_gather", mine, tag=tag).view(mesh.world_size, len(row)).tolist()


def gather_texts(mesh: Mesh, text: str, tag: str) -> list[str]:
    """Every rank's `text` in rank order: two all-gathers (the lengths, then the padded UTF-8 bytes)."""
    if mesh.world_size == 1:
        return [text]
    data = text.encode()
    lengths = [k for k, in gather_rows(mesh, [len(data)], f"{tag}/lengths")]
    width = max(1, *lengths)
    buf = torch.zeros(width, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = mesh.collective("all_gather", buf.to(mesh.device), tag=f"{tag}/text").view(mesh.world_size, width)
    return [bytes(row[:k]).decode(errors="replace") for row, k in zip(rows.tolist(), lengths)]
