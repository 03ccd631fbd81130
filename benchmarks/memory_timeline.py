"""Print CUDA memory at each stage-3 gather event of one step (rank 0): where the peak comes from.

Run (2 GPUs):  torchrun --nproc-per-node 2 benchmarks/memory_timeline.py --gather on_use --layers 8
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "peers"))
from bench_peers import GPT  # noqa: E402

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from fzero._src import gathering  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gather", default="on_use", choices=["eager", "on_use"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    a = ap.parse_args()
    mesh = fzero.DistMesh(verify=False)
    dev = mesh.device
    gib = lambda: f"{torch.cuda.memory_allocated() / 2**30:7.2f} GiB (peak {torch.cuda.max_memory_allocated() / 2**30:7.2f})"  # noqa: E731
    say = (lambda *m: print(*m, flush=True)) if mesh.rank == 0 else (lambda *m: None)
    for name in ("release", "refill"):
        orig = getattr(gathering.Gathering, name)

        def wrapped(self, unit, *args, orig=orig, name=name, **kwargs):  # refill(unit, backward=True) too
            orig(self, unit, *args, **kwargs)
            say(f"{name:8s} {unit:12s} {gib()}")

        setattr(gathering.Gathering, name, wrapped)
    torch.manual_seed(0)
    model = GPT(32000, a.dim, a.layers, 16, a.seq).to(dev)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    del model
    opt = optim.adamw(1e-4)
    state = fzero.init(params, opt, stage=3, mesh=mesh, units=info.units)
    del params

    def loss_fn(p, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = apply(p, *batch)
        say(f"forward done       {gib()}")
        return loss

    step = fzero.train_step(loss_fn, gather=a.gather)
    idx = torch.randint(0, 32000, (4, a.seq), device=dev)
    torch.cuda.reset_peak_memory_stats()
    say(f"start              {gib()}")
    state, m = step(state, (idx, idx))
    say(f"step done          {gib()}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
