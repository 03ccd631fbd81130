"""The `fzero` command line (also `python -m fzero`).

    fzero estimate --params 7.5e9 --world-size 64            # the ZeRO paper's Table 1 row
    fzero estimate --module mypkg.models:make_gpt --world-size 8 --dtype bf16
    fzero estimate --config gpt2.json --world-size 16 --plot mem.png
    fzero estimate --params 14e9 -n 2 --stage 3 --offload-optimizer cpu       # GPU, host and NVMe bytes
    fzero trace --world-size 4 --stage 3 --steps 2                # collectives per step vs the formula
    fzero inspect ckpt/step-100                                    # what a checkpoint holds
    fzero export ckpt/step-100 model.safetensors --dtype bf16     # full params, offline

Each subcommand is one `_add_<name>(subparsers)` function that registers its parser and sets
`func`; `main` dispatches on it, so a new subcommand is one more function in `_SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import math
import os
import sys
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch

from . import estimate as est
from .errors import FzeroError
from .stages import STAGES

LEVELS = tuple(s.level for s in STAGES)


class CliError(Exception):
    """A user-facing error: printed as `fzero <cmd>: error: ...`, exit status 2."""


# ---------------------------------------------------------------------------------------- estimate


def _exact(n: Fraction) -> str:
    return str(n.numerator) if n.denominator == 1 else f"{n.numerator}/{n.denominator}"


def _cell(n: Fraction) -> str:
    return f"{est.human_bytes(n)} ({_exact(n)} B)"


def format_table(estimates: Sequence[est.MemoryEstimate]) -> str:
    """One row per stage: params / grads / optimizer state / master / total per rank."""
    header = ["stage", "params", "grads", "optimizer state", "master", "total"]
    rows = [header] + [
        [str(e.stage), *(_cell(getattr(e, c)) for c in est.CATEGORIES), _cell(e.total)] for e in estimates
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_tiers(estimates: Sequence[est.MemoryEstimate]) -> str:
    """One row per stage: device / host / NVMe totals, and the host's part of each category."""
    header = ["stage", "device", "host", "NVMe", "host: grads", "host: optimizer state", "host: master",
              "host: params", "host: swap buffers"]
    rows = [header] + [
        [str(e.stage), *(est.human_bytes(t) for t in (e.total, e.host.total, e.nvme.total)),
         *(est.human_bytes(getattr(e.host, c)) for c in ("grads", "optimizer_state", "master", "params", "buffers"))]
        for e in estimates
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _load_module(spec: str) -> torch.nn.Module:
    """`PKG.MOD:FACTORY` -> `FACTORY()` built on the meta device (no memory for the weights)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise CliError(f"--module expects PKG.MOD:FACTORY (a callable returning an nn.Module), got {spec!r}")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        here = (isinstance(e, ModuleNotFoundError) and e.name == mod_name.split(".")[0]
                and os.path.exists(os.path.join(os.getcwd(), e.name + ".py")))
        hint = (f" ({e.name}.py is in the current folder, which the `fzero` script does not import from, as "
                f"`python -m fzero` does: run `python -m fzero ...`, or set PYTHONPATH=.)") if here else ""
        raise CliError(f"--module {spec}: cannot load {attr!r} from {mod_name!r}: {e}{hint}") from e
    if not callable(factory):
        raise CliError(f"--module {spec}: {attr!r} is a {type(factory).__name__}, not a callable returning an "
                       f"nn.Module")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory: any failure is a usage error here
        raise CliError(f"--module {spec}: calling {attr}() (with no arguments, on the meta device) raised "
                       f"{type(e).__name__}: {e}; pass a factory that builds the model without arguments") from e
    if not isinstance(model, torch.nn.Module):
        raise CliError(f"--module {spec}: the factory returned a {type(model).__name__}, not an nn.Module")
    return model


def _load_gpt2(path: str) -> torch.nn.Module:
    """A JSON `GPT2Config` -> `GPT2LMHeadModel` on the meta device (needs `transformers`)."""
    try:
        import transformers
    except ImportError as e:
        raise CliError(
            "--config builds a GPT-2 with the `transformers` package, which is not installed (it is not an "
            "fzero dependency): pip install transformers, or pass --params N or --module PKG.MOD:FACTORY"
        ) from e
    try:
        with open(path) as f:
            given = json.load(f)
        _check_gpt2_keys(path, given, transformers.GPT2Config)
        config = transformers.GPT2Config(**given)
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(config)
    except CliError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' validation errors vary by version (found in review)
        raise CliError(f"--config {path}: cannot build a GPT-2 from it: {type(e).__name__}: {e}") from e


# the keys that size a GPT-2 (and their PretrainedConfig aliases): a key close to one of them that
# GPT-2 does not read is a typo that would size the model by the default
_GPT2_SIZES = ("n_layer", "n_embd", "n_head", "n_positions", "n_inner", "vocab_size", "hidden_size",
               "num_hidden_layers", "num_attention_heads", "max_position_embeddings")


def _check_gpt2_keys(path: str, given: Any, config_class: Any) -> None:
    """A `--config` of another model type is refused, and a key GPT-2 does not read that is close
    to one that sizes it (`n_layers` for `n_layer`) is named on stderr: `GPT2Config(**given)` keeps
    any key as an attribute, so a typo or a Llama config estimated a model of GPT-2's defaults,
    silently (found in review of a new user). Other unknown keys are left alone: config files
    carry many that one transformers version lists and another does not (found in review of
    that check: the hub's gpt2-medium and distilgpt2 files were named)."""
    if not isinstance(given, dict):
        raise CliError(f"--config {path}: expected a JSON object of GPT2Config's keys, got {type(given).__name__}")
    kind = given.get("model_type", "gpt2")
    if kind != "gpt2":
        raise CliError(f"--config {path}: model_type {kind!r}; --config builds a GPT-2 only (model_type 'gpt2'); for "
                       f"another model pass --module PKG.MOD:FACTORY (a function returning the torch module) or "
                       f"--params N")
    read = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    typos = {k: near[0] for k in sorted(set(given) - read)
             if (near := difflib.get_close_matches(k, _GPT2_SIZES, n=1, cutoff=0.8))}
    if typos:
        named = ", ".join(f"{k!r} (did you mean {v!r}?)" for k, v in typos.items())
        print(f"fzero estimate: warning: --config {path}: GPT-2 does not read {named}: the model is sized by "
              f"GPT2Config's default there", file=sys.stderr)


def _model_of(args: argparse.Namespace) -> tuple[Any, str]:
    """The `model` argument of `estimate`, and how to name it."""
    if args.params is not None:
        if args.align != 1:
            raise CliError("--align applies to a padded layout (--module or --config); a bare --params count has none")
        return args.params, f"{int(args.params)} parameters (bare count, no padding)"
    model = _load_module(args.module) if args.module is not None else _load_gpt2(args.config)
    source = args.module or args.config
    try:
        count = est.num_params(model)
    except FzeroError as e:  # a module fzero cannot lay out (an int64 parameter): found in review
        raise CliError(f"{'--module' if args.module else '--config'} {source}: {e}") from e
    return model, f"{source}: {count} parameters (padded layout, align {args.align})"


def _units_of(model: Any, prefix: str | None) -> Any:
    """`--units-prefix P`: one unit (so one bucket per dtype) per child of the module's container
    `P` (`fzero.units_by_prefix`), as `from_module(units=...)` would split it; else one unit."""
    if prefix is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise CliError("--units-prefix splits a module into units: use it with --module or --config")
    from .errors import FzeroError
    from .module import units_by_prefix

    try:
        return units_by_prefix(model, prefix)
    except FzeroError as e:
        raise CliError(f"--units-prefix {prefix}: {e}") from e


def _parse_count(text: str) -> float | int:
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0 or value != int(value):  # finite first: int(inf) overflows
        raise argparse.ArgumentTypeError(f"a parameter count must be a finite whole number >= 0, got {text!r}")
    return value


def _parse_dtype(text: str) -> torch.dtype:
    """A floating dtype's name (bf16, fp16, fp32, ...) -> the dtype; else a usage error."""
    try:
        return est.as_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_precision(text: str) -> Any:
    """`COMPUTE[,REDUCE]` (e.g. `bf16` or `bf16,fp32`) -> `fzero.Precision(COMPUTE, REDUCE)`."""
    from .precision import Precision

    parts = text.split(",")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"expected COMPUTE[,REDUCE] such as bf16 or bf16,fp32, got {text!r}")
    try:
        return Precision(*(est.as_dtype(part) for part in parts))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_world_size(text: str) -> int:
    """`-n N`: an int >= 1, else a usage error naming the flag and the value (before: `-n 0`
    reached `estimate`, whose message named no flag)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 (the number of ranks), got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a world size is an int >= 1 (the number of ranks), got {text!r}")
    return n


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1, got {text!r}")
    return sizes


def plot(model: Any, world_sizes: Sequence[int], path: str, title: str, **kwargs: Any) -> str:
    """Total bytes per rank vs world size, one line per stage, log-log, saved to `path`; the path
    written (matplotlib adds its default format's extension to a path with none: found in review,
    the message named the path given)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise CliError("--plot needs matplotlib, which is not installed: pip install 'fzero[plot]'") from e
    try:
        per_size = [est.estimate_stages(model, n, **kwargs) for n in world_sizes]
    except ValueError as e:
        raise CliError(f"--plot-world-sizes {','.join(map(str, world_sizes))}: {e}") from e
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for i, first in enumerate(per_size[0]):  # the stages estimate returned (with an offload: 1-3 or 3)
            ax.plot(world_sizes, [float(stages[i].total) / 1e9 for stages in per_size], marker="o",
                    label=f"stage {first.stage}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size N (ranks)")
        ax.set_ylabel("model-state memory per rank on the device (GB = 1e9 B)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written = path if os.path.splitext(path)[1] else f"{path}.{matplotlib.rcParams['savefig.format']}"
        try:
            fig.savefig(path)
        except OSError as e:
            raise CliError(f"--plot {path}: cannot write it: {e}") from e
        except ValueError as e:  # an extension matplotlib has no writer for ("Format 'txt' is not supported")
            raise CliError(f"--plot {path}: {e}; name a .png, .pdf or .svg file") from e
        return written
    finally:
        plt.close(fig)


def offload_summary(off: est.OffloadSetting, precision: Any = None) -> str:
    """The `offload:` line: what each tier keeps of the offloaded shards."""
    master = "the master" if precision is not None else "the fp32 master"
    host = ["the gradient shards' copies"]
    nvme = []
    if off.optimizer == "cpu":
        host[:0] = [master, "the optimizer state"]
    else:  # nvme: master and state in swap files, read through host buffers
        nvme += [master, "the optimizer state"]
        host.append("the swap files' buffers")
    if off.params == "cpu":
        host.insert(0, "the param shards")
    elif off.params == "nvme":
        nvme.insert(0, "the param shards")
    tiers = f"host: {', '.join(host)}" + (f"; NVMe swap files: {', '.join(nvme)}" if nvme else "")
    return f"offload: optimizer {off.optimizer}, params {off.params or 'on the device'}, ratio {off.ratio} ({tiers})"


def _describe_bytes(args: argparse.Namespace, optimizer: str, estimates: Sequence[est.MemoryEstimate]) -> str:
    """The bytes-per-parameter line: the paper's (one row for every stage), or, with --precision,
    fzero's layout under the policy, stage by stage."""
    head = f"world size {args.world_size}, optimizer {optimizer}"
    if args.precision is None:  # the paper's for adam-mixed, else what fzero.init keeps with no policy
        bpp = est.default_bytes_per_param(optimizer, args.dtype, args.dtype)
        return (f"{head}: bytes per parameter: params {bpp.params}, grads {bpp.grads}, optimizer state "
                f"{bpp.optimizer_state}, master {bpp.master} (K = {bpp.K})")
    rows = []
    for e in estimates:
        bpp, _ = est.policy_bytes_per_param(optimizer, e.stage, args.precision, args.dtype, None, e.offload)
        rows.append(f"stage {e.stage}: params {bpp.params}, grads {bpp.grads}, optimizer state {bpp.optimizer_state}, "
                    f"master {bpp.master}")
    return f"{head}, {args.precision} (fzero's layout): bytes per parameter: " + "; ".join(rows)


def _run_estimate(args: argparse.Namespace) -> int:
    model, what = _model_of(args)
    optimizer = args.optimizer or ("adam" if args.precision is not None else "adam-mixed")
    grad_dtype = args.dtype if args.precision is None else None  # with a policy: its reduce dtype
    kwargs = dict(param_dtype=args.dtype, grad_dtype=grad_dtype, optimizer=optimizer, align=args.align,
                  units=_units_of(model, args.units_prefix), offload_optimizer=args.offload_optimizer,
                  offload_params=args.offload_params, offload_ratio=args.offload_ratio, precision=args.precision)
    try:
        if args.stage is not None:
            estimates = (est.estimate(model, args.world_size, stage=args.stage, **kwargs),)
        else:
            estimates = est.estimate_stages(model, args.world_size, **kwargs)
        described = _describe_bytes(args, optimizer, estimates)
    except (ValueError, FzeroError) as e:  # a module fzero cannot lay out (an int64 parameter): found in review
        raise CliError(str(e)) from e
    off = estimates[0].offload
    print(f"model: {what}")
    print(described)
    if off.optimizer is not None:
        print(offload_summary(off, args.precision))
    print("per rank, model states only, on the device (GB = 1e9 B; exact bytes in parentheses):")
    print(format_table(estimates))
    if off.optimizer is not None:
        print("per rank, device / host (CPU RAM) / NVMe (per node: times the ranks on the node):")
        print(format_tiers(estimates))
        if off.optimizer == "nvme" and args.params is not None:
            print("swap buffers: not counted for a bare count (they hold the largest bucket's state: --module or "
                  "--config gives the buckets)")
    if args.plot:
        print(f"plot written to {plot(model, args.plot_world_sizes, args.plot, f'{what}, {optimizer}', **kwargs)}")
    return 0


def _add_estimate(sub: Any) -> None:
    p = sub.add_parser(
        "estimate",
        help="per-rank memory of params, grads, optimizer state and master weights for ZeRO stages 0-3",
        description="Per-rank bytes of model state for ZeRO stages 0-3 (see proofs/memory.md).",
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=_parse_count, help="a parameter count, e.g. 7.5e9 (no padding)")
    model.add_argument("--module", metavar="PKG.MOD:FACTORY", help="a callable returning an nn.Module (built on meta)")
    model.add_argument("--config", metavar="FILE.json", help="a GPT2Config as JSON (needs transformers)")
    p.add_argument("--world-size", "-n", type=_parse_world_size, required=True,
                   help="N, the data-parallel (shard) size")
    p.add_argument("--stage", type=int, choices=LEVELS, help="print this stage only")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                   help="dtype of params and grads (with --precision: of the held params, default fp32)")
    p.add_argument("--optimizer", choices=est.OPTIMIZERS,
                   help="default: the ZeRO paper's mixed-precision Adam, 'adam-mixed' (K = 12: bf16 params beside an "
                        "fp32 master at every stage; fzero keeps that with a bf16 or fp16 fzero.Precision at stages "
                        "1-2 only: --precision gives its layout); 'adam': fp32 throughout (K = 8), the default with "
                        "--precision")
    p.add_argument("--precision", type=_parse_precision, metavar="COMPUTE[,REDUCE]",
                   help="estimate what fzero keeps under fzero.Precision(COMPUTE, REDUCE), e.g. bf16,fp32: a "
                        "COMPUTE copy beside the master at stages 1-2 (and with the optimizer offloaded), the held "
                        "params alone (the master, cast when gathered) at stages 0 and 3; grads are held in the held "
                        "params' dtype (--dtype), REDUCE (default COMPUTE) being the dtype they are reduced in")
    p.add_argument("--align", type=int, default=1, help="shard length multiple (module/config only)")
    p.add_argument("--units-prefix", metavar="PREFIX",
                   help="one unit per child of this container, e.g. transformer.h (module/config only; default: one "
                        "unit): the buckets NVMe swap buffers are sized by")
    p.add_argument("--offload-optimizer", choices=("cpu", "nvme"),
                   help="the optimizer's shard (master, state) in host memory, or both in NVMe swap files")
    p.add_argument("--offload-params", choices=("cpu", "nvme"),
                   help="stage 3's param shards in host memory, or (nvme, with --offload-optimizer nvme) in swap files")
    p.add_argument("--offload-ratio", type=float, default=1.0,
                   help="the fraction r of the trainable elements whose optimizer state is offloaded, in whole "
                        "buckets (default 1; DeepSpeed's ratio)")
    p.add_argument("--plot", metavar="OUT.png", help="plot bytes per rank vs world size (needs matplotlib)")
    p.add_argument(
        "--plot-world-sizes",
        type=_parse_sizes,
        default=[2**k for k in range(11)],
        metavar="N1,N2,...",
        help="x values of --plot (default 1,2,4,...,1024)",
    )
    p.set_defaults(func=_run_estimate)


# ------------------------------------------------------------------------------------------- trace


def format_comm(volume: Any, title: str) -> str:
    """Per op: count, logical elements, bytes, ring wire bytes sent per rank (one step)."""
    header = ["op", "count", "elements", "bytes", "wire bytes / rank"]
    rows = [header]
    for kind, totals in (("", volume.data), (" (control)", volume.control)):
        for op, t in totals.items():
            rows.append([op + kind, str(t.count), str(t.elements), str(t.bytes), _exact(Fraction(t.wire_bytes))])
    rows.append(["total (data)", str(volume.count), str(volume.elements), str(volume.bytes),
                 _exact(Fraction(volume.wire_bytes))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return title + "\n" + "\n".join(lines)


def _run_trace(args: argparse.Namespace) -> int:
    import fzero
    from fzero import optim

    from . import accounting as acc

    _check_trace_size(args)
    n, d, k = args.world_size, args.width, args.blocks
    gen = torch.Generator().manual_seed(0)
    params = {f"block{i}": {"w": torch.randn(d, d, generator=gen) / d**0.5, "b": torch.zeros(d)} for i in range(k)}

    def loss_fn(p: Any, x: torch.Tensor) -> torch.Tensor:
        for i in range(k):
            x = torch.tanh(x @ p[f"block{i}"]["w"] + p[f"block{i}"]["b"])  # (B, d)
        return x.square().mean()

    mesh, opt = fzero.SimMesh(n), optim.adam(lr=1e-3)
    logs: list[Any] = []

    def rank_fn(x: torch.Tensor) -> Any:
        s = fzero.init(params, opt, stage=args.stage, mesh=mesh, units=lambda path: path.split(".")[0])
        step = fzero.train_step(loss_fn)
        with mesh.record() as log:
            for _ in range(args.steps):
                s, _ = step(s, x)
        logs.append(log)
        return s.layout

    batches = [(torch.randn(args.batch, d, generator=gen),) for _ in range(n)]
    layout = mesh.run(rank_fn, batches)[0]
    got = acc.comm_volume(logs[0], n, steps=args.steps)
    want = acc.expected_comm(layout, n, args.stage, mesh=mesh)
    psi = sum(b.numel for b in layout.buckets)
    print(f"model: {k}-block MLP, width {d}, {psi} parameters in {len(layout.buckets)} buckets; SimMesh({n}), "
          f"stage {args.stage}, adam, {args.steps} steps")
    print(format_comm(got, "recorded, per step, one rank (wire bytes: ring model):"))
    print(format_comm(want, "formula (expected_comm, no backward re-gather, as fzero runs):"))
    if got.data == want.data:
        print("recorded data collectives: matches the formula")
        return 0
    print("recorded data collectives: MISMATCH with the formula")
    return 1


TRACE_MAX_ELEMENTS = 2**26  # N·(Ψ + batch·d) fp32 elements: SimMesh keeps every rank's state in this process


def _check_trace_size(args: argparse.Namespace) -> None:
    """Every count >= 1, and a model small enough to simulate in one process: N ranks' copies of
    Ψ = blocks·(d² + d) params and a batch of batch·d inputs, at most `TRACE_MAX_ELEMENTS` elements
    (each costs about 20 bytes in params, grads, Adam moments and flat buffers)."""
    for flag, value in (("--world-size", args.world_size), ("--steps", args.steps), ("--width", args.width),
                        ("--blocks", args.blocks), ("--batch", args.batch)):
        if value < 1:
            raise CliError(f"{flag} must be >= 1, got {value}")
    psi = args.blocks * (args.width**2 + args.width)
    elements = args.world_size * (psi + args.batch * args.width)
    if elements > TRACE_MAX_ELEMENTS:
        raise CliError(f"--width {args.width} --blocks {args.blocks} --batch {args.batch} -n {args.world_size}: "
                       f"{args.world_size} simulated ranks of a {psi}-parameter MLP hold {elements} elements in this "
                       f"process, over trace's limit of {TRACE_MAX_ELEMENTS}; trace checks the collectives of a small "
                       f"model: use a smaller --width, --blocks, --batch or --world-size")


def _add_trace(sub: Any) -> None:
    p = sub.add_parser(
        "trace",
        help="run a small MLP on a simulated mesh and print its collectives per step against the formula",
        description="Record the collectives of a few train steps of a built-in MLP on SimMesh(N) and compare "
        "them with fzero's communication formula (see proofs/communication.md).",
    )
    p.add_argument("--world-size", "-n", type=int, default=4, help="N, simulated ranks (default 4)")
    p.add_argument("--stage", type=int, choices=LEVELS, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--blocks", type=int, default=4, help="MLP blocks, one unit each (default 4)")
    p.add_argument("--width", type=int, default=16, help="hidden width d (default 16)")
    p.add_argument("--batch", type=int, default=4, help="examples per rank (default 4)")
    p.set_defaults(func=_run_trace)


# -------------------------------------------------------------------------------- checkpoints


def _run_inspect(args: argparse.Namespace) -> int:
    from . import checkpoint as ckpt

    try:
        print(ckpt.summary(args.checkpoint))
    except ckpt.CheckpointError as e:
        raise CliError(str(e)) from None
    return 0


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="print a checkpoint's step, world size, stage, optimizer, leaves and bytes",
                       description="Read a checkpoint's manifest and DCP metadata (fzero.checkpoint.save), offline, "
                       "and print what it holds.")
    p.add_argument("checkpoint", help="a checkpoint folder, root/step-<n>")
    p.set_defaults(func=_run_inspect)


def _run_export(args: argparse.Namespace) -> int:
    from . import checkpoint as ckpt

    inside = os.path.realpath(args.out).startswith(os.path.realpath(args.checkpoint).rstrip(os.sep) + os.sep)
    if inside:  # it would replace a file of the checkpoint (its manifest: found in review), or sit among them
        raise CliError(f"cannot write {args.out!r}: it is inside the checkpoint {args.checkpoint!r}; write the "
                       f"export outside it")
    if os.path.isdir(args.out) or args.out.endswith(("/", os.sep)):  # (found in review: "Not a directory" for "dir/")
        raise CliError(f"cannot write {args.out!r}: it is a folder; name the file to write, e.g. "
                       f"{os.path.join(args.out, 'model.safetensors')!r}")
    try:
        tensors = ckpt.export(args.checkpoint, dtype=args.dtype)
    except ckpt.CheckpointError as e:
        raise CliError(str(e)) from None
    manifest = ckpt.read_manifest(args.checkpoint)
    try:
        ckpt.save_safetensors(tensors, args.out, {"format": "pt", "fzero_step": str(manifest["step"])})
    except ckpt.CheckpointError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot write {args.out!r}: {e.strerror or e}") from None
    print(f"wrote {args.out}: {len(tensors)} tensors, step {manifest['step']}")
    return 0


def _add_export(sub: Any) -> None:
    p = sub.add_parser("export", help="write a checkpoint's full params as a safetensors file, offline",
                       description="Assemble every leaf's master values from a checkpoint's DCP chunks (no "
                       "process group needed, any world size saved at) and write them as OUT.safetensors, each "
                       "tensor once.")
    p.add_argument("checkpoint", help="a checkpoint folder, root/step-<n>")
    p.add_argument("out", help="the .safetensors file to write")
    p.add_argument("--dtype", type=_parse_dtype,
                   help="cast every floating tensor to this dtype (bf16, fp16, fp32, fp64), as module.to(dtype) "
                        "does: the params and the floating buffers (BatchNorm's running statistics); integer buffers "
                        "(num_batches_tracked) stay as saved; default: everything as saved")
    p.set_defaults(func=_run_export)


_SUBCOMMANDS = (_add_estimate, _add_trace, _add_inspect, _add_export)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fzero", description="fzero: ZeRO stages 0-3 as pure functions.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run `fzero ARGV...`; returns the exit status (argparse errors exit with status 2)."""
    p = parser()
    args = p.parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit (a pipe's stdout is block-buffered)
        return rc
    except CliError as e:
        print(f"fzero {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`fzero inspect CKPT | head -1`): Python's recipe, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
