"""Per-step work census at world size 1: fzero stages 0-3 beside a plain torch step, same model.

What one optimizer step does besides the model's own compute, counted from `torch.profiler`
(`record_shapes`, `profile_memory`) over one step after warm-up:

- `passes`: Σ over the aten ops that move data and call no other such op (views, casts to the
  same dtype and other metadata ops excluded) of their inputs' elements,
  divided by Ψ (the parameter count), split into `model` ops (matrix products and the model's
  element-wise ops: the same in every mode) and `other` ops (copies, casts, fills, sums,
  multiplies, the optimizer, ...). A full pass over the parameters, the gradient or the
  optimizer state adds 1 to `other`; fzero minus torch is the work fzero does that torch does not.
- `alloc_MiB`: bytes allocated during the step (Σ of each op's positive self memory usage), and
  `peak_GiB` (CUDA: `max_memory_allocated` over the step).
- `top`: the other ops with the most elements, `[name, calls, elements / Ψ]`.

One JSON line per mode. The model: `--blocks` residual blocks `x + W2 GELU(W1 x)` (as
benchmarks/bench_cpu.py), or `--gpt` the peers' GPT (benchmarks/peers/bench_peers.py). AdamW:
torch `fused=True` on CUDA, foreach on CPU; fzero `impl=None` (the same), `donate=True`.

Run (CPU, tiny):  torchrun --nproc-per-node 1 benchmarks/census.py --dim 64 --hidden 256 --blocks 2
Run (1 GPU):      torchrun --nproc-per-node 1 benchmarks/census.py --gpt
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_cpu import Block  # the CPU benchmark's residual block (benchmarks/ is the script's directory)
from torch import nn
from torch.profiler import ProfilerActivity, profile

import fzero

MODEL_OPS = ("mm", "addmm", "bmm", "matmul", "linear", "gelu", "gelu_backward", "tanh", "softmax", "log_softmax",
             "_log_softmax", "_log_softmax_backward_data", "nll_loss", "nll_loss_forward", "nll_loss_backward",
             "scaled_dot_product", "flash", "efficient_attention", "layer_norm", "native_layer_norm",
             "native_layer_norm_backward", "embedding", "embedding_dense_backward", "mse_loss", "mse_loss_backward",
             "cudnn", "_softmax", "_softmax_backward_data", "silu", "silu_backward")


METADATA = frozenset("aten::" + n for n in (
    "view", "as_strided", "detach", "resolve_conj", "resolve_neg", "result_type", "to", "reshape", "_reshape_alias",
    "expand", "t", "transpose", "permute", "slice", "select", "unsqueeze", "squeeze", "alias", "empty", "empty_like",
    "empty_strided", "lift_fresh", "unbind", "split", "chunk", "narrow", "_unsafe_view", "set_", "resize_",
    "is_nonzero", "item", "_local_scalar_dense", "contiguous", "numpy_T", "flatten", "unflatten", "view_as",
    "split_with_sizes", "_has_compatible_shallow_copy_type", "is_same_size", "zeros_like_meta"))


def _numel(shape) -> int:
    """Elements of one recorded input: a shape `[d0, d1, ...]`, a list of shapes (a TensorList), or
    a non-tensor (0)."""
    if not isinstance(shape, (list, tuple)) or not shape:
        return 0
    if all(isinstance(d, int) for d in shape):
        return math.prod(shape)
    return sum(_numel(s) for s in shape)


def _is_model(name: str) -> bool:
    op = name.removeprefix("aten::")
    return any(op == m or op.startswith(m) for m in MODEL_OPS)


def census(prof, psi: int) -> dict:
    """The profile of one step -> passes (model / other), bytes allocated and the top other ops."""
    elems: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    alloc = 0
    for e in prof.events():
        mem = [getattr(e, k, 0) for k in ("self_cpu_memory_usage", "self_device_memory_usage")]
        if e.name == "[memory]":
            mem = [getattr(e, k, 0) for k in ("cpu_memory_usage", "device_memory_usage")]
        alloc += sum(max(0, m) for m in mem)
        if e.name == "[memory]":
            continue
        if not e.name.startswith("aten::") or e.name in METADATA or any(
                c.name.startswith("aten::") and c.name not in METADATA for c in e.cpu_children):
            continue
        n = sum(_numel(s) for s in (e.input_shapes or []))
        elems[e.name][0] += 1
        elems[e.name][1] += n
    model = sum(n for k, (_, n) in elems.items() if _is_model(k))
    other = {k: v for k, v in elems.items() if not _is_model(k)}
    top = sorted(other.items(), key=lambda kv: -kv[1][1])[:12]
    return {"passes_model": round(model / psi, 2), "passes_other": round(sum(n for _, n in other.values()) / psi, 2),
            "alloc_MiB": round(alloc / 2**20, 3),
            "top": [[k.removeprefix("aten::"), c, round(n / psi, 2)] for k, (c, n) in top]}


def profiled(step, dev: torch.device, warmup: int) -> tuple:
    for _ in range(warmup):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with profile(activities=acts, record_shapes=True, profile_memory=True) as prof:
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    return prof, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gpt", action="store_true", help="the peers' 1.34B GPT (seq 2048, micro 4, bf16 autocast)")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    mesh = fzero.DistMesh(backend="nccl" if torch.cuda.is_available() else "gloo", verify=False)
    dev = mesh.device
    if mesh.world_size != 1:
        raise SystemExit(f"census.py measures world size 1; run it with --nproc-per-node 1 (got {mesh.world_size})")

    if a.gpt:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "peers"))
        from bench_peers import GPT

        def make() -> nn.Module:
            torch.manual_seed(0)
            return GPT(32000, 2048, 24, 16, 2048).to(dev)

        g = torch.Generator().manual_seed(1)
        batch = tuple(torch.randint(0, 32000, (4, 2048), generator=g).to(dev) for _ in range(2))
        units_of = lambda m: fzero.units_by_prefix(m, "blocks")  # noqa: E731
        run = lambda f, p, b: f(p, *b) if p is not None else f(*b)  # noqa: E731
    else:
        def make() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(*(Block(a.dim, a.hidden) for _ in range(a.blocks))).to(dev)

        g = torch.Generator().manual_seed(1)
        batch = (torch.randn(a.batch, a.dim, generator=g).to(dev), torch.randn(a.batch, a.dim, generator=g).to(dev))
        units_of = lambda m: fzero.units_by_prefix(m, "")  # noqa: E731
        run = None

    def loss_of(out_fn, b):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            return out_fn(*b) if a.gpt else F.mse_loss(out_fn(b[0]), b[1])

    model = make()
    psi = sum(p.numel() for p in model.parameters())
    kw = {"fused": True} if dev.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)

    def torch_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(model, batch).backward()
        opt.step()

    rows = [("torch", *profiled(torch_step, dev, a.warmup))]
    del model, opt
    for stage in (int(s) for s in a.stages.split(",")):
        m = make()
        params, apply, info = fzero.from_module(m, units=units_of(m))
        del m
        state = fzero.init(params, fzero.optim.adamw(1e-4), stage=stage, mesh=mesh, units=info.units)
        del params
        step = fzero.train_step(lambda p, b: loss_of(lambda *x: apply(p, *x), b), donate=True)
        box = [state]

        def fzero_step() -> None:
            box[0], _ = step(box[0], batch)

        rows.append((f"fzero-stage{stage}", *profiled(fzero_step, dev, a.warmup)))
        del box, state
    del run
    for mode, prof, peak in rows:
        line = {"mode": mode, "world": 1, "psi": psi, "device": dev.type, **census(prof, psi),
                "peak_GiB": round(peak, 3), "torch": torch.__version__}
        print(json.dumps(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
