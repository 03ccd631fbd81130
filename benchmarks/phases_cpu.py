"""Where a CPU step's time goes, fzero beside torch DDP over gloo (bench_cpu.py's model): host
wall time per step of each phase, medians or means of `--steps` steps after `--warmup`.

DDP: forward, backward (its bucketed all-reduces inside), optimizer step (torch AdamW's default).
fzero, per stage (`--stages`): the forward (the loss function), and, summed per step, the time in
`step.accumulate` (forward + backward + the reductions started in it), the unit gradient
assembly (`unit._assemble`), the local finite check (`unit.nonfinite`, N > 1), the waits on
collectives (`Pending.wait`: reductions, stage 1-2's parameter all-gather after the update,
stage 3's gathers), the agreement, the update (`update.update`, which waits for stage 1-2's
all-gathers) and its kernels (`adam.KERNELS["foreach"]`). The timers wrap fzero's functions (a
few microseconds each); times overlap where one phase runs inside another. Timing only.

Run:  torchrun --nproc-per-node 2 benchmarks/phases_cpu.py --stages 0,1,2,3
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fzero
from fzero._src import mesh as mesh_module
from fzero._src import step as step_module
from fzero._src import unit as unit_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import model_of, workload_args  # noqa: E402

SPENT: dict[str, list[float]] = {}


def _timed(owner, name: str, key: str) -> None:
    """Replace `owner.name` by a wrapper adding its wall time to SPENT[key]."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT.setdefault(key, []).append(time.perf_counter() - t0)

    setattr(owner, name, timed)


def main() -> None:
    a = workload_args(argparse.ArgumentParser()).parse_args()
    for name in ("accumulate", "agreement", "update"):
        _timed(step_module, name, name)
    _timed(unit_module, "_assemble", "assemble")
    _timed(unit_module, "nonfinite", "local_check")
    _timed(mesh_module.Pending, "wait", "waits")
    adam = importlib.import_module("fzero._src.optim.adam")
    real = adam.KERNELS["foreach"]

    def foreach(*args, **kwargs):
        t0 = time.perf_counter()
        real(*args, **kwargs)
        SPENT.setdefault("update_kernels", []).append(time.perf_counter() - t0)

    adam.KERNELS["foreach"] = foreach
    mesh = fzero.DistMesh(backend="gloo", verify=False)
    g = torch.Generator().manual_seed(mesh.rank)
    x, y = torch.randn(a.batch, a.dim, generator=g), torch.randn(a.batch, a.dim, generator=g)

    ddp = DDP(model_of(a))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": [], "step": []}
    for i in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= a.warmup:
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[k].append(v)
    if mesh.rank == 0:
        print(json.dumps({"mode": "ddp", **{f"{k}_ms": round(statistics.median(v) * 1e3, 1) for k, v in phases.items()},
                          "torch": torch.__version__}), flush=True)
    del ddp, opt
    for stage in (int(s) for s in a.stages.split(",")):
        model = model_of(a)
        params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
        state = fzero.init(params, fzero.optim.adamw(1e-4), stage=stage, mesh=mesh, units=info.units)
        forward: list[float] = []

        def loss_fn(p, b):
            t0 = time.perf_counter()
            out = F.mse_loss(apply(p, b[0]), b[1])
            forward.append(time.perf_counter() - t0)
            return out

        step = fzero.train_step(loss_fn, donate=True)
        for _ in range(a.warmup):
            state, _ = step(state, (x, y))
        SPENT.clear()
        forward.clear()
        times = []
        for _ in range(a.steps):
            dist.barrier()
            t0 = time.perf_counter()
            state, _ = step(state, (x, y))
            times.append(time.perf_counter() - t0)
        if mesh.rank == 0:
            spent = {f"{k}_ms": round(sum(v) / a.steps * 1e3, 1) for k, v in SPENT.items()}
            print(json.dumps({"mode": f"fzero-stage{stage}", "step_ms": round(statistics.median(times) * 1e3, 1),
                              "forward_ms": round(statistics.median(forward) * 1e3, 1), **spent,
                              "torch": torch.__version__}), flush=True)
        del state, step
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
