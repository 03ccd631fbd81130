"""Train one residual MLP with ZeRO stages 0-3 and show what each rank holds.

The model: `--blocks` residual blocks `x + W2 GELU(W1 x)` (W1: dim -> hidden, W2: hidden -> dim),
then a 10-class head; AdamW on random data, a few steps per stage, one fzero unit per block.
For each stage the script prints the bytes of parameters, gradients and optimizer state one rank
holds, asserts that they equal ZeRO's formulas (fp32 AdamW: 4 + 4 + 8 bytes per parameter, each
term divided by N where the stage shards it, plus the layout's padding), and finally asserts that
all four stages end with bit-identical parameters.

Run (one process, N simulated ranks; the defaults, 4 x (256 -> 1024 -> 256), peak at 0.6 GB RSS):
    python examples/mlp_stages.py --world-size 2
    python examples/mlp_stages.py --dim 64 --hidden 256 --blocks 2        # tiny, as CI runs it
    python examples/mlp_stages.py --dim 1024 --hidden 4096 --blocks 12    # 100.7M params, ~20 GB RAM
Run on real processes (gloo on CPU, NCCL on GPUs):
    torchrun --nproc-per-node 2 examples/mlp_stages.py --dim 64 --hidden 256 --blocks 2
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero import from_module, units_by_prefix


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, dim)
        return x + self.fc2(F.gelu(self.fc1(x)))  # (B, hidden) -> (B, dim)


class ResidualMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim, hidden) for _ in range(blocks)))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, dim) -> (B, classes)
        return self.head(self.blocks(x))


def held_bytes(state: fzero.ZeroState) -> dict[str, int]:
    """Bytes this rank holds, read from the state's tensors (`fzero.accounting.held_bytes`)."""
    held = fzero.accounting.held_bytes(state)
    return {"params": held.params, "grads": held.grads, "optimizer": held.optimizer_state}


def formula_bytes(stage: int, psi: int, padded: int, leaves: int, n: int) -> dict[str, int]:
    """ZeRO's per-rank model-state bytes for fp32 AdamW: 4 Ψ params, 4 Ψ grads, 8 Ψ moments
    (over the padded buffers), divided by N where the stage shards them; plus AdamW's per-leaf
    step counters (4 bytes per leaf, replicated)."""
    assert padded >= psi
    shard = padded // n
    return {
        "params": 4 * (shard if stage >= 3 else padded),
        "grads": 4 * (shard if stage >= 2 else padded),
        "optimizer": 8 * (shard if stage >= 1 else padded) + 4 * leaves,
    }


# bytes per rank, Ψ' = Ψ + padding, L = number of leaves (AdamW's per-leaf step counters)
FORMULAS = ("4Ψ' + 4Ψ' + (8Ψ' + 4L)", "4Ψ' + 4Ψ' + (8Ψ'/N + 4L)", "4Ψ' + 4Ψ'/N + (8Ψ'/N + 4L)",
            "4Ψ'/N + 4Ψ'/N + (8Ψ'/N + 4L)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="examples per rank per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2, help="SimMesh ranks (ignored under torchrun)")
    args = ap.parse_args()

    mesh = fzero.DistMesh() if "RANK" in os.environ else fzero.SimMesh(args.world_size)
    n = mesh.world_size
    torch.manual_seed(0)
    model = ResidualMLP(args.dim, args.hidden, args.blocks).to(mesh.device)  # CUDA under torchrun + NCCL
    params, apply, info = from_module(model, units=units_by_prefix(model, "blocks"))
    del model  # apply holds a parameter-free skeleton; params is the only copy
    psi = sum(p.numel() for p in params.values())
    opt = fzero.optim.adamw(1e-4, weight_decay=0.01)

    def loss_fn(p, batch):
        x, y = batch  # x: (B, dim), y: (B,)
        return F.cross_entropy(apply(p, x), y)

    def batches(rank: int) -> tuple:
        g = torch.Generator().manual_seed(1000 + rank)
        return ([(torch.randn(args.batch, args.dim, generator=g).to(mesh.device),
                  torch.randint(0, 10, (args.batch,), generator=g).to(mesh.device))
                 for _ in range(args.steps)],)

    def train(stage: int, data: list) -> tuple:
        state = fzero.init(params, opt, stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        step = fzero.train_step(loss_fn)
        losses = []
        for batch in data:
            state, metrics = step(state, batch)
            losses.append(float(metrics.loss))
        held = held_bytes(state)
        padded = sum(b.padded_numel for b in state.layout.buckets)
        want = formula_bytes(stage, psi, padded, len(state.layout.leaves), n)
        assert held == want, f"stage {stage}: held {held} != formula {want}"
        return fzero.gather(state), losses, held, padded

    first = mesh.rank == 0 if isinstance(mesh, fzero.DistMesh) else True
    if first:
        print(f"{mesh!r}: {args.blocks} blocks of {args.dim}->{args.hidden}->{args.dim}, {psi:,} parameters")
    finals = {}
    for stage in range(4):
        out = mesh.run(lambda data: train(stage, data), batches)
        final, losses, held, padded = out[0]
        finals[stage] = final
        if first:
            mb = {k: v / 2**20 for k, v in held.items()}
            print(f"stage {stage}: losses {' '.join(f'{x:.4f}' for x in losses)} (a fresh random batch each step) | "
                  f"per rank: params "
                  f"{held['params']:,} B ({mb['params']:.1f} MiB), grads {held['grads']:,} B, optimizer "
                  f"{held['optimizer']:,} B = formula {FORMULAS[stage]} (padding {padded - psi} elements)")
    for stage in (1, 2, 3):
        for k, v in finals[stage].items():
            assert torch.equal(v, finals[0][k]), f"stage {stage} differs from stage 0 at {k!r}"
    if first:
        print("all stages ended with bit-identical parameters")
    if isinstance(mesh, fzero.DistMesh):
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
