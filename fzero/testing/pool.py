"""A persistent group of `torchrun` worker processes for testing code on a real process group.

Starting a torchrun job costs seconds (about 6 s for 2 gloo ranks, 12 s for 4), far too much
for one job per hypothesis draw. A `Pool` starts one job and keeps it: the test process opens a
`multiprocessing.connection.Listener` on 127.0.0.1 (random port, random authkey) and runs

    torchrun --standalone --nproc-per-node N -m fzero.testing._worker

with the address and authkey in the environment. Each worker turns warnings into errors, builds
`fzero.DistMesh(backend="gloo")` (gloo on CPU, also on a machine with GPUs), connects back and
serves calls: `pool.run(fn, per_rank_args)` ships a reference to `fn` ("module:qualname", so `fn`
must be importable) and rank r's arguments to rank r, which runs `fn(mesh, *args_r)` on a fresh
`DistMesh` and sends back the result or the exception. Draw data in the test process and ship
it; the workers only compute.

Example (two files; `cases.py` is importable from the test process's `sys.path`; tests/test_dist.py
and tests/dist_cases.py are this pattern at full size):

    # cases.py
    def gather(mesh, x):
        return fzero.collectives.all_gather(x, mesh)

    # test_x.py
    with Pool(2) as pool:
        pool.run(cases.gather, [(torch.ones(1),), (torch.zeros(1),)])  # [tensor([1., 0.]), tensor([1., 0.])]

Messages are pickled with the standard pickler (`send_bytes`), never torch's shared-memory
reducers, so tensors travel by value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

from fzero._src.mesh import _per_rank_args  # the one rule for per-rank arguments (SimMesh.run, DistMesh.run)

ENV_ADDRESS = "FZERO_POOL_ADDRESS"
ENV_AUTHKEY = "FZERO_POOL_AUTHKEY"
ENV_SYS_PATH = "FZERO_POOL_SYS_PATH"


class PoolError(RuntimeError):
    """The pool could not start, or a call failed after its first message was sent (it timed out,
    a worker died, a reply did not unpickle, a rank raised and its peers did not answer within
    `Pool.error_grace`): the pool is closed, its workers killed.

    `errors` lists, in rank order, the `RemoteError`s of the ranks that had raised before the
    call failed (empty if none had): where one rank raises while its peers wait for it in a
    collective, that exception is the cause, and the message (`message`, the error's text) leads
    with it."""

    def __init__(self, message: str, errors: Sequence[RemoteError] = ()) -> None:
        super().__init__(message)
        self.errors = list(errors)


@dataclasses.dataclass
class RemoteError:
    """An exception raised by `fn` on one worker, as text (and as the exception, if it pickles):
    the worker's `rank`, the exception's `type_name`, `message` and formatted `traceback`, and
    `exception` itself, or None where it did not pickle."""

    rank: int
    type_name: str
    message: str
    traceback: str
    exception: BaseException | None

    def __str__(self) -> str:
        return f"rank {self.rank} raised {self.type_name}: {self.message}\n{self.traceback}"


class WorkerError(RuntimeError):
    """`fn` raised on one or more ranks; `errors` lists them in rank order."""

    def __init__(self, errors: list[RemoteError]) -> None:
        self.errors = errors
        ranks = [e.rank for e in errors]
        body = "\n".join(f"--- rank {e.rank} ---\n{e}" for e in errors)
        super().__init__(f"fn raised on rank(s) {ranks}:\n{body}")


def reference(fn: Callable[..., Any] | str) -> str:
    """`fn -> "module:qualname"`, checking that a worker can import it."""
    if isinstance(fn, str):
        return fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"pool.run needs a module-level function that workers can import; got {fn!r} "
            f"(module {module!r}, qualname {qualname!r}): move it to an importable module")
    return f"{module}:{qualname}"


@dataclasses.dataclass
class Died:
    """A rank of `run_job` whose process ended without a result: killed by a signal (negative
    `returncode`, as `subprocess` reports it) or exited before answering."""

    rank: int
    returncode: int
    log: str

    def __str__(self) -> str:
        return f"rank {self.rank} died with return code {self.returncode}\n{self.log}"


def _check_nproc(nproc: Any, where: str) -> int:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"{where}: nproc must be an int >= 1 (the number of worker ranks), got {nproc!r}")
    return nproc


def _check_seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{where} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


class Pool:
    """N torchrun workers on one gloo process group, serving `run` calls until `close`.

    Args:
      nproc: the world size N, an int >= 1.
      timeout: default seconds a `run` call may take before the pool is declared hung and closed.
      start_timeout: seconds to wait for all workers to connect.
      error_grace: None (the default) or the seconds the other ranks of a call may still take
        once one rank has raised; past it the pool is declared hung and closed, and `PoolError`
        leads with the exception. A rank that raises outside `mesh.run` leaves its peers waiting
        in their next collective until the process group's timeout, so without it such a call
        ends at `timeout` (a `PoolError` that leads with the exception too; before, it named only
        the ranks that did not answer, the exception lost: found in review). Off by default: a
        peer that is only slow -- still working, with no collective, when another rank raised an
        exception the test expects -- is killed past it, `return_exceptions=True` included, and
        the call raises `PoolError`, not `WorkerError` (found in review). fzero's own suite
        passes 10 (tests/conftest.py).
    """

    #: seconds between SIGTERM and SIGKILL when a failed call kills the workers
    KILL_GRACE = 2.0

    def __init__(self, nproc: int, *, timeout: float = 120.0, start_timeout: float = 180.0,
                 error_grace: float | None = None) -> None:
        self.nproc = _check_nproc(nproc, "Pool")
        self.timeout = timeout
        self.error_grace = None if error_grace is None else _check_seconds(error_grace, "Pool: error_grace")
        self._closed = False
        self._conns: list[Connection] = []
        authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        env = dict(os.environ)
        env.update({
            ENV_ADDRESS: f"{host}:{port}",
            ENV_AUTHKEY: authkey.hex(),
            ENV_SYS_PATH: json.dumps([p for p in sys.path if p and os.path.isdir(p)]),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        })
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="fzero-pool-", suffix=".log", delete=False)
        cmd = [*_torchrun(), "--standalone", "--nproc-per-node", str(nproc), "-m", "fzero.testing._worker"]
        self._proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._accept(start_timeout)
        except BaseException:
            self.close()
            raise

    def _accept(self, start_timeout: float) -> None:
        hello: dict[int, Connection] = {}
        failure: list[BaseException] = []

        def accept() -> None:
            try:
                while len(hello) < self.nproc:
                    conn = self._listener.accept()
                    kind, rank, world = pickle.loads(conn.recv_bytes())
                    if kind != "hello" or world != self.nproc:
                        raise PoolError(f"worker said {kind!r} for rank {rank} of world {world}")
                    hello[rank] = conn
            except BaseException as e:  # noqa: BLE001 - reported by the waiting thread
                failure.append(e)

        thread = threading.Thread(target=accept, daemon=True, name="fzero-pool-accept")
        thread.start()
        deadline = time.monotonic() + start_timeout
        while thread.is_alive():
            thread.join(0.1)
            if self._proc.poll() is not None or time.monotonic() > deadline:
                break
        if failure or len(hello) < self.nproc:
            why = (f"torchrun exited with {self._proc.returncode}" if self._proc.poll() is not None
                   else f"only {len(hello)} of {self.nproc} workers connected within {start_timeout:.0f} s")
            raise PoolError(f"could not start the pool: {why}; {failure or ''}\n{self.log_tail()}")
        self._conns = [hello[r] for r in range(self.nproc)]

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid {self._proc.pid}"
        return f"Pool(nproc={self.nproc}, {state})"

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    def log_tail(self, chars: int = 6000) -> str:
        """The last `chars` bytes of torchrun's combined output (its workers' stdout and stderr),
        decoded."""
        try:
            text = Path(self._log.name).read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""
        return f"--- torchrun output (tail) ---\n{text}"

    def run(
        self,
        fn: Callable[..., Any] | str,
        per_rank_args: Sequence[Any] | Callable[[int], Any] = (),
        *,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Run `fn(mesh, *args_r)` on every rank r; return the N results in rank order.

        Args:
          fn: a module-level function (or "module:qualname") the workers can import.
          per_rank_args: N argument tuples (indexed by rank), a callable `rank -> tuple`, or `()`.
          timeout: seconds for the whole call (default: the pool's); on expiry the pool is
            closed at once, its workers killed (a hung collective cannot be cancelled), and
            `PoolError` is raised.
          return_exceptions: put a `RemoteError` in place of a failed rank's result instead of
            raising `WorkerError`.

        Every rank's message is pickled before any is sent: arguments that do not pickle raise
        ValueError and leave the pool open. Any failure after the first send (a timeout, a dead
        worker, a reply that does not unpickle, ranks still silent `error_grace` seconds after
        one raised) kills the workers at once and raises `PoolError`, which leads with, and
        carries in `errors`, the exceptions of the ranks that had raised (KeyboardInterrupt and
        SystemExit kill them too, and propagate): a rank may hold a call or a reply that the next
        call would read, so the pool is never reused.
        """
        if not self.alive:
            raise PoolError(f"{self!r} is not running")
        ref = reference(fn)
        messages = [self._message(ref, _per_rank_args(per_rank_args, r, self.nproc), r) for r in range(self.nproc)]
        try:
            for conn, message in zip(self._conns, messages):
                conn.send_bytes(message)
            replies = self._replies(ref, self.timeout if timeout is None else timeout)
        except PoolError:
            raise  # the pool is already closed
        except Exception as e:
            # Some ranks may have a call, or a reply, the next call would read: never reuse the pool.
            self._abort()
            raise PoolError(f"{ref}: the call failed after it was sent ({e!r}); the pool is closed (its workers "
                            f"are killed): start a new Pool\n{self.log_tail()}") from e
        except BaseException:
            self._abort()  # KeyboardInterrupt, SystemExit: the workers go too
            raise
        results, errors = [], []
        for r in range(self.nproc):
            kind, *payload = replies[r]
            if kind == "ok":
                results.append(payload[0])
            else:
                err = RemoteError(r, *payload)
                errors.append(err)
                results.append(err)
        if errors and not return_exceptions:
            raise WorkerError(errors)
        return results

    @staticmethod
    def _message(ref: str, args: Any, rank: int) -> bytes:
        """Rank `rank`'s call, pickled; every rank's is pickled before any is sent, so an argument
        that does not pickle leaves the pool as it was."""
        try:
            return pickle.dumps(("call", ref, args))
        except Exception as e:
            raise ValueError(f"pool.run({ref}): rank {rank}'s arguments cannot be pickled ({e!r}); nothing was "
                             f"sent and the pool is still open: pass picklable values (module-level functions, "
                             f"tensors, containers)") from e

    def _replies(self, ref: str, timeout: float) -> dict[int, Any]:
        """Every rank's unpickled reply, or PoolError (pool closed) on a timeout, a dead worker, or
        ranks still silent `error_grace` seconds after a rank raised; the PoolError carries the
        exceptions already received (`_failed`)."""
        replies: dict[int, Any] = {}
        pending = {conn: r for r, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        within = f"{timeout:g} s"
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._abort()
                hint = ("; waiting, most likely, in a collective for the rank that raised (`mesh.run`'s guard stops "
                        "the other ranks of a verified DistMesh with RankFailed where they wait in one of fzero's "
                        "collectives, not in DDP's or in raw torch.distributed calls: agree between those yourself, "
                        "as fzero.testing's ddp_trajectory does)"
                        if _errors(replies) else "")
                raise self._failed(ref, replies, f"rank(s) {sorted(pending.values())} did not answer within "
                                                  f"{within}{hint}")
            for conn in ready:
                r = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError) as e:
                    self._abort()
                    raise self._failed(ref, replies, f"worker {r} died ({e!r})") from e
                replies[r] = pickle.loads(data)
                if replies[r][0] != "ok" and self.error_grace is not None:
                    graced = time.monotonic() + self.error_grace
                    if graced < deadline:
                        deadline, within = graced, f"{self.error_grace:g} s of rank {r}'s error (error_grace)"
        return replies

    def _failed(self, ref: str, replies: dict[int, Any], what: str) -> PoolError:
        """The PoolError of a call that failed after it was sent, leading with the exceptions of
        the ranks that had raised (the likely cause of a hang)."""
        errors = _errors(replies)
        lead = f"rank(s) {[e.rank for e in errors]} raised and " if errors else ""
        body = "".join(f"\n--- rank {e.rank} ---\n{e}" for e in errors)
        return PoolError(f"{ref}: {lead}{what}; the pool is closed (its workers are killed){body}\n{self.log_tail()}",
                         errors)

    def _abort(self) -> None:
        """Close at once after a failed call: the workers may be busy (a hung collective, a peer
        that died), so they are not asked to leave but killed (SIGTERM, SIGKILL after `KILL_GRACE`
        seconds). The torchrun log is kept."""
        if self._closed:
            return
        self._closed = True
        self._terminate(self.KILL_GRACE)
        self._release(keep_log=True)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the workers to leave (they call destroy_process_group) and wait up to `timeout`
        seconds; then SIGTERM torchrun's process group, and SIGKILL it `KILL_GRACE` seconds later.
        The torchrun log is deleted unless torchrun failed."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._terminate(self.KILL_GRACE)
        self._release(keep_log=self._proc.returncode not in (0, None))

    def _terminate(self, grace: float) -> None:
        """SIGTERM torchrun's process group (torchrun and its workers), SIGKILL it after `grace` s."""
        for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self._proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        if sig == signal.SIGTERM:  # torchrun is gone; a worker that ignored SIGTERM is not
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    def _release(self, *, keep_log: bool) -> None:
        for conn in self._conns:
            conn.close()
        self._listener.close()
        self._log.close()
        if not keep_log:
            os.unlink(self._log.name)


class LazyPool:
    """A `Pool` of `nproc` workers started on the first `run`, and started again on the `run`
    after one was closed: a suite's session fixture, which one failed call (a timeout, a dead
    worker, a rank that raised while its peers hung) must not turn into "is not running" for
    every later test. Keyword arguments go to each `Pool`.

        @pytest.fixture(scope="session")
        def dist2():
            with LazyPool(2, error_grace=10) as pool:
                yield pool

    Before, each suite built on fzero.testing had to write this itself (fzero's own lived in
    tests/conftest.py; found in review).
    """

    def __init__(self, nproc: int, **pool_kwargs: Any) -> None:
        self.nproc = _check_nproc(nproc, "LazyPool")
        self.pool_kwargs = pool_kwargs
        self._pool: Pool | None = None

    def __repr__(self) -> str:
        return f"LazyPool(nproc={self.nproc}, {self._pool!r})"

    def __enter__(self) -> LazyPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pool(self) -> Pool:
        """The running `Pool`, started if there is none (or the last one was closed)."""
        if self._pool is None or not self._pool.alive:
            self._pool = Pool(self.nproc, **self.pool_kwargs)
        return self._pool

    def run(self, *args: Any, **kwargs: Any) -> list[Any]:
        """`Pool.run` on the running pool (started if needed)."""
        return self.pool.run(*args, **kwargs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _errors(replies: dict[int, Any]) -> list[RemoteError]:
    """The `RemoteError`s among a call's replies so far, in rank order."""
    return [RemoteError(r, *replies[r][1:]) for r in sorted(replies) if replies[r][0] != "ok"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(
    nproc: int,
    fn: Callable[..., Any] | str,
    per_rank_args: Sequence[Any] | Callable[[int], Any] = (),
    *,
    timeout: float = 60.0,
) -> list[Any]:
    """Run `fn(*args_r)` once on each rank r of a fresh job of `nproc` processes; return, in rank
    order, what each gave: its result, a `RemoteError` if `fn` raised, or a `Died` if its process
    ended without a result (killed, say). Nothing a rank raised is raised here: look at each entry.

    Unlike `Pool.run`, which calls `fn(mesh, *args_r)` with a DistMesh it built, `run_job` passes
    no mesh: `fn(*args_r)` builds its own (`fzero.DistMesh(backend="gloo")`). A function written
    for `Pool.run` given here gives each rank a `RemoteError` (a TypeError saying so, where `fn`
    does not take `args_r` alone), returned like any other.

    Each process gets the environment torchrun gives its workers (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) but there is no torchrun agent, so no process stops
    another: a test sees what each rank does by itself when a peer dies. (torchrun's agent would
    SIGTERM the other workers within its --monitor-interval, 0.1 s by default, once one died; a
    rank whose peer runs on another node gets no such help.) `fn` builds its own DistMesh. Processes
    still running after `timeout` seconds are killed and `PoolError` is raised: a job never hangs
    its caller. Costs a process start per rank (about 3 s for 3 ranks on 2 cores).
    """
    _check_nproc(nproc, "run_job")
    ref = reference(fn)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="fzero-job-") as tmp:
        procs, logs = [], []
        try:
            for r in range(nproc):
                Path(tmp, f"in-{r}.pkl").write_bytes(pickle.dumps((ref, _per_rank_args(per_rank_args, r, nproc))))
                env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
                env.update({
                    "RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    ENV_SYS_PATH: json.dumps([p for p in sys.path if p and os.path.isdir(p)]),
                    "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                })
                log = open(Path(tmp, f"log-{r}.txt"), "w+b")  # noqa: SIM115 - closed below
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fzero.testing._worker", "job", tmp, str(r)], env=env,
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            if hung:
                raise PoolError(f"run_job({ref}): rank(s) {hung} still ran after {timeout:.0f} s; killed\n"
                                + "\n".join(_tail(Path(tmp, f"log-{r}.txt"), r) for r in hung))
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            for log in logs:
                log.close()
        out = []
        for r, p in enumerate(procs):
            path = Path(tmp, f"out-{r}.pkl")
            if not path.exists():
                out.append(Died(r, p.returncode, _tail(Path(tmp, f"log-{r}.txt"), r)))
                continue
            kind, *payload = pickle.loads(path.read_bytes())
            out.append(payload[0] if kind == "ok" else RemoteError(r, *payload))
        return out


def _tail(path: Path, rank: int, chars: int = 3000) -> str:
    text = path.read_bytes()[-chars:].decode(errors="replace") if path.exists() else ""
    return f"--- rank {rank} output (tail) ---\n{text}"
