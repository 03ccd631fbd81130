"""Minor page faults per step of one fzero stage alone in its process (no DDP beside it): the
model and batch of `benchmarks/bench_cpu.py`, `train_step(donate=True)`, `--steps` steps, one
line per step on rank 0 (the faults, `resource.getrusage(RUSAGE_SELF).ru_minflt`, around the step).

Run:  torchrun --nproc-per-node 2 benchmarks/faults_alone.py --stage 2 --steps 14
"""

from __future__ import annotations

import argparse
import json
import resource

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
from bench_cpu import model_of, workload_args


def main() -> None:
    ap = workload_args(argparse.ArgumentParser())
    ap.add_argument("--stage", type=int, default=2)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    model = model_of(a)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    state = fzero.init(params, fzero.optim.adamw(1e-4), stage=a.stage, mesh=fzero.DistMesh(), units=info.units)
    step = fzero.train_step(lambda p, b: F.mse_loss(apply(p, b[0]), b[1]), donate=True)
    x, y = torch.randn(a.batch, a.dim), torch.randn(a.batch, a.dim)
    faults = []
    for _ in range(a.steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        state, _ = step(state, (x, y))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    if dist.get_rank() == 0:
        print(json.dumps({"stage": a.stage, "faults_per_step": faults, "torch": torch.__version__}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
