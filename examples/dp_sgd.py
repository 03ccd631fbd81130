r"""DP-SGD at stage 3: per-example gradient clipping through sharded parameters.

DP-SGD (Abadi et al., 2016) clips every example's gradient to norm C, sums, adds Gaussian noise
and averages. Under data parallelism the clipping must act on an example's *full* gradient
before any reduction: a reduce-scatter would add example b of rank 0 to example b of rank 1.
In fzero the loss sees every unit's gathered leaves (stage 3 gathers them on use), so inside
the loss `torch.func.vmap(torch.func.grad(per_example))` gives each example's full local
gradient g_i, and the loss

    L_r = (Σ_i c_i ℓ_i + (σ C / N) <z, W>) / B,    c_i = min(1, C / ‖g_i‖)  (detached)

has gradient (Σ_i clip_C(g_i) + (σ C / N) z) / B on rank r. The step's mean over the N ranks
is then (Σ over all N·B examples of clip_C(g_i) + σ C z) / (N B): DP-SGD's noisy clipped mean,
with z ~ N(0, I) drawn from the same seed on every rank (it is part of the batch).

The loss adds the noise term as `n - n.detach()` (n = (σ C / N) <z, W>): its value is 0 and its
gradient is n's, so the step's gradient (and every parameter bit) is the one above, and
`metrics.loss` is the clipped loss Σ_i c_i ℓ_i / B (mean over ranks) without the noise term,
which is new each step and would hide the training in the printed values.

The example trains a small MLP in stages 0-3 on SimMesh (or DistMesh under torchrun) and
checks that every stage ends with bit-identical parameters (docs/func.md).

Run:  python examples/dp_sgd.py [--world-size 2 --steps 5]
      torchrun --nproc-per-node 2 examples/dp_sgd.py
"""

from __future__ import annotations

import argparse
import os

import torch

import fzero
from fzero import optim


def make_model(dim: int, hidden: int, classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, classes))


def dp_loss(apply, clip: float, sigma: float, world_size: int):
    """`(params, (x[B, D], y[B], z {path: noise})) -> L_r` above (its value without the noise term)."""

    def per_example(w, xi, yi):  # one example: (D,), () -> 0-d loss
        return torch.nn.functional.cross_entropy(apply(w, xi[None]), yi[None])

    def loss(params, batch):
        x, y, z = batch
        w = dict(params)  # every unit's gathered leaves (a gather per unit in stage 3)
        grads = torch.func.vmap(torch.func.grad(per_example), in_dims=(None, 0, 0))(w, x, y)  # {path: (B, ...)}
        norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()  # (B,)
        c = torch.clamp(clip / (norms + 1e-6), max=1.0).detach()  # (B,)
        losses = torch.func.vmap(per_example, in_dims=(None, 0, 0))(w, x, y)  # (B,)
        noise = sum((z[k] * w[k]).sum() for k in w) * (sigma * clip / world_size)
        return ((c * losses).sum() + (noise - noise.detach())) / x.shape[0]  # the value leaves the noise out

    return loss


def batch_for(step: int, rank: int, args, shapes: dict) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + rank)  # this rank's examples
    x = torch.randn(args.batch, args.dim, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    noise = torch.Generator().manual_seed(step)  # the same z on every rank
    z = {k: torch.randn(s, generator=noise) for k, s in shapes.items()}
    return x, y, z


def train(mesh: fzero.Mesh, stage: int, args) -> tuple[dict, list[float]]:
    model = make_model(args.dim, args.hidden, 3)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    shapes = {k: v.shape for k, v in params.items()}
    state = fzero.init(params, optim.sgd(args.lr), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
    step = fzero.train_step(dp_loss(apply, args.clip, args.sigma, mesh.world_size), engine="func")
    losses = []
    for t in range(args.steps):
        state, m = step(state, batch_for(t, mesh.rank, args, shapes))
        losses.append(float(m.loss))
    return fzero.gather(state), losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--sigma", type=float, default=0.5)
    args = ap.parse_args()
    dist = "WORLD_SIZE" in os.environ
    mesh = fzero.DistMesh() if dist else fzero.SimMesh(args.world_size)
    runs = {}
    for stage in range(4):
        out = [train(mesh, stage, args)] if dist else mesh.run(lambda: train(mesh, stage, args))
        runs[stage] = out[0]
        if not dist or mesh.rank == 0:
            print(f"{mesh!r} stage {stage}: objective (clipped loss, noise term left out) "
                  f"{out[0][1][0]:.4f} -> {out[0][1][-1]:.4f}")
    same = all(torch.equal(runs[0][0][k], runs[s][0][k]) for s in range(1, 4) for k in runs[0][0])
    if not dist or mesh.rank == 0:
        print("dp-sgd: all stages ended with bit-identical parameters" if same else "dp-sgd: stages DIFFER")
    if dist:
        torch.distributed.destroy_process_group()
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
