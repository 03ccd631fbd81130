"""Minor page faults and step time per step: torch DDP and fzero stages over gloo on the CPU.

The model and batch of `benchmarks/bench_cpu.py` (8 blocks 512 -> 2048 -> 512, batch 64, AdamW);
each mode warms up 3 steps, then 6 steps are timed, each between a barrier and its end, with the
process's minor page faults (`resource.getrusage(RUSAGE_SELF).ru_minflt`) counted around it. One
JSON line per mode on rank 0: the medians. A fault is a page the kernel hands the process anew
(a tensor glibc serves from fresh pages); on a VM each costs microseconds.

Run:  torchrun --nproc-per-node 2 benchmarks/faults_cpu.py --stages 0,1,2,3 [--build-first]
      MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 torchrun ...   (glibc keeps
      freed memory for reuse: the same run without the faults)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

import fzero
from bench_cpu import BLOCK, ddp_stepper, fzero_stepper, model_of


def measured(step, steps: int = 6, warmup: int = 3) -> tuple[float, float]:
    """(median step seconds, median faults per step)."""
    for _ in range(warmup):
        step()
    times, faults = [], []
    for _ in range(steps):
        dist.barrier()
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return statistics.median(times), statistics.median(faults)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--build-first", action="store_true",
                    help="build every fzero state before timing any mode (another allocation history)")
    a = ap.parse_args()
    mesh = fzero.DistMesh(backend="gloo", verify=False)
    g = torch.Generator().manual_seed(mesh.rank)
    x, y = torch.randn(a.batch, a.dim, generator=g), torch.randn(a.batch, a.dim, generator=g)
    ddp_step = ddp_stepper(a, x, y)()

    def built(stage: int):
        return fzero_stepper(a, (stage, None, "each", mesh, "on_use", BLOCK), model_of(a), None, x, y)[1]()

    stages = [int(s) for s in a.stages.split(",")]
    steps = {s: built(s) for s in stages} if a.build_first else {}
    rows = [("ddp", *measured(ddp_step))]
    del ddp_step
    for stage in stages:
        rows.append((f"fzero-stage{stage}", *measured(steps.pop(stage, None) or built(stage))))
    if mesh.rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
        for mode, t, f in rows:
            print(json.dumps({"mode": mode, "step_s_median": round(t, 4), "vs_ddp": round(t / rows[0][1], 3),
                              "faults_per_step": f, "build_first": a.build_first, "malloc_env": env,
                              "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
