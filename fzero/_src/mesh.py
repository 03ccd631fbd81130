"""Meshes: where ranks live and how their collectives move data.

One interface, two backends:

- `SimMesh(N)`: N virtual ranks in one process, as threads of which exactly one runs at a time.
  A rank runs until it calls a collective, then hands over to the next rank; the last rank to
  arrive computes the result, reducing in rank order (0, 1, ..., N-1), and rank 0 resumes. Each
  rank has its own torch RNG state, swapped in whenever the rank resumes. Deterministic: the
  same program gives the same bits on every run. CPU tensors only (on CUDA, autograd's device
  thread would run every rank's backward).
- `DistMesh()`: one rank per process of a `torch.distributed` process group (gloo on CPU, NCCL
  on GPU) started by `torchrun`.

Both expose the shard-axis size `world_size`, the running `rank`, `run(fn, per_rank_args)`, and
the backend primitive `collective(op, x, ...)` that `fzero._src.collectives` dispatches to. Every
collective passes through `Mesh.collective`, which checks that ranks agree, records it for the
accounting hooks (`Mesh.record`) and only then moves data.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import datetime
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .errors import CollectiveMismatch, MeshError, RankFailed
from .layout import check_world_size

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
REDUCTIONS = ("sum", "max")


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as one rank called it.

    `elements` counts the whole logical buffer: `N * S` for all_gather (output) and
    reduce_scatter (input), the tensor's numel for all_reduce and broadcast. `bytes` is
    `elements * itemsize`. `tag` names what moved (e.g. a bucket's tag) or is None.
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

    def __str__(self) -> str:
        arg = "" if self.arg is None else f", {self.arg}"
        tag = "" if self.tag is None else f", tag={self.tag!r}"
        return f"{self.op}({str(self.dtype).removeprefix('torch.')}{list(self.shape)}{arg}{tag})"


def _describe(op: str, x: torch.Tensor, arg: Any, tag: str | None) -> _Call:
    return _Call(op, x.dtype, tuple(x.shape), arg, tag)


def _elements(op: str, x: torch.Tensor, world_size: int) -> int:
    return x.numel() * world_size if op == "all_gather" else x.numel()


class Mesh(abc.ABC):
    """The shard axis of a device mesh. `world_size` ranks; `rank` is the one running now."""

    axis_name = "shard"
    device = torch.device("cpu")  # where the mesh's own small tensors (fingerprints, flags) live

    def __init__(self, world_size: int) -> None:
        self.world_size = check_world_size(world_size)
        self._recorders: list[list[CollectiveRecord]] = []

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """The rank whose code is running now."""

    @property
    @abc.abstractmethod
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks this process runs: all N on SimMesh, one on DistMesh."""

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], per_rank_args: Sequence[Any] | Callable[[int], Any] = ()) -> list[Any]:
        """Run `fn(*args_r)` on every rank r of `local_ranks`; return their results in that order.

        `per_rank_args` is a sequence of N argument tuples (indexed by rank), or a callable
        `rank -> tuple`, or `()` for no arguments. If any rank raises, every rank stops (none
        hangs) and `run` raises that rank's exception.
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
    def guard(self) -> Iterator[None]:
        """Wrap one rank's part of a multi-rank computation: if it raises, the other ranks are told
        (DistMesh) so they stop with `RankFailed` instead of waiting. SimMesh.run does this itself."""
        yield

    def collective(self, op: str, x: torch.Tensor, *, arg: Any = None, tag: str | None = None) -> torch.Tensor:
        """The one entry point of every collective: validate, record, agree, move.

        Shapes: all_reduce / broadcast `x[...] -> [...]`; all_gather `x[S, ...] -> [N * S, ...]`;
        reduce_scatter `x[N * S, ...] -> [S, ...]` (rank r gets rows `[r * S, (r + 1) * S)`).
        """
        self._validate(op, x, arg, tag)
        call = _describe(op, x, arg, tag)
        rank = self.rank
        elements = _elements(op, x, self.world_size)
        for log in self._recorders:
            log.append(CollectiveRecord(rank, op, arg if op == "all_reduce" else None, x.dtype,
                                        elements, elements * x.element_size(), tag))
        return self._exchange(call, x.detach().contiguous())

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
                f"{self.world_size}; pad it to a multiple of {self.world_size} (fzero.plan does)"
            )


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


def _combine(call: _Call, xs: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The serial meaning of each collective, reducing in rank order 0, 1, ..., N-1."""
    if call.op == "all_gather":
        out = torch.cat(xs)
        return [out.clone() for _ in range(n)]
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


class SimMesh(Mesh):
    """N virtual ranks in one process; see the module docstring.

    Example:
      >>> mesh = fzero.SimMesh(4)
      >>> mesh.run(lambda x: fzero.all_reduce(x, mesh), [(torch.tensor([float(r)]),) for r in range(4)])
      [tensor([6.]), tensor([6.]), tensor([6.]), tensor([6.])]

    Every rank starts `run` from the caller's RNG state (as N processes seeded alike); the
    caller's state is restored afterwards.
    """

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self._cond = threading.Condition()
        self._running = False
        self._current: int | None = None

    def __repr__(self) -> str:
        return f"SimMesh({self.world_size})"

    @property
    def rank(self) -> int:
        if self._current is None:
            raise MeshError(f"{self!r}: no rank is running; call collectives inside mesh.run(fn, ...)")
        return self._current

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    # -- scheduling: exactly one rank holds the turn -------------------------------------------

    def _take_turn(self, r: int) -> None:
        """Block until rank r holds the turn, then make it the running rank (cond held)."""
        self._cond.wait_for(lambda: self._turn == r)
        self._current = r
        torch.set_rng_state(self._rng[r])

    def _pass_turn(self, r: int) -> None:
        """Save rank r's RNG state and give the turn to the next rank still running (cond held)."""
        self._rng[r] = torch.get_rng_state()
        self._current = None
        n = self.world_size
        later = [(r + k) % n for k in range(1, n + 1)]
        self._turn = next((s for s in later if self._status[s] in ("run", "wait")), None)
        self._cond.notify_all()

    def _poison(self, error: MeshError) -> None:
        if self._error is None:
            self._error = error

    def _waiting(self) -> list[int]:
        """Ranks that deposited into the current, incomplete round."""
        return [s for s, slot in enumerate(self._slots) if slot is not None]

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
            self._slots[r] = (call, x)
            self._status[r] = "wait"
            if len(self._waiting()) == self.world_size:
                self._complete_round()
            self._pass_turn(r)
            self._take_turn(r)
            self._status[r] = "run"
            if self._error is not None:
                raise self._error
            out = self._results[r]
            self._results[r] = None
            return out

    def _complete_round(self) -> None:
        calls = [c for c, _ in self._slots]
        if any(c != calls[0] for c in calls):
            lines = "\n".join(f"  rank {s}: {c}" for s, c in enumerate(calls))
            self._poison(CollectiveMismatch(
                f"{self!r}: ranks called different collectives at collective #{self._round}:\n{lines}\n"
                f"every rank must call the same op with the same dtype, shape and tag"))
        else:
            self._results = _combine(calls[0], [x for _, x in self._slots], self.world_size)
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
        caller_rng = torch.get_rng_state()
        grad_enabled = torch.is_grad_enabled()
        self._rng = [caller_rng.clone() for _ in range(n)]
        self._status = ["run"] * n
        self._slots: list[Any] = [None] * n
        self._results: list[Any] = [None] * n
        self._error: MeshError | None = None
        self._round = 0
        self._turn: int | None = 0
        outputs: list[Any] = [None] * n
        failures: list[tuple[int, BaseException]] = []

        def main(r: int) -> None:
            with self._cond:
                self._take_turn(r)
            try:
                with torch.set_grad_enabled(grad_enabled):
                    outputs[r] = fn(*args[r])
            except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
                with self._cond:
                    failures.append((r, e))
                    self._status[r] = "fail"
                    if not isinstance(e, MeshError):
                        self._poison(RankFailed(f"{self!r}: rank {r} raised {type(e).__name__}: {e}"))
                    self._pass_turn(r)
                return
            with self._cond:
                self._status[r] = "done"
                waiting = self._waiting()
                if waiting:
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
            torch.set_rng_state(caller_rng)
            with self._cond:
                self._running = False
                self._current = None
        if failures:
            own = [(r, e) for r, e in failures if not isinstance(e, MeshError)]
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

_KIND_CALL, _KIND_DONE, _KIND_FAIL = 1, 2, 3
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
_FP_LEN = 11


def _crc(s: Any) -> int:
    return zlib.crc32(repr(s).encode())


def _fingerprint(kind: int, seq: int, call: _Call | None) -> list[int]:
    """`[kind, seq, op, dtype, ndim, d0, d1, d2, d3 (product of the rest), arg, tag crc]`; arg is the
    reduction's index in REDUCTIONS (all_reduce), the source rank (broadcast), or -1."""
    if call is None:
        return [kind, seq] + [0] * (_FP_LEN - 2)
    dtype = _DTYPES.index(call.dtype) if call.dtype in _DTYPES else 99
    dims = list(call.shape[:3]) + [-1] * (3 - min(3, len(call.shape)))
    rest = call.shape[3:]
    dims.append(-1 if not rest else int(torch.tensor(rest).prod()))
    arg = REDUCTIONS.index(call.arg) if call.op == "all_reduce" else (call.arg if call.op == "broadcast" else -1)
    return [kind, seq, OPS.index(call.op), dtype, len(call.shape), *dims, arg, _crc(call.tag)]


def _all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """The compatibility shim: `all_gather_single` where torch has it (2.13 deprecates
    `all_gather_into_tensor` with a FutureWarning), the older name elsewhere (2.11)."""
    fn = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def _reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: Any) -> Any:
    """`reduce_scatter_single` where torch has it, `reduce_scatter_tensor` elsewhere."""
    fn = getattr(torch.distributed, "reduce_scatter_single", None) or torch.distributed.reduce_scatter_tensor
    return fn(out, x, group=group)


class DistMesh(Mesh):
    """One rank per process of a torch.distributed process group, started by `torchrun`.

    If no process group exists, one is started from torchrun's environment: NCCL when CUDA is
    available (device `cuda:LOCAL_RANK`), gloo otherwise.

    Args:
      group: a process group, or None for the default group.
      verify: before each collective, all ranks exchange a fingerprint (op, dtype, shape, tag,
        sequence number) and raise on every rank if they differ or if a rank failed, instead of
        hanging or silently mixing buffers. Costs one small all-gather per collective; turn it off
        for speed once a program is known to be right.
      timeout: how long a fingerprint exchange waits for the other ranks.

    Example (run under `torchrun --nproc-per-node 2 script.py`):
      >>> mesh = fzero.DistMesh()
      >>> fzero.all_reduce(torch.ones(3), mesh)
      tensor([2., 2., 2.])
    """

    def __init__(self, group: Any = None, *, verify: bool = True,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120)) -> None:
        dist = torch.distributed
        if not dist.is_available():
            raise MeshError("DistMesh needs torch.distributed, which this torch build lacks")
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise MeshError(
                    "DistMesh found no process group and no torchrun environment (RANK, WORLD_SIZE); "
                    "start the script with `torchrun --nproc-per-node N script.py`, or use fzero.SimMesh(N)")
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
                dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
            else:
                dist.init_process_group("gloo")
        self.group = group
        super().__init__(dist.get_world_size(group))
        self._rank = dist.get_rank(group)
        self.verify = verify
        self.timeout = timeout
        self._seq = 0
        self._announced = -1  # the sequence number after the last failure this rank announced
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def __repr__(self) -> str:
        return f"DistMesh(world_size={self.world_size}, rank={self._rank})"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return (self._rank,)

    def _agree(self, kind: int, call: _Call | None) -> None:
        """All ranks exchange fingerprints; raise on every rank if any differs or failed."""
        mine = torch.tensor(_fingerprint(kind, self._seq, call), dtype=torch.int64, device=self.device)
        rows = mine.new_empty(self.world_size * _FP_LEN)
        work = _all_gather_into(rows, mine, self.group, async_op=True)
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise MeshError(
                f"{self!r}: ranks did not all reach {call or 'the end of mesh.run'} within "
                f"{self.timeout.total_seconds():.0f} s (collective #{self._seq}): {e}") from e
        rows = rows.view(self.world_size, _FP_LEN).tolist()
        self._seq += 1
        failed = [s for s, row in enumerate(rows) if row[0] == _KIND_FAIL]
        if failed and kind != _KIND_FAIL:
            raise RankFailed(f"{self!r}: rank(s) {failed} raised; rank {self._rank} stops at "
                             f"{call or 'the end of mesh.run'} (collective #{self._seq - 1})")
        if not failed and any(row != rows[0] for row in rows):
            mine_tag = _crc(call.tag) if call is not None else None
            theirs = "\n".join(f"  rank {s}: {call if s == self._rank and call else _decode(row, mine_tag)}"
                               for s, row in enumerate(rows))
            raise CollectiveMismatch(
                f"{self!r}: ranks called different collectives at collective #{self._seq - 1}:\n{theirs}\n"
                f"every rank must call the same op with the same dtype, shape and tag")

    def _exchange(self, call: _Call, x: torch.Tensor) -> torch.Tensor:
        if self.verify:
            self._agree(_KIND_CALL, call)
        dist, n = torch.distributed, self.world_size
        if call.op == "all_reduce":
            out = x.clone()
            dist.all_reduce(out, op=dist.ReduceOp.SUM if call.arg == "sum" else dist.ReduceOp.MAX, group=self.group)
        elif call.op == "broadcast":
            out = x.clone()
            dist.broadcast(out, src=dist.get_global_rank(self.group, call.arg) if self.group else call.arg,
                           group=self.group)
        elif call.op == "all_gather":
            out = x.new_empty((n * x.shape[0], *x.shape[1:]))
            _all_gather_into(out, x, self.group)
        else:
            out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
            _reduce_scatter_into(out, x, self.group)
        return out

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        except MeshError:
            raise
        except BaseException:
            if self.verify and self._announced != self._seq:  # once per failure, however often re-raised
                with contextlib.suppress(MeshError):
                    self._agree(_KIND_FAIL, None)
                self._announced = self._seq
            raise

    def run(self, fn: Callable[..., Any], per_rank_args: Sequence[Any] | Callable[[int], Any] = ()) -> list[Any]:
        args = _per_rank_args(per_rank_args, self._rank, self.world_size)
        with self.guard():
            out = fn(*args)
        if self.verify:
            self._agree(_KIND_DONE, None)
        return [out]


def _decode(row: list[int], my_tag_crc: int | None) -> str:
    """Another rank's fingerprint in words (its tag is known only as equal to this rank's or not)."""
    kind, seq, op, dtype, ndim = row[:5]
    if kind == _KIND_DONE:
        return f"returned from mesh.run (collective #{seq})"
    if kind == _KIND_FAIL:
        return f"raised (collective #{seq})"
    dt = str(_DTYPES[dtype]).removeprefix("torch.") if dtype < len(_DTYPES) else "?"
    shape = [d for d in row[5:9] if d >= 0][:ndim]
    name = OPS[op]
    arg = "" if row[9] < 0 else f", {REDUCTIONS[row[9]] if name == 'all_reduce' else row[9]}"
    tag = "" if row[10] == my_tag_crc else ", another tag"
    return f"{name}({dt}{shape}{arg}{tag}) collective #{seq}"
