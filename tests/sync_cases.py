"""What tests/test_sync.py runs on a rank, as `fn(mesh, *args)`: on a `SimMesh` inside `mesh.run`
and on the torchrun gloo workers of `fzero.testing.Pool` (which import this module).

The model: one unit, one bucket `[a[4], b[4]]` (at N = 2 rank 0's shard is `a`, rank 1's `b`).
SGD with lr 1e38 on the loss `Σ a + 10 Σ b`: the update of `a` is `a - 1e38` (finite), of `b`
`b - 1e39`, which overflows float32 (max ≈ 3.4e38) to -inf. So the first update breaks `b` only:
in stages 1-3 only the rank that updates `b` (rank 1 at N = 2) sees it; every rank must raise.
"""

from __future__ import annotations

import os

import torch

import fzero
import fzero.checkpoint as ck
from fzero import optim

LR = 1e38


def params() -> dict:
    return {"a": torch.linspace(-1, 1, 4), "b": torch.linspace(1, 2, 4)}


def loss(p, x):
    return p["a"].sum() + (p["b"] * x).sum()


def fresh(mesh, stage: int):
    return fzero.init(params(), optim.sgd(LR), stage=stage, mesh=mesh)


def _error(fn) -> str:
    """The NonFiniteError `fn()` raises, as text ("returned" if it does not raise)."""
    try:
        fn()
    except fzero.NonFiniteError as e:
        return str(e)
    return "returned"


def broken_then_read(mesh, stage: int, root: str) -> dict:
    """One donating step that breaks `b`, then every reader of its state: what each raises, and
    what a checkpoint saved before the step restores."""
    state = fresh(mesh, stage)
    before = ck.save(state, root)
    step = fzero.train_step(loss, donate=True)
    broken, m = step(state, torch.full((4,), 10.0))  # returns: nothing is read on the host
    out = {"metrics": (float(m.loss), float(m.grad_norm), m.skipped), "pending": broken.pending is not None}
    out["step"] = _error(lambda: step(broken, torch.full((4,), 10.0)))
    out["gather"] = _error(lambda: fzero.gather(broken))
    out["save"] = _error(lambda: ck.save(broken, root))
    out["saved"] = sorted(os.listdir(root))
    out["evaluate"] = _error(lambda: fzero.evaluate(loss)(broken, torch.ones(4)))
    restored = ck.load(before, broken)  # the way out the message names
    out["restored"] = {k: v.tolist() for k, v in fzero.gather(restored).items()}
    return out
