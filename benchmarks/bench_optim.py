"""One AdamW step over E fp32 elements: fzero's three impls (pure and in place) against torch.optim.

Run (GPU):        python benchmarks/bench_optim.py
Run (CPU smoke):  python benchmarks/bench_optim.py --device cpu --elements 1e6

Rows (one JSON line each):
  fzero  impl single / foreach / fused, form "pure" (`update`: clones, then writes the clones)
         or "in_place" (`update_`: writes param and state), over one flat shard of E elements
         holding `--tensors` leaves (N = 1, every leaf used: one run, one call per op);
  torch  torch.optim.AdamW over `--tensors` separate tensors of the same sizes and values,
         foreach=False / foreach=True / fused=True.

`ms` is the median of `--iters` steps after `--warmup` (CUDA events on CUDA, perf_counter on
CPU), `ms_min` the fastest. `transient_gib` is the peak memory above what was resident before
the timed steps (params, grads, optimizer state): `torch.cuda.max_memory_allocated` on CUDA; on
CPU the peak live bytes of new storages made by aten ops during one more step
(`fzero.accounting.LiveStorages`). The floor of an AdamW step is 7 x 4 bytes per element
(read p, g, m, v; write p, m, v) at the memory bandwidth.

First, a check on the run's device: after each of `--check-steps` steps from the same values,
fzero's params and state equal torch's matching path (single = foreach=False, foreach =
foreach=True, fused = fused=True) bit for bit; printed as {"check": ..., "equal": ...} lines,
then whether the fused kernel was found element-wise (`fzero._src.optim.fused`, CUDA only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fzero.optim as fo
from fzero.accounting import LiveStorages
from fzero import ParamGroup
from fzero.layout import Segment
from fzero._src.optim import fused

GIB = 2**30
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
TORCH_FLAGS = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def sizes_of(elements: int, tensors: int) -> list[int]:
    """`tensors` sizes summing to `elements`, as equal as possible."""
    q, r = divmod(elements, tensors)
    return [q + (i < r) for i in range(tensors)]


def context(sizes: list[int], step: int) -> fo.UpdateContext:
    """The context of one flat shard holding `sizes` leaves back to back, all used (N = 1)."""
    segs, at = [], 0
    for leaf, n in enumerate(sizes):
        segs.append(Segment(leaf, 0, at, at + n))
        at += n
    leaves = tuple(range(len(sizes)))
    return fo.UpdateContext(step, ParamGroup(), tuple(segs), leaves, (True,) * len(sizes), leaf_numels=tuple(sizes))


class Clock:
    """Milliseconds of `fn()`: CUDA events on CUDA, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def resident(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def measure(step, device: torch.device, warmup: int, iters: int) -> dict:
    """Time `step()` and the memory it needs above what is resident now."""
    clock = Clock(device)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = resident(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = [clock(step) for _ in range(iters)]
    if device.type == "cuda":
        transient = torch.cuda.max_memory_allocated(device) - base
    else:
        with LiveStorages() as census:
            step()
        transient = census.peak
    return dict(ms=round(statistics.median(times), 3), ms_min=round(min(times), 3),
                transient_gib=round(transient / GIB, 3), transient_bytes=int(transient))


def fzero_row(impl: str, form: str, sizes: list[int], device: torch.device, a) -> dict:
    gen = torch.Generator(device).manual_seed(0)
    e = sum(sizes)
    opt = fo.adamw(**HP, impl=impl)
    box = {"p": torch.randn(e, device=device, generator=gen)}
    box["s"] = opt.init(box["p"], len(sizes))
    g = torch.randn(e, device=device, generator=gen)
    count = [0]

    def step():
        ctx = context(sizes, count[0])
        count[0] += 1
        if form == "pure":
            box["p"], box["s"] = opt.update(g, box["s"], box["p"], ctx)
        else:
            box["s"] = opt.update_(g, box["s"], box["p"], ctx)

    out = measure(step, device, a.warmup, a.iters)
    del box, g
    return dict(who="fzero", impl=impl, form=form, **out)


def torch_row(impl: str, sizes: list[int], device: torch.device, a) -> dict:
    gen = torch.Generator(device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device, generator=gen)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    opt = torch.optim.AdamW(params, **HP, **TORCH_FLAGS[impl])
    opt.step()  # the state (exp_avg, exp_avg_sq, step) exists from here on: resident, not transient
    out = measure(opt.step, device, a.warmup, a.iters)
    del opt, params
    return dict(who="torch", impl=impl, form="torch.optim", **out)


def check_bitwise(impl: str, sizes: list[int], device: torch.device, steps: int) -> dict:
    """fzero `impl` (in place) vs torch.optim.AdamW with the matching flags, after every step."""
    gen = torch.Generator(device).manual_seed(1)
    flat = torch.randn(sum(sizes), device=device, generator=gen)
    grads = [torch.randn(sum(sizes), device=device, generator=gen) for _ in range(steps)]
    params = [torch.nn.Parameter(x.clone()) for x in flat.split(sizes)]
    topt = torch.optim.AdamW(params, **HP, **TORCH_FLAGS[impl])
    opt = fo.adamw(**HP, impl=impl)
    p, state = flat.clone(), opt.init(flat, len(sizes))
    equal = True
    for t, g in enumerate(grads):
        for q, gi in zip(params, g.split(sizes)):
            q.grad = gi.clone()
        topt.step()
        state = opt.update_(g, state, p, context(sizes, t))
        for mine, field in ((p, None), (state.exp_avg, "exp_avg"), (state.exp_avg_sq, "exp_avg_sq")):
            theirs = torch.cat([q.detach() if field is None else topt.state[q][field] for q in params])
            equal &= torch.equal(mine, theirs)
        equal &= all(float(topt.state[q]["step"]) == float(s) for q, s in zip(params, state.step))
    return dict(check=f"fzero {impl} == torch AdamW({TORCH_FLAGS[impl]}) bitwise, {steps} steps", equal=bool(equal))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--elements", type=float, default=1.34e9)
    ap.add_argument("--tensors", type=int, default=24, help="leaves of fzero's shard = torch's tensors")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--check-steps", type=int, default=2)
    ap.add_argument("--check-elements", type=float, default=None, help="elements of the check (default: --elements)")
    a = ap.parse_args()
    device = torch.device(a.device)
    sizes = sizes_of(int(a.elements), a.tensors)
    head = dict(device=str(torch.cuda.get_device_name(device) if device.type == "cuda" else device), torch=torch.__version__,
                elements=sum(sizes), tensors=a.tensors, threads=torch.get_num_threads())
    print(json.dumps(head), flush=True)
    check_sizes = sizes if a.check_elements is None else sizes_of(int(a.check_elements), a.tensors)
    for impl in fo.IMPLS:
        print(json.dumps(check_bitwise(impl, check_sizes, device, a.check_steps)), flush=True)
    for key, ok in fused._checked.items():  # the placement probes the checks ran (CUDA only)
        print(json.dumps({"fused_kernel": str(key[2]), "elementwise": ok}), flush=True)
    for impl in fo.IMPLS:
        for form in ("pure", "in_place"):
            print(json.dumps({**head, **fzero_row(impl, form, sizes, device, a)}), flush=True)
    for impl in fo.IMPLS:
        print(json.dumps({**head, **torch_row(impl, sizes, device, a)}), flush=True)


if __name__ == "__main__":
    main()
