"""Train transformers' GPT-2 (built from a config, nothing downloaded) with ZeRO stage 3.

Each rank holds 1/N of the parameters, gradients and AdamW state; each transformer block is one
fzero unit, gathered for its forward and again for its backward, its gradient reduce-scattered
as soon as it is ready. The data is a random token stream (the loss falls as the model learns its
unigram statistics). The tied `lm_head` / `wte` weight is one leaf (fzero.from_module).

Run on 2 processes (gloo on CPU, NCCL on GPUs):
    torchrun --nproc-per-node 2 examples/gpt2_stage3.py
    torchrun --nproc-per-node 2 examples/gpt2_stage3.py --layers 2 --embd 32 --steps 5   # tiny
Without torchrun it falls back to a 2-rank SimMesh in one process:
    python examples/gpt2_stage3.py --layers 2 --embd 32 --steps 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import fzero
from fzero import from_module, units_by_prefix


def progress(step: int, total: int, loss: float, started: float, width: int = 30) -> str:
    """A plain-text progress bar: `[#####.....] 5/10 loss 4.1234 0.3 s/step`."""
    done = width * step // total
    rate = (time.perf_counter() - started) / max(step, 1)
    return f"[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.4f} {rate:.2f} s/step"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    mesh = fzero.DistMesh() if "RANK" in os.environ else fzero.SimMesh(2)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(mesh.device)  # CUDA under torchrun + NCCL
    params, apply, info = from_module(model, units=units_by_prefix(model, "transformer.h"))
    del model
    warmup = max(1, args.steps // 10)  # cosine's decay_steps counts the steps after the warmup: args.steps in all
    opt = fzero.optim.adamw(fzero.optim.cosine(args.lr, max(1, args.steps - warmup), warmup_steps=warmup),
                            weight_decay=0.1)
    stage = 3

    def loss_fn(p, tokens):  # tokens: (B, T)
        return apply(p, tokens, labels=tokens).loss  # next-token cross-entropy, mean over (B, T - 1)

    def rank_fn(rank_seed: int):
        state = fzero.init(params, opt, stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        step = fzero.train_step(loss_fn)
        g = torch.Generator().manual_seed(rank_seed)
        # a skewed unigram distribution: something a model can learn in a few steps
        probs = torch.arange(args.vocab, 0, -1, dtype=torch.float64) ** 2
        talk = mesh.rank == 0
        started, losses = time.perf_counter(), []
        for i in range(args.steps):
            tokens = torch.multinomial(probs, args.batch * args.seq, replacement=True, generator=g)
            state, metrics = step(state, tokens.view(args.batch, args.seq).to(mesh.device))  # (B, T)
            losses.append(float(metrics.loss))
            if talk:
                end = "\n" if i + 1 == args.steps or not sys.stdout.isatty() else ""
                print("\r" + progress(i + 1, args.steps, losses[-1], started), end=end, flush=True)
        shard = sum(t.numel() for t in state.params)
        return losses, shard, sum(b.padded_numel for b in state.layout.buckets)

    out = mesh.run(rank_fn, lambda r: (1000 + r,))
    losses, shard, padded = out[0]
    if isinstance(mesh, fzero.SimMesh) or mesh.rank == 0:
        psi = sum(p.numel() for p in params.values())
        print(f"{mesh!r} stage {stage}: {psi:,} parameters, {shard:,} held per rank "
              f"({padded:,} padded / {mesh.world_size})")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if isinstance(mesh, fzero.DistMesh):
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
