"""`fzero` command-line usage errors and edge cases found in review: each is exit status 2 with a
one-line `fzero <cmd>: error: ...` message and no traceback, or now works."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fzero
from fzero import optim
from fzero._src.cli import TRACE_MAX_ELEMENTS, main, offload_summary
from fzero._src.estimate import offload_setting

ROOT = Path(__file__).resolve().parents[1]  # `python -m fzero` there runs this checkout's fzero


def _usage_error(capsys, argv, *fragments):
    """`fzero ARGV` exits 2 (argparse's SystemExit(2) or main's return) with every fragment in
    its one-line message."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"fzero {argv[0]}: error: "), last
    for fragment in fragments:
        assert fragment in last, (fragment, last)
    return last


@pytest.mark.parametrize("count", ["inf", "1e400", "nan"])
def test_params_must_be_finite(capsys, count):
    """`--params inf` / `1e400` raised OverflowError (int(inf)) before the check."""
    _usage_error(capsys, ["estimate", "--params", count, "-n", "2"], "argument --params", "finite", repr(count))


def test_the_edges_of_the_counts_are_as_their_words_say(capsys):
    """`--params 0` is a count ">= 0" and runs; `--plot-world-sizes 0,2` is refused by its own
    argument's words ("must be >= 1"). Mutants moving either edge passed the suite (found by a
    mutation audit)."""
    assert main(["estimate", "--params", "0", "-n", "2"]) == 0
    capsys.readouterr()
    _usage_error(capsys, ["estimate", "--params", "1e6", "-n", "2", "--plot", "p.png", "--plot-world-sizes", "0,2"],
                 "argument --plot-world-sizes", "world sizes must be >= 1, got '0,2'")


@pytest.mark.parametrize("spec, fragments", [
    ("math:pi", ["--module math:pi", "'pi' is a float, not a callable"]),
    ("torch.nn:Linear", ["--module torch.nn:Linear", "calling Linear()", "TypeError", "in_features"]),
])
def test_module_factory_that_fails(capsys, spec, fragments):
    """A non-callable or a factory needing arguments gave a TypeError traceback."""
    _usage_error(capsys, ["estimate", "--module", spec, "-n", "2"], *fragments)


def test_plot_with_offload(tmp_path, capsys):
    """--plot indexed the estimates by stage number: with an offload (stages 1-3) it raised IndexError."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    argv = ["estimate", "--params", "7.5e9", "-n", "2", "--plot", str(out), "--plot-world-sizes", "1,2,4"]
    assert main(argv + ["--offload-optimizer", "cpu"]) == 0
    assert out.stat().st_size > 0
    assert main(argv + ["--offload-optimizer", "cpu", "--offload-params", "cpu"]) == 0  # stage 3 only
    capsys.readouterr()


def test_plot_names_the_file_written_and_refuses_a_format_matplotlib_lacks(tmp_path, capsys):
    """`--plot out` wrote out.png and said "out"; `--plot p.txt` was matplotlib's ValueError
    traceback after the table (found in review of a CLI user)."""
    pytest.importorskip("matplotlib")
    argv = ["estimate", "--params", "1e9", "-n", "4", "--plot"]
    assert main(argv + [str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip().endswith(f"plot written to {tmp_path / 'out.png'}")
    assert (tmp_path / "out.png").stat().st_size > 0
    _usage_error(capsys, argv + [str(tmp_path / "p.txt")], "Format 'txt' is not supported", "name a .png")


def test_a_module_fzero_cannot_lay_out_and_a_bad_gpt2_config_are_usage_errors(tmp_path, capsys, monkeypatch):
    """An int64 parameter (a `LayoutError`) and a GPT-2 config transformers refuses were
    tracebacks, exit 1 (found in review of a CLI user)."""
    (tmp_path / "fzero_int_model.py").write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Module()\n"
        "    m.i = torch.nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=False)\n"
        "    return m\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _usage_error(capsys, ["estimate", "--module", "fzero_int_model:make", "-n", "2"],
                 "--module fzero_int_model:make: params leaf 'i' has dtype torch.int64")
    pytest.importorskip("transformers")
    config = tmp_path / "gpt.json"
    config.write_text('{"n_layer": 2, "n_embd": 65, "n_head": 4, "vocab_size": 100}')
    _usage_error(capsys, ["estimate", "--config", str(config), "-n", "2"], f"--config {config}: cannot build a GPT-2",
                 "ValueError")


def test_a_gpt2_config_of_another_model_is_refused_and_keys_gpt2_does_not_read_are_named(tmp_path, capsys):
    """`--config` builds `GPT2Config(**json)`, which keeps any key: a typo (`n_layers`) estimated a
    12-layer default and a Llama config a GPT-2 of its sizes, exit 0 and no word (found in review of
    a new user). Another `model_type` is a usage error naming the way out; a key close to one that
    sizes GPT-2 is named on stderr; a saved GPT-2 config's own extra keys are not (`n_ctx`,
    `torch_dtype`, and the hub's gpt2-medium and distilgpt2 files' `n_special`,
    `predict_special_tokens`, `_num_labels`: found in review of the first check, which named them)."""
    pytest.importorskip("transformers")
    llama = tmp_path / "llama.json"
    llama.write_text('{"model_type": "llama", "hidden_size": 64}')
    _usage_error(capsys, ["estimate", "--config", str(llama), "-n", "2"],
                 f"--config {llama}: model_type 'llama'; --config builds a GPT-2 only", "--module PKG.MOD:FACTORY")
    typo = tmp_path / "typo.json"
    typo.write_text('{"n_layers": 2, "n_embd": 64, "n_head": 4}')
    assert main(["estimate", "--config", str(typo), "-n", "2"]) == 0
    assert (f"warning: --config {typo}: GPT-2 does not read 'n_layers' (did you mean 'n_layer'?): the model is "
            f"sized by GPT2Config's default there") in capsys.readouterr().err
    saved = tmp_path / "saved.json"
    saved.write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_ctx": 1024, '
                     '"torch_dtype": "float32", "architectures": ["GPT2LMHeadModel"], "n_special": 0, '
                     '"predict_special_tokens": true, "_num_labels": 1, "num_labels": 3, "is_decoder": false}')
    assert main(["estimate", "--config", str(saved), "-n", "2"]) == 0
    assert capsys.readouterr().err == ""

def test_plot_to_a_missing_folder(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "missing" / "p.png")
    _usage_error(capsys, ["estimate", "--params", "7.5e9", "-n", "2", "--plot", path], f"--plot {path}: cannot write")


@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--batch", "-1"), ("--blocks", "0"), ("-n", "0")])
def test_trace_counts_must_be_positive(capsys, flag, value):
    """--batch 0 / -1 ran and failed inside the step (a RankFailed or negative-dimension traceback)."""
    name = "--world-size" if flag == "-n" else flag
    _usage_error(capsys, ["trace", flag, value, "--steps", "1"], f"{name} must be >= 1, got {value}")


def test_trace_refuses_a_model_too_large_to_simulate(capsys):
    """--width 100000 tried to allocate 4 blocks of 10^10 floats (a RuntimeError, or the OOM killer)."""
    _usage_error(capsys, ["trace", "--width", "100000"], "--width 100000", str(TRACE_MAX_ELEMENTS),
                 "use a smaller --width")
    assert main(["trace", "-n", "2", "--width", "8", "--blocks", "1", "--steps", "1"]) == 0  # small still runs
    capsys.readouterr()


def test_offload_summary_names_each_tier():
    """The line said "host: fp32 master" for nvme too, where the master is in swap files."""
    cpu = offload_summary(offload_setting(optimizer="cpu"))
    assert "host: the fp32 master, the optimizer state, the gradient shards' copies" in cpu and "NVMe" not in cpu
    nvme = offload_summary(offload_setting(optimizer="nvme"))
    host, disk = nvme.split("; NVMe swap files: ")
    assert "master" not in host and "swap files' buffers" in host
    assert disk.startswith("the fp32 master, the optimizer state")
    both = offload_summary(offload_setting(optimizer="nvme", params="nvme"))
    assert "NVMe swap files: the param shards, the fp32 master" in both
    assert "host: the param shards, the fp32 master" in offload_summary(offload_setting(optimizer="cpu", params="cpu"))


def test_cli_prints_the_nvme_tiers(capsys):
    assert main(["estimate", "--params", "14e9", "-n", "2", "--stage", "3", "--offload-optimizer", "nvme"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("offload:"))
    assert "host: the gradient shards' copies, the swap files' buffers; NVMe swap files: the fp32 master" in line


def test_cli_precision_gives_fzero_layout(capsys):
    """--precision bf16,fp32: fzero's layout (fp32 params alone at stages 0 and 3), with adam."""
    assert main(["estimate", "--params", "7.5e9", "-n", "64", "--precision", "bf16,fp32"]) == 0
    out = capsys.readouterr().out
    assert "optimizer adam" in out and "stage 3: params 4, grads 4, optimizer state 8, master 0" in out
    totals = {line.split()[0]: line.split()[-3:-1] for line in out.splitlines() if line[:2] in ("0 ", "1 ", "2 ", "3 ")}
    assert totals == {"0": ["GB", "(120000000000"], "1": ["GB", "(46406250000"], "2": ["GB", "(16875000000"],
                      "3": ["GB", "(1875000000"]}
    _usage_error(capsys, ["estimate", "--params", "10", "-n", "2", "--precision", "bf16", "--optimizer", "adam-mixed"],
                 "use optimizer='adam'")
    _usage_error(capsys, ["estimate", "--params", "10", "-n", "2", "--precision", "int8"], "argument --precision")


# ---------------------------------------------------------------------------------------------- export


@pytest.fixture
def checkpoint(tmp_path):
    mesh = fzero.SimMesh(1)
    root = tmp_path / "ckpt"

    def rank():
        s = fzero.init({"w": torch.randn(3, 3)}, optim.adam(1e-3), stage=1, mesh=mesh)
        fzero.checkpoint.save(s, str(root))

    mesh.run(rank)
    return fzero.checkpoint.latest(str(root))


def test_a_crashed_save_beside_a_checkpoint_names_it(checkpoint):
    """A crash's .tmp-step-* folder passed where a checkpoint goes, beside a complete checkpoint:
    the words name the one `latest(root)` returns."""
    crash = os.path.join(os.path.dirname(checkpoint), ".tmp-step-9-0123abcd")
    os.mkdir(crash)
    try:
        with pytest.raises(fzero.checkpoint.CheckpointError, match=r"it is a save that did not complete .*its root's "
                           r"last complete checkpoint, fzero\.checkpoint\.latest\(root\), is " + re.escape(repr(checkpoint))):
            fzero.checkpoint.read_manifest(crash)
    finally:
        os.rmdir(crash)


def test_inspect_and_export_of_a_root_name_the_checkpoint_written_last(checkpoint, tmp_path, capsys):
    """A root passed where a checkpoint goes (DeepSpeed's `load_checkpoint(dir)` takes one) names
    the checkpoint `latest(root)` finds, for a shell user; a folder without checkpoints keeps the
    words on a save that crashed (found in review of a new user: both told to call a Python function)."""
    root = os.path.dirname(checkpoint)
    for argv in (["inspect", root], ["export", root, str(tmp_path / "out.safetensors")]):
        _usage_error(capsys, argv, f"{root!r} is not a complete fzero checkpoint: it is a checkpoint root, which holds "
                                   f"1 complete checkpoint(s); the one written last, fzero.checkpoint.latest(root), is "
                                   f"{checkpoint!r}")
    _usage_error(capsys, ["inspect", str(tmp_path)], "a save that crashed leaves a .tmp-step-* folder")


def test_a_root_of_crashed_saves_only_is_not_sent_to_latest(tmp_path, capsys):
    """A root holding only saves that did not complete (a crash's .tmp-step-* folders), or one such
    folder itself, passed where a checkpoint goes: the words told its user to call `latest(root)`,
    which returns None there (found in review of the root's words)."""
    crash = tmp_path / ".tmp-step-3-0123abcd"
    crash.mkdir()
    (crash / "shard-0.distcp").write_bytes(b"x")
    assert fzero.checkpoint.latest(str(tmp_path)) is None
    _usage_error(capsys, ["inspect", str(tmp_path)], "it holds no complete checkpoint, only 1 save(s) that did not "
                 "complete ('.tmp-step-3-0123abcd'...; a crash leaves them), so fzero.checkpoint.latest(root) is None")
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"it is a save that did not complete \(a crash leaves "
                       r"a \.tmp-step-\* folder\); its root holds no complete checkpoint \(fzero\.checkpoint\.latest"
                       r"\(root\) is None\)"):
        fzero.checkpoint.read_manifest(str(crash))

@pytest.mark.parametrize("dtype", ["foo", "int8"])
def test_export_dtype_is_a_usage_error(capsys, tmp_path, dtype):
    """`export --dtype foo` raised ConfigError with a traceback."""
    _usage_error(capsys, ["export", str(tmp_path), str(tmp_path / "o.safetensors"), "--dtype", dtype],
                 "argument --dtype", f"unknown dtype {dtype!r}")


def test_export_to_a_folder_leaves_no_temporary_file(checkpoint, tmp_path, capsys):
    """The writer left OUT.tmp behind when OUT could not be replaced (a folder)."""
    out = tmp_path / "out"
    out.mkdir()
    _usage_error(capsys, ["export", checkpoint, str(out)], f"cannot write {str(out)!r}: it is a folder")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out"] and os.listdir(out) == []
    # with a trailing slash: "Not a directory" before, of a folder (found in review)
    _usage_error(capsys, ["export", checkpoint, str(out) + "/"], "it is a folder", "out/model.safetensors")
    _usage_error(capsys, ["export", checkpoint, str(tmp_path / "new") + "/"], "it is a folder")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out"] and os.listdir(out) == []
    assert main(["export", checkpoint, str(tmp_path / "m.safetensors"), "--dtype", "bf16"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "m.safetensors", "out"]
    capsys.readouterr()


def test_export_onto_a_fifo_is_refused_and_through_a_link_writes_its_target(checkpoint, tmp_path, capsys):
    """The rename that makes the write whole put a regular file in place of a FIFO, a device
    (`/dev/null`, as root) or a link (found in review): a FIFO is refused, leaving it as it was;
    a link is written through, to its target; a link into the checkpoint is refused as the path is."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _usage_error(capsys, ["export", checkpoint, str(fifo)], f"{str(fifo)!r} is a FIFO", "nothing was written")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    target, link = tmp_path / "model.safetensors", tmp_path / "latest.safetensors"
    target.write_bytes(b"old")
    link.symlink_to(target)
    assert main(["export", checkpoint, str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_bytes() != b"old"
    loop_a, loop_b = tmp_path / "loop_a", tmp_path / "loop_b"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    _usage_error(capsys, ["export", checkpoint, str(loop_a)], "goes through a loop of symbolic links", "nothing was written")
    assert loop_a.is_symlink()  # (the rename replaced it, where open fails)
    inside = tmp_path / "sneaky"
    inside.symlink_to(os.path.join(checkpoint, "manifest.json"))
    _usage_error(capsys, ["export", checkpoint, str(inside)], "it is inside the checkpoint")
    capsys.readouterr()


def test_export_into_the_checkpoint_is_refused_and_leaves_it_whole(checkpoint, capsys):
    """`fzero export CKPT CKPT/manifest.json` replaced the checkpoint's manifest with the export
    and exited 0, destroying the checkpoint (found in review). Any output inside the checkpoint
    folder is refused; the checkpoint still loads (`latest` finds it)."""
    before = sorted(os.listdir(checkpoint))
    for out in ("manifest.json", "sub/o.safetensors", "o.safetensors"):
        _usage_error(capsys, ["export", checkpoint, os.path.join(checkpoint, out)], "is inside the checkpoint",
                     "write the export outside it")
    assert sorted(os.listdir(checkpoint)) == before
    assert fzero.checkpoint.latest(os.path.dirname(checkpoint)) == checkpoint


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_inspect_names_a_damaged_file(checkpoint, capsys, damage):
    """`fzero inspect` summed the manifest's sizes as the bytes "on disk" and printed a truncated or
    incomplete checkpoint as whole, exit 0 (found in review); it now names the file, its size and
    the manifest's, exit 2, as `latest` skips it and `export` refuses it."""
    data = next(f for f in os.listdir(checkpoint) if f.endswith(".distcp"))
    recorded = os.path.getsize(os.path.join(checkpoint, data))
    if damage == "truncated":
        os.truncate(os.path.join(checkpoint, data), 100)
        said = f"file {data!r} is 100 B on disk, the manifest records {recorded:,} B"
    else:
        os.remove(os.path.join(checkpoint, data))
        said = f"file {data!r} is missing, the manifest records {recorded:,} B"
    _usage_error(capsys, ["inspect", checkpoint], "is damaged", said)


def test_module_in_the_current_folder_names_the_way_out(tmp_path, capsys, monkeypatch):
    """The `fzero` script does not import from the current folder, as `python -m fzero` does, so
    `--module mymodels:make` beside mymodels.py failed with "No module named 'mymodels'" alone
    (found in review): the error now says why and how."""
    (tmp_path / "fzero_cwd_models.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.chdir(tmp_path)
    _usage_error(capsys, ["estimate", "--module", "fzero_cwd_models:make", "-n", "2"],
                 "No module named 'fzero_cwd_models'", "python -m fzero", "PYTHONPATH=.")


def test_no_traceback_from_the_command_line():
    """The same, through `python -m fzero` (a fresh interpreter: what a user runs)."""
    script = textwrap.dedent("""
        fzero estimate --params inf -n 2
        fzero estimate --module math:pi -n 2
        fzero trace --batch 0 -n 2 --steps 1
        fzero export /nonexistent o.safetensors --dtype foo
    """).strip().splitlines()
    for line in script:
        proc = subprocess.run([sys.executable, "-m", *line.split()], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (line, proc.stderr)


def test_a_reader_that_closes_the_pipe_gets_no_traceback():
    """`fzero estimate ... | true`: BrokenPipeError's traceback, or "Exception ignored" at exit
    (found in review of a CLI user)."""
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # no reader: every write meets a closed pipe
    try:
        done = subprocess.run([sys.executable, "-m", "fzero", "estimate", "--params", "1e9", "-n", "4"],
                              stdout=write, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write)
    err = done.stderr.decode()
    assert done.returncode == 1 and "Traceback" not in err and "BrokenPipe" not in err, err

