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
