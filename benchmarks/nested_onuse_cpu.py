"""Host time of one step over nested params with on-use gathering (placeholders), on the CPU.

50 units of a 4x4 weight and a bias (100 leaves, 32 elements each), stage 3, SimMesh(1), one
thread: the step is host work, so this shows what the placeholders cost per leaf (each a view
of a 0-d root that requires grad, a `Placeholder` subclass, the roots differentiated with the
params: `fzero._src.gathering.FirstUse`). Prints the best of 5 means of 10 steps. Compare two
commits by putting a git worktree of the other first on PYTHONPATH, alternating runs:

    python benchmarks/nested_onuse_cpu.py
    PYTHONPATH=/tmp/base python benchmarks/nested_onuse_cpu.py
"""

from __future__ import annotations

import time

import torch

import fzero
from fzero import optim


def main() -> None:
    torch.set_num_threads(1)
    params = {f"l{i}": {"w": torch.randn(4, 4), "b": torch.zeros(4)} for i in range(50)}
    mesh = fzero.SimMesh(1)

    def loss(p, x):
        h = x
        for i in range(50):
            h = torch.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return h.square().mean()

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.01), stage=3, mesh=mesh, units=lambda path: path.split(".")[0])
        step, x = fzero.train_step(loss, gather="on_use"), torch.randn(2, 4)
        for _ in range(5):
            state, _ = step(state, x)
        means = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(10):
                state, _ = step(state, x)
            means.append((time.perf_counter() - t) / 10)
        return min(means)

    print(f"fzero {fzero.__file__}: step {1000 * mesh.run(rank_fn)[0]:.2f} ms (100 nested leaves, on use, stage 3)")


if __name__ == "__main__":
    main()
