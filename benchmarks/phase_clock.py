"""GPU time per phase of a training step, from CUDA events (no profiler): the forward, and what
follows it (backward, gradient passes, update), for fzero and the peers side by side.

`clock.mark(name)` records an event on the current stream; a step's marks are "start", "forward",
"loss" and "end" (the step returned, before the synchronisation of the timing rule). After the
timed steps, `clock.summary()` gives each phase's median in ms over the steps: `prologue` (start to
the forward's first op: the host's work before the model runs), `forward` (the model's forward,
its gathers and casts included), `rest` (loss to end: backward and update). Events on one stream
order with that stream's kernels only; fzero's side-stream work is joined to the step's stream
before the step returns, so `rest` covers it.

With NVML (`pynvml`, from nvidia-ml-py), `start()` before the timed steps and `summary()` after
them also give the GPU's energy per step (`energy_J_per_step`, its total-energy counter) and mean
power over the timed steps: the H200 of these runs reaches its 700 W limit in a training step and
lowers its clocks, so a step's time follows the energy it spends (BENCHMARKS.md, seventeenth session).

Used by `bench_stages.py --phases 1` and `peers/bench_peers.py --phases 1`.
"""

from __future__ import annotations

import statistics
import time

import torch


class PhaseClock:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self.steps: list[dict[str, torch.cuda.Event]] = []
        self._energy: tuple[object, int, float] | None = None  # (NVML handle, mJ, host time) at start()

    def start(self) -> None:
        """Before the timed steps (the device idle): the energy counter's reading, where NVML is."""
        if not self.enabled:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self._energy = (handle, pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter())
        except Exception:  # no NVML here: times only
            self._energy = None

    def begin(self) -> None:
        if self.enabled:
            self.steps.append({})
            self.mark("start")

    def mark(self, name: str) -> None:
        """An event named `name` in the current step (the first such mark only)."""
        if self.enabled and self.steps and name not in self.steps[-1]:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.steps[-1][name] = event

    def summary(self) -> dict[str, float]:
        """The medians and energy (above); the clock then stops, so later steps mark nothing."""
        if not self.enabled:
            return {}
        self.enabled = False
        torch.cuda.synchronize()
        out: dict[str, float] = {}
        if self._energy is not None and self.steps:
            import pynvml

            handle, mj, t0 = self._energy
            joules, seconds = (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - mj) / 1e3, time.perf_counter() - t0
            out |= {"energy_J_per_step": round(joules / len(self.steps), 2), "power_W_mean": round(joules / seconds, 1)}
        spans = {"prologue": ("start", "forward"), "forward": ("forward", "loss"), "rest": ("loss", "end"),
                 "step": ("start", "end")}
        for name, (a, b) in spans.items():
            times = [s[a].elapsed_time(s[b]) for s in self.steps if a in s and b in s]
            if times:
                out[f"{name}_ms"] = round(statistics.median(times), 3)
        return out
