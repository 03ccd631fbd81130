"""The memory model (fzero/_src/estimate.py) and `fzero estimate`; proofs/memory.md cites these."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import warnings
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fzero._src import nvme
from fzero._src.cli import main
from fzero._src.estimate import (
    STAGES,
    BytesPerParam,
    TierBytes,
    bytes_per_param,
    estimate,
    estimate_stages,
    human_bytes,
    num_params,
    offload_setting,
    round_significant,
)
from fzero._src.errors import ConfigError, LayoutError
from fzero._src.layout import ParamGroup, plan
from fzero._src.tree import flatten_with_paths
from fzero.testing import world_sizes

GB = 10**9

# ---------------------------------------------------------------- the ZeRO paper, Table 1 (7.5B)

# Rajbhandari et al. 2020, Table 1, the 7.5B-parameter columns (GB): DP degree -> baseline, P_os,
# P_os+g, P_os+g+p, as printed.
TABLE1_7_5B = {
    1: ("120", "120", "120", "120"),
    4: ("120", "52.5", "41.3", "30"),
    16: ("120", "35.6", "21.6", "7.5"),
    64: ("120", "31.4", "16.6", "1.88"),
    256: ("120", "30.4", "15.4", "0.47"),
    1024: ("120", "30.1", "15.1", "0.12"),
}


@pytest.mark.parametrize("n", sorted(TABLE1_7_5B))
def test_table1_7_5b_every_cell(n):
    psi, k = Fraction(7_500_000_000), 12
    closed_forms = ((4 + k) * psi, 4 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (4 + k) * psi / n)
    for stage, printed, closed in zip(STAGES, TABLE1_7_5B[n], closed_forms):
        e = estimate(7.5e9, n, stage=stage, optimizer="adam-mixed")
        assert e.total == closed, (n, stage)
        gb = e.total / GB
        # At the cell's own printed precision, rounded half up, the value is the printed one ...
        places = Decimal(printed).as_tuple().exponent
        exact = Decimal(gb.numerator) / Decimal(gb.denominator)
        assert exact.quantize(Decimal(1).scaleb(places), rounding=ROUND_HALF_UP) == Decimal(printed), (n, stage)
        # ... and one rule prints every cell: 3 significant digits, at most 2 decimals, half up.
        assert round_significant(gb, 3, max_decimals=2) == printed, (n, stage)


@given(n=st.integers(1, 10**6), psi=st.integers(1, 10**12))
def test_closed_forms_hold_for_any_n_and_psi(n, psi):
    """ZeRO's four totals for mixed-precision Adam, (2 + 2 + K)Ψ, 2Ψ + 2Ψ + KΨ/N, 2Ψ + (2 + K)Ψ/N and
    (2 + 2 + K)Ψ/N with K = 12, exactly (`Fraction`s) at any N and Ψ, not only the table's
    (proofs/memory.md; the table's cells above)."""
    k, psi = 12, Fraction(psi)
    closed_forms = ((4 + k) * psi, 4 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (4 + k) * psi / n)
    for stage, closed in zip(STAGES, closed_forms):
        assert estimate(int(psi), n, stage=stage, optimizer="adam-mixed").total == closed, (n, stage)


def test_table1_needs_half_up():
    """41.25 GB is printed 41.3: round-half-even (Python's `round`) would print 41.2."""
    e = estimate(7.5e9, 4, stage=2, optimizer="adam-mixed")
    assert e.total == Fraction(4125, 100) * GB
    assert Decimal("41.25").quantize(Decimal("0.1"), rounding=ROUND_HALF_EVEN) == Decimal("41.2")
    assert round_significant(e.total / GB) == "41.3"
    assert human_bytes(e.total) == "41.3 GB"


def test_article_claim_14b_on_2_gpus():
    """A 14B model on 2 GPUs (optimizer state sharded, stage 1): 56 GB of Adam moments per GPU,
    84 GB with fp32 master weights; not the 14 GB a widely read article prints."""
    moments = estimate(14e9, 2, stage=1, optimizer="adam")
    assert moments.optimizer_state == 56 * GB and moments.master == 0
    mixed = estimate(14e9, 2, stage=1, optimizer="adam-mixed")
    assert mixed.optimizer_state + mixed.master == 84 * GB
    assert bytes_per_param("adam-mixed").K == 12


def test_deepspeed_no_offload_gap():
    """DeepSpeed's estimators without offload (restated from their formulas, see proofs/memory.md):
    stage 2 per GPU = 2Ψ + ⌊18Ψ/N⌋, stage 3 = 4L + ⌊18Ψ/N⌋ (L = largest layer). Against the
    paper's K = 12 model the gap is the fp32 gradient partition 4Ψ/N (stage 2) and 2Ψ/N + 4L
    (stage 3)."""
    psi, largest = 7_500_000_000, 50_000_000
    for n in (1, 4, 64, 1024):
        ds2 = 2 * psi + Fraction(18 * psi, n)  # DeepSpeed truncates to int: < 1 byte less
        ds3 = 4 * largest + Fraction(18 * psi, n)
        assert ds2 - estimate(psi, n, stage=2, optimizer="adam-mixed").total == Fraction(4 * psi, n)
        assert ds3 - estimate(psi, n, stage=3, optimizer="adam-mixed").total == Fraction(2 * psi, n) + 4 * largest


# ---------------------------------------------------------------------- bytes per parameter


def test_bytes_per_param():
    assert bytes_per_param("adam-mixed") == BytesPerParam(2, 2, 8, 4)
    assert bytes_per_param("adam-mixed", "fp16") == BytesPerParam(2, 2, 8, 4)
    assert bytes_per_param("adam") == BytesPerParam(4, 4, 8, 0)
    assert bytes_per_param("adam", torch.bfloat16) == BytesPerParam(2, 2, 8, 4)
    assert bytes_per_param("sgd-momentum") == BytesPerParam(4, 4, 4, 0)
    assert bytes_per_param("sgd-momentum", "bf16") == BytesPerParam(2, 2, 4, 4)
    assert bytes_per_param("sgd") == BytesPerParam(4, 4, 0, 0)
    assert bytes_per_param("adam", "bf16", "fp32") == BytesPerParam(2, 4, 8, 4)
    with pytest.raises(ValueError, match="use optimizer='adam'"):
        bytes_per_param("adam-mixed", "fp32")
    with pytest.raises(ValueError, match="unknown optimizer"):
        bytes_per_param("lion")
    with pytest.raises(ValueError, match="unknown dtype"):
        bytes_per_param("adam", "int8")


def test_bad_arguments():
    with pytest.raises(LayoutError, match="world size"):
        estimate(100, 0)
    with pytest.raises(ValueError, match="stage"):
        estimate(100, 2, stage=4)
    with pytest.raises(ValueError, match="whole number"):
        estimate(1.5, 2)
    with pytest.raises(ValueError, match="finite"):
        estimate(float("inf"), 2)


# ------------------------------------------------------------- padded layouts, from first principles

CATEGORIES = ("params", "grads", "optimizer_state", "master")
SHARDED_FROM = {"optimizer_state": 1, "master": 1, "grads": 2, "params": 3}  # the ZeRO paper's Section 5
DTYPES = (torch.float32, torch.bfloat16)
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
leaves = st.tuples(shapes, st.sampled_from(DTYPES)).map(lambda sd: torch.empty(sd[0], dtype=sd[1], device="meta"))
trees = st.dictionaries(st.sampled_from("abcdefgh"), st.lists(leaves, min_size=1, max_size=3), min_size=1, max_size=4)


FIELDS = {"adam": 2, "sgd-momentum": 1, "sgd": 0}  # per-element optimizer fields: Adam's m and v, the momentum buffer
STEPS = {"adam": 4, "sgd-momentum": 4, "sgd": 0, "adam-mixed": 0}  # bytes per leaf: a float32 count (not the paper's)


def _bpp(optimizer, dtype):
    """Bytes per element of a bucket held in `dtype`: the paper's mixed-precision Adam (bf16 params
    and grads, fp32 moments and master) for "adam-mixed"; else, as `fzero.init` keeps it without a
    policy, everything in the bucket's own dtype and no master."""
    if optimizer == "adam-mixed":
        return BytesPerParam(2, 2, 8, 4)
    k = dtype.itemsize
    return BytesPerParam(k, k, FIELDS[optimizer] * k, 0)


def _expected(tree, n, align, unit_of, optimizer, stage):
    """Per-rank bytes from first principles: buckets keyed by (unit, dtype), in any order;
    S = align·⌈numel/(N·align)⌉, at least align; each bucket costs what its dtype does, and every
    rank keeps its leaves' step counts whole; and without padding (`unpadded`)."""
    paths, ls, _ = flatten_with_paths(tree)
    numel, leaves = {}, {}
    for path, leaf in zip(paths, ls):
        key = (unit_of(path), leaf.dtype)
        numel[key] = numel.get(key, 0) + leaf.numel()
        leaves[key] = leaves.get(key, 0) + 1
    shard = {key: align * max(1, math.ceil(m / (n * align))) for key, m in numel.items()}
    out, unpadded = {}, {}
    for k, cat in enumerate(CATEGORIES):
        sharded = stage >= SHARDED_FROM[cat]
        out[cat] = sum(_bpp(optimizer, key[1])[k] * (s if sharded else n * s) for key, s in shard.items())
        unpadded[cat] = sum(_bpp(optimizer, key[1])[k] * Fraction(m, n if sharded else 1) for key, m in numel.items())
    steps = STEPS[optimizer] * sum(leaves.values())
    out["optimizer_state"] += steps
    unpadded["optimizer_state"] += steps
    return out, unpadded, numel, shard


@given(
    tree=trees,
    n=world_sizes(9),  # N >= 2 first: st.integers(1, 9) drew N = 1, where nothing shards, in 39 of 100
    align=st.integers(1, 4),
    split_units=st.booleans(),
    optimizer=st.sampled_from(["adam-mixed", "adam", "sgd-momentum", "sgd"]),
)
def test_padded_estimate_is_the_sum_over_buckets(tree, n, align, split_units, optimizer):
    unit_of = (lambda path: path.split(".")[0]) if split_units else (lambda path: "default")
    units = unit_of if split_units else None
    psi = num_params(tree)
    for e in estimate(tree, n, optimizer=optimizer, align=align, units=units):
        expected, unpadded, numel, shard = _expected(tree, n, align, unit_of, optimizer, e.stage)
        assert sum(numel.values()) == psi
        assert {c: getattr(e, c) for c in expected} == expected
        # Padding per bucket: < align elements per rank in a sharded category, < N·align in a
        # replicated one (<= when the bucket is empty: then S = align holds no element at all).
        bound = 0
        for k, c in enumerate(CATEGORIES):
            assert getattr(e, c) >= unpadded[c]
            bound += sum(_bpp(optimizer, key[1])[k] * (align if e.stage >= SHARDED_FROM[c] else n * align)
                         for key in shard)
        total = sum(unpadded.values())
        assert e.total <= total + bound
        if all(m > 0 for m in numel.values()) and bound > 0:
            assert e.total < total + bound
        if optimizer == "adam-mixed":  # the paper's accounting: the bare count's, padded
            assert total == estimate(psi, n, stage=e.stage, optimizer=optimizer).total


def test_padding_example():
    """10 elements over N = 4: S = 3, the padded buffer is 12; replicated 12, sharded 3 per rank;
    and the leaf's Adam step count (float32, 4 bytes) on every rank."""
    tree = {"w": torch.empty(10, device="meta")}
    e0, e1, e2, e3 = estimate(tree, 4, optimizer="adam")
    assert (e0.params, e0.optimizer_state) == (4 * 12, 8 * 12 + 4)
    assert (e1.params, e1.optimizer_state) == (4 * 12, 8 * 3 + 4)
    assert (e2.grads, e3.params) == (4 * 3, 4 * 3)
    assert estimate(10, 4, stage=3, optimizer="adam").params == Fraction(40, 4)


def test_frozen_group_has_no_grads_or_state():
    tree = {"emb": torch.empty(8, device="meta"), "head": torch.empty(4, device="meta")}
    frozen = (ParamGroup("frozen", match=lambda p: p == "emb", frozen=True),)
    e = estimate(tree, 1, stage=0, groups=frozen, optimizer="adam-mixed")
    assert (e.params, e.grads, e.optimizer_state, e.master) == (2 * 12, 2 * 4, 8 * 4, 4 * 4)


def test_meta_module_costs_no_memory():
    """A 10^10-parameter module on meta: estimated exactly, nothing allocated."""
    with torch.device("meta"):
        model = torch.nn.Linear(100_000, 100_000, bias=False)
    assert num_params(model) == 10**10
    e = estimate(model, 64, stage=3, optimizer="adam-mixed")
    assert e.total == estimate(10**10, 64, stage=3, optimizer="adam-mixed").total  # 10^10 is a multiple of 64: no padding


def test_tied_parameters_counted_once():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert num_params(model) == 40
    assert estimate_stages(model, 1)[0].total == 16 * 40 + 4  # one leaf: one Adam step count


# --------------------------------------------------------------------------------------- CLI


def test_cli_prints_the_table(capsys):
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0:1] + [line] for line in out.splitlines() if line[:1] in "0123"]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    for (_, line), total in zip(rows, ("120 GB (120000000000 B)", "31.4 GB (31406250000 B)",
                                       "16.6 GB (16640625000 B)", "1.88 GB (1875000000 B)")):  # fmt: skip
        assert line.endswith(total)
    assert "K = 12" in out and "234 MB (234375000 B)" in out


def test_cli_options(capsys):
    assert main(["estimate", "--params", "14e9", "-n", "2", "--optimizer", "adam", "--stage", "1"]) == 0
    out = capsys.readouterr().out
    assert "56 GB (56000000000 B)" in out and "K = 8" in out
    assert main(["estimate", "--params", "10", "-n", "3", "--dtype", "fp32", "--optimizer", "sgd", "--stage", "3"]) == 0
    assert "40/3 B" in capsys.readouterr().out  # 4 bytes · 10 / 3, exact
    assert main(["estimate", "--params", "10", "-n", "3", "--dtype", "fp32"]) == 2
    assert "use optimizer='adam'" in capsys.readouterr().err


def test_cli_module(tmp_path, monkeypatch, capsys):
    (tmp_path / "fzero_cli_model.py").write_text(
        textwrap.dedent(
            """
            import torch
            def make():
                assert torch.empty(()).device.type == "meta"
                return torch.nn.Linear(1000, 999)  # 999999 params
            def not_a_module():
                return 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["estimate", "--module", "fzero_cli_model:make", "-n", "4", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    # buckets by dtype: one fp32 bucket of 999999 -> S = 250000; 16 bytes · 250000 per rank
    assert "999999 parameters" in out and "4 MB (4000000 B)" in out
    assert main(["estimate", "--module", "fzero_cli_model:not_a_module", "-n", "4"]) == 2
    assert "not an nn.Module" in capsys.readouterr().err
    assert main(["estimate", "--module", "fzero_cli_model", "-n", "4"]) == 2
    assert "PKG.MOD:FACTORY" in capsys.readouterr().err


def test_cli_units_size_the_swap_buffers(tmp_path, monkeypatch, capsys):
    """--units-prefix makes one bucket per block: the NVMe swap buffers (2 · 6 buffers of the
    largest fp32 file, a bucket's three: Adam's two fields and the master) shrink from the whole
    model's 4·(3·100 + 2·10) = 1280 B file, 15360 B, to the largest bucket's: a block's 4·100 =
    400 B, 4800 B (the head's 4·20 = 80 B, the rest unit, is smaller)."""
    (tmp_path / "fzero_cli_blocks.py").write_text(
        textwrap.dedent(
            """
            import torch
            def make():
                blocks = torch.nn.Sequential(*(torch.nn.Linear(10, 10, bias=False) for _ in range(3)))
                return torch.nn.ModuleDict({"blocks": blocks, "head": torch.nn.Linear(10, 2, bias=False)})
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["estimate", "--module", "fzero_cli_blocks:make", "-n", "1", "--stage", "3", "--optimizer", "adam",
            "--offload-optimizer", "nvme"]

    def swap_buffers(argv):
        assert main(argv) == 0
        return [line.split()[-2:] for line in capsys.readouterr().out.splitlines() if line.startswith("3 ")][-1]

    assert swap_buffers(base) == ["15.4", "kB"]
    assert swap_buffers(base + ["--units-prefix", "blocks"]) == ["4.8", "kB"]
    assert main(base + ["--units-prefix", "nope"]) == 2
    assert "no submodule 'nope'" in capsys.readouterr().err
    assert main(["estimate", "--params", "10", "-n", "1", "--units-prefix", "blocks"]) == 2
    assert "use it with --module or --config" in capsys.readouterr().err


def test_cli_optional_dependencies_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    cfg = tmp_path / "gpt2.json"
    cfg.write_text("{}")
    assert main(["estimate", "--config", str(cfg), "-n", "8"]) == 2
    assert "pip install transformers" in capsys.readouterr().err
    assert main(["estimate", "--params", "1e6", "-n", "8", "--plot", str(tmp_path / "m.png")]) == 2
    assert "pip install 'fzero[plot]'" in capsys.readouterr().err


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "mem.png"
    assert main(["estimate", "--params", "7.5e9", "-n", "64", "--plot", str(out)]) == 0
    assert out.stat().st_size > 0


def test_cli_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--world-size", "4"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "1.5", "-n", "4"])
    assert "whole number" in capsys.readouterr().err


@pytest.mark.parametrize("n", ["0", "-3", "2.5"])
def test_cli_world_size_below_one_names_the_flag(capsys, n):
    """`-n 0` reached `estimate`, whose one line named no flag ("world size must be an int >= 1");
    now argparse refuses it as it refuses `--params inf`: exit status 2, the last line naming
    `--world-size/-n` and the value. (A huge N is computed exactly: Fractions, nothing allocated.)"""
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--params", "10", "-n", n])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and last.startswith("fzero estimate: error: argument --world-size/-n: ")
    assert f"int >= 1 (the number of ranks), got {n!r}" in last
    huge = estimate(10**30, 10**40, stage=3)
    assert huge.total == Fraction(16 * 10**30, 10**40)


def test_python_dash_m():
    r = subprocess.run(
        [sys.executable, "-m", "fzero", "estimate", "--params", "7.5e9", "-n", "1024", "--stage", "3"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "117 MB (117187500 B)" in r.stdout  # the paper's 0.12 GB


def test_cli_gpt2_config(tmp_path, capsys):
    """`--config` builds transformers' GPT-2 on the meta device: GPT-2 small has 124,439,808
    distinct parameters (the LM head is tied to the token embedding and counted once)."""
    pytest.importorskip("transformers")
    cfg = tmp_path / "gpt2.json"
    cfg.write_text('{"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}')
    assert main(["estimate", "--config", str(cfg), "-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "124439808 parameters" in out
    # stage 3, mixed-precision Adam: 16 bytes per padded parameter / 8 ranks
    assert "249 MB (248879616 B)" in out.splitlines()[-1]


# ------------------------------------------------------------------------------------ offload


def _gb(x) -> Fraction:
    return Fraction(x) / GB


def test_offload_14b_on_2_gpus_by_hand():
    """14B params, N = 2, mixed-precision Adam (p = g = 2, s = 8, m = 4), so the shard is
    E = Ψ/N = 7·10⁹ elements. Stage 3 + optimizer offload: the GPU keeps its bf16 param shard and
    gradient shard, (2 + 2)·E = 28 GB; the host holds the gradient shard's copy 2·E = 14 GB, Adam's
    moments 8·E = 56 GB and the fp32 master 4·E = 28 GB, 98 GB. + params offload: the GPU keeps
    only the gradient shard, 14 GB (the gathered units are transient), the host those 98 GB and
    the bf16 copy of its shard that the units move, 2·E = 14 GB: 112 GB. NVMe: the moments and the
    fp32 master move to the disk, 56 + 28 = 84 GB; the host keeps the gradient copy, 14 GB (and the
    swap buffers, not counted for a bare count).
    + params="nvme": the bf16 copy 14 GB moves to the disk too (98 GB there), the GPU keeps the
    gradient shard, 14 GB, and the host the gradient copy, 14 GB.
    Stages 1 and 2 keep their full params (2·Ψ = 28 GB) and full / sharded gradients."""
    kw = dict(optimizer="adam-mixed")
    plain = estimate(14e9, 2, stage=3, **kw)
    cpu = estimate(14e9, 2, stage=3, offload_optimizer="cpu", **kw)
    both = estimate(14e9, 2, stage=3, offload_optimizer="cpu", offload_params="cpu", **kw)
    disk = estimate(14e9, 2, stage=3, offload_optimizer="nvme", **kw)
    assert _gb(plain.total) == 112 and plain.host == TierBytes() and plain.nvme == TierBytes()
    assert (_gb(cpu.params), _gb(cpu.grads), cpu.optimizer_state, cpu.master) == (14, 14, 0, 0)
    assert cpu.host == TierBytes(grads=Fraction(14 * GB), optimizer_state=Fraction(56 * GB), master=Fraction(28 * GB))
    assert (_gb(cpu.total), _gb(cpu.host.total), cpu.nvme.total) == (28, 98, 0)
    assert (both.params, _gb(both.grads), both.host) == (0, 14, cpu.host._replace(params=Fraction(14 * GB)))
    assert _gb(both.host.total) == 112
    assert (_gb(disk.total), _gb(disk.host.total), _gb(disk.nvme.total)) == (28, 14, 84)
    assert disk.host.optimizer_state == disk.host.master == 0
    assert (disk.nvme.optimizer_state, disk.nvme.master) == (56 * GB, 28 * GB)
    # + params="nvme": the bf16 shard's copy, 14 GB, in files too; the GPU keeps the gradient shard
    files = estimate(14e9, 2, stage=3, offload_optimizer="nvme", offload_params="nvme", **kw)
    assert (_gb(files.total), _gb(files.host.total), _gb(files.nvme.total)) == (14, 14, 98)
    assert files.nvme == disk.nvme._replace(params=Fraction(14 * GB))
    s1, s2, s3 = estimate(14e9, 2, offload_optimizer="cpu", **kw)  # stage 0 has no shard: not listed
    assert [_gb(e.total) for e in (s1, s2, s3)] == [28 + 28, 28 + 14, 14 + 14]
    assert s1.host == s2.host == s3.host


def test_offload_ratio_by_hand():
    """r = 1/4 at stage 2, Ψ = 8·10⁹, N = 4, mixed Adam: E = 2·10⁹. The device keeps
    3/4 of the state and master, 0.75·(8 + 4)·E = 18 GB, besides its full params 2Ψ = 16 GB and
    gradient shard 2·E = 4 GB: 38 GB. The host holds 1/4: gradient copy 0.25·2·E = 1 GB, moments
    0.25·8·E = 4 GB, master 0.25·4·E = 2 GB: 7 GB. A float ratio is read as its decimal (0.3 is
    3/10 exactly)."""
    e = estimate(8e9, 4, stage=2, optimizer="adam-mixed", offload_optimizer="cpu", offload_ratio=0.25)
    assert (_gb(e.params), _gb(e.grads), _gb(e.optimizer_state), _gb(e.master), _gb(e.total)) == (16, 4, 12, 6, 38)
    assert e.host == TierBytes(grads=Fraction(GB), optimizer_state=Fraction(4 * GB), master=Fraction(2 * GB))
    assert estimate(10, 1, stage=1, offload_optimizer="cpu", offload_ratio=0.3).offload.ratio == Fraction(3, 10)


@given(
    tree=trees,
    n=world_sizes(6),  # N >= 2 first: st.integers(1, 6) drew N = 1 in 52 of 100
    split_units=st.booleans(),
    optimizer=st.sampled_from(["adam-mixed", "adam", "sgd-momentum", "sgd"]),
    where=st.sampled_from(["cpu", "nvme"]),
    params=st.sampled_from([None, "cpu", "nvme"]),
    ratio=st.sampled_from([1, Fraction(1, 2), Fraction(1, 3)]),
)
def test_offload_moves_state_without_losing_any(tree, n, split_units, optimizer, where, params, ratio):
    """For every stage that accepts the setting, with E = Σ_b S_b the rank's shard and H the
    elements of it on the host: the optimizer state is split s·(E - H) on the device + s·H on the
    host or NVMe, nothing lost or duplicated; the host's master ("cpu") or the file's ("nvme") is
    4·H (fp32: the master, or the fp32 param shard) and the host's gradient copy g·H; the device's
    master is m·(E - H), its params and grads those of the stage without offload (no params with
    params offload). H is whole
    buckets: r·E <= H < r·E + max_b S_b (the device keeps the longest prefix of buckets holding
    at most (1 - r)·E; the next one did not fit), H = E at r = 1. The step counts (4 bytes a
    leaf, every rank's; "adam" and "sgd-momentum") are kept in host memory with the buckets that
    go there (with "nvme" too), the others' on the device. fp32 params (`param_dtype`), so that
    every bucket costs alike; the paper's "adam-mixed" counts bf16 params."""
    if params is not None and ratio != 1:
        ratio = 1  # params offload keeps the whole shard on the host (a ConfigError otherwise)
    if params == "nvme" and where != "nvme":
        params = "cpu"  # params="nvme" needs the NVMe tier (a ConfigError otherwise)
    units = (lambda path: path.split(".")[0]) if split_units else None
    bpp = bytes_per_param(optimizer)
    kw = dict(optimizer=optimizer, units=units, param_dtype=None if optimizer == "adam-mixed" else "fp32")
    shard = estimate(tree, n, stage=3, **kw).grads / bpp.grads  # E, read off stage 3's sharded grads
    layout = plan(tree, n, units=units)
    largest = max(b.shard_numel for b in layout.buckets)
    steps = STEPS[optimizer] * len(layout.leaves)  # every leaf's count, on the device or the host
    r = Fraction(ratio)
    for e in estimate(tree, n, offload_optimizer=where, offload_params=params, offload_ratio=ratio, **kw):
        plain = estimate(tree, n, stage=e.stage, **kw)
        on_host = (e.host.master if where == "cpu" else e.nvme.master) / 4  # H
        assert (e.nvme.master if where == "cpu" else e.host.master) == 0
        assert r * shard <= on_host and (on_host < r * shard + largest if r < 1 else on_host == shard)
        assert e.optimizer_state + e.host.optimizer_state + e.nvme.optimizer_state == plain.optimizer_state
        host_steps = e.host.optimizer_state - (bpp.optimizer_state * on_host if where == "cpu" else 0)
        assert 0 <= host_steps <= steps and (host_steps == steps if r == 1 else host_steps % 4 == 0)
        assert e.optimizer_state == bpp.optimizer_state * (shard - on_host) + steps - host_steps
        assert e.nvme.optimizer_state == (bpp.optimizer_state * on_host if where == "nvme" else 0)
        assert (e.master, e.host.grads) == (bpp.master * (shard - on_host), bpp.grads * on_host)
        assert (e.params, e.grads) == ((0 if params else plain.params), plain.grads)
        # every bucket of these trees trains: host params only as params offload's compute copy beside a master
        # that is wider or in a file; params="nvme": that copy in a file
        copy = bpp.params * on_host if params and (bpp.master or where == "nvme") else 0
        assert (e.host.params, e.nvme.params) == ((0, copy) if params == "nvme" else (copy, 0))
        assert e.stage >= (3 if params else 1)


def test_offload_ratio_keeps_whole_buckets():
    """Three buckets of 10, 20, 30 elements (N = 1, fp32 Adam): r = 1/2 leaves room for 30
    elements on the device, so buckets 10 and 20 stay (8·30 = 240 B of state) and 30 goes to the
    host (state 8·30, master 4·30, gradient copy 4·30); r = 0.6 leaves room for 24: only the first
    stays (80 B) and 20 + 30 = 50 go (state 400 B); r = 1: all 60 go. A frozen bucket in front is
    skipped, not counted against the room. The same buckets as `fzero.Offload.host_buckets`
    where fzero has it. Each bucket's one Adam step count (4 bytes) goes with it."""
    import fzero

    tree = {"a": torch.empty(10, device="meta"), "b": torch.empty(20, device="meta"), "c": torch.empty(30, device="meta")}
    units = lambda path: path  # noqa: E731 -- one bucket per leaf, in this order
    kw = dict(stage=1, optimizer="adam", units=units, offload_optimizer="cpu")
    for r, device_state, host_elements, on_host in ((0.5, 240 + 8, 30, 1), (0.6, 80 + 4, 50, 2), (1, 0, 60, 3)):
        e = estimate(tree, 1, offload_ratio=r, **kw)
        want = TierBytes(grads=Fraction(4 * host_elements), optimizer_state=Fraction(8 * host_elements + 4 * on_host),
                         master=Fraction(4 * host_elements))
        assert (e.optimizer_state, e.host) == (device_state, want)
        if hasattr(fzero, "Offload"):
            layout = plan(tree, 1, units=units)
            held = fzero.Offload(optimizer="cpu", ratio=r).host_buckets(layout)
            assert sum(layout.buckets[b].shard_numel for b in held) == host_elements
    frozen = (ParamGroup("frozen", match=lambda p: p == "f", frozen=True),)
    e = estimate({"f": torch.empty(50, device="meta"), **tree}, 1, offload_ratio=0.5, groups=frozen, **kw)
    assert e.optimizer_state == 240 + 8 and e.host.params == 0  # the frozen 50 stay on the device (params stay)


def test_nvme_estimate_is_what_swap_files_hold(tmp_path):
    """The NVMe bytes and host swap buffers of the estimate are those of a `SwapFiles` made as the
    NVMe tier makes it: one fp32 entry per bucket and tensor (Adam's m, v and the fp32 master),
    and twice a bucket's files as buffers (this bucket's and the next one's): files and buffers as
    built."""
    tree = {"a": torch.empty(10, 3, device="meta"), "b": torch.empty(7, device="meta")}
    units = lambda path: path  # noqa: E731 -- two buckets, of 30 and 7 elements
    n = 3
    e = estimate(tree, n, stage=3, optimizer="adam", units=units, offload_optimizer="nvme")
    layout = plan(tree, n, units=units)
    entries = {f"{b.tag}/{field}": (b.shard_numel, torch.float32) for b in layout.buckets
               for field in ("m", "v", "master")}
    with nvme.SwapFiles(tmp_path, entries, buffers=6) as files:
        on_disk = sum(os.path.getsize(x.path) for x in files.entries.values())
        host = files.host_bytes
    assert e.nvme.total == e.nvme.optimizer_state + e.nvme.master == on_disk == 12 * (10 + 3)
    assert e.nvme.master == 4 * (10 + 3)
    assert e.host.buffers == host == nvme.buffer_bytes([40, 12], buffers=6) == 2 * 6 * 40
    assert estimate(37, n, stage=3, optimizer="adam", offload_optimizer="nvme").host.buffers == 0  # bare count


def test_offload_settings_refused():
    with pytest.raises(ConfigError, match="stage 0 replicates it; use stage 1, 2 or 3"):
        estimate(100, 2, stage=0, offload_optimizer="cpu")
    for stage in (1, 2):
        with pytest.raises(ConfigError, match=f"stage {stage} holds the full params on every rank; use stage 3"):
            estimate(100, 2, stage=stage, offload_optimizer="cpu", offload_params="cpu")
    with pytest.raises(ConfigError, match="offload the optimizer too"):
        estimate(100, 2, stage=3, offload_params="cpu")
    for optimizer in ("cpu", None):  # None: it named optimizer='cpu', which the next call refused (found in review)
        with pytest.raises(ConfigError, match=r"params='nvme'.*optimizer to 'nvme' too, or use params='cpu' with "
                                                 r"optimizer='cpu'"):
            estimate(100, 2, stage=3, offload_optimizer=optimizer, offload_params="nvme")
    for bad in (0, 1.5, float("nan"), True, "1"):
        with pytest.raises(ConfigError, match=r"ratio .*\(0, 1\]"):
            estimate(100, 2, stage=3, offload_optimizer="cpu", offload_ratio=bad)
    with pytest.raises(ConfigError, match="needs the optimizer offloaded and the params not"):
        estimate(100, 2, stage=3, offload_optimizer="cpu", offload_params="cpu", offload_ratio=0.5)
    with pytest.raises(ConfigError, match="needs the optimizer offloaded"):
        estimate(100, 2, stage=3, offload_ratio=0.5)
    with pytest.raises(ConfigError, match="one of"):
        estimate(100, 2, stage=3, offload_optimizer="gpu")
    with pytest.raises(ConfigError, match="not both"):
        offload_setting(offload_setting(optimizer="cpu"), optimizer="cpu")
    assert estimate_stages(100, 2, offload_optimizer="cpu", offload_params="cpu")[0].stage == 3


def test_offload_object_is_read_by_its_fields():
    """`offload=` takes a `fzero.Offload` (read by optimizer / params / ratio; a stand-in with
    those fields where fzero has none yet) and gives what the three keywords give."""
    import dataclasses

    import fzero

    @dataclasses.dataclass(frozen=True)
    class StandIn:
        optimizer: str | None = None
        params: str | None = None
        ratio: float = 1.0

    kinds = [StandIn] + ([fzero.Offload] if hasattr(fzero, "Offload") else [])
    for kind in kinds:
        for kw in (dict(optimizer="cpu"), dict(optimizer="cpu", params="cpu")):
            got = estimate(14e9, 2, stage=3, offload=kind(**kw))
            want = estimate(14e9, 2, stage=3, **{f"offload_{k}": v for k, v in kw.items()})
            assert got == want and got.offload.optimizer == "cpu"


def test_cli_offload(capsys):
    assert main(["estimate", "--params", "14e9", "-n", "2", "--stage", "3", "--offload-optimizer", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "offload: optimizer cpu, params on the device, ratio 1" in out
    row = [line.split() for line in out.splitlines() if line.startswith("3 ")][-1]
    assert row[:7] == ["3", "28", "GB", "98", "GB", "0", "B"]  # device, host, NVMe
    argv = ["estimate", "--params", "14e9", "-n", "2", "--stage", "3", "--offload-optimizer", "nvme"]
    assert main(argv + ["--offload-params", "nvme"]) == 0
    row = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("3 ")][-1]
    assert row[:7] == ["3", "14", "GB", "14", "GB", "98", "GB"]  # the bf16 shard, master and moments on the disk
    assert main(argv[:-1] + ["cpu", "--offload-params", "nvme"]) == 2
    assert "params='nvme'" in capsys.readouterr().err
    assert main(["estimate", "--params", "14e9", "-n", "2", "--offload-optimizer", "nvme"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line[:2] in ("0 ", "1 ", "2 ", "3 ")] == ["1", "2", "3"] * 2
    assert "not counted for a bare count" in out
    assert main(["estimate", "--params", "14e9", "-n", "2", "--stage", "0", "--offload-optimizer", "cpu"]) == 2
    assert "stage 0 replicates it" in capsys.readouterr().err


def test_seed_14b_on_2_gpus_row():
    """The seed's row "14B on 2 GPUs, ZeRO-3 + CPU offload: 72 GB -> 25.6 GB per GPU", checked
    against the formula (proofs/memory.md, "The seed's 14B row"): with mixed-precision Adam stage
    3 holds 16·Ψ/N = 112 GB per GPU without offload and (2 + 2)·Ψ/N = 28 GB with the optimizer
    offloaded (26.1 GiB), 14 GB with the params too (the gradient shard). No optimizer, dtype,
    offload setting or stage of the model, in GB or in GiB, gives 72 or 25.6 per GPU for
    Ψ = 14·10⁹, N = 2, so the row is not a count of model states: it is not reproduced."""
    e = estimate(14e9, 2, stage=3, optimizer="adam-mixed")
    off = estimate(14e9, 2, stage=3, optimizer="adam-mixed", offload_optimizer="cpu")
    assert (_gb(e.total), _gb(off.total), round(float(off.total) / 2**30, 1)) == (112, 28, 26.1)
    printed = set()
    for optimizer in ("adam-mixed", "adam", "sgd-momentum", "sgd", "adafactor"):
        for dtype in ("bf16", "fp16", "fp32"):
            for where, params in ((None, None), ("cpu", None), ("nvme", None), ("cpu", "cpu")):
                try:
                    es = estimate(14e9, 2, optimizer=optimizer, param_dtype=dtype, offload_optimizer=where,
                                  offload_params=params)
                except ConfigError:  # adam-mixed with fp32 params
                    continue
                printed |= {round(float(x.total) / unit, 1) for x in es for unit in (10**9, 2**30)}
    assert 28.0 in printed and 26.1 in printed and not {72.0, 25.6} & printed


# ------------------------------------------- fzero's layout under a precision policy (review, 7)


def _held_state(tree, opt, stage, where, params_where, swap, **init_kw):
    """`(rank 0's fzero.init state on SimMesh(3), {"offload": ...} or {})`: offloaded to `where`
    ("cpu", "nvme" with swap files in the new folder `swap`, or None) with params at
    `params_where`; `init_kw` (units, groups, precision) passed on."""
    import fzero

    swap.mkdir()
    mesh = fzero.SimMesh(3)
    off = None if where is None else fzero.Offload(
        optimizer=where, params=params_where, **({"nvme_path": str(swap)} if where == "nvme" else {}))
    kw = {} if off is None else {"offload": off}
    return mesh.run(lambda: fzero.init(tree, opt, stage=stage, mesh=mesh, **init_kw, **kw))[0], kw


def test_precision_estimates_what_fzero_keeps_at_every_stage(tmp_path):
    """`estimate(..., precision=fzero.Precision(...))` against `held_bytes` of a real `fzero.init`:
    params, optimizer state (its replicated per-leaf step counts included) and master, on each
    tier, at stages 0-3, with and without offload, a frozen group, fp32 and bf16 held params, and
    optimizers whose state is per element (Adam, amsgrad, momentum SGD). Before, the only mixed
    setting was the paper's "adam-mixed", whose bf16 copy beside an fp32 master fzero keeps at
    stages 1-2 only (at stages 0 and 3 the fp32 params are the master: 2Ψ too few params bytes
    and 4Ψ too many master bytes at stage 0); and the step counts were left out (4 bytes a leaf
    of every trainable bucket, on every rank)."""
    import fzero
    from fzero import optim
    from fzero._src.accounting import held_bytes

    tree32 = {f"l{i}.w": torch.randn(6, 5) for i in range(3)} | {"l3.w": torch.randn(4, 5)}
    frozen = (ParamGroup("frozen", match=lambda p: p == "l1.w", frozen=True),)
    units = lambda p: p.split(".")[0]  # noqa: E731
    opts = {"adam": (lambda: optim.adam(1e-2), {}),
            "amsgrad": (lambda: optim.adam(1e-2, amsgrad=True), {"amsgrad": True}),
            "sgd-momentum": (lambda: optim.sgd(0.1, momentum=0.9), {})}
    cases = [(0, None, None), (1, None, None), (2, None, None), (3, None, None), (2, "cpu", None), (3, "cpu", "cpu"),
             (3, "nvme", "nvme")]
    policies = [fzero.Precision(), fzero.Precision(torch.bfloat16, torch.float32), fzero.Precision(torch.float16)]
    checked = 0
    for name, (make, extra) in opts.items():
        for held in (torch.float32, torch.bfloat16):
            for precision in policies:
                for groups in ((), frozen):
                    for stage, where, params_where in cases:
                        tree = {k: v.to(held) for k, v in tree32.items()}
                        opt = make()
                        with warnings.catch_warnings(record=True) as seen:  # 16-bit params, 16-bit param_dtype:
                            warnings.simplefilter("always", fzero.NoFp32Master)  # no fp32 master, and init says so
                            state, kw = _held_state(tree, opt, stage, where, params_where,
                                                    tmp_path / f"swap{checked}", units=units, groups=groups,
                                                    precision=precision)
                        no_master = held != torch.float32 and precision.param_dtype is not None
                        assert {type(w.message) for w in seen} == ({fzero.NoFp32Master} if no_master else set()), (
                            [str(w.message)[:200] for w in seen], held, precision)
                        hb = held_bytes(state, opt)
                        e = estimate(tree, 3, stage=stage, optimizer="adam" if name == "amsgrad" else name,
                                     param_dtype=held, units=units, groups=groups, precision=precision, **kw,
                                     **extra)
                        got = [[t.params, t.optimizer_state, t.master] for t in hb.tiers]
                        assert hb.optimizer_leaf > 0  # the step counts: compared, not left out
                        want = [[int(x.params), int(x.optimizer_state), int(x.master)] for x in (e, e.host, e.nvme)]
                        assert got == want, (name, held, precision, groups, stage, where, params_where)
                        checked += 1
    assert checked == 3 * 2 * 3 * 2 * 7


def test_precision_estimate_per_stage_and_the_paper_unchanged():
    """fp32 params under Precision(bf16, fp32), Ψ = 7.5e9, N = 64: stages 0 and 3 keep the fp32
    params alone (16Ψ and 16Ψ/N with fp32 grads), stages 1-2 a bf16 copy beside the fp32 master.
    The paper's rows (adam-mixed, no precision) are as before."""
    import fzero

    policy = fzero.Precision(torch.bfloat16, torch.float32)
    es = estimate_stages(7.5e9, 64, precision=policy)
    assert [e.total for e in es] == [120 * GB, Fraction(46_406_250_000), 16_875_000_000, 1_875_000_000]
    assert [(e.params, e.master) for e in (es[0], es[3])] == [(30 * GB, 0), (Fraction(30 * GB, 64), 0)]
    assert (es[1].params, es[1].master) == (15 * GB, Fraction(30 * GB, 64))
    paper = [float(e.total) / GB for e in estimate_stages(7.5e9, 64, optimizer="adam-mixed")]
    assert [round(x, 2) for x in paper] == [120.0, 31.41, 16.64, 1.88]
    with pytest.raises(ConfigError, match="use optimizer='adam'"):
        estimate(10, 2, optimizer="adam-mixed", precision=policy)
    with pytest.raises(ConfigError, match="precision must be a fzero.Precision"):
        estimate(10, 2, precision="bf16")


def test_amsgrad_and_bucket_bytes():
    """amsgrad keeps a third fp32 array (max v): s = 12; `bucket_bytes` cuts buckets as `init` does
    (before: no such arguments; an amsgrad state was 4 bytes a parameter over the estimate)."""
    assert bytes_per_param("adam", amsgrad=True) == BytesPerParam(4, 4, 12, 0)
    assert bytes_per_param("adam-mixed", amsgrad=True).K == 16
    with pytest.raises(ConfigError, match="amsgrad=True is an Adam setting"):
        bytes_per_param("sgd", amsgrad=True)
    params = {f"w{i}": torch.randn(5) for i in range(6)}  # 6 leaves of 5 elements, one unit
    one, cut = (estimate(params, 4, stage=3, **kw) for kw in ({}, {"bucket_bytes": 20}))
    assert (one.params, cut.params) == (4 * 8, 6 * 4 * 2)  # one bucket of 30 -> S = 8; six of 5 -> S = 2 each
    with pytest.raises(ConfigError, match="a bare parameter count has none"):
        estimate(100, 4, bucket_bytes=20)


def test_estimate_without_precision_is_what_init_keeps_in_the_params_own_dtype(tmp_path):
    """Without `precision=` (and without `param_dtype`), `estimate` of a params pytree against
    `held_bytes` of `fzero.init` with no policy: params, grads, optimizer state and master on each
    tier, and the NVMe swap files' host buffers, for fp32, bf16 and fp16 trees and one with an
    fp32 and a bf16 bucket, each optimizer name `estimate` takes but the paper's "adam-mixed"
    (adafactor's replicated row and column statistics, plain SGD's empty state), at stages 0-3,
    with and without offload and a frozen group. Found in review: bf16 params were estimated
    with an fp32 master and fp32 moments (with `param_dtype="bf16"`; without it, as fp32 params)
    where `init` keeps neither, the per-leaf step counts were left out, and the NVMe buffers
    counted a bf16 state's two fields as one."""
    import fzero
    from fzero import optim
    from fzero._src.accounting import held_bytes

    g = torch.Generator().manual_seed(0)
    base = {f"l{i}.w": torch.randn(6, 5, generator=g) for i in range(3)} | {"l3.w": torch.randn(4, 5, generator=g)}
    trees = {str(d).removeprefix("torch."): {k: v.to(d) for k, v in base.items()}
             for d in (torch.float32, torch.bfloat16, torch.float16)}
    trees["mixed"] = {k: v.to(torch.bfloat16 if k in ("l2.w", "l3.w") else torch.float32) for k, v in base.items()}
    units = lambda p: "a" if p < "l2" else "b"  # noqa: E731 -- two units of two leaves each
    frozen = (ParamGroup("frozen", match=lambda p: p == "l1.w", frozen=True),)
    opts = {"adam": (lambda: optim.adam(1e-2), {}),
            "amsgrad": (lambda: optim.adam(1e-2, amsgrad=True), {"optimizer": "adam", "amsgrad": True}),
            "sgd-momentum": (lambda: optim.sgd(0.1, momentum=0.9), {}),
            "sgd": (lambda: optim.sgd(0.1), {}),
            "adafactor": (lambda: optim.adafactor(), {})}
    cases = [(0, None, None), (1, None, None), (2, None, None), (3, None, None), (2, "cpu", None), (3, "cpu", "cpu"),
             (2, "nvme", None), (3, "nvme", "nvme")]
    checked = 0
    for tree_name, tree in trees.items():
        for name, (make, kw) in opts.items():
            for groups in ((), frozen):
                for stage, where, params_where in cases:
                    opt = make()
                    state, extra = _held_state(tree, opt, stage, where, params_where, tmp_path / f"swap{checked}",
                                               units=units, groups=groups)
                    hb = held_bytes(state, opt)
                    e = estimate(tree, 3, stage=stage, units=units, groups=groups, **{"optimizer": name, **kw}, **extra)
                    got = [[t.params, t.grads, t.optimizer_state, t.master] for t in hb.tiers]
                    want = [[int(x.params), int(x.grads), int(x.optimizer_state), int(x.master)]
                            for x in (e, e.host, e.nvme)]
                    where_ = (tree_name, name, groups, stage, where, params_where)
                    assert got == want, where_
                    if where == "nvme" and params_where is None:  # the swap files' buffers, as the tier made them
                        assert e.host.buffers == state.info.tier.files.host_bytes, where_
                    checked += 1
    assert checked == 4 * 5 * 2 * 8


def test_a_model_that_is_none_a_str_or_a_count_in_a_list_is_refused_naming_what_a_model_is():
    """Found in review: `estimate(None, 8, stage=3)` said 0 bytes, a str and `[1e9]` blamed a
    "params leaf"; `init(None, ...)` made a state of nothing. An empty container is a model of
    no parameters still (the census property test draws them)."""
    import fzero

    what = r"a model is a parameter count \(an int, or a whole float such as 7.5e9\), an nn.Module, or a pytree"
    for model, given in ((None, "got NoneType None"), ("7B", "got str '7B'"), (b"7B", "got bytes")):
        with pytest.raises(fzero.ConfigError, match=f"{what}.*; {given}"):
            estimate(model, 8, stage=3)
    with pytest.raises(fzero.ConfigError, match=rf"{what}.*got a list holding the number\(s\) at \['0'\]: pass a count "
                                                r"alone"):
        estimate([1e9], 8, stage=3)
    with pytest.raises(fzero.ConfigError, match=r"holding the number\(s\) at \['n'\]"):
        estimate({"w": torch.empty(4, device="meta"), "n": 3}, 2, stage=1)
    assert estimate({}, 8, stage=3).params == 0
    with pytest.raises(fzero.LayoutError, match=r"params is None: pass a pytree of tensors"):
        fzero.layout.plan(None, 2)
    mesh = fzero.SimMesh(1)
    with pytest.raises(fzero.LayoutError, match=r"params is None"):
        mesh.run(lambda: fzero.init(None, fzero.optim.sgd(0.1), stage=1, mesh=mesh))
