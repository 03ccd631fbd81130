"""One worker of `fzero.testing.pool.Pool`; started by torchrun, never directly.

    torchrun --standalone --nproc-per-node N -m fzero.testing._worker

Turns warnings into errors, builds `fzero.DistMesh(backend="gloo")` (gloo on CPU wherever it runs,
GPUs or not), connects to the pool's listener (address and authkey from the environment) and
serves calls `(module:qualname, args)` by running `fn(DistMesh(backend="gloo"), *args)` until told
to stop; then destroys the process group.

Between calls. After each call, failed or not, a worker puts back torch's global settings as
they were before it (`_settings`: the default dtype, grad mode, deterministic-algorithms mode,
anomaly detection, float32 matmul precision, the number of threads, the default device) and the
warnings filters (a call runs in `warnings.catch_warnings()`): before, a call that set
`torch.set_default_dtype(torch.float64)` and failed before setting it back made every later call
of the pool run in float64, where an equivalence test passed in the wrong dtype (found in
review). A call imports its function's module before the settings are saved, outside the
`catch_warnings()`: what a module sets when imported (`torch.set_default_dtype`, a warnings
filter) stays for every later call, as in a process that imported it (before, the import ran
inside the first call's window, whose end undid it: two identical calls saw float64, then
float32; found in review). What persists from call to call is the process: module globals
(imported modules, their caches, a model a module keeps), torch's random-number generators (not
reseeded: seed in each call, as `make_model` does), the process group, and every other
process-wide setting (`torch.backends` flags, environment variables, the working directory).

    python -m fzero.testing._worker job DIR RANK

is one rank of `fzero.testing.pool.run_job`: runs `fn(*args)` from DIR/in-RANK.pkl once, with
warnings as errors, and writes the result or the exception to DIR/out-RANK.pkl.

Both check first that `fn` takes the arguments it is called with
(`inspect.signature(fn, follow_wrapped=False).bind`: the signature of the function called, not of
the one a `functools.wraps` decorator wraps; before, a test under `@mock.patch(...)`, which
appends its mock, was refused though the call works; found in review):
a pool calls `fn(mesh, *args)`, `run_job` `fn(*args)`, and a function written for one given to
the other raises a TypeError that says so (before, Python's "missing 1 required positional
argument", or a failure inside `fn`; found in review).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pickle
import sys
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

from fzero.testing.pool import ENV_ADDRESS, ENV_AUTHKEY, ENV_SYS_PATH


def _resolve(ref: str) -> Any:
    module, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return obj


def _error(e: BaseException) -> tuple:
    text = "".join(traceback.format_exception(e))
    try:
        exc: BaseException | None = e
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - the text is enough
        exc = None
    return ("err", f"{type(e).__module__}.{type(e).__qualname__}", str(e), text, exc)


def _settings() -> tuple[tuple[str, Callable[[], Any], Callable[[Any], Any]], ...]:
    """`(what, read, write)` of each of torch's global settings a call may change and a worker puts
    back after it."""
    import torch

    cpu = torch.device("cpu")
    return (
        ("the default dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        ("deterministic algorithms",
         lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
         lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        ("anomaly detection", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
         lambda v: torch.set_anomaly_enabled(*v)),
        ("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        ("threads", torch.get_num_threads, torch.set_num_threads),
        ("the default device", torch.get_default_device,
         lambda d: torch.set_default_device(None if d == cpu else d)),  # None: no device context at all
    )


def _saved() -> list[tuple[Callable[[], Any], Callable[[Any], Any], Any]]:
    """Each of `_settings()` with its value now."""
    return [(read, write, read()) for _, read, write in _settings()]


def _restore(saved: list[tuple[Callable[[], Any], Callable[[Any], Any], Any]]) -> None:
    """Put back each setting that a call changed."""
    for read, write, value in saved:
        if read() != value:
            write(value)


def _check_call(fn: Any, args: tuple, how: str) -> None:
    """TypeError, saying how `fn` is called here, where it does not take `args` (`how`: "pool" or "job")."""
    try:
        # the function called, not the one it wraps: a `functools.wraps` decorator may add or take
        # arguments (`@mock.patch(...)` appends its mock)
        signature = inspect.signature(fn, follow_wrapped=False)
        signature.bind(*args)
    except TypeError as e:
        name = getattr(fn, "__qualname__", repr(fn))
        if how == "pool":
            said = (f"Pool.run calls fn(mesh, *args): a fresh DistMesh, then rank r's {len(args) - 1} argument(s) "
                    f"per_rank_args gave it; {name}{signature} does not take them ({e}). A function "
                    f"for run_job, fn(*args) building its own DistMesh, does not fit Pool.run")
        else:
            said = (f"run_job calls fn(*args): rank r's {len(args)} argument(s), with no mesh (fn builds its own "
                    f"fzero.DistMesh()); {name}{signature} does not take them ({e}). A function for "
                    f"Pool.run, fn(mesh, *args), does not fit run_job: write one that builds its DistMesh")
        raise TypeError(said) from None
    except ValueError:  # no signature to read (a builtin): let the call say
        pass


def _setup() -> None:
    warnings.simplefilter("error")
    for p in reversed(json.loads(os.environ.get(ENV_SYS_PATH, "[]"))):
        if p not in sys.path:
            sys.path.insert(0, p)


def job(folder: str, rank: int) -> None:
    _setup()
    ref, args = pickle.loads(Path(folder, f"in-{rank}.pkl").read_bytes())
    try:
        fn = _resolve(ref)
        _check_call(fn, args, "job")
        data = pickle.dumps(("ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        data = pickle.dumps(_error(e))
    tmp = Path(folder, f"out-{rank}.tmp")
    tmp.write_bytes(data)
    tmp.rename(Path(folder, f"out-{rank}.pkl"))  # whole or absent


def main() -> None:
    _setup()
    import torch.distributed as dist

    import fzero

    mesh = fzero.DistMesh(backend="gloo")
    host, port = os.environ[ENV_ADDRESS].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[ENV_AUTHKEY]))
    try:
        conn.send_bytes(pickle.dumps(("hello", mesh.rank, mesh.world_size)))
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:
                break
            if msg[0] == "stop":
                break
            _, ref, args = msg
            saved = None
            try:
                # the import first, outside the window: what a module sets when imported stays
                fn = _resolve(ref)
                saved = _saved()
                with warnings.catch_warnings():  # a call's filters go when it returns
                    mesh = fzero.DistMesh(backend="gloo")  # first: every rank joins its construction
                    _check_call(fn, (mesh, *args), "pool")
                    reply: tuple = ("ok", fn(mesh, *args))
                    del mesh
                data = pickle.dumps(reply)
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
                data = pickle.dumps(_error(e))
            finally:
                if saved is not None:
                    _restore(saved)
            conn.send_bytes(data)
    finally:
        conn.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        job(sys.argv[2], int(sys.argv[3]))
    else:
        main()
