"""Upper bounds, not results: how much faster a step would be without one of fzero's own passes.

Runs `bench_stages.py` with a pass removed by a patch, so the numbers it trains on are WRONG
(timing only; the loss it prints shows it):
  WHATIF=noassemble  each unit's backward returns a zero buffer made once, instead of
                     assembling its gradient (no copy, no zero fill);
  WHATIF=noends      no finite check of the updated params (the state's pending flag is 0);
  WHATIF=both        both.
  WHATIF=overlap     noends, and the update launched before the agreement's read runs on its own
                     stream, bucket by bucket in bucket order, each bucket's end an event that the
                     next step's forward waits for when it reads the bucket's unit (a probe of
                     running the update under the next forward; the grads, flags and step tensors
                     its kernels read are kept until the next step).
  WHATIF=tailgap     nothing changed: CUDA events at the step's start, where the host returns from
                     the backward (`step.accumulate`) and where it queues the agreement's host read
                     (`agreement.HostRead`), so that the GPU time between them (the agreement's kernels,
                     and the GPU's wait for the host's work after the backward) is printed, median
                     over the steps, as a JSON line at exit.
Run beside the real modes in one job, e.g. (1 GPU):
  WHATIF=noassemble torchrun --nproc-per-node 1 benchmarks/whatif.py --stage 0 --steps 20
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fzero._src import agreement, step, unit  # noqa: E402
from fzero._src import update as update_module  # noqa: E402

WHAT = os.environ.get("WHATIF", "")


def _cached_zeros() -> object:
    made = {}

    def assemble(bucket, grads, dtype, device, side=None):
        key = (id(bucket), dtype, str(device))
        if key not in made:
            made[key] = torch.zeros(bucket.size, dtype=dtype, device=device)
        return made[key]

    return assemble


if WHAT in ("noassemble", "both"):
    unit._assemble = _cached_zeros()
if WHAT in ("noends", "both", "overlap"):
    update_module.Ends.of = staticmethod(lambda state, donate: None)
    update_module._nonfinite_flag = lambda state, updated, taken=None: torch.zeros((), device=state.mesh.device)
if WHAT == "overlap":
    from fzero._src import gathering

    EVENTS, KEEP, STREAM = {}, [], []

    def agree_launching(config, state, rows, shards, reduced, report, ready):
        skip = agreement.early_skip(config, state, rows, reduced, report, ready)
        grads = None if skip is None else agreement._checked(ready, reduced)
        if grads is None:
            return agreement.agree(config, state, rows, shards, reduced), ready, None
        read = agreement.HostRead(rows, skip)
        if not STREAM:
            STREAM.append(torch.cuda.Stream())
        u, main = STREAM[0], torch.cuda.current_stream()
        u.wait_stream(main)
        KEEP.clear()
        KEEP.append((grads, skip, ready))
        states = {}
        with torch.cuda.stream(u):
            for b in sorted(grads):
                states[b] = ready.launches[b].run(grads[b], skip)
                ev = torch.cuda.Event()
                ev.record(u)
                EVENTS[b] = ev
        got, skipped = read.values()
        verdict = agreement._verdict(config, state, got, shards, reduced)
        if skipped:
            return verdict, None, None
        return verdict, ready, update_module.Early(states, None)

    step.agree_launching = agree_launching
    _read = gathering.Gathering.read

    def read(self, unit):
        for b in self._programs[unit].buckets:
            ev = EVENTS.pop(b.index, None)
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)
        return _read(self, unit)

    gathering.Gathering.read = read
elif WHAT == "tailgap":
    import atexit
    import json
    import statistics

    marks: dict = {}
    spans: dict = {"backward_to_read_ms": [], "start_to_backward_end_ms": []}
    accumulate, host_read, eager_step = step.accumulate, agreement.HostRead.__init__, step.eager_step

    def _event(name):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks[name] = e

    def timed_step(*args, **kwargs):
        marks.clear()
        _event("start")
        out = eager_step(*args, **kwargs)
        if "read" in marks:
            marks["read"].synchronize()
            spans["backward_to_read_ms"].append(marks["backward"].elapsed_time(marks["read"]))
            spans["start_to_backward_end_ms"].append(marks["start"].elapsed_time(marks["backward"]))
        return out

    def timed_accumulate(*args, **kwargs):
        out = accumulate(*args, **kwargs)
        _event("backward")
        return out

    def timed_read(self, *args, **kwargs):
        if "backward" in marks and "read" not in marks:
            _event("read")
        host_read(self, *args, **kwargs)

    step.eager_step, step.accumulate, agreement.HostRead.__init__ = timed_step, timed_accumulate, timed_read  # by name

    @atexit.register
    def _report():
        if spans["backward_to_read_ms"] and int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"whatif": "tailgap"} | {k: round(statistics.median(v), 3) for k, v in spans.items()}
                             | {"steps": len(spans["backward_to_read_ms"])}), flush=True)
elif WHAT not in ("", "noassemble", "noends", "both"):
    sys.exit(f"WHATIF={WHAT!r}: expected noassemble, noends, both, overlap or tailgap")

import bench_stages  # noqa: E402

if __name__ == "__main__":
    bench_stages.main()
