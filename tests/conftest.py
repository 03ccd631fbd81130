"""Test configuration: hypothesis profiles and the shared pool of torchrun workers.

Profiles (select with HYPOTHESIS_PROFILE, default "ci"):
  ci    deterministic (derandomize, no database, no deadline); what .ci/run uses.
  local 10x the examples, random seeds, the example database on; for a long local run.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "local",
    deadline=None,
    max_examples=1000,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ---------------------------------------------------------------------------------------------
# Pools of torchrun gloo workers, started on first use and kept for the whole session
# (fzero.testing.pool; tests/dist_cases.py holds the functions they run).

import pytest  # noqa: E402

from fzero.testing.pool import Pool  # noqa: E402


class LazyPool:
    """A `Pool` of n workers, started on the first `run` and again after one was closed (a call
    that times out closes its pool, since a hung collective cannot be cancelled)."""

    def __init__(self, n: int) -> None:
        self.nproc = n
        self._pool: Pool | None = None

    def run(self, *args, **kwargs):
        if self._pool is None or not self._pool.alive:
            self._pool = Pool(self.nproc)
        return self._pool.run(*args, **kwargs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


@pytest.fixture(scope="session")
def dist2():
    """2 torchrun gloo workers, started on first use, shared by the whole session."""
    pool = LazyPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def dist4():
    """4 torchrun gloo workers, started on first use, shared by the whole session."""
    pool = LazyPool(4)
    yield pool
    pool.close()


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
