"""Writes tests/golden/loss_scale_traces.json: DeepSpeed's DynamicLossScaler, step by step.

Not part of the test suite and not a dependency of fzero: it needs DeepSpeed, which fzero never
imports. tests/test_scale.py replays the JSON it writes through `fzero`'s `DynamicLossScale`.

Run it from the repository root in a throwaway venv:

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.8
    /tmp/dsvenv/bin/python tests/golden/make_loss_scale_traces.py

It drives `deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler.update_scale(overflow)`, the
scaler ZeRO stages 1-3 build through `CreateLossScaler`, under many settings and seeded overflow
patterns (clean stretches, isolated overflows, bursts), and records after every update the
scale and the hysteresis, and the update at which it raised at the minimum scale, if it did.
`update_scale` logs through `deepspeed.comm.get_rank()`, so a one-process gloo group on the
loopback address is started first.

The JSON, compactly:
  {"deepspeed": version, "torch": version,
   "traces": [{"name", "settings": {init_scale, window, hysteresis, consecutive_hysteresis,
                                    min_scale, raise_at_min},
               "overflow":   "0110..."  one character per update, "1" = overflow,
               "hysteresis": "2211..."  cur_hysteresis after each update (one digit, <= 9),
               "scales": [[1, 16], [1, 15], [3, -1], ...]  the distinct values cur_scale
                         took, each as [m, e] with m an odd integer (or 0): value = m * 2**e,
                         which `math.ldexp(m, e)` reads back exactly,
               "scale": "0010..."  cur_scale after each update, as the position of its value
                        in "scales", written in base len(ALPHABET) with "width" digits each
                        (width 1 while there are at most 62 distinct values),
               "raised_at": index of the update that raised, or null}]}
A trace that raised ends at that update: its entry in "overflow" is the overflow that raised,
and "hysteresis" and "scale" have one entry fewer (the raise leaves DeepSpeed's state as it was).

Settings are named as in fzero; DeepSpeed's names: window = scale_window, hysteresis =
delayed_shift, raise_at_min = raise_error_at_min_scale.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import pathlib
import random

OUT = pathlib.Path(__file__).with_name("loss_scale_traces.json")
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

# (init_scale, min_scale): the ZeRO defaults, a high floor, small inits that reach the floor
# within a few overflows, inits that are not a power of two times the floor (the floor clamps),
# and floors not representable in float32 (0.1) or of the unfused profile (0.25).
SCALES = [(2**16, 1), (2**16, 2**10), (8, 1), (3.0, 1), (1.0, 0.1), (2**16, 0.25)]


def setup_deepspeed():
    """Import DeepSpeed with a one-process gloo group (its scaler asks comm for the rank)."""
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(key, value)
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return deepspeed.__version__, torch.__version__, DynamicLossScaler


def pattern(rng: random.Random, steps: int, max_phase: int) -> str:
    """`steps` overflow flags in phases of random length, each with its own overflow rate:
    clean stretches (rate 0), isolated overflows (0.01, 0.05), and bursts (0.5, 0.95)."""
    out: list[str] = []
    while len(out) < steps:
        rate = rng.choice([0.0, 0.0, 0.01, 0.05, 0.5, 0.95])
        length = rng.randint(1, max_phase) if rate < 0.5 else rng.randint(1, 12)
        out += ["1" if rng.random() < rate else "0" for _ in range(length)]
    return "".join(out[:steps])


def mantissa_exponent(v: float) -> list[int]:
    """[m, e] with v == m * 2**e exactly and m odd (m = 0 for 0.0); v must be finite."""
    assert math.isfinite(v)
    num, den = v.as_integer_ratio()  # den is a power of two
    e = -(den.bit_length() - 1)
    while num and num % 2 == 0:
        num //= 2
        e += 1
    assert math.ldexp(num, e) == v
    return [num, e]


def digits(n: int, width: int) -> str:
    """`n` in base len(ALPHABET), `width` digits, most significant first."""
    out = ""
    for _ in range(width):
        n, d = divmod(n, len(ALPHABET))
        out = ALPHABET[d] + out
    assert n == 0
    return out


def trace(DynamicLossScaler, name: str, settings: dict, overflow: str) -> dict:
    """Drive one DynamicLossScaler through `overflow` and record it (see the module docstring)."""
    s = DynamicLossScaler(
        init_scale=settings["init_scale"],
        scale_window=settings["window"],
        min_scale=settings["min_scale"],
        delayed_shift=settings["hysteresis"],
        consecutive_hysteresis=settings["consecutive_hysteresis"],
        raise_error_at_min_scale=settings["raise_at_min"],
    )
    scales: list[float] = []
    hysteresis: list[str] = []
    raised_at = None
    last = -1
    for k, flag in enumerate(overflow):
        try:
            s.update_scale(flag == "1")
        except Exception as e:  # DeepSpeed raises a bare Exception at the minimum
            assert "minimum" in str(e), e
            raised_at = k
            break
        last = k if flag == "1" else last
        # The counters follow from the flags alone; checked here so the test may rely on it.
        assert s.cur_iter == k + 1 and s.last_overflow_iter == last, (name, k)
        assert 1 <= s.cur_hysteresis <= 9
        scales.append(float(s.cur_scale))
        hysteresis.append(str(s.cur_hysteresis))
    values = sorted(set(scales), reverse=True)
    width = 1
    while len(ALPHABET) ** width < len(values):
        width += 1
    end = len(overflow) if raised_at is None else raised_at + 1
    return dict(
        name=name,
        settings=settings,
        overflow=overflow[:end],
        hysteresis="".join(hysteresis),
        scales=[mantissa_exponent(v) for v in values],
        width=width,
        scale="".join(digits(values.index(v), width) for v in scales),
        raised_at=raised_at,
    )


def cases(rng: random.Random):
    """(name, settings, overflow flags) of every trace."""
    zero = dict(init_scale=2**16, window=1000, hysteresis=2, consecutive_hysteresis=False, min_scale=1, raise_at_min=True)
    yield "zero_defaults_clean", zero, "0" * 2600
    yield "zero_defaults_overflow_at_0_and_1500", zero, "1" + "0" * 1499 + "1" + "0" * 1600
    for i in range(3):
        yield f"zero_defaults_random{i}", zero, pattern(rng, 3000, 1500)
    for h, c in itertools.product([1, 2, 3], [False, True]):
        settings = dict(zero, hysteresis=h, consecutive_hysteresis=c, raise_at_min=False)
        yield f"w1000_h{h}_c{int(c)}", settings, pattern(rng, 2500, 1500)
    for w, h, c, (init, low), r in itertools.product([1, 2, 3, 5], [1, 2, 3], [False, True], SCALES, [False, True]):
        settings = dict(init_scale=init, window=w, hysteresis=h, consecutive_hysteresis=c, min_scale=low, raise_at_min=r)
        yield f"w{w}_h{h}_c{int(c)}_init{init}_min{low}_r{int(r)}", settings, pattern(rng, 200, 40)


def growths(t: dict) -> int:
    """How often the scale went up in trace `t`."""
    w = t["width"]
    idx = [t["scale"][i : i + w] for i in range(0, len(t["scale"]), w)]
    vals = [float(t["settings"]["init_scale"])] + [math.ldexp(*t["scales"][decode(i)]) for i in idx]
    return sum(b > a for a, b in zip(vals, vals[1:]))


def decode(d: str) -> int:
    """Inverse of `digits`."""
    n = 0
    for c in d:
        n = n * len(ALPHABET) + ALPHABET.index(c)
    return n


def main() -> None:
    ds_version, torch_version, DynamicLossScaler = setup_deepspeed()
    rng = random.Random(20260519)
    traces = [trace(DynamicLossScaler, *case) for case in cases(rng)]
    doc = dict(deepspeed=ds_version, torch=torch_version, alphabet=ALPHABET, traces=traces)
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    raised = sum(t["raised_at"] is not None for t in traces)
    grew = sum(growths(t) > 0 for t in traces)
    print(f"{OUT}: {len(traces)} traces, {raised} raised at the minimum, {grew} grew, {OUT.stat().st_size} bytes")
    for t in traces:  # the encoding round-trips
        assert len(t["scale"]) == t["width"] * len(t["hysteresis"])


if __name__ == "__main__":
    main()
