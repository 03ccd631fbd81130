"""The examples run, tiny, on CPU (as their docstrings say), and print what they claim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-W", "error", str(EXAMPLES / name), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("world_size", ["2", "3"])
def test_mlp_stages_memory_formulas_and_equal_params(world_size):
    out = run_example("mlp_stages.py", "--dim", "64", "--hidden", "256", "--blocks", "2", "--world-size", world_size)
    assert f"SimMesh({world_size}, id=" in out
    for stage in range(4):
        assert f"stage {stage}: loss" in out and "= formula" in out
    assert "all stages ended with bit-identical parameters" in out


def test_gpt2_stage3_falls_back_to_simmesh_and_learns():
    out = run_example("gpt2_stage3.py", "--layers", "2", "--embd", "32", "--heads", "2", "--vocab", "64",
                      "--seq", "16", "--steps", "5")
    assert "[##############################] 5/5 loss" in out
    assert "SimMesh(2, id=1) stage 3:" in out
    first, last = (float(x) for x in out.strip().splitlines()[-1].removeprefix("loss ").split(" -> "))
    assert last < first, out


def test_fp16_loss_scale_stage3_equals_stage0_and_plots(tmp_path):
    png = tmp_path / "curves.png"
    out = run_example("fp16_loss_scale.py", "--steps", "120", "--plot", str(png))
    assert "stage 3 equals stage 0 at every step" in out
    skipped = int(out.split(" skipped for overflow")[0].rsplit(" ", 1)[1])
    assert 0 < skipped < 120, out  # the scale overflowed now and then, and training went on
    assert png.stat().st_size > 10_000


def test_custom_optimizer_example_runs():
    out = run_example("custom_optimizer.py")
    assert "signum on 3 shards == signum leaf by leaf" in out


def test_dp_sgd_example_equal_across_stages():
    out = run_example("dp_sgd.py", "--steps", "3")
    for stage in range(4):
        assert f"stage {stage}: objective" in out
    assert "dp-sgd: all stages ended with bit-identical parameters" in out


def test_hvp_example_stage_3_equals_stage_0():
    """The printed HVP differences are information (float64 rounding of two different orders);
    the HVP's equality with the unsharded one on exact data is tests/test_func.py."""
    out = run_example("hvp.py")
    assert "gradient penalty (double backward): stage 3 equals stage 0 bit for bit" in out
    for stage in (0, 3):
        assert f"stage {stage} H̄v (reverse over reverse): max |fzero - unsharded|" in out
