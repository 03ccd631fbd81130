"""One worker of `fzero.testing.pool.Pool`; started by torchrun, never directly.

    torchrun --standalone --nproc-per-node N -m fzero.testing._worker

Turns warnings into errors, builds `fzero.DistMesh(backend="gloo")` (gloo on CPU wherever it runs,
GPUs or not), connects to the pool's listener (address and authkey from the environment) and
serves calls `(module:qualname, args)` by running `fn(DistMesh(backend="gloo"), *args)` until told
to stop; then destroys the process group.

    python -m fzero.testing._worker job DIR RANK

is one rank of `fzero.testing.pool.run_job`: runs `fn(*args)` from DIR/in-RANK.pkl once, with
warnings as errors, and writes the result or the exception to DIR/out-RANK.pkl.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import traceback
import warnings
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


def _setup() -> None:
    warnings.simplefilter("error")
    for p in reversed(json.loads(os.environ.get(ENV_SYS_PATH, "[]"))):
        if p not in sys.path:
            sys.path.insert(0, p)


def job(folder: str, rank: int) -> None:
    _setup()
    ref, args = pickle.loads(Path(folder, f"in-{rank}.pkl").read_bytes())
    try:
        data = pickle.dumps(("ok", _resolve(ref)(*args)))
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
            try:
                reply: tuple = ("ok", _resolve(ref)(fzero.DistMesh(backend="gloo"), *args))
                data = pickle.dumps(reply)
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
                data = pickle.dumps(_error(e))
            conn.send_bytes(data)
    finally:
        conn.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        job(sys.argv[2], int(sys.argv[3]))
    else:
        main()
