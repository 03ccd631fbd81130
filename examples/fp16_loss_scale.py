"""Train a small MLP in fp16 with dynamic loss scaling, at stage 0 and stage 3, and show that the
two loss curves (and the loss-scale curves) are the same numbers.

The model computes in fp16 (`fzero.Precision(torch.float16, torch.float32)`: fp16 compute, fp32
reduction, fp32 master weights and AdamW state); the loss is scaled by DeepSpeed's dynamic
scaler (`fzero.DynamicLossScale`), with a short window so the scale grows until the fp16
gradients overflow, backs off, and grows again: a saw-tooth of skipped steps. The script asserts
that stage 3's losses, scales and skips equal stage 0's at every step, and saves a plot.

Run (one process, 2 simulated ranks):
    python examples/fp16_loss_scale.py --plot fp16_loss_scale.png
Run on real processes (gloo on CPU, NCCL on GPUs):
    torchrun --nproc-per-node 2 examples/fp16_loss_scale.py --steps 100
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import fzero
from fzero import optim


def make_params(dim: int, hidden: int, classes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fc1": {"w": torch.randn(hidden, dim, generator=g) / dim**0.5, "b": torch.zeros(hidden)},
        "fc2": {"w": torch.randn(classes, hidden, generator=g) / hidden**0.5, "b": torch.zeros(classes)},
    }


def loss_fn(p, batch):
    x, y = batch  # x: (B, dim) in fp32, y: (B,)
    h = F.gelu(x.to(p["fc1"]["w"].dtype) @ p["fc1"]["w"].T + p["fc1"]["b"])  # (B, hidden), fp16
    logits = h @ p["fc2"]["w"].T + p["fc2"]["b"]  # (B, classes), fp16
    return F.cross_entropy(logits.float(), y)


def train(mesh, stage: int, data: list, args) -> list[tuple[float, float, bool]]:
    params = make_params(args.dim, args.hidden, args.classes)
    state = fzero.init(params, optim.adamw(args.lr), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0],
                       precision=fzero.Precision(torch.float16, torch.float32),
                       loss_scale=fzero.DynamicLossScale(init_scale=2.0**16, window=args.window, hysteresis=1))
    step = fzero.train_step(loss_fn)
    curve = []
    for batch in data:
        state, m = step(state, batch)
        curve.append((float(m.loss), m.loss_scale, m.skipped))
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16, help="examples per rank per step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--window", type=int, default=8, help="clean steps before the scale doubles")
    ap.add_argument("--world-size", type=int, default=2, help="SimMesh ranks (ignored under torchrun)")
    ap.add_argument("--plot", help="save the loss and loss-scale curves to this PNG (needs matplotlib)")
    args = ap.parse_args()
    if args.plot:  # before training: matplotlib is not an fzero dependency (the [plot] and [test] extras bring it)
        try:
            import matplotlib
        except ImportError:
            ap.error("--plot needs matplotlib, which is not installed: pip install 'fzero[plot]'")

    mesh = fzero.DistMesh() if "RANK" in os.environ else fzero.SimMesh(args.world_size)
    first = not isinstance(mesh, fzero.DistMesh) or mesh.rank == 0

    def data(rank: int) -> tuple:
        g = torch.Generator().manual_seed(100 + rank)
        return ([(torch.randn(args.batch, args.dim, generator=g).to(mesh.device) * 4,
                  torch.randint(0, args.classes, (args.batch,), generator=g).to(mesh.device))
                 for _ in range(args.steps)],)

    curves = {stage: mesh.run(lambda d: train(mesh, stage, d, args), data)[0] for stage in (0, 3)}
    assert curves[0] == curves[3], "stage 3's curve differs from stage 0's"
    skips = sum(s for _, _, s in curves[0])
    if first:
        losses = [loss for loss, _, s in curves[0] if not s]
        print(f"{mesh!r}: {args.steps} fp16 steps, {skips} skipped for overflow; loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}; scales {min(c[1] for c in curves[0]):g}..{max(c[1] for c in curves[0]):g}")
        print("stage 3 equals stage 0 at every step (loss, loss scale, skips)")
    if args.plot and first:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
        for stage, style in ((0, "-"), (3, "--")):
            ax1.plot([c[0] for c in curves[stage]], style, label=f"stage {stage}")
            ax2.semilogy([c[1] for c in curves[stage]], style, label=f"stage {stage}")
        ax1.set_ylabel("loss")
        ax2.set_ylabel("loss scale")
        ax2.set_xlabel("step")
        ax1.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"saved {args.plot}")
    if isinstance(mesh, fzero.DistMesh):
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
