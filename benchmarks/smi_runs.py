"""The GPU's clocks and power during each run of a job, from an `nvidia-smi` log.

A job samples the GPU beside its runs,
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,\
clocks_event_reasons.active --format=csv -lms 100 > smi.csv &
and writes `BEGIN <run> <HH:MM:SS.ns>` / `END <run> <HH:MM:SS.ns>` lines around each run into
runs.txt. For each run this prints, over the samples drawing more than `--busy` watts (the timed
and warm-up steps, not the model's build), the SM clock's median and mean, the mean power, and
how many samples had the software power cap among their clock event reasons (bit 0x4).

Run:  python benchmarks/smi_runs.py smi.csv runs.txt
"""

from __future__ import annotations

import argparse
import csv
import statistics


def _seconds(clock: str) -> float:
    h, m, s = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s[:9])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("smi")
    ap.add_argument("runs")
    ap.add_argument("--busy", type=float, default=300.0, help="watts above which a sample counts as a training step's")
    a = ap.parse_args()
    samples = []
    for row in list(csv.reader(open(a.smi)))[1:]:
        try:
            sm, _, power, _, _, reasons = (c.strip().split()[0] for c in row[1:7])
            samples.append((_seconds(row[0].split()[1]), float(sm), float(power), int(reasons, 16)))
        except (ValueError, IndexError):
            continue  # a sample nvidia-smi could not read
    spans: dict[str, dict[str, float]] = {}
    for line in open(a.runs):
        what, run, at = line.split()
        spans.setdefault(run, {})[what] = _seconds(at)
    for run, span in spans.items():
        busy = [s for s in samples if span["BEGIN"] < s[0] < span["END"] and s[2] > a.busy]
        if not busy:
            print(f"{run:16s} no busy samples")
            continue
        sm, power = [s[1] for s in busy], [s[2] for s in busy]
        capped = sum(1 for s in busy if s[3] & 0x4)
        print(f"{run:16s} busy samples {len(busy):3d}  SM MHz median {statistics.median(sm):5.0f} mean "
              f"{statistics.mean(sm):5.0f}  power mean {statistics.mean(power):4.0f} W  power-capped {capped}/{len(busy)}")


if __name__ == "__main__":
    main()
