"""Activation checkpointing per block at N = 1: fzero stage 3 with `remat=True` against FSDP2 with
torch's checkpointing per block, on the peers' 1.34B GPT (benchmarks/peers/bench_peers.py).

Run (one GPU, one job, JSON lines on stdout, each mode in its own process under a time limit):

    python benchmarks/bench_remat.py                       # all modes, 1.34B GPT, seq 2048
    python benchmarks/bench_remat.py --modes fzero3-remat fsdp2-ckpt --micro 8
    python benchmarks/bench_remat.py --tiny                # CPU check: a tiny GPT on gloo

Modes (each one JSON line: tokens/s, median step time, peak memory; or an error line):

- `fsdp2-ckpt`:   FSDP2 (`fully_shard` per block and the root, bf16 params / fp32 reduce,
                  `MixedPrecisionPolicy`) with every block wrapped in `torch.utils.checkpoint`
                  (`use_reentrant=False`);
- `fzero3-remat`: fzero stage 3, one unit per block, `from_module(..., remat=True)`, under
                  `fzero.Precision(bf16, fp32)` (fp32 master, bf16 compute: FSDP2's policy),
                  `prefetch=--prefetch`;
- `fsdp2`, `fzero3`: the same without checkpointing (what checkpointing saves and costs).

The model, data, AdamW (lr 1e-4), warm-up and timing rule (median of `--steps` steps after
`--warmup`, `torch.cuda.synchronize` around each) are the peer script's; peak memory is
`torch.cuda.max_memory_allocated` after the warm-up's reset. Every process is one rank of a
process group of size 1 (NCCL on CUDA, gloo on CPU) started here, no torchrun needed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("fsdp2-ckpt", "fzero3-remat", "fsdp2", "fzero3")
TINY = ["--dim", "64", "--layers", "2", "--heads", "4", "--seq", "32", "--vocab", "128", "--micro", "2",
        "--warmup", "1", "--steps", "2"]


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--mode", choices=MODES, help="(internal) run one mode in this process")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak", type=float, default=989e12, help="peak bf16 FLOP/s, for MFU (H200 dense)")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per mode")
    ap.add_argument("--budget", type=float, default=1500.0, help="seconds for the whole job")
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT (a CPU check of the script); flags given "
                                                        "after it still apply")
    a = ap.parse_args(argv)
    return ap.parse_args(TINY + list(argv if argv is not None else sys.argv[1:])) if a.tiny else a


# -- one mode, in this process ------------------------------------------------------------------


def _group():
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    return dev


def _checkpointed(block):
    """`block` whose forward runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`."""
    import torch
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    return Checkpointed(block)


def _fsdp2_step(a, model, dev, ckpt: bool):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = dev.type == "cuda"
    if ckpt:
        model.blocks = torch.nn.ModuleList(_checkpointed(b) for b in model.blocks)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
    model = model.to(dev)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

    def step(batch):
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _fzero_step(a, model, dev, remat: bool):
    import torch

    import fzero
    from fzero import optim

    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"), remat=remat)
    mesh = fzero.DistMesh(verify=False)
    policy = fzero.Precision(torch.bfloat16, torch.float32) if dev.type == "cuda" else fzero.Precision()
    holder = {"state": fzero.init(params, optim.adamw(lr=1e-4), stage=3, mesh=mesh, units=info.units,
                                  precision=policy)}
    del params
    train = fzero.train_step(lambda p, batch: apply(p, *batch), prefetch=a.prefetch, donate=True)

    def step(batch):
        holder["state"], m = train(holder["state"], batch)
        return m.loss

    return step


def run_mode(a: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, os.path.join(HERE, "peers"))
    from bench_peers import GPT

    dev = _group()
    torch.manual_seed(0)
    model = GPT(a.vocab, a.dim, a.layers, a.heads, a.seq).to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    make = {"fsdp2-ckpt": lambda: _fsdp2_step(a, model, dev, True), "fsdp2": lambda: _fsdp2_step(a, model, dev, False),
            "fzero3-remat": lambda: _fzero_step(a, model, dev, True), "fzero3": lambda: _fzero_step(a, model, dev, False)}
    step = make[a.mode]()
    del model
    g = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g).to(dev)
    tgt = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g).to(dev)
    cuda = dev.type == "cuda"
    for _ in range(a.warmup):
        step((idx, tgt))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step((idx, tgt))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    tok = a.micro * a.seq
    flops_per_tok = 6 * nparams + 12 * a.layers * a.dim * a.seq  # the peer script's estimate (no recompute)
    return {"mode": a.mode, "world": 1, "params_M": round(nparams / 1e6, 1), "micro": a.micro, "seq": a.seq,
            "step_s_median": round(med, 4), "tok_s": round(tok / med, 1),
            "mfu": round(tok / med * flops_per_tok / a.peak, 4),
            "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "loss": round(float(loss), 4), "torch": torch.__version__,
            "prefetch": a.prefetch if a.mode.startswith("fzero") else None}


# -- the job: every mode in its own process ------------------------------------------------------


def main(argv=None) -> None:
    a = _args(argv)
    if a.mode is not None:
        print(json.dumps(run_mode(a)), flush=True)
        return
    passed = list(argv if argv is not None else sys.argv[1:])  # the child reads the same flags, plus --mode
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    for mode in a.modes:
        left = a.budget - (time.monotonic() - start)
        if left < 30:
            print(json.dumps({"mode": mode, "error": "skipped: the job's --budget is spent"}), flush=True)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), *passed, "--mode", mode]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=min(a.timeout, left))
        except subprocess.TimeoutExpired:
            print(json.dumps({"mode": mode, "error": f"timed out after {min(a.timeout, left):.0f} s"}), flush=True)
            continue
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            print(json.dumps({"mode": mode, "error": f"exit {done.returncode}", "tail": tail}), flush=True)
        else:
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
