"""Host time of fzero's step where a model has many small units: the structure's cost, not the math's.

The model: `--leaves` L leaves `p{i}` of 8 elements, one unit each (`units=lambda p: p`), a loss
that chains `h = tanh(h * p_i)` through all of them (batch 4 x 8); stage 3, AdamW, a donating
step with `prefetch=1` on `SimMesh(1)` (so nothing waits on another rank). Printed, in seconds:
`init`, the first step (which builds the unit programs), and the min and median of `--steps` more.
Then the time of one 8-float `all_gather` on `SimMesh(1)` (µs, min of 3 runs of 2,000), the
per-collective cost of the simulated mesh.

Run (compare two trees by their PYTHONPATH):
    python benchmarks/many_units.py --leaves 1000
    python benchmarks/many_units.py --leaves 3000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fzero
from fzero import optim


def step_times(leaves: int, steps: int) -> dict[str, float]:
    params = {f"p{i}": torch.randn(8) / 3 for i in range(leaves)}

    def loss(p, x):
        h = x
        for i in range(leaves):
            h = torch.tanh(h * p[f"p{i}"])
        return h.square().mean()

    mesh = fzero.SimMesh(1)

    def rank():
        start = time.perf_counter()
        state = fzero.init(params, optim.adamw(1e-3), stage=3, mesh=mesh, units=lambda path: path)
        init = time.perf_counter() - start
        step = fzero.train_step(loss, donate=True, prefetch=1)
        x = torch.randn(4, 8)
        start = time.perf_counter()
        state, _ = step(state, x)
        first = time.perf_counter() - start
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, _ = step(state, x)
            times.append(time.perf_counter() - start)
        return {"init_s": init, "first_step_s": first, "step_s_min": min(times), "step_s_median": statistics.median(times)}

    return mesh.run(rank)[0]


def all_gather_us() -> float:
    mesh = fzero.SimMesh(1)

    def rank():
        x = torch.randn(8)
        for _ in range(200):
            fzero.collectives.all_gather(x, mesh)
        start = time.perf_counter()
        for _ in range(2000):
            fzero.collectives.all_gather(x, mesh)
        return (time.perf_counter() - start) / 2000 * 1e6

    return min(mesh.run(rank)[0] for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    out = {"leaves": a.leaves, **{k: round(v, 3) for k, v in step_times(a.leaves, a.steps).items()},
           "simmesh_all_gather_us": round(all_gather_us(), 1), "torch": torch.__version__}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
