"""GPU time per phase of a training step, from CUDA events (no profiler): the forward, and what
follows it (backward, gradient passes, update), for fzero and the peers side by side.

`clock.mark(name)` records an event on the current stream; a step's marks are "start", "forward",
"loss" and "end" (the step returned, before the synchronisation of the timing rule). After the
timed steps, `clock.summary()` gives each phase's median in ms over the steps: `prologue` (start to
the forward's first op: the host's work before the model runs), `forward` (the model's forward,
its gathers and casts included), `rest` (loss to end: backward and update). Events on one stream
order with that stream's kernels only; fzero's side-stream work is joined to the step's stream
before the step returns, so `rest` covers it.

Used by `bench_stages.py --phases 1` and `peers/bench_peers.py --phases 1`.
"""

from __future__ import annotations

import statistics

import torch


class PhaseClock:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self.steps: list[dict[str, torch.cuda.Event]] = []

    def begin(self) -> None:
        if self.enabled:
            self.steps.append({})
            self.mark("start")

    def mark(self, name: str) -> None:
        if self.enabled and self.steps:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.steps[-1].setdefault(name, event)

    def summary(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        torch.cuda.synchronize()
        spans = {"prologue": ("start", "forward"), "forward": ("forward", "loss"), "rest": ("loss", "end"),
                 "step": ("start", "end")}
        out = {}
        for name, (a, b) in spans.items():
            times = [s[a].elapsed_time(s[b]) for s in self.steps if a in s and b in s]
            if times:
                out[f"{name}_ms"] = round(statistics.median(times), 3)
        return out
