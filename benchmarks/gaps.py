"""Where the GPU waits: the idle gaps between kernels in a torch.profiler trace of one step.

`gpu_gaps(prof)` reads the CUDA kernel intervals of a finished `torch.profiler.profile` (one step
between two `torch.cuda.synchronize()`), and returns the step's span, the kernels' busy time, the
idle time, and the largest gaps, each with the kernel before it, the kernel after it and the CPU op
the CPU ops the host was in during the gap (`host`: the innermost ops covering most of it; with
`torch.profiler.record_function` ranges, such as fzero's "fzero.step/<phase>" ranges, these name the
phase). So a gap before the first `_fused_adamw_` is the host's work between the agreement and the
update; the time before the first kernel is the step's host prologue. Kernels that overlap (several streams) count once in the busy time.

`kernel_time(prof)` sums the kernels' time by kind (matrix products, attention, the optimizer,
copies and casts, reductions, the rest), to set two libraries' steps side by side;
`kernel_table(prof)` lists the kernels themselves, by total time, with their kind.

Used by `bench_stages.py --profile` and `peers/bench_peers.py --profile`; runs wherever the profiler records CUDA kernels.
"""

from __future__ import annotations

import re
from typing import Any


def _intervals(prof: Any) -> tuple[list[tuple[float, float, str]], list[tuple[float, float, str]]]:
    """(CUDA kernels, CPU ops) as [(start_us, end_us, name)], kernels sorted by start."""
    gpu, cpu = [], []
    for e in prof.events():
        (gpu if e.device_type.name == "CUDA" else cpu).append((e.time_range.start, e.time_range.end, e.name))
    # a `record_function` range is mirrored on the GPU's timeline as an annotation spanning its
    # kernels (same name as the CPU range): not a kernel, so not busy time
    ranges = {name for _, _, name in cpu}
    gpu = sorted(k for k in gpu if k[2] not in ranges)
    return gpu, cpu


def _host_during(cpu: list[tuple[float, float, str]], g0: float, g1: float, k: int = 3) -> list[str]:
    """The names of the innermost CPU ops covering at least half of the gap [g0, g1]."""
    covering = [(e - s, name) for s, e, name in cpu if min(e, g1) - max(s, g0) >= 0.5 * (g1 - g0)]
    names: list[str] = []
    for _, name in sorted(covering):
        if name not in names:
            names.append(name[:50])
    return names[:k]


def gpu_gaps(prof: Any, min_us: float = 20.0, top: int = 8, window_ms: float = 10.0) -> dict:
    """{span_ms, busy_ms, idle_ms, prologue_ms, gaps: [{at_ms, us, before, after, launched_by}]}:
    span from the first CPU op to the last kernel's end; `prologue_ms` the time before the first
    kernel starts (host work at the step's start while the GPU has nothing), `prologue_host` the
    longest host ops in it. `small_gaps`: how many gaps between kernels were shorter than
    `min_us` and their total (ms); `idle_ms_by_window`: the idle time after the first kernel,
    every gap, per `window_ms` of the step (so where the GPU waits: at the forward's start, in
    the backward, at the update)."""
    ks, cpu = _intervals(prof)
    lo = min((s for s, _, _ in cpu), default=ks[0][0] if ks else 0.0)
    if not ks:
        return {"error": "no CUDA kernels in the trace"}
    busy, gaps, end, last = 0.0, [], ks[0][0], None  # `end`: the latest end so far, `last` its kernel
    windows: dict[int, float] = {}  # idle us per `window_ms` window from the first kernel (every gap)
    small = [0, 0.0]  # gaps under `min_us`: how many, how long in all (us)
    for s, e, name in ks:
        if s > end and last is not None:
            _spread(windows, end - ks[0][0], s - ks[0][0], window_ms * 1e3)
            if s - end >= min_us:
                gaps.append({"at_ms": round((end - lo) / 1e3, 3), "us": round(s - end, 1), "before": last[:60],
                             "after": name[:60], "g": (end, s)})
            else:
                small[0], small[1] = small[0] + 1, small[1] + s - end
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, last = e, name
    span = end - lo
    gaps.sort(key=lambda g: -g["us"])
    gaps = gaps[:top]
    for g in gaps:
        g["host"] = _host_during(cpu, *g.pop("g"))
    last_window = int((end - ks[0][0]) // (window_ms * 1e3))
    return {"span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3), "idle_ms": round((span - busy) / 1e3, 3),
            "prologue_ms": round((ks[0][0] - lo) / 1e3, 3), "prologue_host": _within(cpu, lo, ks[0][0]), "gaps": gaps,
            "small_gaps": [small[0], round(small[1] / 1e3, 3)], "window_ms": window_ms,
            "idle_ms_by_window": [round(windows.get(i, 0.0) / 1e3, 3) for i in range(last_window + 1)]}


def _spread(windows: dict[int, float], t0: float, t1: float, width: float) -> None:
    """Add the interval [t0, t1) (us) to the windows of `width` us it covers, part by part."""
    while t0 < t1:
        i = int(t0 // width)
        cut = min(t1, (i + 1) * width)
        windows[i] = windows.get(i, 0.0) + cut - t0
        t0 = cut


def _within(cpu: list[tuple[float, float, str]], t0: float, t1: float, top: int = 12) -> list[str]:
    """The longest CPU ops that start in [t0, t1] (the prologue: what the host did before the
    GPU had its first kernel), as "name ms" (the part inside the span)."""
    inside = sorted(((min(e, t1) - s, name) for s, e, name in cpu if t0 <= s < t1), reverse=True)[:top]
    return [f"{name[:60]} {us / 1e3:.3f}" for us, name in inside]


_KINDS = (  # the first pattern a kernel's name matches names its kind
    ("attention", re.compile(r"flash|fmha|attention|efficient|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|sm90_|nvjet|cublas", re.I)),
    ("optimizer", re.compile(r"adam|sgd|multi_tensor_apply", re.I)),
    ("copy_cast", re.compile(r"copy|cast|Memcpy|Memset|cat_|CatArray", re.I)),
    ("reduce", re.compile(r"reduce|norm|aminmax|sum|max|min", re.I)),
    ("collective", re.compile(r"nccl", re.I)),
)


def _kind(name: str) -> str:
    return next((k for k, pat in _KINDS if pat.search(name)), "other")


def kernel_table(prof: Any, top: int = 40) -> str:
    """The `top` CUDA kernels of `prof` by total time: `ms  calls  kind  name` per line."""
    totals: dict[str, list[float]] = {}
    for s, e, name in _intervals(prof)[0]:
        row = totals.setdefault(name, [0.0, 0])
        row[0] += (e - s) / 1e3
        row[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return "\n".join(f"{ms:9.3f} ms {n:5d}  {_kind(name):10s} {_short(name)[:160]}" for name, (ms, n) in rows)


def _short(name: str) -> str:
    """A kernel's name without the namespaces that every ATen kernel repeats, so that the part
    that tells two multi-tensor kernels apart (their functor) fits on the line."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "at_cuda_detail::"):
        name = name.replace(noise, "")
    return name


def kernel_time(prof: Any) -> dict[str, float]:
    """{kind: ms} of the CUDA kernels in `prof`, by `_KINDS` ("other" for the rest; layer norms
    count as "reduce"), with "total"; overlapping kernels each count in full."""
    ks, _ = _intervals(prof)
    out: dict[str, float] = {}
    for s, e, name in ks:
        kind = _kind(name)
        out[kind] = out.get(kind, 0.0) + (e - s) / 1e3
    out["total"] = sum(out.values())
    return {k: round(v, 3) for k, v in sorted(out.items())}
