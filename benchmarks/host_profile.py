"""Host Python time of fzero's step on a toy model whose kernels are tiny, so host time is most of it.

The model: `--blocks` residual blocks `x + W2 GELU(W1 x)` (benchmarks/bench_cpu.py's Block, small
by default: 16 blocks of 16 -> 32 -> 16, 64 leaves in 16 units), batch 4, AdamW (foreach), one
rank (SimMesh(1): no collectives move). Times are the rank thread's CPU time (`time.thread_time`:
what the host spends, not what a busy machine's other processes take from it), medians of
`--steps` steps after `--warmup`, per stage:

- `step_us`: median time of one step;
- `gap_us`: median time from the agreement's return (`step.agree`) to the first optimizer call
  (`Optimizer.update_`), the host Python between the step's one synchronisation and its first
  update kernel;
- `update_us`: median time of `step.update`;
- `gap_calls`: the Python and C function calls in that gap, in one step (`sys.setprofile`):
  the same on every run, where the times depend on how busy the machine is;
- a cProfile of `--profile-steps` steps: the top functions by own time (`--top`), per step.

Run:  python benchmarks/host_profile.py                 (JSON lines; --stages 0,1,2,3)
      python benchmarks/host_profile.py --top 15 --stages 0
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu import model_of  # noqa: E402

import fzero  # noqa: E402
from fzero._src import step as step_module  # noqa: E402


class Clock:
    """Wraps `step.agree` and `step.update` (module attributes `run_step` looks up) and the
    optimizer's `update_` to time the gap between the agreement and the first update."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.updates: list[float] = []
        self.calls: list[int] = []
        self.count_calls = False
        self._agreed: float | None = None
        self._calls = 0
        agree, update = step_module.agree, step_module.update

        def timed_agree(*args, **kwargs):
            out = agree(*args, **kwargs)
            if self.count_calls:
                self._calls = 0
                sys.setprofile(self._count)
            self._agreed = time.thread_time()
            return out

        def timed_update(*args, **kwargs):
            t0 = time.thread_time()
            out = update(*args, **kwargs)
            self.updates.append(time.thread_time() - t0)
            return out

        step_module.agree, step_module.update = timed_agree, timed_update

    def _count(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self._calls += 1

    def first_kernel(self) -> None:
        if self._agreed is not None:
            self.gaps.append(time.thread_time() - self._agreed)
            self._agreed = None
            if self.count_calls:
                sys.setprofile(None)
                self.calls.append(self._calls - 1)  # less this function's own call


def optimizer(clock: Clock) -> fzero.optim.Optimizer:
    opt = fzero.optim.adamw(1e-4, impl="foreach")

    def update_(*args):
        clock.first_kernel()
        return opt.update_(*args)

    return opt._replace(update_=update_)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile-steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--stages", default="0,1,2,3")
    a = ap.parse_args()
    torch.set_num_threads(1)
    mesh = fzero.SimMesh(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(a.batch, a.dim, generator=g), torch.randn(a.batch, a.dim, generator=g)
    for stage in (int(s) for s in a.stages.split(",")):
        clock = Clock()
        model = model_of(a)
        params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
        step = fzero.train_step(lambda p, b: F.mse_loss(apply(p, b[0]), b[1]), donate=True)

        def rank_fn():
            state = fzero.init(params, optimizer(clock), stage=stage, mesh=mesh, units=info.units)
            for _ in range(a.warmup):
                state, _ = step(state, (x, y))
            clock.gaps.clear()
            clock.updates.clear()
            times = []
            for _ in range(a.steps):
                t0 = time.thread_time()
                state, _ = step(state, (x, y))
                times.append(time.thread_time() - t0)
            clock.count_calls = True
            state, _ = step(state, (x, y))
            clock.count_calls = False
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.profile_steps):
                state, _ = step(state, (x, y))
            prof.disable()
            return times, prof

        (times, prof), = mesh.run(rank_fn)
        stats = pstats.Stats(prof)
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: a.top]  # by own time
        print(json.dumps({
            "stage": stage, "leaves": len(params), "step_us": round(statistics.median(times) * 1e6, 1),
            "gap_us": round(statistics.median(clock.gaps) * 1e6, 1),
            "update_us": round(statistics.median(clock.updates) * 1e6, 1), "gap_calls": clock.calls[0],
            "profile_top_own_us_per_step": [
                (f"{os.path.basename(f)}:{line}:{name}", round(tt / a.profile_steps * 1e6, 1), calls // a.profile_steps)
                for (f, line, name), (_, calls, tt, _, _) in top],
            "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
