"""Bad input to `python -m minipaged.embedded.train`: refused before any work with one
`error: ...` line, the shipped model never overwritten without --overwrite, and a run that is
interrupted or killed leaves no half-written model behind."""

import os
import signal
import subprocess
import sys
import time

import pytest
from cli_probes import ROOT, digest, env, interrupt, refused, run_many

from minipaged import load_model, load_tokenizer
from minipaged.embedded.train import train
from minipaged.errors import UsageError
from minipaged.formats import DEFAULT_MODEL_DIR

SHIPPED = [DEFAULT_MODEL_DIR]          # the model and its loss curve
OUTPUTS = {"config.json", "model.safetensors", "tokenizer.model", "training.json",
           "loss_curve.png"}


def temporaries(folder):
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name]


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    probes = {   # argv: what the error line names
        ("--steps", "-5"): ["steps", "-5"],
        ("--steps", "0"): ["steps"],
        ("--steps", "abc"): ["--steps"],
        ("--seed", "-1"): ["seed"],
        ("--seed", "9" * 25): ["seed"],
        ("--steps", "2"): ["the shipped model", "--overwrite"],                   # no flag
        ("--steps", "2", "--out", other): ["does not write", "notes.txt"],
        ("--steps", "2", "--out", other, "--overwrite"): ["does not write", "notes.txt"],
        ("--steps", "2", "--out", a_file): ["is a file"],
        ("--steps", "2", "--out", "/proc/minipaged-model"): ["--out", "cannot write"],
        ("--steps", "2", "--out", tmp_path / "x", "--plot", "/nonexistent/loss.png"):
            ["--plot", "does not exist"],
        ("--steps", "2", "--out", tmp_path / "y", "--plot", a_file): ["exists", "--overwrite"],
        # every target checked before the work, not at the rename after it
        ("--steps", "2", "--out", empty, "--plot", empty / "curve.svg"): ["PNG", "curve.png"],
        ("--steps", "2", "--out", tmp_path / "z", "--plot", tmp_path / "z.jpeg"): ["PNG"],
        ("--steps", "2", "--out", tmp_path / "z", "--plot", tmp_path / "notes"): ["folder"],
        ("--steps", "2", "--out", ROOT): ["working in", "--out"],      # the probes' cwd
        ("--steps", "2", "--out", ROOT / "minipaged" / ".."): ["working in"],
        ("--steps", "2", "--out", "/"): ["mount point"],
        ("--steps", "2", "--out", "/proc/self"): ["cannot", "/proc"],
    }
    before = [digest(p) for p in SHIPPED] + [digest(other), digest(a_file)]
    start = time.perf_counter()
    results = run_many("minipaged.embedded.train", [(argv, None) for argv in probes])
    for (argv, words), result in zip(probes.items(), results):
        refused(result, *words)
    assert time.perf_counter() - start < 60                   # none of them trained
    assert [digest(p) for p in SHIPPED] + [digest(other), digest(a_file)] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "empty", "notes"]
    assert list(empty.iterdir()) == []                                        # nothing made


def test_out_dot_in_an_empty_folder_is_refused_before_training(tmp_path):
    """`--out .` cannot be renamed into place (the shell stands in it): said at once."""
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "minipaged.embedded.train", "--out", ".",
                        "--steps", "2"], cwd=tmp_path, env=env(PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and \
        r.stderr.count("\n") == 1 and "working in" in r.stderr, r.stderr
    assert time.perf_counter() - start < 60 and list(tmp_path.iterdir()) == []


def test_interrupted_or_killed_runs_leave_nothing_and_the_next_run_writes_everything(tmp_path):
    shipped = [digest(p) for p in SHIPPED]
    # Ctrl-C while it works: exit 130, no traceback, no model and no temporary folder.
    code, out, err = interrupt(["-m", "minipaged.embedded.train", "--steps", "400", "--out",
                                tmp_path / "stopped"], ready=lambda out: temporaries(tmp_path))
    assert code == 130 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []
    # A kill cannot clean up: its temporary folder stays until the next run beside it.
    p = subprocess.Popen([sys.executable, "-m", "minipaged.embedded.train", "--steps", "400",
                          "--out", tmp_path / "killed"], cwd=ROOT, env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not temporaries(tmp_path) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (tmp_path / "killed").exists() and temporaries(tmp_path)
    # The next run (a small one, in this process): all of its files, the orphan gone.
    train(tmp_path / "model", steps=1, batch_size=2, seq_len=32, threads=1,
          plot_path=tmp_path / "model" / "loss_curve.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert {p.name for p in (tmp_path / "model").iterdir()} == OUTPUTS
    assert load_model(tmp_path / "model").args.vocab_size == \
        load_tokenizer(tmp_path / "model").n_words
    assert (tmp_path / "model").stat().st_mode & 0o777 != 0o700     # a usual folder
    assert [digest(p) for p in SHIPPED] == shipped


@pytest.mark.parametrize("bad", [dict(steps=0), dict(batch_size=-1), dict(seq_len=2.5),
                                 dict(seed=-1), dict(lr=float("nan"))])
def test_train_refuses_bad_numbers_before_any_work(tmp_path, bad):
    with pytest.raises(UsageError, match=next(iter(bad))):
        train(tmp_path / "m", **bad)
    assert list(tmp_path.iterdir()) == []
