r"""Hessian-vector products and double backward through a stage-3 loss.

Two ways second derivatives meet sharded parameters:

1. *Double backward inside the loss* (a gradient penalty, Drucker & LeCun 1992):
   `L_r = ℓ_r(W) + ½ λ ‖∇_W ℓ_r(W)‖²`, whose gradient `∇ℓ_r + λ H_r ∇ℓ_r` holds a
   Hessian-vector product. `W` is every unit's gathered leaves, so the inner `torch.func.grad` is
   rank r's full local gradient; the step differentiates through it (`engine="func"`) and reduces
   as usual: every stage ends with the same bits as stage 0.
2. *An HVP of the mean loss with respect to the sharded params*, through a step: with
   `sgd(lr)`, `step(p) = p - lr ḡ(p)` with `ḡ = (1/N) Σ_r ∇L_r`, so
   `grad_p <v, step(p)> = v - lr H̄ v` (reverse over reverse; SimMesh or DistMesh) and
   `jvp(step)(v) = v - lr H̄ v` (forward over reverse; DistMesh only: forward mode needs one
   process per rank). Stage 3 gives rank r its shard of `H̄ v`; the example compares it with the
   unsharded `H̄ v` (float64; `(v - step)/lr` and the serial sums round differently, so the
   printed difference is rounding; on exact data the two are equal bit for bit,
   tests/test_func.py). fzero carries fl(1/N) once per derivative order (docs/func.md).

Run:  python examples/hvp.py [--world-size 2]
      torchrun --nproc-per-node 2 examples/hvp.py     (adds the forward-over-reverse HVP)
"""

from __future__ import annotations

import argparse
import os

import torch

import fzero
from fzero import optim

LR = 0.5


def make_model(dim: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)).double()


def penalized(apply, lam: float):
    """`(params, (x[B, D], y[B])) -> ℓ + ½ λ ‖∇_W ℓ‖²` (double backward through the gathered leaves)."""

    def plain(w, batch):
        x, y = batch
        return ((apply(w, x).squeeze(-1) - y) ** 2).mean()

    def loss(params, batch):
        w = dict(params)
        g = torch.func.grad(plain)(w, batch)  # rank r's full local gradient, {path: leaf shape}
        return plain(w, batch) + 0.5 * lam * sum(v.square().sum() for v in g.values())

    return plain, loss


def batch_for(rank: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, dim, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(1))


def run_rank(mesh: fzero.Mesh, stage: int, args, forward: bool) -> dict:
    model = make_model(args.dim, args.hidden)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    plain, loss = penalized(apply, args.lam)
    batch = batch_for(mesh.rank, args.dim)
    def init(opt):
        return fzero.init(params, opt, stage=stage, mesh=mesh, units=info.units, groups=info.groups)

    state = init(optim.sgd(0.1))
    trained = fzero.train_step(loss, engine="func")
    for _ in range(args.steps):  # 1. training through a double backward
        state, _ = trained(state, batch)
    out = {"trained": fzero.gather(state)}

    state = init(optim.sgd(LR))  # 2. H̄ v through one step of plain SGD
    step = fzero.train_step(plain, engine="func")  # float64 params: gradients added in float64
    new = lambda p: step(state.replace(params=p), batch)[0].params  # noqa: E731
    v = tuple(torch.ones_like(p) for p in state.params)
    g = torch.func.grad(lambda p: sum((n * u).sum() for n, u in zip(new(p), v)))(state.params)
    out["rev"] = [(u - gi) / LR for u, gi in zip(v, g)]  # this rank's part of H̄ v (its copy's, stages 0-2)
    if forward:
        _, t = torch.func.jvp(new, (state.params,), (v,))
        out["fwd"] = [(u - ti) / LR for u, ti in zip(v, t)]
    out["layout"] = state.layout
    return out


def unsharded_hvp(args, n: int) -> dict:
    """`H̄ v = (1/N) Σ_r H_r v` serially, v = ones, by torch.func reverse over reverse."""
    model = make_model(args.dim, args.hidden)
    params, apply, _ = fzero.from_module(model)
    plain, _ = penalized(apply, args.lam)
    ones = {k: torch.ones_like(p) for k, p in params.items()}
    out = {k: 0 for k in params}
    for r in range(n):
        batch = batch_for(r, args.dim)
        hv = torch.func.grad(lambda p: sum((g * ones[k]).sum() for k, g in torch.func.grad(plain)(p, batch).items()))(
            params)
        out = {k: out[k] + hv[k] * (1.0 / n) for k in out}
    return out


def leaves(layout, flat_by_bucket: list[torch.Tensor]) -> dict:
    return {ls.path: flat_by_bucket[ls.bucket][ls.offset : ls.offset + ls.numel].view(ls.shape) for ls in layout.leaves}


def _full(mesh: fzero.Mesh, dist: bool, stage: int, parts: list[torch.Tensor]) -> torch.Tensor:
    """A bucket's `H̄ v` from the ranks' parts: stage 3's shards in rank order; in stage 0 rank r's
    copy gets `H_r v` (each rank's `<v, step(p)>` counts once per copy), so the mean over ranks.
    `parts` holds every rank's part on SimMesh, this rank's under torchrun."""
    n, c = mesh.world_size, fzero.collectives
    if not dist:
        return torch.cat(parts) if stage == 3 else sum(parts) * (1.0 / n)
    return c.all_gather(parts[0], mesh) if stage == 3 else c.all_reduce(parts[0], mesh) * (1.0 / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dim", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=8)
    ap.add_argument("--lam", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    dist = "WORLD_SIZE" in os.environ
    mesh = fzero.DistMesh() if dist else fzero.SimMesh(args.world_size)
    n, show = mesh.world_size, (not dist or mesh.rank == 0)
    want = unsharded_hvp(args, n)
    scale = max(v.abs().max().item() for v in want.values())
    runs = {}
    for stage in (0, 3):
        outs = ([run_rank(mesh, stage, args, True)] if dist else
                mesh.run(lambda: run_rank(mesh, stage, args, False)))
        runs[stage] = outs[0]["trained"]
        for kind in ("rev", "fwd"):
            if kind not in outs[0]:
                continue
            per_bucket = [_full(mesh, dist, stage, [o[kind][b] for o in outs]) for b in range(len(outs[0][kind]))]
            got = leaves(outs[0]["layout"], per_bucket)
            err = max((got[k] - want[k]).abs().max().item() for k in want)
            if show:
                name = {"rev": "reverse over reverse", "fwd": "forward over reverse"}[kind]
                print(f"{mesh!r} stage {stage} H̄v ({name}): max |fzero - unsharded| = {err:.2e} "
                      f"(max |H̄v| = {scale:.3f})")
    same = all(torch.equal(runs[0][k], runs[3][k]) for k in runs[0])
    if show:
        print("gradient penalty (double backward): stage 3 equals stage 0 bit for bit" if same else "stages DIFFER")
    if dist:
        torch.distributed.destroy_process_group()
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
