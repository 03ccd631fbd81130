"""CPU time per step by thread, fzero beside torch DDP over gloo (bench_cpu.py's model and steps):
where a step's CPU time goes between the main thread (forward, backward, update, checks) and the
backend's threads (gloo's loops), read from /proc/self/task/*/stat (clock ticks, summed over
`--steps` interleaved steps, so one tick's 10 ms is 0.5 ms a step at 20). Wall time is the mean
per step. Linux only; timing only.

`--profile K`: then K more steps of each mode under torch's profiler, and rank 0 prints the ops
by their wall time inside the op ("self CPU" in torch's table: time the thread spent in it,
including time another thread held the core).

Run:  torchrun --nproc-per-node 2 benchmarks/threads_cpu.py --stages 0,1,2 [--profile 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import fzero

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import BLOCK, ddp_stepper, fzero_stepper, model_of, workload_args  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def per_thread() -> dict[tuple[str, str], float]:
    """`{(thread id, name): user + system seconds}` of this process's threads now."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:  # the thread ended
            continue
        out[(t, name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def main() -> None:
    ap = workload_args(argparse.ArgumentParser())
    ap.set_defaults(steps=20, stages="0")
    ap.add_argument("--profile", type=int, default=0)
    a = ap.parse_args()
    mesh = fzero.DistMesh(backend="gloo", verify=False)
    g = torch.Generator().manual_seed(mesh.rank)
    x, y = torch.randn(a.batch, a.dim, generator=g), torch.randn(a.batch, a.dim, generator=g)
    model = model_of(a)
    modes = [("ddp", ddp_stepper(a, x, y))] + [
        fzero_stepper(a, (int(s), None, "each", mesh, "on_use", BLOCK), model, None, x, y) for s in a.stages.split(",")]
    steps = {mode: make() for mode, make in modes}
    for step in steps.values():
        for _ in range(a.warmup):
            step()
    spent: dict[str, dict[tuple[str, str], float]] = {m: {} for m in steps}
    wall = dict.fromkeys(steps, 0.0)
    for _ in range(a.steps):
        for mode, step in steps.items():  # interleaved: every mode sees the same moments of the machine
            dist.barrier()
            before, t0 = per_thread(), time.perf_counter()
            step()
            wall[mode] += time.perf_counter() - t0
            for k, v in per_thread().items():
                spent[mode][k] = spent[mode].get(k, 0.0) + v - before.get(k, 0.0)
    me = str(os.getpid())
    for mode, threads in spent.items():
        others: dict[str, float] = {}
        for (t, name), v in threads.items():
            if t != me and v > 0:
                others[name] = others.get(name, 0.0) + v
        print(f'{{"rank": {mesh.rank}, "mode": "{mode}", "wall_ms": {wall[mode] / a.steps * 1e3:.1f}, '
              f'"main_cpu_ms": {sum(v for (t, _), v in threads.items() if t == me) / a.steps * 1e3:.1f}, '
              f'"other_threads_ms": {{{", ".join(f"{chr(34)}{n}{chr(34)}: {v / a.steps * 1e3:.1f}" for n, v in others.items())}}}}}',
              flush=True)
    for mode, step in steps.items() if a.profile else ():
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(a.profile):
                step()
        if mesh.rank == 0:
            print(f"===== {mode}, {a.profile} steps, rank 0")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=40))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
