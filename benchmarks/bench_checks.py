"""What a finite check of a flat buffer costs: the reductions that can say "this holds a NaN or
an inf", timed over the buckets of a model's parameters (default: 25 buckets of 53.7M fp32
elements, the peers' 1.34B GPT at one unit per block), and whether each one says it exactly.

A check is exact when its result is non-finite if and only if some element is: `aminmax` (the
minimum and maximum: NaN if any element is, -inf or +inf if one is), `vector_norm(ord=inf)` (the
largest magnitude), `_foreach_norm(ord=inf)` (the same over every bucket in one launch on CUDA);
`sum` in the element dtype is finite only if every element is, but can overflow (a false alarm,
so it needs an exact check behind it), which `sum_f64` (float64 accumulation) cannot for fewer
than 2**900 elements; `amax` alone misses a -inf; `finite_witness` is fzero's check
(`fzero._src.unit`: the sum with aminmax behind it on the CPU, aminmax elsewhere). Each row: the median time of
`--reps` passes over all buckets (CUDA: events; CPU: `perf_counter`, one thread), and whether
the reduction flagged a NaN, a +inf and a -inf planted in a bucket.

Run:  python benchmarks/bench_checks.py                      (CUDA if present, else CPU)
      python benchmarks/bench_checks.py --device cpu --numel 2099712 --buckets 8
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fzero._src.unit import finite_witness


def _aminmax(xs):
    return [torch.stack(torch.aminmax(x)) for x in xs]


def _norm_inf(xs):
    return [torch.linalg.vector_norm(x, float("inf")) for x in xs]


def _foreach_norm_inf(xs):
    return list(torch._foreach_norm(xs, float("inf")))


def _sum(xs):
    return [x.sum() for x in xs]


def _amax(xs):
    return [x.amax() for x in xs]


def _sum_f64(xs):
    return [x.sum(dtype=torch.float64) for x in xs]


def _witness(xs):
    return [torch.stack(finite_witness(x)) for x in xs]


CHECKS = {"aminmax": _aminmax, "vector_norm_inf": _norm_inf, "foreach_norm_inf": _foreach_norm_inf,
          "sum": _sum, "sum_f64": _sum_f64, "amax": _amax, "finite_witness": _witness}


def flags(check, x: torch.Tensor) -> dict[str, bool]:
    """Whether `check` finds each planted non-finite value (in the middle of a copy of `x`)."""
    out = {}
    for name, v in (("nan", float("nan")), ("+inf", float("inf")), ("-inf", float("-inf"))):
        y = x.clone()
        y[y.numel() // 2 + 1] = v
        out[name] = not bool(torch.isfinite(torch.cat([r.reshape(-1).float() for r in check([y])])).all())
    return out


def timed(check, xs, reps: int, device: torch.device) -> float:
    check(xs)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            check(xs)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            check(xs)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--numel", type=int, default=53_739_520)
    ap.add_argument("--buckets", type=int, default=25)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    for dtype in (getattr(torch, d) for d in a.dtypes.split(",")):
        xs = [torch.randn(a.numel, device=device).to(dtype) for _ in range(a.buckets)]
        gb = a.numel * a.buckets * dtype.itemsize / 1e9
        for name, check in CHECKS.items():
            ms = timed(check, xs, a.reps, device)
            print(json.dumps({"check": name, "dtype": str(dtype), "device": device.type, "GB": round(gb, 2),
                              "ms": round(ms, 3), "TB_s": round(gb / ms, 3),
                              "finds": flags(check, xs[0][: min(a.numel, 1 << 20)]),
                              "torch": torch.__version__}), flush=True)
        del xs


if __name__ == "__main__":
    main()
