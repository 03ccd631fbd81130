"""A transformer-like model for the prefetch and remat tests, and the functions that train it.

Module-level so that the torchrun workers of `fzero.testing.Pool` can import them: each runner
takes the mesh first (`fn(mesh, *args)`), so a test runs the same function on a `SimMesh`.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero import optim


class Block(nn.Module):
    """Pre-norm block: `x + proj(attn(ln1(x)))`, then `x + down(gelu(up(ln2(x))))`, `up` of width
    `hidden` (so blocks of one model may differ in size); optional dropout after each branch."""

    def __init__(self, d: int, hidden: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # (B, h, T, hs)
        att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5  # (B, h, T, T)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)  # (B, T, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class Tiny(nn.Module):
    """Token embedding, `len(hidden)` blocks, final norm and head; `order` picks which blocks run."""

    def __init__(self, vocab: int, d: int, hidden: tuple[int, ...], heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h, heads, dropout) for h in hidden)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, order=None) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.emb(idx)
        for i in order if order is not None else range(len(self.blocks)):
            x = self.blocks[i](x)
        return self.head(self.ln_f(x))


def model(d: int, hidden: tuple[int, ...], vocab: int = 11, dropout: float = 0.0, seed: int = 0, remat=False):
    """`(params, apply, info)` of a `Tiny` with one unit per block (the rest: unit "default"),
    checkpointing the units `remat` names (`from_module(..., remat=)`)."""
    torch.manual_seed(seed)
    m = Tiny(vocab, d, tuple(hidden), dropout=dropout)
    return fzero.from_module(m, units=fzero.units_by_prefix(m, "blocks"), remat=remat)


def batch(r: int, vocab: int = 11, b: int = 2, t: int = 5):
    g = torch.Generator().manual_seed(100 + r)
    idx = torch.randint(0, vocab, (b, t + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train(mesh, stage: int, d: int, hidden: tuple[int, ...], steps: int = 2, order=None, *, dropout: float = 0.0,
          remat=False, note=None, **settings):
    """Train a `Tiny` `steps` AdamW steps on this rank's batches: `(gathered params, [loss])`.
    `note(when)` (if given) is called with "start" when the loss starts and with "end" once it
    is computed, before backward."""
    params, apply, info = model(d, hidden, dropout=dropout, remat=remat)

    def loss(p, b):
        if note is not None:
            note("start")
        logits = apply(p, b[0], order)
        out = F.cross_entropy(logits.flatten(0, 1), b[1].flatten())
        if note is not None:
            note("end")
        return out

    state = fzero.init(params, optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh, units=info.units)
    step = fzero.train_step(loss, **settings)
    losses = []
    for i in range(steps):
        state, m = step(state, batch(mesh.rank + mesh.world_size * i))
        losses.append(m.loss)
    return fzero.gather(state), losses


def train_with_prefetch(mesh, stage: int, d: int, hidden: tuple[int, ...], steps: int, order, prefetch: int):
    """`train` with `prefetch` as a positional argument (how the pool passes arguments)."""
    return train(mesh, stage, d, tuple(hidden), steps, order, prefetch=prefetch)


def sim_train_with_prefetch(mesh, stage: int, d: int, hidden: tuple[int, ...], steps: int, order, prefetch: int):
    """On a pool worker: `train_with_prefetch` on a SimMesh of the same size, in this process (so
    with this process's kernels), returning this rank's result: the reference for DistMesh."""
    sim = fzero.SimMesh(mesh.world_size)
    args = (stage, d, tuple(hidden), steps, order, prefetch)
    return sim.run(lambda: train_with_prefetch(sim, *args))[mesh.rank]


class GatherCensusMesh(fzero.SimMesh):
    """A SimMesh that marks, per thread, when it is inside a unit's all-gather (a tag not starting
    with "fzero."): `inside()` then says whether an allocation is gathered parameter storage --
    SimMesh's concatenation of the shards and each rank's copy of the result."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self._flag = threading.local()

    def inside(self, _t: torch.Tensor) -> bool:
        return getattr(self._flag, "on", False)

    def _exchange(self, call, x):
        gather = call.op == "all_gather" and call.tag is not None and not call.tag.startswith("fzero.")
        self._flag.on = gather
        try:
            return super()._exchange(call, x)
        finally:
            self._flag.on = False


def default_prefetch(mesh):
    """On a pool worker: `(mesh.asynchronous, the default depth, an explicit 2, the default under
    torch.func.grad)` for a stage-3 state's unit programs."""
    from fzero._src.gathering import prefetch_of
    from fzero._src.stages import STAGES
    from fzero._src.unit import unit_programs

    state = fzero.init({"a": torch.ones(4)}, optim.sgd(0.1), stage=3, mesh=mesh)
    progs = unit_programs(state.layout, mesh, STAGES[3])
    under = []
    torch.func.grad(lambda x: under.append(prefetch_of(None, progs)) or x.sum())(torch.ones(2))
    return mesh.asynchronous, prefetch_of(None, progs), prefetch_of(2, progs), under[0]


# --- frozen first units, an embedding first: backward prefetches nobody reads ----------------

FROZEN = {  # variant -> (the submodules frozen, the first unit, blocks, embedding and head in one unit)
    "frozen_first": (("emb", "blocks.0"), "emb", 3, False),  # fine-tuning: the embedding and first block frozen
    "frozen_root": (("emb", "blocks.0"), "emb", 2, True),  # the same, the embedding in the root's unit
    "emb_first": ((), "emb", 3, False),  # all trainable: the embedding's backward reads no weight
    "probe_first": ((), "offset", 3, False),  # a `Probe` after a first unit that saves nothing
}


class Probe(nn.Module):
    """A frozen weight times a trainable scale, a product the forward drops: autograd saves the
    weight (for the scale's gradient) and frees it unread."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self) -> torch.Tensor:
        return self.w * self.scale


class Offset(nn.Module):
    """`x + bias`: its backward reads no saved tensor."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Stack(nn.Module):
    """A first unit -- an embedding ("emb"), or the one-hot input plus a trainable `offset`
    ("offset", whose backward reads no saved tensor), then a `Probe` --, `k` tanh-linear blocks
    and a head (`stack_model`)."""

    def __init__(self, first: str = "emb", vocab: int = 9, d: int = 32, k: int = 3) -> None:
        super().__init__()
        self.first, self.d = first, d
        if first == "emb":
            self.emb = nn.Embedding(vocab, d)
        else:
            self.offset, self.probe = Offset(d), Probe(d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(k))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B,) -> (B, vocab)
        if self.first == "emb":
            x = self.emb(idx)
        else:
            x = self.offset(F.one_hot(idx, self.d).float())
            self.probe()
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def stack_model(variant: str):
    """`(params, apply, info)` of the `Stack` of `FROZEN[variant]`: one unit per child ("emb" or
    "offset" and "probe", "blocks.i", "head"), or "blocks.i" and "default" (the root's, gathered
    for the whole step: the embedding and the head); the frozen submodules with
    requires_grad=False."""
    frozen, first, k, rooted = FROZEN[variant]
    torch.manual_seed(0)
    m = Stack(first, k=k)
    for name in frozen:
        m.get_submodule(name).requires_grad_(False)
    own = ("blocks",) if rooted else ("blocks", "emb", "offset", "probe", "head")
    return fzero.from_module(m, units=lambda path: path.rsplit(".", 1)[0] if path.split(".")[0] in own else "default")


def train_stack(mesh, variant: str, stage: int, steps: int = 2, **settings):
    """`steps` AdamW steps of `stack_model(variant)` on this rank's batches: `(gathered params,
    [loss])`."""
    params, apply, info = stack_model(variant)
    state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
    step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]), **settings)
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(mesh.rank + mesh.world_size * i)
        state, m = step(state, (torch.randint(0, 9, (6,), generator=g), torch.randint(0, 9, (6,), generator=g)))
        losses.append(m.loss)
    return fzero.gather(state), losses


def stack_over_gloo(variant: str, timeout: float):
    """For `run_job` (a fresh process per rank): on a gloo `DistMesh` with `timeout` seconds,
    `train_stack` at stage 0 and at stage 3 with the default prefetch (one unit ahead there)."""
    mesh = fzero.DistMesh(backend="gloo", timeout=timeout)
    return train_stack(mesh, variant, 0), train_stack(mesh, variant, 3)
