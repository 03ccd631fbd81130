"""fzero's CPU update in blocks (`optim.base.in_blocks`) against one call over the whole shard,
per optimizer, dtype and block size: which cut is fastest, and that every cut gives one call's bits.

On the CPU "single" and "foreach" updates run over consecutive blocks of `CPU_BLOCK` elements per
thread for float32 / float64 shards (every op of a block while it is in cache), and over the
whole shard in one call for bfloat16 / float16. This script times both ways for every dtype (the
half-precision blocks by widening the blocked dtypes for the run: `ops` rounds an element alike
wherever a call cuts it, so the bits are the same) and checks the params after the timed steps
against one call's.

Rows (one JSON line each): optimizer, dtype, elements, block ("one call" or elements per
thread), `ms` (median of `--iters` in-place steps after `--warmup`, perf_counter), `equal`
(params after the steps `torch.equal` to one call's). Timing only.

Run:  python benchmarks/bench_cpu_blocks.py --elements 16e6 --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import os
import time

import torch

import fzero.optim as fo
from fzero._src.optim import base

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_optim import context, sizes_of  # noqa: E402

OPTIMIZERS = {
    "adamw": lambda impl: fo.adamw(1e-3, eps=1e-3, weight_decay=1e-2, impl=impl),  # eps: float16's 1e-8 is 0
    "sgd": lambda impl: fo.sgd(1e-2, impl=impl),
    "sgd-momentum": lambda impl: fo.sgd(1e-2, momentum=0.9, impl=impl),
    "sgd-momentum-wd": lambda impl: fo.sgd(1e-2, momentum=0.9, weight_decay=1e-4, impl=impl),
}
ONE_CALL = 1 << 62  # a block larger than any shard: `in_blocks` makes one call


def timed(kind: str, impl: str, dtype: torch.dtype, sizes: list[int], block: int, warmup: int, iters: int
          ) -> tuple[float, torch.Tensor]:
    """Median ms of an in-place step of `kind` over one flat shard of `sizes` leaves, cut into
    blocks of `block` elements per thread, and the params after the steps."""
    before = base.CPU_BLOCK, base._BLOCKED
    base.CPU_BLOCK, base._BLOCKED = block, (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    try:
        gen = torch.Generator().manual_seed(0)
        opt = OPTIMIZERS[kind](impl)
        p = torch.randn(sum(sizes), generator=gen).to(dtype)
        state = opt.init(p, len(sizes))
        g = torch.randn(sum(sizes), generator=gen).to(dtype)
        times = []
        for t in range(warmup + iters):
            t0 = time.perf_counter()
            state = opt.update_(g, state, p, context(sizes, t))
            times.append(time.perf_counter() - t0)
        return statistics.median(times[warmup:]) * 1e3, p
    finally:
        base.CPU_BLOCK, base._BLOCKED = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=float, default=16e6)
    ap.add_argument("--tensors", type=int, default=24)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--impl", default="foreach", choices=("single", "foreach"))
    ap.add_argument("--blocks", default="17,18,19,20", help="log2 of the elements per thread of a block")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    sizes = sizes_of(int(a.elements), a.tensors)
    print(json.dumps(dict(torch=torch.__version__, threads=torch.get_num_threads(), elements=sum(sizes),
                          default_block=base.CPU_BLOCK, blocked_dtypes=[str(d) for d in base._BLOCKED])), flush=True)
    for kind in a.optimizers.split(","):
        for name in a.dtypes.split(","):
            dtype = getattr(torch, name)
            one_ms, one_p = timed(kind, a.impl, dtype, sizes, ONE_CALL, a.warmup, a.iters)
            print(json.dumps(dict(optimizer=kind, impl=a.impl, dtype=name, block="one call", ms=round(one_ms, 2))),
                  flush=True)
            for log2 in (int(v) for v in a.blocks.split(",")):
                ms, p = timed(kind, a.impl, dtype, sizes, 1 << log2, a.warmup, a.iters)
                print(json.dumps(dict(optimizer=kind, impl=a.impl, dtype=name, block=f"2^{log2}", ms=round(ms, 2),
                                      vs_one_call=round(ms / one_ms, 3), equal=bool(torch.equal(p, one_p)))),
                      flush=True)


if __name__ == "__main__":
    main()
