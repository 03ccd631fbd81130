"""fzero stages 0-3 against torch DDP over gloo on the CPU, as ratios from one job.

The model: `--blocks` residual blocks `x + W2 GELU(W1 x)` (dim -> hidden -> dim; defaults 8 x
512 -> 2048 -> 512, 16.8M parameters), batch `--batch` per rank, AdamW (torch: AdamW's default,
which on the CPU is its single-tensor loop, `foreach=False`; fzero: `impl=None`, foreach on
CPU). Every mode runs in the same processes, one after the other: median step time of `--steps`
steps after `--warmup`; one JSON line per mode on rank 0, with the ratio to DDP's median. On a
CPU only ratios mean anything.

Run:  torchrun --nproc-per-node 2 benchmarks/bench_cpu.py
Bucket-size sweep:  torchrun --nproc-per-node 2 benchmarks/bench_cpu.py --stages 0,2,3 \
        --bucket-bytes none,1048576,4194304,16777216
(a cap splits each unit's leaves into consecutive buckets of at most that many bytes; the
reductions of a unit's buckets are then in flight together)
Overlap check:  torchrun --nproc-per-node 2 benchmarks/bench_cpu.py --stages 0,1 --once-stages 0,1
(adds `fzero-stage<s>-once` rows: `accumulate="once"`, which at one micro-batch reduces after the
whole backward, as stages 0-1 did before they started each unit's reduce-scatter in its backward)
Stage 0's one all-reduce against its reduce-scatter + all-gather (the same bits; gloo's
reduce-scatter is an all-reduce plus a chunk, so the pair moves about 1.5x what DDP moves):
        torchrun --nproc-per-node 2 benchmarks/bench_cpu.py --stages 0 --split-stages 0 --rounds 2
(adds `fzero-stage0-split` rows, on a mesh that claims nothing about its all-reduce,
`Mesh.all_reduce_is_reduce_scatter_gather`; `--rounds R` times every mode R times in turn, DDP
included, each row's ratio to its own round's DDP)
Stage 3 keeping every gathered unit until the backward (`gather="eager"`: no re-gather, so it
moves 2Ψ per step as DDP does, against 3Ψ):
        torchrun --nproc-per-node 2 benchmarks/bench_cpu.py --stages 3 --eager-stages 3 --rounds 2
(adds `fzero-stage3-eager` rows)
The update in cache-sized blocks against one pass per op (the same bits; `optim.base.in_blocks`):
        torchrun --nproc-per-node 2 benchmarks/bench_cpu.py --stages 0,1,2,3 --block-stages 0,1,2,3 --rounds 2
Paired, interleaved (every mode built at once, one step of each in rotating order, `--steps`
times; `paired_vs_ddp` is the median over those rounds of the mode's step / DDP's,
`faults_per_step_mean` the process's minor page faults around each of its steps, averaged):
        torchrun --nproc-per-node 2 benchmarks/bench_cpu.py --steps 30 --interleave
Tiny check (numbers mean nothing):  torchrun --nproc-per-node 2 benchmarks/bench_cpu.py --dim 64 \
        --hidden 128 --blocks 4 --batch 8 --warmup 1 --steps 3 --once-stages 0
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fzero
from fzero._src.optim import base as optim_base

BLOCK, ONE_PASS = optim_base.CPU_BLOCK, 1 << 40  # the update's blocks, and one pass per op (`--block-stages`)


class SplitMesh(fzero.DistMesh):
    """A DistMesh that claims nothing about its all-reduce: stage 0 reduces each bucket with a
    reduce-scatter, then an all-gather (what it did before it used gloo's all-reduce)."""

    @property
    def all_reduce_is_reduce_scatter_gather(self) -> bool:
        return False


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, dim) -> (B, dim)
        return x + self.fc2(F.gelu(self.fc1(x)))


def model_of(a) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(a.dim, a.hidden) for _ in range(a.blocks)))


def timed(step, a) -> float:
    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(modes: list[tuple[str, Callable[[], Callable[[], None]]]], a
                ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Every mode's state built at once, each warmed up, then `--steps` rounds of one step per
    mode, the order rotated each round: `({mode: median step time}, {mode: median over rounds
    of its step time / DDP's in the same round}, {mode: mean minor page faults per step})`. The
    modes share the machine's state over time (its load, the process's heap), so drift cancels
    out of the ratios; the faults (the process's, `getrusage`, counted around each step: pages
    the kernel hands it anew) show which modes ask for fresh memory each step."""
    steps = {mode: make() for mode, make in modes}
    for _ in range(a.warmup):
        for step in steps.values():
            step()
    names, times, faults = list(steps), {mode: [] for mode in steps}, {mode: [] for mode in steps}
    for i in range(a.steps):
        for mode in names[i % len(names):] + names[: i % len(names)]:
            dist.barrier()
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            steps[mode]()
            times[mode].append(time.perf_counter() - t0)
            faults[mode].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    base = times[names[0]]
    return ({m: statistics.median(t) for m, t in times.items()},
            {m: round(statistics.median(x / d for x, d in zip(t, base)), 3) for m, t in times.items()},
            {m: round(statistics.mean(f)) for m, f in faults.items()})


def ddp_stepper(a, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Callable[[], None]]:
    """A maker of DDP's step: a fresh model (the same initial values as every fzero mode's)."""

    def make() -> Callable[[], None]:
        ddp = DDP(model_of(a))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

        def ddp_step() -> None:
            opt.zero_grad(set_to_none=True)
            F.mse_loss(ddp(x), y).backward()
            opt.step()

        return ddp_step

    return make


def fzero_stepper(a, run: tuple, model: nn.Module, split, x: torch.Tensor, y: torch.Tensor,
                  prefetch: int | None = None) -> tuple[str, Callable[[], Callable[[], None]]]:
    """`(mode name, maker of its step)` for one fzero run `(stage, bucket cap, accumulate, mesh,
    gather, CPU_BLOCK of the update)`, with `train_step(prefetch=prefetch)`."""
    stage, cap, accumulate, on, gather, block = run
    mode = (f"fzero-stage{stage}" + ("" if cap is None else f"-bucket{cap}")
            + ("" if accumulate == "each" else "-once") + ("-split" if on is split else "")
            + ("" if gather == "on_use" else f"-{gather}") + ("-noblock" if block == ONE_PASS else ""))

    def make() -> Callable[[], None]:
        params, apply, info = fzero.from_module(model_of(a), units=fzero.units_by_prefix(model, ""))
        state = fzero.init(params, fzero.optim.adamw(1e-4), stage=stage, mesh=on, units=info.units, bucket_bytes=cap)
        step = fzero.train_step(lambda p, b: F.mse_loss(apply(p, b[0]), b[1]), donate=True,
                                accumulate=accumulate, gather=gather, prefetch=prefetch)
        box = [state]

        def fzero_step() -> None:
            optim_base.CPU_BLOCK = block  # read by the update (the modes may differ)
            box[0], _ = step(box[0], (x, y))

        return fzero_step

    return mode, make


def workload_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model, batch, step counts and stages every CPU benchmark here takes."""
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--stages", default="0,1,2,3")
    return ap


def main() -> None:
    ap = workload_args(argparse.ArgumentParser())
    ap.add_argument("--bucket-bytes", default="none",
                    help="comma list of fzero.init(bucket_bytes=...) to sweep ('none': one bucket per unit), "
                         "e.g. none,1048576,4194304,16777216")
    ap.add_argument("--once-stages", default="",
                    help="comma list of stages (0, 1) to time also with accumulate='once' (reduce after backward)")
    ap.add_argument("--split-stages", default="",
                    help="comma list of stages to time also on a mesh that claims nothing about its all-reduce "
                         "(stage 0: reduce-scatter + all-gather instead of one all-reduce)")
    ap.add_argument("--eager-stages", default="",
                    help='also time these stages with gather="eager" (every unit gathered before the loss)')
    ap.add_argument("--prefetch", type=lambda v: None if v == "default" else int(v), default=None,
                    help="train_step(prefetch=k) for every fzero mode (default: the library's, 1 on DistMesh)")
    ap.add_argument("--rounds", type=int, default=1, help="time every mode this many times, in turn")
    ap.add_argument("--interleave", action="store_true",
                    help="build every mode at once and time them step by step in rotating order (paired ratios: "
                         "`paired_vs_ddp`, the median over rounds of the mode's step / DDP's in the same round)")
    ap.add_argument("--block-stages", default="",
                    help="comma list of stages to time also with the update in one pass per op over the shard "
                         "(`fzero-stage<s>-noblock` rows: no cache-sized blocks, what fzero did before them)")
    a = ap.parse_args()
    mesh = fzero.DistMesh(backend="gloo", verify=False)
    split = SplitMesh(verify=False) if a.split_stages else None
    rank = mesh.rank
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(a.batch, a.dim, generator=g), torch.randn(a.batch, a.dim, generator=g)

    model = model_of(a)
    caps = [None if c == "none" else int(c) for c in a.bucket_bytes.split(",")]
    once = {int(s) for s in a.once_stages.split(",") if s}
    # (stage, bucket cap, accumulate, mesh, gather, CPU_BLOCK of the update)
    runs = [(int(s), cap, "each", mesh, "on_use", BLOCK) for s in a.stages.split(",") for cap in caps]
    runs += [(s, caps[0], "once", mesh, "on_use", BLOCK) for s in sorted(once)]
    runs += [(int(s), caps[0], "each", split, "on_use", BLOCK) for s in a.split_stages.split(",") if s]
    runs += [(int(s), caps[0], "each", mesh, "eager", BLOCK) for s in a.eager_stages.split(",") if s]
    runs += [(int(s), caps[0], "each", mesh, "on_use", ONE_PASS) for s in a.block_stages.split(",") if s]
    for r in range(a.rounds):
        modes = [("ddp", ddp_stepper(a, x, y))] + [fzero_stepper(a, run, model, split, x, y, a.prefetch)
                                                   for run in runs]
        if a.interleave:
            medians, paired, faults = interleaved(modes, a)
        else:
            medians, paired, faults = {}, {}, {}
            for mode, make in modes:  # one mode at a time, its state freed before the next is built
                medians[mode] = timed(make(), a)
        if rank == 0:
            base = medians["ddp"]
            for mode, t in medians.items():
                pair = {"paired_vs_ddp": paired[mode], "faults_per_step_mean": faults[mode]} if paired else {}
                print(json.dumps({"mode": mode, "round": r, "world": mesh.world_size, "step_s_median": round(t, 4),
                                  "vs_ddp": round(t / base, 3), **pair,
                                  "interleaved": a.interleave, "torch": torch.__version__,
                                  "threads": torch.get_num_threads()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
