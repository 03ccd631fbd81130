"""Can fzero's memory-bound checks hide behind the model's matrix products? One GPU, no fzero.

A step's own passes over the gradients and the updated params (the norm, the non-finite check)
are memory-bound; the backward's matrix products are compute-bound. This times, with CUDA
events, the products alone (`mm_ms`: `--mm` products of the peers' GPT shapes, 8192 x 2048 @
2048 x 8192 in bf16), the checks alone (`check_ms`: `vector_norm` and `aminmax` over `--numel`
fp32 elements in `--pieces` pieces, as per-unit work), and both at once, the checks on a side
stream (`both_ms`, the products on the default stream, then on a high-priority one). `exposed_ms` =
both - mm: what the checks still cost when overlapped (check_ms when they do not overlap at all).

Run (one GPU):  python3 benchmarks/bench_overlap.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import timed as timed_and_peak  # noqa: E402  (median ms and peak GiB, with events)


def timed(fn) -> float:
    return timed_and_peak(fn)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1_343_000_000)
    ap.add_argument("--pieces", type=int, default=25)
    ap.add_argument("--mm", type=int, default=100)
    a = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(a.numel, device="cuda")
    pieces = g.chunk(a.pieces)

    def products():
        for _ in range(a.mm):
            torch.mm(x, w, out=y)

    def checks():
        return [(torch.linalg.vector_norm(p), torch.aminmax(p)) for p in pieces]

    mm_ms, check_ms = timed(products), timed(checks)
    row = {"bench": "overlap", "numel": a.numel, "pieces": a.pieces, "mm_ms": round(mm_ms, 3),
           "check_ms": round(check_ms, 3)}
    side = torch.cuda.Stream()  # CUDA: a lower number is a higher priority; 0 is the default
    for name, main in (("same_priority", torch.cuda.current_stream()), ("main_high", torch.cuda.Stream(priority=-1))):

        def both():
            main.wait_stream(torch.cuda.current_stream())
            side.wait_stream(main)
            with torch.cuda.stream(side):
                checks()
            with torch.cuda.stream(main):
                products()
            main.wait_stream(side)
            torch.cuda.current_stream().wait_stream(main)

        t = timed(both)
        row[f"both_ms_{name}"] = round(t, 3)
        row[f"exposed_ms_{name}"] = round(t - mm_ms, 3)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
