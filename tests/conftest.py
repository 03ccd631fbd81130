"""Test configuration: hypothesis profiles and the shared pool of torchrun workers.

Profiles (select with HYPOTHESIS_PROFILE, default "ci"):
  ci    deterministic (derandomize, no database, no deadline); what .ci/run uses.
  local 10x the examples, random seeds, the example database on; for a long local run
        (one file at a time on a 2-core machine: tests/test_stages.py's property alone takes
        9-10 minutes, the properties of 18 files about 45; none failed on 2026-12-06).
"""

import logging
import sys

import pytest

from fzero.testing import LazyPool, register_profiles

register_profiles()  # fzero.testing.PROFILES: the same "ci" and "local" a suite of one's own gets


class _CurrentStderr:
    """A stream writing to whatever `sys.stderr` is at each write (pytest's capture of the test
    running, capsys's)."""

    def write(self, text):
        return sys.stderr.write(text)

    def flush(self):
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def _transformers_logs_to_this_tests_stderr():
    """transformers' log handler writes to the `sys.stderr` of its import, and binds its `flush`
    to that stream's: under pytest, the capture of the test that imported it, closed after that
    test. A later test whose code logs through it (fzero's CLI building a GPT2Config) then printed
    "--- Logging error ---" with a traceback into its own stderr (found by a mutation audit:
    tests/test_cli_more.py failed when run after tests/test_checkpoint.py in one process). The
    handler is pointed at the current `sys.stderr`, its own `flush` put back. Only transformers'
    own handler: the first version walked the handlers of the "transformers" logger, and on the
    GPU machine's image (transformers 5.17, pytest 9.1) a pytest log-capture handler came to be
    among them during the suite (the errors: "'_CurrentStderr' object has no attribute
    'getvalue'", pytest reading its captured logs): every later test of that worker failed at
    setup."""
    handler = getattr(sys.modules.get("transformers.utils.logging"), "_default_handler", None)
    if isinstance(handler, logging.StreamHandler) and not isinstance(handler.stream, _CurrentStderr):
        handler.__dict__.pop("flush", None)
        handler.stream = _CurrentStderr()  # (not setStream, which flushes the closed one first)


# ---------------------------------------------------------------------------------------------
# Pools of torchrun gloo workers, started on first use and kept for the whole session
# (fzero.testing.LazyPool; tests/dist_cases.py holds the functions they run).


@pytest.fixture(scope="session")
def dist2():
    """2 torchrun gloo workers, started on first use, shared by the whole session."""
    with LazyPool(2, error_grace=10) as pool:  # a rank's exception within 10 s where its peers hang
        yield pool


@pytest.fixture(scope="session")
def dist4():
    """4 torchrun gloo workers, started on first use, shared by the whole session."""
    with LazyPool(4, error_grace=10) as pool:
        yield pool


@pytest.fixture
def nccl_mesh(monkeypatch):
    """A one-rank NCCL `DistMesh` in this process (the CUDA tests: pinned buffers, streams, the
    caching allocator), its process group destroyed after the test. Skips without a GPU."""
    import torch

    import fzero
    from fzero.testing.pool import _free_port

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                            LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    mesh = fzero.DistMesh(backend="nccl")
    try:
        yield mesh
    finally:
        torch.distributed.destroy_process_group()
