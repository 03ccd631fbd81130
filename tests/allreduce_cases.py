"""Helpers of tests/test_allreduce.py: functions the torchrun workers of `fzero.testing.Pool` run
(as `fn(mesh, *args)`, the mesh first, so a test runs the same function on a `SimMesh` too), the
order-sensitive values, a SimMesh that does not claim its all-reduce has the bits of its
reduce-scatter + all-gather (so stage 0 takes the two-collective path NCCL takes at N > 2), and
one that counts its donated all-reduces (SimMesh, as DistMesh, sums a donated one in the caller's
buffer)."""

from __future__ import annotations

import contextlib
import itertools

import torch

import fzero
from fzero import optim

# p: the significand's digits; u = 2^-p is half an ulp of 1, so fl(1 + u) = 1 (a tie, to even)
# while fl(u + u) = 2u and fl(1 + 2u) = 1 + 2u exactly
DIGITS = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}


class SplitSimMesh(fzero.SimMesh):
    """A SimMesh that claims nothing about its all-reduce: stage 0 reduces each bucket with a
    reduce-scatter, then an all-gather (started in backward: `reduce.Chained`), as on NCCL at N > 2."""

    @property
    def all_reduce_is_reduce_scatter_gather(self) -> bool:
        return False


class DonatedSimMesh(fzero.SimMesh):
    """A SimMesh that counts its donated all-reduces (and broadcasts). Like DistMesh's, SimMesh's
    return their result in the caller's own buffer (`Mesh._start`): a caller that read a buffer
    after donating it would read the sum, not what it gave."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.donated: list[str | None] = []  # the tags of the donated collectives, every rank's

    def _start(self, call, x, donate=False, out=None):
        pending = super()._start(call, x, donate, out)
        if donate and call.op in ("all_reduce", "broadcast"):
            self.donated.append(call.tag)
            assert pending.wait().data_ptr() == x.data_ptr()  # the result is in the donated buffer
        return pending


def order_sensitive(n: int, s: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Per rank r, `x_r[n * s]` whose sum over ranks depends on the order of the additions.

    The first half of every chunk of `s` (the part one rank's reduce-scatter keeps) holds, at
    each element, 1 on one rank (cycling over the ranks) and u = 2^-p on the others, times one
    random power of two and sign per element (which scales every sum exactly): adding the ranks
    left to right gives 1 + (n - 1)u rounded where the 1 comes last, and 1 wherever it comes
    earlier, so at n >= 3 orders that end on different ranks disagree on every such element. The
    rest are random normals with random exponents in [-10, 10]."""
    g = torch.Generator().manual_seed(seed)
    u = 2.0 ** -DIGITS[dtype]
    x = torch.randn(n, n * s, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-10, 11, (n, n * s), generator=g).double())
    half = max(1, s // 2)
    for c in range(n):
        for j in range(c * s, c * s + half):
            scale = 2.0 ** int(torch.randint(-8, 9, (), generator=g)) * (1 if torch.rand((), generator=g) < 0.5 else -1)
            x[:, j] = u * scale
            x[j % n, j] = scale
    return [x[r].to(dtype) for r in range(n)]


def wide(n: int, s: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Per rank r, `x_r[n * s]` of random normals times 2^k, k uniform in [-12, 12], with no loop
    per element (large buffers): sums of terms this far apart in size round differently in
    different orders on a few percent of the elements at n >= 3. Every 997th element is +inf on
    rank 0 and -inf on rank n - 1 (a NaN sum), every 1009th NaN on rank n - 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n * s, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-12, 13, (n, n * s), generator=g).double())
    x[0, ::997], x[n - 1, ::997], x[n - 1, 5::1009] = float("inf"), float("-inf"), float("nan")
    return [x[r].to(dtype) for r in range(n)]


def left_to_right(xs: list[torch.Tensor], order: tuple[int, ...]) -> torch.Tensor:
    """`((x_{o0} + x_{o1}) + x_{o2}) + ...`: one summation order over ranks."""
    acc = xs[order[0]].clone()
    for r in order[1:]:
        acc.add_(xs[r])
    return acc


def every_order(xs: list[torch.Tensor]) -> dict[tuple[int, ...], torch.Tensor]:
    return {o: left_to_right(xs, o) for o in itertools.permutations(range(len(xs)))}


def reduce_forms(mesh, x):
    """A sum over ranks of `x[N * S]` in both forms, blocking and started: `all_reduce(x)` and
    `all_gather(reduce_scatter(x))`; and the mesh's claim."""
    blocking = {"all_reduce": mesh.collective("all_reduce", x, arg="sum"),
                "rs_ag": mesh.collective("all_gather", mesh.collective("reduce_scatter", x))}
    ar = mesh.start("all_reduce", x, arg="sum")
    rs = mesh.start("reduce_scatter", x)
    started = {"all_reduce": ar.wait(), "rs_ag": mesh.start("all_gather", rs.wait()).wait()}
    mine = x.clone()
    donated = mesh.start("all_reduce", mine, arg="sum", donate=True).wait()  # DistMesh: summed in `mine` itself
    started["donated"] = donated
    return {"blocking": blocking, "started": started, "claim": mesh.all_reduce_is_reduce_scatter_gather,
            "in_place": donated.data_ptr() == mine.data_ptr()}


def broadcast_forms(mesh, x, src):
    """`broadcast(x, src)` blocking and started, and started with `donate=True` (DistMesh: in
    `x`'s own storage): `(blocking, started, donated, whether donated is x's storage, x untouched
    by the undonated ones)`."""
    before = x.clone()
    blocking = mesh.collective("broadcast", x, arg=src)
    started = mesh.start("broadcast", x, arg=src).wait()
    untouched = torch.equal(x, before)
    mine = x.clone()
    donated = mesh.start("broadcast", mine, arg=src, donate=True).wait()
    return blocking, started, donated, donated.data_ptr() == mine.data_ptr(), untouched


WIDTH = 12


def params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"l{i}": {"w": torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5, "b": torch.randn(WIDTH, generator=g)}
            for i in range(3)}


def loss(p, x):
    for i in range(3):
        x = torch.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return x.square().mean()


def stage_steps(mesh, stage, engine="autograd", steps=2):
    """`steps` AdamW steps of a 3-layer MLP (one unit per layer) at `stage` on `mesh`, a different
    batch per rank: `(gathered params after each step, the data collectives' ops, in order)`."""
    state = fzero.init(params(), optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh,
                       units=lambda path: path.split(".")[0])
    step = fzero.train_step(loss, engine=engine)
    g = torch.Generator().manual_seed(100 + mesh.rank)
    trace = []
    with mesh.record() as log:
        for _ in range(steps):
            state, _ = step(state, torch.randn(8, WIDTH, generator=g))
            trace.append(fzero.gather(state))
    ops = [c.op for c in log if c.rank == mesh.rank and c.tag is not None and not c.tag.startswith("fzero.")
           and not c.tag.endswith("/leaf_sum")]
    return trace, ops


def loss_some_ranks(p, x):
    """`loss` plus a frozen leaf's term, plus leaf `extra.v` only where the batch says so
    (`x[0, 0] > 50`: some ranks' batches only, so the other ranks reduce zeros for its bucket)."""
    out = loss(p, x) + (x[:, :WIDTH] * p["frz"]["f"]).mean()
    if float(x[0, 0]) > 50:
        out = out + (p["extra"]["v"] * x).mean()
    return out


def donation_steps(mesh, stage, engine, micro, accumulate, steps=2):
    """`steps` AdamW steps at `stage` of `loss_some_ranks` (one unit per layer, a frozen group, a
    leaf rank 0 alone uses) with `micro` micro-batches: the gathered params after each step."""
    p = {**params(), "extra": {"v": torch.linspace(-1, 1, WIDTH)}, "frz": {"f": torch.linspace(2, 3, WIDTH)}}
    state = fzero.init(p, optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh,
                       units=lambda path: path.split(".")[0],
                       groups=[fzero.ParamGroup("frozen", match=lambda q: q.startswith("frz"), frozen=True)])
    step = fzero.train_step(loss_some_ranks, engine=engine, micro_batches=micro, accumulate=accumulate)
    g = torch.Generator().manual_seed(200 + mesh.rank)
    trace = []
    for _ in range(steps):
        xs = [torch.randn(8, WIDTH, generator=g) for _ in range(micro)]
        if mesh.rank == 0:
            xs[0][0, 0] = 100.0
        state, _ = step(state, xs if micro > 1 else xs[0])
        trace.append(fzero.gather(state))
    return trace


def params_gathered_in_place(mesh, stage, bf16):
    """Two AdamW steps of `loss` at `stage` (1 or 2), each taken once by the pure step and once by
    a donating one from the same state, a different batch per rank (`bf16`: the bf16 policy, whose
    master shard is cast into the params): per step, whether the donating step's new state holds
    each params buffer the input held (the all-gather after the update written into it, not into
    a new buffer), and the pure and donated gathered params."""
    policy = {"precision": fzero.Precision(torch.bfloat16)} if bf16 else {}
    state = fzero.init(params(), optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh,
                       units=lambda path: path.split(".")[0], **policy)
    pure, donating = fzero.train_step(loss), fzero.train_step(loss, donate=True)
    g = torch.Generator().manual_seed(300 + mesh.rank)
    out = []
    for _ in range(2):
        x = torch.randn(8, WIDTH, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
        want, _ = pure(state, x)
        held = [p.data_ptr() for p in state.params]
        state, _ = donating(state, x)
        out.append(([p.data_ptr() for p in state.params] == held, fzero.gather(want), fzero.gather(state)))
    return out


@contextlib.contextmanager
def _counted(module, name):
    """`module.name` wrapped to append to the yielded list at each call, restored after."""
    ran, original = [], getattr(module, name)
    setattr(module, name, lambda *a: ran.append(1) or original(*a))
    try:
        yield ran
    finally:
        setattr(module, name, original)


def all_gather_vs_torch(mesh, x):
    """`x[S, ...]`'s all-gather on a gloo DistMesh at N = 2 (one send and one receive:
    `mesh._all_gather_by_exchange`), blocking and started, and several started at once, beside
    torch's own gloo all-gather of the same tensors, and how often the exchange ran."""
    from fzero._src import mesh as mesh_mod

    with _counted(mesh_mod, "_all_gather_by_exchange") as ran:
        blocking = mesh.collective("all_gather", x)
        started = mesh.start("all_gather", x).wait()
        parts = [x[: k + 1] for k in range(4)]
        together = [p.wait() for p in [mesh.start("all_gather", p) for p in parts]]
        out = torch.full((2 * x.shape[0], *x.shape[1:]), 7, dtype=x.dtype)
        into = mesh.start("all_gather", x, out=out).wait()  # gathered into the caller's tensor
        assert into is out
    theirs = []
    for t in [x, x, *parts, x]:  # blocking, started and into gather x
        out = t.new_empty((2 * t.shape[0], *t.shape[1:]))
        mesh_mod._all_gather_into(out, t.contiguous(), mesh.group)  # torch's, under either torch's name
        theirs.append(out)
    return [blocking, started, *together, into], theirs, len(ran)


def reduce_scatter_vs_torch(mesh, x):
    """`x[2 * S]`'s reduce-scatter on a gloo DistMesh at N = 2 (one exchange of halves, one
    addition: `mesh._reduce_scatter_by_exchange`), blocking and started, beside torch's own gloo
    reduce-scatter of the same buffer (an all-reduce of a clone, then this rank's chunk); then four
    of several sizes started before any is waited for, an all-gather started among them; and how
    often the exchange ran."""
    from fzero._src import mesh as mesh_mod

    with _counted(mesh_mod, "_reduce_scatter_by_exchange") as ran:
        blocking = mesh.collective("reduce_scatter", x)
        started = mesh.start("reduce_scatter", x).wait()
        # several in flight at once, an all-gather (the other point-to-point exchange) among them,
        # waited for in reverse: each receive must match its own send on the pair
        parts = [x[: 2 * (k + 1)] for k in range(3)] + [x]
        flights = [mesh.start("reduce_scatter", p) for p in parts[:2]]
        gather = mesh.start("all_gather", x[:5])
        flights += [mesh.start("reduce_scatter", p) for p in parts[2:]]
        together = [f.wait() for f in reversed(flights)][::-1]
        gathered = gather.wait()
    theirs = []
    for t in [x, x, *parts]:
        out = t.new_empty(t.shape[0] // 2)
        mesh_mod._reduce_scatter_into(out, t.clone(), mesh.group)  # torch's, under either torch's name
        theirs.append(out)
    their_gather = x.new_empty(10)
    mesh_mod._all_gather_into(their_gather, x[:5].contiguous(), mesh.group)
    return [blocking, started, *together, gathered], [*theirs, their_gather], len(ran)


def subgroup_collectives(mesh):
    """On a 3-process world, a `DistMesh` over the subgroup {1, 2}: its group rank 0 is global rank
    1, so the N = 2 exchange and the broadcast must address the peer by its global rank (a mutant
    sending to the group rank passed the suite: every group there was the whole world); and its
    repr, which names the global ranks. Global rank 0, not a member, returns the `MeshError` its
    own `DistMesh(group)` raises."""
    import torch.distributed as dist

    group = dist.new_group([1, 2], backend="gloo")  # (every rank of the world calls it)
    if dist.get_rank() not in (1, 2):
        try:
            fzero.DistMesh(group)
        except fzero.MeshError as e:
            return str(e)
        return None
    sub = fzero.DistMesh(group)
    x = torch.arange(2.0) + 10 * sub.rank
    c = fzero.collectives
    return (sub.rank, c.all_gather(x, sub), c.reduce_scatter(torch.arange(4.0) + sub.rank, sub), c.broadcast(x, sub, 1),
            repr(sub))
