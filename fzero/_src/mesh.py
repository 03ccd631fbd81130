"""Meshes: where ranks live and how their collectives move data.

One interface, two backends:

- `SimMesh(N)`: N virtual ranks in one process, as threads of which exactly one runs at a time.
  A rank runs until it calls a collective, then hands over to the next rank; the last rank to
  arrive computes the result, reducing in rank order (0, 1, ..., N-1), and rank 0 resumes. Each
  rank has its own torch RNG state, swapped in whenever the rank resumes, and runs under the
  caller's thread-local modes (autocast, grad mode, ...: `ThreadModes`). Deterministic: the
  same program gives the same bits on every run. CPU tensors only (on CUDA, autograd's device
  thread would run every rank's backward).
- `DistMesh()`: one rank per process of a `torch.distributed` process group started by
  `torchrun`: gloo on CPU or NCCL on GPU, asked for (`backend=`, `device=`, `$FZERO_BACKEND`) or
  the default (NCCL when CUDA has one device per local process; never a silent switch to gloo).
  A rank whose peer's process dies raises `RankFailed` naming it instead of waiting.

Both expose the shard-axis size `world_size`, the running `rank`, `run(fn, per_rank_args)`, and
the backend primitive `collective(op, x, ...)` that `fzero._src.collectives` dispatches to. Every
collective passes through `Mesh.collective`, which checks that ranks agree, records it for the
accounting hooks (`Mesh.record`) and only then moves data. Every mesh has a process-wide `id`
(a creation counter) in its repr, so that two meshes of one size read differently in messages.
"""

from __future__ import annotations

import abc
import collections
import atexit
import contextlib
import dataclasses
import datetime
import itertools
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .eager import eager
from .errors import CollectiveMismatch, MeshError, RankFailed, said
from .layout import check_world_size

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
REDUCTIONS = ("sum", "max")


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as one rank called it.

    `rank` is the caller's rank; `op` one of "all_gather", "reduce_scatter", "all_reduce",
    "broadcast"; `reduce` the reduction ("sum", or "max" for an all-reduce; None for all_gather and
    broadcast); `dtype` the tensor's. `elements` counts the whole logical buffer: `N * S` for
    all_gather (output) and reduce_scatter (input), the tensor's numel for all_reduce and broadcast.
    `bytes` is `elements * itemsize`. `tag` names what moved (e.g. a bucket's tag) or is None.
    """

    rank: int
    op: str
    reduce: str | None
    dtype: torch.dtype
    elements: int
    bytes: int
    tag: str | None


@dataclasses.dataclass(frozen=True)
class _Call:
    """What a rank asks of a collective: compared across ranks before any data moves."""

    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    arg: str | int | None  # reduction op, or broadcast source
    tag: str | None
    grad: bool = False  # whether this rank's call has a backward, a collective too (`collectives.has_backward`)
    phase: str | None = None  # the rank's `Mesh.phase` label at the call (a step's micro-batch), or None

    def __str__(self) -> str:
        arg = "" if self.arg is None else f", {self.arg}"
        tag = "" if self.tag is None else f", tag={self.tag!r}"
        grad = ", requires_grad" if self.grad else ""
        phase = "" if self.phase is None else f" [{self.phase}]"
        return f"{self.op}({str(self.dtype).removeprefix('torch.')}{list(self.shape)}{arg}{tag}{grad}){phase}"


def _describe(op: str, x: torch.Tensor, arg: Any, tag: str | None, grad: bool = False,
              phase: str | None = None) -> _Call:
    return _Call(op, x.dtype, tuple(x.shape), arg, tag, grad, phase)


_ENTRIES = (("fzero.checkpoint/", "fzero.checkpoint.save / load"), ("fzero.gather", "fzero.gather"),
            ("fzero.init/", "fzero.init"))  # tag prefix, the call (not evaluate's paths: a rank that read fewer units)


def entry_of(call: str) -> str | None:
    """The fzero call every rank must make (`fzero.checkpoint.save / load`, `fzero.gather`, ...)
    that a mismatch line's collective (`op(dtype[shape], tag='...')`) belongs to, or None."""
    return next((name for prefix, name in _ENTRIES if f"tag='{prefix}" in call), None)


EVALUATING = "evaluate"  # the `Mesh.phase` label of `fzero.evaluate`'s collectives
_LABEL = re.compile(r"\) \[([^\]]*)\]")  # a call's `Mesh.phase` label in its words (`_Call.__str__`)


def _labels_alone(calls: Sequence[str]) -> str:
    """Where the calls differ only in their `Mesh.phase` labels (the same op, dtype, shape and tag
    made inside `fzero.evaluate` on some ranks, outside it on others): which rank made it where,
    and the way out; else "". Found in review: rank 0's evaluation of a donated state, alone,
    met the other ranks' `fzero.gather` at the same check of the state and was told to call the
    same op with the same dtype, shape and tag, which it did."""
    labels = _labels(calls)
    if len(set(labels)) < 2 or len({unlabelled(c) for c in calls}) != 1:
        return ""
    named = {label: "fzero.evaluate" if label == EVALUATING else label for label in labels if label}
    where = "; ".join(f"rank(s) {[r for r, x in enumerate(labels) if x == label]} "
                      + (f"in {named[label]}" if label else f"outside {' and '.join(dict.fromkeys(named.values()))}")
                      for label in sorted(dict.fromkeys(labels), key=lambda x: x is None))  # the labelled first
    return (f"the calls are the same but made in different parts of the ranks' programs: {where}."
            f"{evaluating_words(calls)}")


def _labels(calls: Sequence[str]) -> list[str | None]:
    """Each call's `Mesh.phase` label, or None."""
    return [m.group(1) if (m := _LABEL.search(c)) else None for c in calls]


def unlabelled(call: str) -> str:
    """A call in words without its `Mesh.phase` label and DistMesh's " collective #n"."""
    return re.sub(r" collective #\d+$", "", _LABEL.sub(")", call))


def evaluating_words(calls: Sequence[str]) -> str:
    """Where some ranks' calls are `fzero.evaluate`'s and others' not: which, and the way out; else
    "" (a rank evaluating alone, a logging branch, whose call met another rank's `fzero.gather` or
    `checkpoint.save`: found in review, the words blamed the save alone)."""
    labels = _labels(calls)
    inside = [r for r, label in enumerate(labels) if label == EVALUATING]
    if not inside or len(inside) == len(labels):
        return ""
    return (f" Rank(s) {inside} were in fzero.evaluate and the others not: every rank calls fzero.evaluate at "
            f"the same point of its program, as it does each step (an evaluation on rank 0 alone, a logging "
            f"branch, meets the other ranks' next call).")


def _advice(op: str, grads: list[bool] | None, calls: Sequence[str] = ()) -> str:
    """The way out of a collective mismatch; `grads`: each rank's `_Call.grad` where the calls
    differ in that alone, else None; `calls`: each rank's call in words, where the ranks in one of
    fzero's calls every rank must make are named (found in a new user's walkthrough: a
    `checkpoint.save` under `if rank == 0:`, the DDP habit, was told only to call the same op),
    and calls that differ in their labels alone are said to (`_labels_alone`)."""
    if grads is None and (labelled := _labels_alone(calls)):
        return labelled
    if grads is None:
        entries = {r: name for r, c in enumerate(calls) if (name := entry_of(c))}
        alone = "".join(f"; rank {r} is in {_every_rank_calls(name)}"
                        for r, name in entries.items()) if len(entries) < len(calls) else ""
        return f"every rank must call the same op with the same dtype, shape and tag{alone}.{evaluating_words(calls)}"
    on, off = [r for r, g in enumerate(grads) if g], [r for r, g in enumerate(grads) if not g]
    receives = " (a rank that only receives too: `torch.empty_like(x).requires_grad_()`)" if op == "broadcast" else ""
    return (f"the calls differ only in requires_grad: rank(s) {on} differentiate through this {op} (its input "
            f"requires grad, under grad mode; inside torch.func.grad / vjp: it depends on the differentiated "
            f"input), rank(s) {off} do not. Its backward is a collective that every rank must join, and a rank "
            f"whose input does not require grad never runs it: make the input require grad on every "
            f"rank{receives}, or on none (`x.detach()`)")


def _every_rank_calls(name: str) -> str:
    """`name` (one of fzero's calls every rank must make, `entry_of`), and why a rank waits in it."""
    return (f"{name}, which every rank must call at the same point of its program (not under `if rank == 0:`: "
            f"each rank saves, loads or gathers its own part)")


def _waits_in(what: str, rank: int) -> str:
    """`"; rank r waits in <call>, which every rank must call ..."` where `what` (a collective in
    words, `_Call`'s) belongs to one of fzero's calls every rank must make (`entry_of`), else "".
    A timeout's words (`DistMesh._lost`): found in review, rank 0 in `checkpoint.save` while rank
    1 still evaluated (alive, elsewhere) was told only of an all-gather with a tag."""
    name = entry_of(what)
    return f"; rank {rank} waits in {_every_rank_calls(name)}" if name else ""


def _exited_without(what: str, who: str) -> str:
    """The two reasons a peer leaves while this rank waits in `what` (a collective in words,
    `_Call`'s), each with its way out: `who` (the rank, in words) died, or finished its program
    without making the call (named where it is one of fzero's calls every rank must make,
    `entry_of`). Found in a new user's walkthrough: a `checkpoint.save` under `if rank == 0:` (the
    DDP habit) after the loop, where rank 1 had returned from its script, was told only that
    rank 1 was lost and to restart the job."""
    name = entry_of(what)
    call = _every_rank_calls(name) if name else "this collective, which every rank must call, in the same order"
    return (f"{who} either died (a crash or a kill: see its log): restart the job (every rank: a new torchrun, "
            f"or torchrun --max-restarts) and resume from fzero.checkpoint.latest(root); or finished its program "
            f"(returned or exited normally) without calling {call}: make that call on every rank")


_CLOSED = ("closed", "reset by peer", "broken pipe", "remote process exited", "network error", "end of file")


def _closed(e: BaseException) -> bool:
    """Whether the backend's words say a connection to a peer closed (gloo's "Connection closed by
    peer", NCCL's "remote process exited or there was a network error"): a peer left, so
    `_exited_without`'s two reasons apply. Not for this rank's own failures (a local CUDA out of
    memory in the collective's copy), which were told of a peer that left (found in review)."""
    words = said(e).lower()
    return any(w in words for w in _CLOSED)


def _interrupted(mesh: "DistMesh", e: BaseException, what: str) -> MeshError:
    """The error a `DistMesh` raises for every collective after an interrupt `e` stopped this rank
    in `what`'s agreement or start (`DistMesh._break_if_interrupted`)."""
    told = f": {words}" if (words := said(e)) else ""
    return MeshError(
        f"{mesh!r}: rank {mesh.rank} was interrupted ({type(e).__name__}{told}) in {what}, while agreeing on it "
        f"with the other ranks or starting it (world size {mesh.world_size}); they may have gone on past it, so "
        f"this rank's collectives would now meet theirs out of step (a wait to the timeout, or buffers mixed "
        f"silently). The mesh cannot be used again: construct a new DistMesh on every rank, or restart the job")


def _elements(op: str, x: torch.Tensor, world_size: int) -> int:
    return x.numel() * world_size if op == "all_gather" else x.numel()


_MESH_IDS = itertools.count(1)
_ABANDONED = 64  # the started collectives a `DistMesh` keeps unwaited after errors (`DistMesh.abandon`)
_TAG_KEYS = 4096  # the distinct collectives a `DistMesh` counts exchanges of in one era (`DistMesh._p2p_tag`)
_NEXT_ORDINAL = [0]  # the ordinal this process proposes for its next `DistMesh` (`DistMesh._ordinal`)
_CONSTRUCTED = [0]  # how many DistMesh this process constructed (`_lost`'s words; the ordinal is the ranks' max)


class Mesh(abc.ABC):
    """The shard axis of a device mesh. `world_size` ranks; `rank` is the one running now.

    `id` numbers the meshes of this process in creation order (1, 2, ...); it shows in the repr.
    """

    device = torch.device("cpu")  # where the mesh's own small tensors (fingerprints, flags) live

    def __init__(self, world_size: int) -> None:
        self.world_size = check_world_size(world_size)
        self.id = next(_MESH_IDS)
        self._recorders: list[list[CollectiveRecord]] = []
        self._phases: dict[int, str] = {}  # rank -> its current `phase` label, where it has one

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """The rank whose code is running now."""

    @property
    def all_reduce_is_reduce_scatter_gather(self) -> bool:
        """Whether a sum `all_reduce(x)` of `x[N * S]` has, on every rank, exactly the bits of
        `all_gather(reduce_scatter(x))` on this mesh, for every float dtype and every input.

        The base claim is N <= 2, for any backend: over one rank both are `x`; over two, each
        element is one correctly rounded addition of the same two values, and `a + b == b + a`
        exactly, so the order the backend adds in cannot matter (a NaN's payload aside, which only
        a non-finite term makes; a step never uses the reduced gradient of a non-finite one).
        SimMesh (any N: both reduce through one accumulator in rank order) and DistMesh over gloo
        (any N: gloo's reduce-scatter is its all-reduce of the whole buffer, then this rank's
        chunk) say more. Where it holds, stage 0 reduces each bucket with one all-reduce instead of a
        reduce-scatter and an all-gather: the same bits, one collective (proofs/communication.md,
        "One all-reduce for stage 0")."""
        return self.world_size <= 2

    @property
    def asynchronous(self) -> bool:
        """Whether `start` returns before its collective is done, so that work issued between
        `start` and `wait` overlaps it (DistMesh over more than one rank; SimMesh completes a
        collective before `start` returns, and over one rank nothing moves). Stage 3's default
        prefetch reads it (`train_step(prefetch=None)`)."""
        return False

    @property
    def starts_agreed(self) -> bool:
        """Whether every rank has called a collective once its `start` returns (SimMesh: the
        collective is done; a verifying DistMesh: the ranks exchanged its fingerprint first), so
        that waiting for it cannot wait for a rank that never started it. A rank that raised
        waits for the gathers it started ahead only where this holds (`Gathering.finish`): over
        `DistMesh(verify=False)` its peers may have raised before reaching them, and the wait
        would last to the process group's timeout (found in review)."""
        return not self.asynchronous

    def waits_after(self, error: BaseException) -> bool:
        """Whether a rank that raised `error` may wait for the collectives it started and left
        unwaited: where every rank started them (`starts_agreed`), and not after the mesh's own
        error (`MeshError`: a lost or stuck rank, after which a wait may never end) nor an
        interrupt (any BaseException that is not an Exception). What it does not wait for, it
        hands to `abandon` (`Gathering.finish`, and `unit.settle_flights` for `Inflight.settle`,
        `reduce.reduce` and `update.update`)."""
        return self.starts_agreed and isinstance(error, Exception) and not isinstance(error, MeshError)

    def abandon(self, pending: Any) -> None:
        """Keep `pending` (a started collective, or what holds some) that this rank will not wait
        for, where dropping it would cancel it (`DistMesh.abandon`); here: nothing to keep."""

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], per_rank_args: Sequence[Any] | Callable[[int], Any] = ()) -> list[Any]:
        """Run `fn(*args_r)` on every rank r this process runs (all N on SimMesh, its own on
        DistMesh); return their results in rank order.

        `per_rank_args` is a sequence of N argument tuples (indexed by rank), or a callable
        `rank -> tuple`, or `()` for no arguments. If any rank raises, every rank stops (none
        hangs): on a SimMesh `run` raises that rank's exception (the first rank's own, where
        several raised: the others stopped with `RankFailed` at their next collective); on a
        DistMesh the rank that raised raises its own exception, and the others `RankFailed` naming
        it, at their next collective (found in review: this said "that rank's exception" for both).
        """

    @abc.abstractmethod
    def _exchange(self, call: _Call, x: torch.Tensor) -> torch.Tensor:
        """Backend primitive: run `call` with this rank's `x`, after ranks agreed on `call`."""

    @contextlib.contextmanager
    def record(self) -> Iterator[list[CollectiveRecord]]:
        """Record every collective called while the context is open (all local ranks)."""
        log: list[CollectiveRecord] = []
        self._recorders.append(log)
        try:
            yield log
        finally:
            self._recorders.remove(log)

    @contextlib.contextmanager
    def phase(self, label: str | None) -> Iterator[None]:
        """Label the collectives the running rank calls inside (`label`, e.g. "micro-batch 1 of 2"; None:
        none): ranks compare the label with the rest of the call (SimMesh: `_Call`; DistMesh: in the
        fingerprint's tag crc) and show it in a mismatch's words (`... tag='a') [micro-batch 1 of 2]`),
        but `record` logs the tag alone. So calls alike in all else, made in different phases --
        a step's micro-batches, where one rank's loss read no unit in micro-batch 0 and its units
        of micro-batch 1 would meet another rank's of micro-batch 0 -- raise `CollectiveMismatch`
        on every rank instead of pairing. Nested phases replace the label; leaving restores it."""
        rank = self.rank
        before = self._phases.get(rank)
        self._set_phase(rank, label)
        try:
            yield
        finally:
            self._set_phase(rank, before)

    def _set_phase(self, rank: int, label: str | None) -> None:
        if label is None:
            self._phases.pop(rank, None)
        else:
            self._phases[rank] = label

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Wrap one rank's part of a multi-rank computation: if it raises an exception of its own
        (any but a MeshError every rank raised together, `_is_shared`), the other ranks are told
        (`_announce`: SimMesh; DistMesh with `verify=True`) so they stop with `RankFailed` instead
        of waiting, also where the rank catches its error and goes on; once (`_told`: an
        enclosing guard announced it already)."""
        try:
            yield
        except BaseException as e:
            if not _is_shared(e) and not self._told(e):
                self._announce(e)
            raise

    def _told(self, e: BaseException) -> bool:
        """Whether the other ranks were told of `e` already (`guard`)."""
        return True

    def _announce(self, e: BaseException) -> None:
        """Tell the other ranks of this rank's exception `e` (`guard`): nothing here."""

    @eager  # dynamo never traces a mesh (locks, condition variables, process groups)
    def collective(self, op: str, x: torch.Tensor, *, arg: Any = None, tag: str | None = None,
                   grad: bool = False) -> torch.Tensor:
        """The one entry point of every collective: validate, record, agree, move.

        Shapes: all_reduce / broadcast `x[...] -> [...]`; all_gather `x[S, ...] -> [N * S, ...]`;
        reduce_scatter `x[N * S, ...] -> [S, ...]` (rank r gets rows `[r * S, (r + 1) * S)`).
        `grad`: whether this rank will run the collective's backward (a differentiable collective
        whose input requires grad); ranks must agree on it as on the rest of the call.
        """
        return self._exchange(*self._enter(op, x, arg, tag, grad))

    @eager
    def solo(self, op: str, x: torch.Tensor, *, arg: Any = None, tag: str | None = None) -> torch.Tensor:
        """At world size 1: `collective(op, x)` validated and recorded, returning `x` itself (over one
        rank every collective is the identity). The caller guarantees that nothing writes or frees
        `x` while the result is used, as the copy `collective` makes would allow."""
        if self.world_size != 1:
            raise MeshError(f"{op} (tag {tag!r}): Mesh.solo is the world-size-1 form, this mesh has {self.world_size}")
        self._enter(op, x, arg, tag)
        return x

    @eager
    def start(self, op: str, x: torch.Tensor, *, arg: Any = None, tag: str | None = None,
              donate: bool = False, out: torch.Tensor | None = None) -> "Pending":
        """`collective` without waiting, where the backend allows: `start(...).wait()` is
        `collective(...)`, the same bits. DistMesh issues the operation and returns at once (NCCL
        runs it on its own stream, gloo on its own threads); SimMesh completes it before
        returning. Every rank must start the same collectives in the same order and wait for each
        before reading its result; between start and wait, `x` must not be written.

        `donate`: the caller hands `x` over and never reads it again, so an all-reduce or a
        broadcast runs in `x`'s own storage and returns it (DistMesh: no copy of `x`; SimMesh: the
        result copied into `x`); the bits are the same.

        `out` (all-gather only): a contiguous `[N * S, ...]` tensor of `x`'s dtype and device that
        the result is written into and returned as (DistMesh gathers into it, no copy; SimMesh
        copies the result there); nothing may read it before the wait."""
        call, data = self._enter(op, x, arg, tag)
        if out is not None:
            with found_here():
                self._check_out(op, data, out, tag)
        return self._start(call, data, donate=donate, out=out)

    def _check_out(self, op: str, x: torch.Tensor, out: torch.Tensor, tag: str | None) -> None:
        where = f" (tag {tag!r})" if tag else ""
        want = (self.world_size * x.shape[0], *x.shape[1:])
        if op != "all_gather":
            raise MeshError(f"{op}{where}: out= is for all_gather only")
        if tuple(out.shape) != want or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise MeshError(f"all_gather{where}: out must be a contiguous {list(want)} {x.dtype} tensor on {x.device} "
                            f"(world size {self.world_size}), got {list(out.shape)} {out.dtype} on {out.device}"
                            f"{'' if out.is_contiguous() else ', not contiguous'}")

    def _enter(self, op: str, x: torch.Tensor, arg: Any, tag: str | None,
               grad: bool = False) -> tuple[_Call, torch.Tensor]:
        """Validate and record one collective: `(its description, the contiguous data to move)`."""
        with found_here():
            self._validate(op, x, arg, tag)
        rank = self.rank
        call = _describe(op, x, arg, tag, grad, self._phases.get(rank))
        elements = _elements(op, x, self.world_size)
        for log in self._recorders:
            log.append(CollectiveRecord(rank, op, arg if op == "all_reduce" else None, x.dtype,
                                        elements, elements * x.element_size(), tag))
        return call, x.detach().contiguous()

    def _start(self, call: _Call, x: torch.Tensor, donate: bool = False,
               out: torch.Tensor | None = None) -> "Pending":
        """Backend primitive of `start`: by default the blocking `_exchange`, already complete. A
        donated all-reduce or broadcast returns its result in `x`'s own storage, as DistMesh's
        does, so a caller that read a buffer after donating it reads the result here too (SimMesh
        is where the tests run); an all-gather with `out` returns the result copied into it."""
        result = self._exchange(call, x)
        if donate and call.op in ("all_reduce", "broadcast"):
            return Pending(x.copy_(result))
        return Pending(result if out is None else out.copy_(result))

    def _validate(self, op: str, x: torch.Tensor, arg: Any, tag: str | None) -> None:
        where = f" (tag {tag!r})" if tag else ""
        if op not in OPS:
            raise MeshError(f"unknown collective {op!r}; expected one of {OPS}")
        if not isinstance(x, torch.Tensor):
            raise MeshError(f"{op}{where}: expected a tensor, got {type(x).__name__}")
        if op == "all_reduce" and arg not in REDUCTIONS:
            raise MeshError(f"all_reduce{where}: reduction must be one of {REDUCTIONS}, got {arg!r}")
        if op == "broadcast" and not (isinstance(arg, int) and 0 <= arg < self.world_size):
            raise MeshError(f"broadcast{where}: source rank {arg!r} is outside world size {self.world_size}")
        if op in ("all_gather", "reduce_scatter") and x.dim() == 0:
            raise MeshError(f"{op}{where}: needs a tensor with a dim 0, got a 0-d tensor")
        if op == "reduce_scatter" and x.shape[0] % self.world_size:
            raise MeshError(
                f"reduce_scatter{where}: dim 0 of {list(x.shape)} is not divisible by world size "
                f"{self.world_size}; pad it to a multiple of {self.world_size} (fzero.layout.plan does)"
            )


class Pending:
    """A collective in flight (`Mesh.start`): `wait()` returns its result, the same tensor on
    every call. `work` is the backend's handle (None: already complete); `lost(error)` turns a
    failure seen while waiting into the mesh's error; `abandon(self)` is the mesh's `abandon`,
    to which an interrupted wait hands this collective (`wait`)."""

    def __init__(self, out: torch.Tensor, work: Any = None, keep: Any = None,
                 lost: Callable[[BaseException], BaseException] | None = None,
                 abandon: Callable[["Pending"], None] | None = None) -> None:
        self._out, self._work, self._keep, self._lost, self._abandon = out, work, keep, lost, abandon

    @property
    def result(self) -> torch.Tensor:
        """The tensor `wait()` returns, without waiting: pass it on, but read it only after `wait()`."""
        return self._out

    @property
    def holds_more(self) -> bool:
        """Whether, until waited, this keeps a tensor besides its result (the collective's input,
        where the result is not written into it): what `wait()` lets go."""
        return self._keep is not None and self._keep is not self._out

    @property
    def done(self) -> bool:
        """Whether `wait()` has returned (or the collective completed when started)."""
        return self._work is None

    @property
    def cancelled_if_dropped(self) -> bool:
        """Whether freeing this unwaited collective cancels it: gloo's point-to-point exchanges
        (DistMesh's all-gather and reduce-scatter at N = 2), whose peer then waits out the
        timeout. A backend's own collective (gloo's all-reduce, every NCCL one) runs to the
        end whoever holds its handle (`DistMesh.abandon`)."""
        return getattr(self._work, "point_to_point", False)

    @eager
    def wait(self) -> torch.Tensor:
        """The result, once the collective is done. A wait that fails (`RuntimeError`: a lost or
        stuck peer) raises `lost`'s error, and this is done: the mesh is unusable. A wait that
        something interrupts (anything else: a `KeyboardInterrupt`, an exception a signal handler
        raised) leaves this not done, its handle and input held, and hands it to `abandon` before
        the interrupt goes on: the collective was issued on every rank, so the ranks are still in
        step (the mesh stays usable, unlike after an interrupt in the agreement or the start,
        `DistMesh._break_if_interrupted`), a peer waiting for it gets its data, and a later
        `wait()` waits for it again. Before, the handle was let go before the wait, so an
        interrupt freed it with its traceback (and a later `wait()` returned the result
        unfinished, without waiting): gloo cancelled the exchange (an all-gather or reduce-scatter
        at N = 2, `cancelled_if_dropped`), and a peer that posted its half after this rank's
        interrupt waited for it to the timeout (found in review). The step's bookkeeping keeps it
        too (`unit.wait_held`), and hands it on again: the mesh keeps it once (`DistMesh.abandon`)."""
        work = self._work
        if work is not None:
            try:
                work.wait()
            except RuntimeError as e:
                self._work = self._keep = None
                raise (self._lost(e) if self._lost is not None else e) from e
            except BaseException:
                if self._abandon is not None:
                    self._abandon(self)
                raise
        self._work = self._keep = None
        return self._out


def _cancelled_if_dropped(held: Any) -> list[Any]:
    """What of `held` (`Mesh.abandon`'s argument: a `Pending`, what holds one as its `pending` --
    a `stages.Flight`: its current collective -- or a list or tuple of those, nested) the backend
    cancels if it is freed unwaited (`Pending.cancelled_if_dropped`); anything else is returned
    as it is, kept as before (`abandon` runs while an error is raised, and must not raise)."""
    if isinstance(held, (list, tuple)):
        return [p for h in held for p in _cancelled_if_dropped(h)]
    pending = getattr(held, "pending", held)
    if not isinstance(pending, Pending):
        return [held]
    return [pending] if not pending.done and pending.cancelled_if_dropped else []


class HeldInterrupts:
    """A context that holds Ctrl-C back: on the main thread, where SIGINT's handler is Python's
    (the default, which raises `KeyboardInterrupt`, or a user's callable), a SIGINT that arrives
    in the body is recorded, and the handler runs when the body ends: at once where the body
    raised, else where the caller calls `deliver()` (`pending` says whether one came). A second
    SIGINT runs the handler at once (a user who insists is not held). Elsewhere (another thread:
    SimMesh's ranks; SIG_IGN, SIG_DFL) it holds nothing. Nested, an inner one hands its signal to
    the outer (the outer's hold is the inner's handler).

    Found in review: gloo's C++ waits cannot be interrupted, so a Ctrl-C came out when a wait
    returned, mostly inside a collective's agreement -- which leaves the mesh unusable (row 171)
    -- and inside `torch.distributed.checkpoint`'s own collectives, where the other rank waited
    out the timeout (a save) or gloo aborted its process (a load): a "save on Ctrl-C" lost the
    checkpoint. Held, the interrupt comes after the collective has started on every rank (the mesh
    stays usable, row 177) or after the checkpoint is written or read. Its cost: a SIGINT handler
    swapped in and back per hold, about 10 µs on the 2-core CPU VM under load (a gloo collective
    takes hundreds); a mesh of one rank holds nothing."""

    def __init__(self, active: bool = True) -> None:
        self._old: Any = None
        self._got: tuple[int, Any] | None = None
        self._active = active  # False: holds nothing (a mesh of one rank, never out of step with itself)

    def __enter__(self) -> "HeldInterrupts":
        if self._active and threading.current_thread() is threading.main_thread():
            old = signal.getsignal(signal.SIGINT)
            if callable(old):
                self._old = old
                signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum: int, frame: Any) -> None:
        if self._got is None:
            self._got = (signum, frame)
            return
        first, self._got = self._got, None  # a second one: both at once, the held one first (found in
        self._restore()  # review: the first was dropped, so a user's handler ran once for two, and a nested
        self._old(*first)  # hold took the second for the outer hold's first)
        self._old(signum, frame)

    def _restore(self) -> None:
        if self._old is not None and signal.getsignal(signal.SIGINT) == self._hold:
            signal.signal(signal.SIGINT, self._old)

    @property
    def pending(self) -> bool:
        return self._got is not None

    def deliver(self) -> None:
        """Run the held signal's handler (it raises `KeyboardInterrupt` by default), once."""
        got, self._got = self._got, None
        if got is not None:
            self._old(*got)

    def __exit__(self, kind: Any, e: Any, tb: Any) -> None:
        self._restore()
        if kind is not None:
            try:
                self.deliver()
            except BaseException as raised:
                if _is_shared(e):  # the ranks stopped together (a RankFailed, a mismatch): the interrupt raised
                    _mark(raised, "_fzero_shared")  # over it is no failure of this rank's own for `guard` to announce
                    # (found in review: announced, it met the other ranks' next collective out of step)
                raise


@contextlib.contextmanager
def found_here() -> Iterator[None]:
    """Mark a `MeshError` raised in the body as this rank's own finding, made before any exchange
    (a collective's bad argument): `DistMesh.guard` tells the other ranks of it, as of any
    exception of the rank's own. A MeshError of an exchange (a mismatch, a lost rank) every rank
    raises together, and the guard tells no one of it."""
    try:
        yield
    except MeshError as e:
        e.__dict__["_fzero_local"] = True
        raise


def _is_shared(e: BaseException) -> bool:
    """Whether `e` is a MeshError every rank raised together (not marked by `found_here`), or an
    interrupt a `HeldInterrupts` raised over one (`_mark`)."""
    if isinstance(e, MeshError):
        return not e.__dict__.get("_fzero_local", False)
    return bool(getattr(e, "__dict__", {}).get("_fzero_shared", False))


def _mark(e: BaseException, flag: str) -> None:
    """Set `flag` ("_fzero_shared", "_fzero_told") on `e`, read by `_is_shared` / `_marked_told`."""
    with contextlib.suppress(AttributeError):  # an exception type without a __dict__
        e.__dict__[flag] = True


def _marked_told(e: BaseException) -> bool:
    """Whether `e`, or an exception it was raised from or while handling, was announced to the
    other ranks by a mesh's `guard` (`_mark`)."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        if getattr(x, "__dict__", {}).get("_fzero_told"):
            return True
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return False


class _Failed(NamedTuple):
    """A SimMesh rank's slot in a round where it announced an error of its own (`SimMesh.guard`),
    in place of a collective's call."""

    error: str

    def __str__(self) -> str:
        return f"its announcement of an error it raised ({self.error})"


def _per_rank_args(per_rank_args: Sequence[Any] | Callable[[int], Any], rank: int, n: int) -> tuple:
    if callable(per_rank_args):
        args = per_rank_args(rank)
    elif len(per_rank_args) == 0:
        args = ()
    elif len(per_rank_args) != n:
        raise MeshError(f"per_rank_args has {len(per_rank_args)} entries; expected one per rank ({n})")
    else:
        args = per_rank_args[rank]
    return args if isinstance(args, tuple) else (args,)


# ---------------------------------------------------------------------------------------------
# SimMesh


def _combine(call: _Call, xs: list[torch.Tensor], n: int,
             into: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """The serial meaning of each collective, reducing in rank order 0, 1, ..., N-1. `into`: per
    rank, the tensor an all-gather writes that rank's result into (`Mesh.start`'s `out`), or None."""
    if call.op == "all_gather":
        out = torch.cat(xs)
        return [out.clone() if o is None else o.copy_(out) for o in (into or [None] * n)]
    if call.op == "broadcast":
        return [xs[call.arg].clone() for _ in range(n)]
    acc = xs[0].clone()  # one accumulator, updated in place: the same bits as acc = acc + x
    for x in xs[1:]:
        if call.arg in (None, "sum"):
            acc.add_(x)
        else:
            torch.maximum(acc, x, out=acc)
    if call.op == "reduce_scatter":
        return [c.clone() for c in acc.chunk(n)]
    return [acc.clone() for _ in range(n)]


_SIM_THREAD = threading.local()  # .mesh, .rank: the SimMesh rank a thread started by SimMesh.run runs


@dataclasses.dataclass
class ProcessState:
    """What each process of a `DistMesh` has its own of and the threads of one process share: what
    a `SimMesh` rank keeps apart from the others, swapped in when the rank takes its turn and out
    when it passes it (at every collective), as torch's RNG is. Each rank starts from the
    caller's (a copy: a rank's `warnings.simplefilter` is its own), and the caller's is back after
    `run`. Found in review: with only torch's RNG swapped, `random.seed(rank)` on each rank had rank
    0 drawing from rank 1's stream after a collective; a `warnings.catch_warnings()` spanning a
    collective restored another rank's filters (after `run` a rank's `simplefilter("ignore")`
    stayed on for the process, and a rank's warning went into another's record); and a default
    dtype set and restored around one stayed float64.

    - torch's CPU RNG, Python's `random`, numpy's global RNG (where numpy is imported);
    - torch's default dtype;
    - `warnings`' filters and the functions that show a warning (what `catch_warnings` swaps).

    A rank that passes the turn to itself (one rank, or the others done) keeps the process's state
    as it is: at N = 1 a warning shown once per place is shown once, as in one process (swapping
    resets `warnings`' registry, which shows it again at every collective at N > 1).

    Not kept apart (set them around `mesh.run`, or make them per rank): `torch.backends` flags,
    deterministic algorithms, objects made outside `fn` (a `torch.Generator`, a data iterator),
    and thread-local settings a rank makes without `with`, which end with its thread.
    """

    torch_rng: torch.Tensor
    python_rng: Any
    numpy_rng: Any
    dtype: torch.dtype
    filters: list[Any]
    show: tuple[Any, Any]

    @staticmethod
    def now(copy: bool = False) -> "ProcessState":
        """This process's state; `copy`: the RNG state and filters copied (a rank's start)."""
        np = sys.modules.get("numpy")
        rng = torch.get_rng_state()
        return ProcessState(rng.clone() if copy else rng, random.getstate(),
                            np.random.get_state() if np is not None else None, torch.get_default_dtype(),
                            list(warnings.filters) if copy else warnings.filters,
                            (warnings.showwarning, getattr(warnings, "_showwarnmsg_impl", None)))

    def set(self) -> None:
        """Make it the process's."""
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        np = sys.modules.get("numpy")
        if np is not None and self.numpy_rng is not None:
            np.random.set_state(self.numpy_rng)
        torch.set_default_dtype(self.dtype)
        warnings.filters = self.filters
        warnings.showwarning = self.show[0]
        if self.show[1] is not None:
            warnings._showwarnmsg_impl = self.show[1]
        mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
        if mutated is not None:  # (what catch_warnings calls: the filters' cached version moves on; renamed in 3.14)
            mutated()


def simmesh_rank() -> tuple[SimMesh, int] | None:
    """`(mesh, rank)` of the `SimMesh` rank this thread runs (a thread `SimMesh.run` started),
    else None (the main thread, a `DistMesh` process): what a rank keeps apart from the other
    ranks of its process (`from_module`'s `apply`'s training mode, held per mesh weakly)."""
    mesh = getattr(_SIM_THREAD, "mesh", None)
    return None if mesh is None else (mesh, _SIM_THREAD.rank)


@dataclasses.dataclass(frozen=True)
class ThreadModes:
    """The thread-local torch modes of one thread: what `SimMesh.run` reads in the caller's thread
    and enters in each rank's thread before `fn`. DistMesh runs `fn` in the caller's own thread,
    under whatever the caller entered; a new thread starts from torch's defaults. Carried:

    - grad mode (`torch.no_grad`, `enable_grad`, `set_grad_enabled`) and `torch.inference_mode`;
    - autocast (`torch.autocast`): per device type whether it is on and its dtype, whether its
      cast cache is on, and how many autocast regions the thread is in (torch clears the cache on
      leaving the last: a rank's own `with torch.autocast` clears it on exit where the caller is
      in none, and keeps it to the end of `fn` where the caller is in one);
    - the saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, `save_on_cpu`): the
      innermost pair, the one torch applies;
    - the torch-function and torch-dispatch mode stacks (`torch.set_default_device`,
      `FlopCounterMode`, `fzero.accounting.LiveStorages`): the same mode objects, pushed as they
      are (not entered again), as torch's autograd engine carries them into its own threads.

    Process-wide settings the caller made need nothing (deterministic algorithms, anomaly
    detection); those a rank changes inside `fn` are kept apart per rank where `ProcessState` lists
    them (the RNGs, the default dtype, `warnings`' filters), and otherwise reach every rank;
    forward-AD levels are process-wide too, which the ranks cannot share
    (`collectives.check_forward_mode`).
    """

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device type, on, dtype)
    autocast_cache: bool
    autocast_nesting: int
    saved_tensors_hooks: tuple[Callable[..., Any], Callable[..., Any]] | None
    function_modes: tuple[Any, ...]  # innermost last
    dispatch_modes: tuple[Any, ...]  # innermost last

    @staticmethod
    def now() -> "ThreadModes":
        """This thread's modes. The device types are torch's (a private list, in 2.11 and 2.13)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        return ThreadModes(
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                  for d in torch._C._autocast_supported_devices()),
            torch.is_autocast_cache_enabled(), _autocast_nesting(),
            torch._C._autograd._top_saved_tensors_default_hooks(True),
            tuple(torch.overrides._get_current_function_mode_stack()),
            tuple(_get_current_dispatch_mode_stack()))

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Run the body under these modes; this thread's own are back afterwards."""
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            stack.enter_context(_autocast(self.autocast, self.autocast_cache, self.autocast_nesting))
            if self.saved_tensors_hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.saved_tensors_hooks))
            for mode in self.function_modes:
                torch._C._push_on_torch_function_stack(mode)
                stack.callback(torch._C._pop_torch_function_stack)
            for mode in self.dispatch_modes:
                torch._C._push_on_torch_dispatch_stack(mode)
                stack.callback(torch._C._pop_torch_dispatch_stack, getattr(mode, "_mode_key", None))
            yield


def _autocast_nesting() -> int:
    """How many autocast regions this thread is in (torch counts them to clear its cast cache on
    leaving the last; it has no reader of the count, so this goes up one and back)."""
    n = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return n


@contextlib.contextmanager
def _autocast(devices: tuple[tuple[str, bool, torch.dtype], ...], cache: bool, nesting: int) -> Iterator[None]:
    """Autocast set to `devices` (`(device type, on, dtype)`), `cache` and `nesting` regions deep,
    entered and left as `torch.autocast` enters and leaves its regions (the cast cache cleared on
    leaving the last), through torch's setters: `torch.autocast` itself would warn of a device
    type this build cannot run, as every type is set (off, where the caller's is off). With no
    region (`nesting` 0) a region the body enters clears the cache on exit, as in the caller's
    thread: a region entered here for the whole body would keep casts of updated weights."""
    before = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d, _, _ in devices]
    cache_before = torch.is_autocast_cache_enabled()
    for d, on, dtype in devices:
        torch.set_autocast_enabled(d, on)
        torch.set_autocast_dtype(d, dtype)
    for _ in range(nesting):
        torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(cache)
    try:
        yield
    finally:
        for _ in range(nesting):
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
        for d, on, dtype in before:
            torch.set_autocast_enabled(d, on)
            torch.set_autocast_dtype(d, dtype)
        torch.set_autocast_cache_enabled(cache_before)


class SimMesh(Mesh):
    """`world_size` (N) virtual ranks in one process; see `fzero._src.mesh`'s docstring.

    Example:
      >>> mesh = fzero.SimMesh(4)
      >>> mesh.run(lambda x: fzero.collectives.all_reduce(x, mesh), [(torch.tensor([float(r)]),) for r in range(4)])
      [tensor([6.]), tensor([6.]), tensor([6.]), tensor([6.])]

    Every rank starts `run` from the caller's RNG state (as N processes seeded alike); the
    caller's state is restored afterwards (so each `run` of a loop of them starts from the same
    state, where a `DistMesh` process goes on). Each rank keeps its own torch, `random` and numpy
    RNG, default dtype and `warnings` filters (`ProcessState`, swapped at every collective). Every rank runs under the caller's thread-local torch
    modes (`ThreadModes`: grad and inference mode, autocast, saved-tensor hooks, torch-function
    and torch-dispatch modes), as DistMesh's rank runs `fn` in the caller's own thread: a step
    under the caller's `torch.autocast` is autocast on both.

    Calls that differ raise `CollectiveMismatch` on every rank of that collective, which moves
    nothing, and the mesh goes on, as DistMesh's verified exchange does: ranks that catch it (or
    the `DivergentPaths` a step makes of it) and call alike collectives afterwards proceed, and
    `run` returns where every rank returned. (Before, the mismatch stayed with the mesh: every
    later collective raised it again and `run` raised it at the end, though each rank had handled
    it, where DistMesh returned.) A rank that stops, by returning or raising, while another waits
    in a collective stops that one too; an error of a rank's own inside fzero's calls (a step,
    `init`, a save) is announced where it is raised (`guard`), as DistMesh's is, so the others
    raise `RankFailed` in their collective also where the rank catches it and goes on.
    """

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self._cond = threading.Condition()
        self._running = False
        self._current: int | None = None
        self._round = 0  # (`run` resets both; a guard outside any run reads them: found in review)
        self._announced: dict[int, int] = {}

    def __repr__(self) -> str:
        return f"SimMesh({self.world_size}, id={self.id})"

    @property
    def all_reduce_is_reduce_scatter_gather(self) -> bool:
        """True at every N: `_combine` sums an all-reduce and a reduce-scatter through the same
        accumulator in rank order, and a reduce-scatter's chunks of it, gathered back in rank
        order, are that accumulator."""
        return True

    @property
    def rank(self) -> int:
        owner = getattr(_SIM_THREAD, "mesh", None)
        if owner is not None and owner is not self:
            raise MeshError(
                f"{self!r}: this thread is rank {_SIM_THREAD.rank} of {owner!r}, not a rank of {self!r}; "
                f"code inside {owner!r}.run must use {owner!r} (or run its work on {self!r} with "
                f"{self!r}.run(fn, ...) outside the other mesh's run)")
        if self._current is None:
            raise MeshError(f"{self!r}: no rank is running; call collectives inside mesh.run(fn, ...)")
        return self._current

    # -- scheduling: exactly one rank holds the turn -------------------------------------------

    def _take_turn(self, r: int) -> None:
        """Block until rank r holds the turn, then make it the running rank (cond held)."""
        self._cond.wait_for(lambda: self._turn == r)
        self._current = r
        held = self._held[r]
        if held is not None:  # (None: r passed the turn to itself, and the process holds its state)
            held.set()

    def _pass_turn(self, r: int) -> None:
        """Save rank r's process state and give the turn to the next rank still running (cond held);
        where that is r itself (one rank, or the others done), nothing is saved and set again
        (found in review: numpy's RNG state, read and written at every collective, cost two to
        three times a small collective at N = 1)."""
        self._current = None
        n = self.world_size
        later = [(r + k) % n for k in range(1, n + 1)]
        self._turn = next((s for s in later if self._status[s] in ("run", "wait")), None)
        self._held[r] = None if self._turn == r else ProcessState.now()
        self._cond.notify_all()

    def _poison(self, error: MeshError) -> None:
        if self._error is None:
            self._error = error

    def _told(self, e: BaseException) -> bool:
        """As DistMesh's `_told`: an enclosing guard announced `e` (or its cause) and this rank
        ran no collective since (a round completes only with every rank's slot in it, so the
        round count moves on only where this rank took part)."""
        r = getattr(_SIM_THREAD, "rank", None)
        return self._announced.get(r) == self._round and _marked_told(e)

    def _announce(self, e: BaseException) -> None:
        """Put this rank's `_Failed` slot into the round this rank is at and wait for the round to
        end, as `_exchange` waits for a collective: the ranks whose calls are in it raise
        `RankFailed` naming `e` (`_complete_round`). Before, SimMesh told them only when the error
        left `fn`: a rank that caught its error and retried met the others in their collective
        unannounced (a retried step paired with their first), or left them waiting to a
        `CollectiveMismatch` at the end of `run` that named no error, where DistMesh raised
        `RankFailed` (found in review). Nothing where this thread is not a running rank of this
        mesh, the mesh is poisoned, or a rank has left `run` (its end raises there)."""
        if getattr(_SIM_THREAD, "mesh", None) is not self:
            return
        with self._cond:
            r = _SIM_THREAD.rank
            if not self._running or self._error is not None or self._current != r or any(
                    st in ("done", "fail") for st in self._status):
                return
            self._round_trip(r, _Failed(_words(e, 4000)), None)  # (a str() that raises: found in review)
            self._announced[r] = self._round
        _mark(e, "_fzero_told")

    def _round_trip(self, r: int, call: Any, x: torch.Tensor | None) -> Any:
        """Put rank `r`'s slot `(call, x)` into the current round, complete it where every rank's
        is in, and wait for the turn to come back (the round then done: ranks take turns in order):
        rank `r`'s result (cond held)."""
        self._slots[r] = (call, x)
        self._status[r] = "wait"
        if len(self._waiting()) == self.world_size:
            self._complete_round()
        self._pass_turn(r)
        self._take_turn(r)
        self._status[r] = "run"
        out, self._results[r] = self._results[r], None
        return out

    def _waiting(self) -> list[int]:
        """Ranks that deposited into the current, incomplete round."""
        return [s for s, slot in enumerate(self._slots) if slot is not None]

    def _start(self, call: _Call, x: torch.Tensor, donate: bool = False,
               out: torch.Tensor | None = None) -> "Pending":
        """An all-gather with `out` writes each rank's result into its `out` in the round itself
        (`_combine`), with no per-rank copy between: what DistMesh's gather into `out` holds."""
        if out is None:
            return super()._start(call, x, donate)
        r = self.rank
        self._into[r] = out
        try:
            return Pending(self._exchange(call, x))
        finally:
            self._into[r] = None

    def _exchange(self, call: _Call, x: torch.Tensor) -> torch.Tensor:
        with self._cond:
            r = self.rank
            if self._error is None:
                gone = [s for s, st in enumerate(self._status) if st in ("done", "fail")]
                if gone:
                    self._poison(CollectiveMismatch(
                        f"{self!r}: rank {r} calls {call} but rank(s) {gone} already returned from "
                        f"mesh.run; every rank must call the same collectives in the same order"))
            if self._error is not None:
                raise self._error
            out = self._round_trip(r, call, x)
            if isinstance(out, MeshError):  # this round's calls differ, or a rank failed (`_complete_round`)
                raise out
            if self._error is not None:
                raise self._error
            return out

    def _complete_round(self) -> None:
        calls = [c for c, _ in self._slots]
        failed = [s for s, c in enumerate(calls) if isinstance(c, _Failed)]
        if failed:  # as DistMesh's agreement with a FAIL row: every other rank of the round raises
            said = "; ".join(f"rank {s} raised {calls[s].error}" for s in failed)
            self._results = [None if s in failed else RankFailed(
                f"{self!r}: {said}; rank {s} stops at {c} (collective #{self._round})") for s, c in enumerate(calls)]
        elif any(c != calls[0] for c in calls):
            lines = "\n".join(f"  rank {s}: {c}" for s, c in enumerate(calls))
            alike = len({dataclasses.replace(c, grad=False) for c in calls}) == 1
            # every rank's result: each raises it, and the mesh goes on (the class docstring)
            self._results = [CollectiveMismatch(
                f"{self!r}: ranks called different collectives at collective #{self._round}:\n{lines}\n"
                f"{_advice(calls[0].op, [c.grad for c in calls] if alike else None, [str(c) for c in calls])}"
            )] * self.world_size
        else:
            self._results = _combine(calls[0], [x for _, x in self._slots], self.world_size, self._into)
        self._slots = [None] * self.world_size
        self._round += 1

    # -- run ----------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], per_rank_args: Sequence[Any] | Callable[[int], Any] = ()) -> list[Any]:
        n = self.world_size
        args = [_per_rank_args(per_rank_args, r, n) for r in range(n)]
        with self._cond:
            if self._running:
                raise MeshError(f"{self!r}.run is not reentrant: a rank called mesh.run inside mesh.run")
            self._running = True
        caller = ProcessState.now()
        modes = ThreadModes.now()
        self._held = [ProcessState.now(copy=True) for _ in range(n)]
        self._status = ["run"] * n
        self._slots: list[Any] = [None] * n
        self._results: list[Any] = [None] * n
        self._into: list[torch.Tensor | None] = [None] * n  # per rank, an all-gather's `out` (`_start`)
        self._error: MeshError | None = None
        self._round = 0
        self._announced: dict[int, int] = {}  # rank -> the round count after its last announcement (`_told`)
        self._turn: int | None = 0
        outputs: list[Any] = [None] * n
        failures: list[tuple[int, BaseException]] = []

        def main(r: int) -> None:
            _SIM_THREAD.mesh, _SIM_THREAD.rank = self, r
            with self._cond:
                self._take_turn(r)
            try:
                with modes.enter():
                    outputs[r] = fn(*args[r])
            except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
                with self._cond:
                    failures.append((r, e))
                    self._status[r] = "fail"
                    waiting = self._waiting()
                    try:  # (words that cannot raise, and the turn passed whatever: an error whose str() raised
                        # here left the others waiting for a turn forever; found in review)
                        if not _is_shared(e):  # its own error (a MeshError too: a collective's argument)
                            self._poison(RankFailed(f"{self!r}: rank {r} raised {_words(e, 4000)}"))
                        elif waiting:  # a mismatch it raised, which a waiting rank caught and went on from
                            self._poison(RankFailed(
                                f"{self!r}: rank {r} raised {type(e).__name__} while rank(s) {waiting} wait in "
                                f"{self._slots[waiting[0]][0]} (they went on past the error rank {r} stops at): "
                                f"{_words(e, 4000).partition(': ')[2]}"))
                    finally:
                        self._pass_turn(r)
                return
            with self._cond:
                self._status[r] = "done"
                waiting = self._waiting()
                failed = [s for s in waiting if isinstance(self._slots[s][0], _Failed)]
                if failed:  # as DistMesh's end of run meeting a FAIL row
                    self._poison(RankFailed(f"{self!r}: rank(s) {failed} raised "
                                            f"({'; '.join(self._slots[s][0].error for s in failed)}); rank {r} "
                                            f"stops at the end of mesh.run"))
                elif waiting:
                    self._poison(CollectiveMismatch(
                        f"{self!r}: rank {r} returned from mesh.run while rank(s) {waiting} wait in "
                        f"{self._slots[waiting[0]][0]}; every rank must call the same collectives"))
                self._pass_turn(r)

        threads = [threading.Thread(target=main, args=(r,), name=f"fzero-simrank-{r}") for r in range(n)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            caller.set()
            with self._cond:
                self._running = False
                self._current = None
        if failures:
            own = [(r, e) for r, e in failures if not _is_shared(e)]
            if own:
                r, e = own[0]
                e.add_note(f"raised on rank {r} of {self!r}; the other ranks stopped")
                raise e
            raise failures[0][1]
        if self._error is not None:
            raise self._error
        return outputs


# ---------------------------------------------------------------------------------------------
# DistMesh

_KIND_CALL, _KIND_DONE, _KIND_FAIL, _KIND_CONSTRUCT = 1, 2, 3, 4
_FP_LEN = 12


def _words(e: BaseException, most: int = 400) -> str:
    """`e` as the others' `RankFailed` quotes it (`_announce`), at most `most` characters; never
    raising: an error whose `str()` raises left the guard with that error in place of the user's,
    and no FAIL row sent, so the others waited out the timeout (found in review; SimMesh's paired
    a rank's retry with the others' first attempt)."""
    try:
        return f"{type(e).__name__}: {e}"[:most]
    except Exception:  # noqa: BLE001 - any error of a user's __str__
        return f"{type(e).__name__} (its str() raised)"


def settings_crc(x: Any) -> int:
    """CRC-32 of `x`'s repr, 31 bits (exact in an int64 or float64 row): how ranks compare what
    they were given -- a collective's tag here, `init`'s and a step's settings (`state`, `step`)."""
    return zlib.crc32(repr(x).encode()) & 0x7FFFFFFF


def _fingerprint(kind: int, seq: int, call: _Call | None) -> list[int]:
    """`[kind, seq, op, dtype crc, ndim, d0, d1, d2, crc of the dims past d2 (-1: none), arg, tag crc,
    grad]`; arg is the reduction's index in REDUCTIONS (all_reduce), the source rank (broadcast), or
    -1; the tag crc covers `_Call.phase` too where there is one (`Mesh.phase`; without one it is the
    tag's alone, as before phases); grad is `_Call.grad` (last, so that `_agree` can tell calls that
    differ in it alone). The crcs cover every dtype and every dim (before, a dtype outside a list of
    twelve was 99 and the dims past d2 their product: complex64 met complex128 in gloo, which
    aborted the process, and [1, 1, 1, 2, 3] met [1, 1, 1, 3, 2], gathered silently; found in
    review)."""
    if call is None:
        return [kind, seq] + [0] * (_FP_LEN - 2)
    dims = list(call.shape[:3]) + [-1] * (3 - min(3, len(call.shape)))
    rest = call.shape[3:]
    dims.append(-1 if not rest else settings_crc(tuple(rest)))
    arg = REDUCTIONS.index(call.arg) if call.op == "all_reduce" else (call.arg if call.op == "broadcast" else -1)
    return [kind, seq, OPS.index(call.op), settings_crc(call.dtype), len(call.shape), *dims, arg,
            settings_crc(call.tag if call.phase is None else (call.tag, call.phase)), int(call.grad)]


def _all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """The compatibility shim: `all_gather_single` where torch has it (2.13 deprecates
    `all_gather_into_tensor` with a FutureWarning), the older name elsewhere (2.11)."""
    fn = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def _reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """`reduce_scatter_single` where torch has it, `reduce_scatter_tensor` elsewhere."""
    fn = getattr(torch.distributed, "reduce_scatter_single", None) or torch.distributed.reduce_scatter_tensor
    return fn(out, x, group=group, async_op=async_op)


# the dtypes whose N = 2 gloo reduce-scatter is `_reduce_scatter_by_exchange`: those whose sums
# (and NaNs) come out bit for bit as gloo's own; bfloat16 differs in the sign and payload of NaNs
# (inf + -inf, x + NaN), so it keeps gloo's reduce-scatter
_EXCHANGED = (torch.float32, torch.float64, torch.float16)


class _ThenAdd:
    """A work handle whose `wait()` waits for `work`, then writes `out = a + b` (one addition),
    once: `out` is one of the terms (the received half), so a second addition would add this
    rank's half twice. A wait that an interrupt stopped is waited again (`Pending.wait` keeps
    the handle); where the interrupt came right after the addition (a signal is raised once the
    call returns), the addition counts as made (`added`, set in a `finally`, where no signal is
    raised before it is set)."""

    point_to_point = True  # its `work` is an exchange's `_Works` (`Pending.cancelled_if_dropped`)

    def __init__(self, work: Any, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        self.work, self.out, self.a, self.b, self.added = work, out, a, b, False

    def wait(self) -> None:
        self.work.wait()
        if not self.added:
            try:
                torch.add(self.a, self.b, out=self.out)
            finally:
                self.added = True


_CONSTRUCTION = "DistMesh construction (each rank's host, process id, verify and ordinal)"


def _check_member(group: Any) -> None:
    """A `MeshError` where this process is not in `group`: `new_group` hands the ranks it leaves out
    a non-member handle, on which torch raised a bare "Invalid process group specified" (found in
    review of sub-group meshes)."""
    dist = torch.distributed
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise MeshError(f"DistMesh: global rank {dist.get_rank()} is not a member of this process group "
                        f"(torch.distributed.new_group returns a non-member handle to the ranks it leaves out); only "
                        f"its members construct a DistMesh over it: make it where rank in the group's ranks")


def _global_ranks(group: Any, world_size: int) -> tuple[int, ...] | None:
    """The global rank of each rank of `group`, in its order, where it is not the whole job (None
    where it is: the same numbers)."""
    dist = torch.distributed
    if group is None or group is dist.GroupMember.WORLD:
        return None
    ranks = tuple(dist.get_global_rank(group, r) for r in range(world_size))
    return None if ranks == tuple(range(dist.get_world_size())) else ranks


def _peer(group: Any, rank: int) -> tuple[int, int]:
    """At N = 2: the other rank, in `group` and as the global rank point-to-point calls address."""
    peer = 1 - rank
    return peer, (torch.distributed.get_global_rank(group, peer) if group is not None else peer)


def _reduce_scatter_by_exchange(x: torch.Tensor, group: Any, rank: int, tag: int = 0) -> tuple[torch.Tensor, _ThenAdd]:
    """gloo's reduce-scatter at N = 2, `x[2 * S, ...] -> [S, ...]`, as one exchange and one addition:
    this rank sends the other rank's half of `x` and receives the other rank's half for this one
    into `out` (one `isend` and one `irecv`, gloo's point-to-point pairs, matched by their tag), then `out = x0 + x1` in rank order, in place: `out = mine + out` on rank 0,
    `out + mine` on rank 1. Each element is one correctly rounded addition of the same two terms in
    the same order -- a + b = b + a exactly in IEEE arithmetic anyway, and a 16-bit sum computed in
    float32 and rounded once more is still correctly rounded (float32 has more than 2p + 2 bits for
    p = 8, 11) -- so the bits are those of gloo's own reduce-scatter, which all-reduces a clone of
    the whole buffer and keeps this rank's chunk: that moves `x` twice around the ring where this
    moves half of it once, and the only new memory is `out`. For float32, float64 and float16
    (`_EXCHANGED`) the NaNs come out the same too; bfloat16's NaNs may differ in sign and payload
    from gloo's, so bfloat16 keeps gloo's reduce-scatter. `tag`: the exchange's
    point-to-point tag (`DistMesh._p2p_tag`)."""
    dist, s, x = torch.distributed, x.shape[0] // 2, x.contiguous()
    peer, to = _peer(group, rank)
    out = x.new_empty((s, *x.shape[1:]))
    mine = x[rank * s : (rank + 1) * s]
    ops = [dist.P2POp(dist.isend, x[peer * s : (peer + 1) * s], to, group, tag),
           dist.P2POp(dist.irecv, out, to, group, tag)]
    a, b = (mine, out) if rank == 0 else (out, mine)
    return out, _ThenAdd(_Works(dist.batch_isend_irecv(ops)), out, a, b)


def _overlaps(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `x`'s elements lie in `out`'s storage range (contiguous tensors)."""
    a, b = x.data_ptr(), out.data_ptr()
    return a < b + out.numel() * out.element_size() and b < a + x.numel() * x.element_size()


class _Works:
    """Work handles waited for together: `wait()` waits for each, in order (a point-to-point
    exchange's send and receive, which gloo cancels when freed: `Pending.cancelled_if_dropped`)."""

    point_to_point = True

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _all_gather_by_exchange(x: torch.Tensor, group: Any, rank: int, into: torch.Tensor | None = None,
                            tag: int = 0) -> tuple[torch.Tensor, _Works]:
    """gloo's all-gather at N = 2, `x[S, ...] -> [2 * S, ...]` (rank order), as one exchange: this
    rank's `x` is copied into its half of the output and sent to the other rank, whose `x` is
    received straight into the other half (one `isend` and one `irecv`, gloo's point-to-point
    pairs, in flight together). Only bits move, so every dtype comes out as gloo's own all-gather,
    which gathers into a staging buffer of its own and then copies each rank's chunk into the
    output: one copy of `x` here where gloo makes a copy of the whole `[2 * S]`. `into`: the
    output, where the caller has one (`Mesh.start`'s `out`); `tag`: the exchange's point-to-point
    tag (`DistMesh._p2p_tag`)."""
    dist, s = torch.distributed, x.shape[0]
    out = x.new_empty((2 * s, *x.shape[1:])) if into is None else into
    out[rank * s : (rank + 1) * s].copy_(x)
    peer, to = _peer(group, rank)
    ops = [dist.P2POp(dist.isend, x.contiguous(), to, group, tag),
           dist.P2POp(dist.irecv, out[peer * s : (peer + 1) * s], to, group, tag)]
    return out, _Works(dist.batch_isend_irecv(ops))


# -- choosing a backend and device -------------------------------------------------------------

BACKENDS = ("gloo", "nccl")
ENV_BACKEND = "FZERO_BACKEND"  # overrides the default backend of a process group DistMesh starts


def _as_device(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise MeshError(f"DistMesh: device={device!r} is not a device: {e}; use 'cpu', 'cuda' or 'cuda:K'") from e
    if dev.type not in ("cpu", "cuda"):
        raise MeshError(f"DistMesh: device={str(dev)!r} is not supported; use 'cpu' (gloo) or 'cuda' (nccl)")
    return dev


def _check_pair(backend: str, dev: torch.device | None, source: str) -> None:
    """gloo moves CPU tensors here, NCCL CUDA tensors; any other pair is an error."""
    if backend == "nccl" and dev is not None and dev.type != "cuda":
        raise MeshError(f"DistMesh: backend 'nccl' ({source}) moves CUDA tensors only, but device={str(dev)!r} "
                        f"was asked for; use backend='gloo' for CPU tensors, or a CUDA device")
    if backend == "gloo" and dev is not None and dev.type != "cpu":
        raise MeshError(f"DistMesh: backend 'gloo' ({source}) runs fzero's collectives on CPU tensors, but "
                        f"device={str(dev)!r} was asked for; use backend='nccl' for CUDA tensors, or device='cpu'")


def _choose_backend(backend: str | None, device: str | torch.device | None, env: Mapping[str, str],
                    cuda_devices: int) -> tuple[str, torch.device]:
    """The `(backend, device)` a process group started by DistMesh uses, or MeshError.

    backend: the argument, else `env["FZERO_BACKEND"]`, else the default: "nccl" when `device` is
    CUDA, or when no device is given and `cuda_devices > 0`; "gloo" otherwise. The device: gloo ->
    cpu; nccl -> the CUDA device given with its index, else `cuda:LOCAL_RANK`, which needs one CUDA
    device per process of the node, `LOCAL_WORLD_SIZE <= cuda_devices`. Too few devices is an
    error whether NCCL was asked for or chosen by default, never a silent switch to gloo; the check
    reads LOCAL_WORLD_SIZE, the same on every rank of a node, so every rank raises (none starts
    NCCL and waits for a rank that raised).
    """
    source = f"asked for by backend={backend!r}"
    if backend is None and env.get(ENV_BACKEND):
        backend, source = env[ENV_BACKEND], f"set by {ENV_BACKEND}={env[ENV_BACKEND]}"
    if backend is not None and backend not in BACKENDS:
        raise MeshError(f"DistMesh: unknown backend {backend!r} ({source}); expected one of {BACKENDS}")
    dev = _as_device(device)
    if backend is None:
        cuda = dev.type == "cuda" if dev is not None else cuda_devices > 0
        backend = "nccl" if cuda else "gloo"
        source = (f"the default for device={str(dev)!r}" if dev is not None else
                  f"the default, as torch.cuda.device_count() is {cuda_devices}")
    _check_pair(backend, dev, source)
    if backend == "gloo":
        return backend, torch.device("cpu")
    if cuda_devices == 0:
        raise MeshError(f"DistMesh: backend 'nccl' ({source}) needs CUDA, but torch.cuda.device_count() is 0; "
                        f"use DistMesh(backend='gloo') (or {ENV_BACKEND}=gloo) to run on CPU")
    if dev is not None and dev.index is not None:
        if dev.index >= cuda_devices:
            raise MeshError(f"DistMesh: device={str(dev)!r} but torch.cuda.device_count() is {cuda_devices}; "
                            f"use an index below {cuda_devices}")
        return backend, dev
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", local_rank + 1))
    if local_world > cuda_devices:
        raise MeshError(
            f"DistMesh: backend 'nccl' ({source}) needs one CUDA device per process, but this node runs "
            f"LOCAL_WORLD_SIZE={local_world} processes and torch.cuda.device_count() is {cuda_devices} "
            f"(this is LOCAL_RANK {local_rank}); use DistMesh(backend='gloo') (or {ENV_BACKEND}=gloo) to run "
            f"on CPU, or start at most {cuda_devices} process(es) per node "
            f"(torchrun --nproc-per-node {cuda_devices})")
    return backend, torch.device("cuda", local_rank)


def _group_device(actual: str, backend: str | None, device: str | torch.device | None) -> torch.device:
    """The device of a mesh over an existing process group whose backend is `actual`."""
    if backend is not None and backend != actual:
        raise MeshError(f"DistMesh: the process group runs {actual!r} but backend={backend!r} was asked for; "
                        f"leave backend out, or start the group with {backend!r}")
    dev = _as_device(device)
    if actual in BACKENDS:
        _check_pair(actual, dev, "the process group's backend")
    if actual == "nccl" and (dev is None or dev.index is None):
        return torch.device("cuda", torch.cuda.current_device())
    return dev if dev is not None else torch.device("cpu")


def _as_timedelta(timeout: datetime.timedelta | float) -> datetime.timedelta:
    t = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if t.total_seconds() <= 0:
        raise MeshError(f"DistMesh: timeout must be positive, got {timeout!r}")
    return t


# -- naming a lost rank ---------------------------------------------------------------------------

_GRACE_S = 2.0  # how long a rank whose collective broke waits for a dying peer's process to vanish


def _destroy_started_group() -> None:
    """At exit, the process group a DistMesh started, where the program did not destroy it: left
    to the interpreter's teardown, gloo's threads sometimes abort the process after a run that
    succeeded ("terminate called without an active exception", torchrun then reports SIGABRT;
    found in review, in 2 of 8 runs, and without fzero too)."""
    dist = torch.distributed
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _agreed_ordinal(proposed: list[int]) -> int:
    """A new DistMesh's ordinal from every rank's proposal (`_NEXT_ORDINAL`, in the construction's
    rows): the largest, the same on every rank, and larger than that of any DistMesh this process
    made before, so that two meshes over one process group -- whose point-to-point exchanges
    share gloo's tags -- never tag an exchange alike (`DistMesh._p2p_tag`)."""
    ordinal = max(proposed)
    _NEXT_ORDINAL[0] = max(_NEXT_ORDINAL[0], ordinal + 1)
    return ordinal


def _identity() -> tuple[int, int]:
    """`(host key, pid)` of this process. The host key is the crc32 of the host name and the PID
    namespace: two processes with one key can see each other's process ids."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return zlib.crc32(f"{socket.gethostname()} {ns}".encode()), os.getpid()


def _process_gone(pid: int) -> bool:
    """Whether process `pid` (on this host) has exited: no such process, or a zombie not yet reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


class DistMesh(Mesh):
    """One rank per process of a torch.distributed process group, started by `torchrun`.

    Every rank of the group constructs it (construction exchanges each rank's host and process id,
    so that a rank whose peer dies can name it).

    Args:
      group: a process group, or None for the default group. Only its members construct a mesh
        over it (another rank gets a `MeshError`; `new_group(..., use_local_synchronization=True)`
        hands the others `None`, the default group, over which such a rank must not build one).
        Its ranks, which `rank` and every message name, are the group's
        (`torch.distributed.get_rank(group)`); over a group that is not the whole
        job the repr, quoted by every message that names the mesh, lists the global rank of each.
        Each group runs its own steps: fzero has no replica groups (HSDP), so its agreement, skip,
        norm, clipping and loss cover one group only (README, "Limits today").
      backend: "gloo", "nccl" or None. Used when no process group exists yet and DistMesh starts
        one from torchrun's environment: None means `$FZERO_BACKEND` if set, else NCCL when CUDA
        has devices, gloo otherwise. NCCL runs rank `LOCAL_RANK` on `cuda:LOCAL_RANK` and needs
        `LOCAL_WORLD_SIZE <= torch.cuda.device_count()`; with fewer devices DistMesh raises
        `MeshError` (asked for or by default: it never switches to gloo silently), saying to pass
        backend="gloo" or to start fewer processes per node. With an existing group, a backend
        other than the group's is an error.
      device: "cpu", "cuda", "cuda:K", a torch.device, or None (the backend's: gloo -> cpu, nccl
        -> cuda:LOCAL_RANK). gloo takes CPU tensors, NCCL CUDA tensors; another pair is an error.
      verify: before each collective, all ranks exchange a fingerprint (op, dtype, shape, tag,
        sequence number) and raise on every rank if they differ or if a rank failed, instead of
        hanging or silently mixing buffers. Costs one small all-gather per collective; turn it off
        for speed once a program is known to be right. Off, nothing is compared and a rank's
        exception is not announced (`guard`): calls that differ meet in the backend (a wait, an
        abort, or buffers mixed silently; stages 2-3 raise no `DivergentPaths`), and the other
        ranks of one that raised stop when its process exits (`RankFailed`), at the timeout, or,
        where it caught its error and called again (a retry, a notebook), not at all: their
        pending call meets its new one, and where the two agree in shape it returns, built from
        the retry's data, and nothing says so (where they differ gloo may abort a process; found
        in review, tests/test_one_rank_fails.py runs the verified case). Run with `verify=True`
        wherever a rank may catch an error and go on. The settings `init` and each step compare
        are compared either way.
      timeout: a `timedelta` or seconds: how long a fingerprint exchange waits for the other
        ranks, and the timeout of a process group DistMesh starts.

    A process group DistMesh starts is destroyed at exit where the program did not destroy it
    (`torch.distributed.destroy_process_group`; left to the interpreter's teardown, gloo sometimes
    aborted a run that had succeeded).

    A rank whose collective fails because a peer's process died raises `RankFailed` naming that
    rank (found among the ranks on this host; for ranks on other hosts the message says which may
    be lost); the mesh is unusable afterwards. A peer that finished its program without making
    the call (a `checkpoint.save` under `if rank == 0:`, after the other ranks returned) is lost
    alike: the message names both, and the call every rank must make. A rank interrupted
    (`KeyboardInterrupt`) inside a collective's agreement, or before its data exchange started,
    may be out of step with the others: its mesh is unusable afterwards too, and says so. One
    interrupted while it waits for a started collective (`Pending.wait`) is not: that collective
    was issued on every rank, and the mesh keeps it (`abandon`) to run to the end, so a peer
    waiting for it gets its data and the mesh stays usable.

    Example (a script run as `torchrun --nproc-per-node 2 script.py`; tests/test_dist.py runs
    the same on a pool of gloo workers):

        mesh = fzero.DistMesh()  # or DistMesh(backend="gloo") to run on CPU whatever the GPUs
        fzero.collectives.all_reduce(torch.ones(3, device=mesh.device), mesh)  # tensor([2., 2., 2.])
    """

    def __init__(self, group: Any = None, *, backend: str | None = None, device: str | torch.device | None = None,
                 verify: bool = True, timeout: datetime.timedelta | float = datetime.timedelta(seconds=120)) -> None:
        dist = torch.distributed
        if not dist.is_available():
            raise MeshError("DistMesh needs torch.distributed, which this torch build lacks")
        self.timeout = _as_timedelta(timeout)
        if dist.is_initialized():
            _check_member(group)
            dev = _group_device(dist.get_backend(group), backend, device)
        else:
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise MeshError(
                    "DistMesh found no process group and no torchrun environment (RANK, WORLD_SIZE); "
                    "start the script with `torchrun --nproc-per-node N script.py`, or use fzero.SimMesh(N)")
            backend, dev = _choose_backend(backend, device, os.environ, torch.cuda.device_count())
            if backend == "nccl":
                torch.cuda.set_device(dev)
                dist.init_process_group("nccl", device_id=dev, timeout=self.timeout)
            else:
                dist.init_process_group("gloo", timeout=self.timeout)
            atexit.register(_destroy_started_group)
        self.group = group
        super().__init__(dist.get_world_size(group))
        self._rank = dist.get_rank(group)
        self._global = _global_ranks(group, self.world_size)  # (None: the group is the world, its ranks the same)
        self.backend = dist.get_backend(group)
        self.device = dev
        self.verify = verify
        self._seq = 0
        self._exchanges: dict[tuple, int] = {}  # point-to-point exchanges issued this era, per collective (`_p2p_tag`)
        self._era = 0  # how many times `_exchanges` filled up and was cleared (`_p2p_tag`)
        self._abandoned: collections.deque[Any] = collections.deque(maxlen=_ABANDONED)  # (`abandon`)
        self._announced = -1  # the sequence number after the last failure this rank announced (`_told`)
        self._broken: MeshError | None = None  # set once a collective failed: the group is unusable
        self._peers: list[tuple[int, int]] = []
        # a fingerprint-sized row, so that a rank constructing a mesh where another verifies a
        # collective is named on both (before, the two exchanges' sizes differed: gloo aborted)
        mine = [_KIND_CONSTRUCT, 0, *_identity(), int(verify), _NEXT_ORDINAL[0]] + [0] * (_FP_LEN - 6)
        rows = self._gather(torch.tensor(mine, dtype=torch.int64, device=self.device), _CONSTRUCTION)
        rows = rows.view(self.world_size, _FP_LEN).tolist()
        elsewhere = [s for s, row in enumerate(rows) if row[0] != _KIND_CONSTRUCT]
        if elsewhere:
            raise CollectiveMismatch(
                f"{self!r}: rank(s) {elsewhere} were in a collective of another mesh while rank {self._rank} "
                f"constructed this one: every rank must construct each DistMesh at the same point of its program")
        self._ordinal = _agreed_ordinal([row[5] for row in rows])
        _CONSTRUCTED[0] += 1
        verifies = [bool(row[4]) for row in rows]
        if len(set(verifies)) > 1:
            raise MeshError(f"{self!r}: ranks constructed it with different verify: "
                            + ", ".join(f"rank {s} {v}" for s, v in enumerate(verifies))
                            + "; every rank must pass the same verify (a verified collective exchanges a "
                            "fingerprint first, which an unverified rank would not join)")
        self._peers = [(row[2], row[3]) for row in rows]

    def __repr__(self) -> str:
        """Its ranks are the group's, which every message names; over a group that is not the whole
        job, the repr says which global rank each is (found in review of sub-group meshes: a failure
        on global rank 3 of `new_group([3, 1], sort_ranks=False)`, its rank 0, read "rank 0", with
        torchrun's log saying [rank3])."""
        ranks = ("" if self._global is None
                 else f", global ranks {list(self._global)} (this rank {self._global[self._rank]})")
        return (f"DistMesh(world_size={self.world_size}, rank={self._rank}{ranks}, backend={self.backend!r}, "
                f"id={self.id})")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def asynchronous(self) -> bool:
        return self.world_size > 1

    @property
    def starts_agreed(self) -> bool:
        return self.verify or self.world_size == 1

    @property
    def all_reduce_is_reduce_scatter_gather(self) -> bool:
        """gloo at any N (at N > 2 torch's gloo reduce-scatter clones the input, all-reduces the
        whole clone and copies out this rank's chunk: the all-reduce of the same buffer, so the
        same bits; at N = 2 DistMesh reduce-scatters by one exchange and one addition,
        `_reduce_scatter_by_exchange`, the N <= 2 case); any backend at N <= 2
        (`Mesh.all_reduce_is_reduce_scatter_gather`). NCCL at N > 2 may add in other orders in
        the two (ring, tree): not claimed."""
        return self.backend == "gloo" or super().all_reduce_is_reduce_scatter_gather

    def _validate(self, op: str, x: torch.Tensor, arg: Any, tag: str | None) -> None:
        super()._validate(op, x, arg, tag)
        if self.backend in BACKENDS and x.device.type != self.device.type:
            where = f" (tag {tag!r})" if tag else ""
            raise MeshError(f"{op}{where}: {self!r} moves {self.device.type} tensors but got one on {x.device}; "
                            f"move it with .to(mesh.device)")

    # -- failures: a lost peer, a timeout ---------------------------------------------------------

    def _gone_peers(self, grace: float = _GRACE_S) -> list[tuple[int, int]]:
        """`(rank, pid)` of the peers on this host whose process exited, polled for up to `grace` s."""
        host = _identity()[0]
        local = [(s, pid) for s, (h, pid) in enumerate(self._peers) if h == host and s != self._rank]
        deadline = time.monotonic() + grace
        while local:
            gone = [(s, pid) for s, pid in local if _process_gone(pid)]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.05)
        return []

    def _lost(self, e: BaseException, what: str, started: float) -> MeshError:
        """The error for a collective that raised `e` (or timed out) after `started`; the mesh is
        unusable afterwards. Whether it timed out is read before the wait for a dying peer's process
        to show (up to _GRACE_S), which a timeout skips (its peers had the whole timeout to die):
        before, that wait counted as waiting, so a failure within _GRACE_S of a short timeout was
        called a timeout, and a timeout was raised _GRACE_S late."""
        timed_out = time.monotonic() - started >= self.timeout.total_seconds()
        gone, n = self._gone_peers(0.0 if timed_out else _GRACE_S), self.world_size
        if gone:
            err: MeshError = RankFailed(
                f"{self!r}: rank(s) {[s for s, _ in gone]} lost: process(es) {[p for _, p in gone]} on this "
                f"host exited while rank {self._rank} waited in {what}. The group (world size {n}) cannot go on "
                f"without them. {_exited_without(what, 'Such a rank')}. {self.backend} said: {e}")
        elif timed_out:
            building = (_CONSTRUCTION in what) * (
                "; or the ranks construct meshes over different process groups at this point, or over the same "
                "groups in another order: every rank of a group constructs its meshes over it in one order; a "
                "construction that timed out may leave its exchange to pair with a later one's, so restart the job")
            made = _CONSTRUCTED[0]
            crossed = (not building and made > 1) * (
                f"; or the ranks passed different DistMesh objects to this call (this process constructed {made}, "
                f"each of whose collectives meets only its own): every rank passes the mesh it constructed at the "
                f"same point of its program")  # (found in review: ranks on meshes A and B were told of a stuck rank)
            err = MeshError(
                f"{self!r}: ranks did not all reach {what} within {self.timeout.total_seconds():g} s "
                f"(world size {n}); a rank is stuck or took another path (see its log){building}{crossed}"
                f"{_waits_in(what, self._rank)}: {e}")
        else:
            host = _identity()[0]
            remote = [s for s, (h, _) in enumerate(self._peers) if h != host]
            maybe = (f"; no rank on this host exited, so one of rank(s) {remote} on other hosts was probably "
                     f"lost (see their logs)" if remote else "")
            who = "A rank that left the group (a closed connection: its process may take a while to exit)"
            left = f". {_exited_without(what, who)}. {self.backend} said" if _closed(e) else ""
            err = MeshError(f"{self!r}: {what} failed on rank {self._rank} (world size {n}){maybe}{left}: {e}")
        self._broken = err
        return err

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise type(self._broken)(f"{self!r} is unusable since an earlier collective failed: {self._broken}")
        if not torch.distributed.is_initialized():  # found in review: torch's "Default process group has not
            # been initialized" from inside the exchange
            raise MeshError(f"{self!r}: the process group is gone (torch.distributed.destroy_process_group() was "
                            f"called); a DistMesh lives as long as its group: make a new one after "
                            f"init_process_group, or call destroy_process_group after the mesh's last use")

    def _gather(self, mine: torch.Tensor, what: str) -> torch.Tensor:
        """`mine[K] -> rows[N * K]`, every rank's `mine` in rank order, waiting at most `timeout`."""
        self._check_usable()
        rows = mine.new_empty(self.world_size * mine.numel())
        started = time.monotonic()
        try:
            _all_gather_into(rows, mine, self.group, async_op=True).wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(e, what, started) from e
        return rows

    # -- agreement ------------------------------------------------------------------------------

    def _agree(self, kind: int, call: _Call | None, error: str = "") -> None:
        """All ranks exchange fingerprints; raise on every rank if any differs or failed. Where a
        rank failed (`_announce`: `error` its words), every rank is in this agreement, so they
        also exchange the failed ranks' words, which the others' `RankFailed` quotes, as SimMesh's
        does (found in review: "rank(s) [1] raised" named no error under torchrun)."""
        seq = self._seq
        what = f"{call or 'the end of mesh.run'} (collective #{seq})"
        mine = torch.tensor(_fingerprint(kind, seq, call), dtype=torch.int64, device=self.device)
        try:
            rows = self._gather(mine, what).view(self.world_size, _FP_LEN).tolist()
            constructing = [s for s, row in enumerate(rows) if row[0] == _KIND_CONSTRUCT]
            if constructing:  # those ranks raise in their construction: no text exchange they would not join,
                # and no sequence number taken (their own mesh took none), so this mesh goes on in step
                raise CollectiveMismatch(f"{self!r}: rank(s) {constructing} constructed a new DistMesh where rank "
                                         f"{self._rank} is at {what}: every rank must construct each DistMesh at the "
                                         f"same point of its program")
            self._seq += 1
            failed = [s for s, row in enumerate(rows) if row[0] == _KIND_FAIL]
            if failed:
                texts = self._gather_text(error if kind == _KIND_FAIL else "", what)
                said = "; ".join(f"rank {s} raised {texts[s]}" for s in failed if texts[s])
                if kind != _KIND_FAIL:
                    raise RankFailed(f"{self!r}: rank(s) {failed} raised; rank {self._rank} stops at {what}"
                                     + (f" ({said})" if said else ""))
            if not failed and any(row != rows[0] for row in rows):
                # every rank sees the same rows, so every rank is here: exchange the calls in words
                mine_text = (f"{call} collective #{seq}" if kind == _KIND_CALL else
                             f"returned from mesh.run (collective #{seq})")
                texts = self._gather_text(mine_text, what)
                lines = "\n".join(f"  rank {s}: {t}" for s, t in enumerate(texts))
                alike = kind == _KIND_CALL and all(row[:-1] == rows[0][:-1] for row in rows)
                raise CollectiveMismatch(
                    f"{self!r}: ranks called different collectives at collective #{seq}:\n{lines}\n"
                    f"{_advice(call.op if call else '', [bool(row[-1]) for row in rows] if alike else None, texts)}")
        except BaseException as e:  # (a try costs nothing until it catches)
            self._break_if_interrupted(e, what)
            raise

    def _break_if_interrupted(self, e: BaseException, what: str) -> None:
        """Mark the mesh unusable (`_broken`) where `e` stopped `what`'s agreement -- its exchanges,
        from the fingerprints' all-gather to the sequence number taken and the calls' words
        gathered -- or the start of an agreed collective's data exchange (`_start`), `e` being
        anything but the mesh's own outcome (a `MeshError`: a mismatch, a failed or lost rank, each
        raised on every rank in step): a `KeyboardInterrupt`, or an exception a signal handler
        raised, midway, at N > 1. An exchange may have been issued, or finished on the other
        ranks, which then went on past it (to the collective's data, or the next agreement), while
        this rank's sequence number stayed behind or its data exchange never started: its next
        collective met theirs out of step, a fingerprint all-gather against their data collective,
        which waited out the whole timeout and was called a stuck rank, or mixed buffers silently
        where the two looked alike (found in review). Now the next call raises at once, saying so.
        The interrupt itself goes on as it was raised (the callers' `except` re-raises it; a `try`
        costs nothing until it catches). The other ranks are not told (`guard`'s announcement
        would be one more exchange out of step): they stop at the timeout, or at once with
        `RankFailed` where this rank's process exits."""
        if self.world_size > 1 and not isinstance(e, MeshError):  # one rank is never out of step with itself
            self._broken = _interrupted(self, e, what)

    def _gather_text(self, text: str, what: str) -> list[str]:
        """Every rank's `text`, in rank order (two all-gathers: lengths, then padded UTF-8 bytes)."""
        data = list(text.encode(errors="backslashreplace"))  # (a lone surrogate, a path decoded with
        # surrogateescape: strict encoding raised here, after the others had entered the exchange; found in review)
        lengths = self._gather(torch.tensor([len(data)], dtype=torch.int64, device=self.device), what).tolist()
        buf = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        buf[: len(data)] = torch.tensor(data, dtype=torch.uint8)
        rows = self._gather(buf, what).view(self.world_size, max(lengths)).tolist()
        return [bytes(row[:k]).decode(errors="replace") for row, k in zip(rows, lengths)]

    # -- moving data ----------------------------------------------------------------------------

    def _exchange(self, call: _Call, x: torch.Tensor) -> torch.Tensor:
        return self._start(call, x).wait()

    def _start(self, call: _Call, x: torch.Tensor, donate: bool = False, out: torch.Tensor | None = None) -> Pending:
        """Agree on `call` and start it, with Ctrl-C held from the agreement until it is started on
        every rank (`HeldInterrupts`): a held interrupt is raised then, the collective kept by the
        mesh (`abandon`), which stays usable (row 177) where an interrupt inside the agreement
        makes it unusable (row 171: a second Ctrl-C still can). At N = 1 nothing is held (one rank
        is never out of step with itself): no handler swap on that path."""
        with HeldInterrupts(self.world_size > 1) as held:
            self._check_usable()
            if self.verify:
                self._agree(_KIND_CALL, call)
            what = f"{call} (collective #{self._seq - 1})" if self.verify else str(call)
            started = time.monotonic()
            try:  # agreed (or unverified): the others start it
                out, work = self._move(call, x, donate, out)
            except RuntimeError as e:
                raise self._lost(e, what, started) from e
            except BaseException as e:
                self._break_if_interrupted(e, what)
                raise
            pending = Pending(out, work, keep=x, lost=lambda e: self._lost(e, what, started), abandon=self.abandon)
        if held.pending:
            try:
                held.deliver()
            except BaseException:
                self.abandon(pending)
                raise
        return pending

    def _p2p_tag(self, call: _Call) -> int:
        """The tag of `call`'s point-to-point exchange (gloo at N = 2): a CRC-32, in a range of its
        own (2^30 and up, below gloo's limit of 2^31), of the mesh's ordinal (`_agreed_ordinal`),
        its era, what the call is (op, dtype, shape, tag) and how many such exchanges the mesh
        issued before in the era. gloo matches a receive with the first send of the same tag,
        first in, first out. With one tag for all, an exchange that only one rank started (over
        `DistMesh(verify=False)`: a gather prefetched before that rank raised, where its peer had
        raised earlier) fed its bits to the next exchange if kept, silently, and hung it if
        dropped; with no ordinal, two meshes over one group (each counting from 0) fed each other
        alike (both found in review). Now such an exchange matches no other: the same
        collective's next one, counted once more on one rank than on the other, waits out the
        timeout (`MeshError`) there, while the other rank may take the kept exchange's stale bits
        (docs/bad-input.md, `DistMesh(verify=False)`). Alike tags of exchanges both ranks post in
        one order (a CRC collision) still pair first in, first out: rightly.

        Bounded (found in review: a count per distinct collective for ever, so a `mesh.collective`
        whose tag names the step grew the mesh without bound): at most `_TAG_KEYS` collectives are
        counted; a new one past that clears the counts and starts the next era. Ranks that issue
        the same exchanges clear at the same one. The era is in the tag because an exchange may
        stay in flight past any number of later ones (kept by `abandon`): with counts restarted
        and no era, a new exchange could take a kept one's tag. Where the ranks' sequences already
        differ (above), their clears may fall apart, and the exchanges between are tagged apart:
        the same wait to the timeout. Cost: a dict look-up and store, and a length check for a
        collective new to the era."""
        key = (call.op, str(call.dtype), call.shape, call.tag)
        counts = self._exchanges
        count = counts.get(key, -1) + 1
        if not count and len(counts) >= _TAG_KEYS:  # a collective new to a full era: start the next era
            counts.clear()
            self._era += 1
        counts[key] = count
        return (1 << 30) | (zlib.crc32(repr((self._ordinal, self._era, key, count)).encode()) >> 2)

    def abandon(self, pending: Any) -> None:
        """Keep a started collective this rank will not wait for: over `DistMesh(verify=False)`
        a rank that raised leaves the gathers it prefetched, the refills it started for its
        backward, the reductions its backward started and those `reduce` / `update` started
        (`unit.settle_flights`) unwaited (its peers
        may never have started them, `starts_agreed`). gloo cancels a point-to-point send or
        receive whose work handle is freed, so where the peer did start it and waits for it,
        dropping it here left the peer waiting to the timeout (found in review: a flaky test).
        Only such exchanges are kept (`Pending.cancelled_if_dropped`): a backend's own
        collective (gloo's all-reduce, gloo at N > 2, every NCCL collective) runs to the end
        without its handle, and keeping it held its buffers -- a stage-3 unit's gather, a
        bucket's reduction -- until later errors pushed it out (found in review). What the last
        `_ABANDONED` calls kept is kept, each call's as one entry; each holds its buffers."""
        # those waited for since (a retried wait) let go, with their buffers; one handed on again (an
        # interrupted `Pending.wait` hands itself on, then the step's bookkeeping) kept once (found in review)
        live = [entry for entry in self._abandoned if not all(getattr(p, "done", False) for p in entry)]
        held = {id(p) for entry in live for p in entry}
        kept = tuple(p for p in _cancelled_if_dropped(pending) if id(p) not in held)
        if kept:
            self._abandoned.clear()
            self._abandoned.extend(live)
            self._abandoned.append(kept)

    def _move(self, call: _Call, x: torch.Tensor, donate: bool = False,
              into: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Issue `call` asynchronously: `(its result, once waited for; the work handle)`. An
        all-reduce or broadcast runs in place on a copy of `x`, or on `x` itself where donated;
        an all-gather into `into` where given."""
        dist, n = torch.distributed, self.world_size
        if call.op == "all_reduce":
            out = x if donate else x.clone()
            work = dist.all_reduce(out, op=dist.ReduceOp.SUM if call.arg == "sum" else dist.ReduceOp.MAX,
                                   group=self.group, async_op=True)
        elif call.op == "broadcast":
            out = x if donate else x.clone()
            work = dist.broadcast(out, src=dist.get_global_rank(self.group, call.arg) if self.group else call.arg,
                                  group=self.group, async_op=True)
        elif call.op == "all_gather" and self.backend == "gloo" and n == 2:
            out, work = _all_gather_by_exchange(x, self.group, self._rank, into, self._p2p_tag(call))
        elif call.op == "all_gather":
            out = x.new_empty((n * x.shape[0], *x.shape[1:])) if into is None else into
            if into is not None and self.backend != "nccl" and _overlaps(x, into):
                x = x.clone()  # NCCL gathers in place (its chunk of `into`); gloo copies it in with memcpy
            work = _all_gather_into(out, x, self.group, async_op=True)
        elif self.backend == "gloo" and n == 2 and x.dtype in _EXCHANGED:
            out, work = _reduce_scatter_by_exchange(x, self.group, self._rank, self._p2p_tag(call))
        else:
            out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
            work = _reduce_scatter_into(out, x, self.group, async_op=True)
        return out, work

    def _announce(self, e: BaseException) -> None:
        """A FAIL row in the agreement the other ranks wait in (with `verify`; before, every
        MeshError passed untold, so the others waited in their collective for one that a rank's
        own argument check refused; found in review)."""
        if self.verify:
            with contextlib.suppress(MeshError):
                self._agree(_KIND_FAIL, None, _words(e))
            self._announced = self._seq
            _mark(e, "_fzero_told")

    def _told(self, e: BaseException) -> bool:
        """Whether the other ranks were told of this failure already: an enclosing guard of this
        mesh announced `e`, or the exception it was raised from or while handling (a guard
        nested in another, re-raising or wrapping it), and no collective ran since. A new failure
        right after one (a rank that caught an error and called again, with no collective in
        between) is announced: the others wait in that call's first collective."""
        return self._announced == self._seq and _marked_told(e)

    def run(self, fn: Callable[..., Any], per_rank_args: Sequence[Any] | Callable[[int], Any] = ()) -> list[Any]:
        args = _per_rank_args(per_rank_args, self._rank, self.world_size)
        with self.guard():
            out = fn(*args)
        if self.verify:
            self._agree(_KIND_DONE, None)
        return [out]
