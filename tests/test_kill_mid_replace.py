"""A writer killed with SIGKILL at each moment of replacing a model folder (`train
--overwrite`'s `staged_folder`): the next load finds a complete model, the old or the new, and
never one that is half of each or gone (formats/atomic.py's `recover`)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from minipaged import load_model
from minipaged.formats.atomic import recover, remove_orphans, staged_folder
from minipaged.formats.checkpoint import save_model

TESTS = Path(__file__).resolve().parent

# The child replaces the model at argv[1] with tiny_model(seed=1), and stops for good (until the
# SIGKILL) at the moment argv[2] names: before the n-th rename ("rename-1".."rename-3"), before
# the old copy is removed ("remove-old"), or half-way through removing it ("removing-old").
REPLACER = """
import os, shutil, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from conftest import tiny_model
from minipaged.formats import atomic
from minipaged.formats.checkpoint import save_model

target, moment = Path(sys.argv[1]), sys.argv[2]
def stop():
    print("stopped", flush=True)
    time.sleep(600)
renames, real_rename, real_rmtree = [0], os.rename, shutil.rmtree
def rename(src, dst):
    renames[0] += 1
    if moment == f"rename-{renames[0]}":
        stop()
    real_rename(src, dst)
def rmtree(path, *a, **k):
    if ".old-" in Path(path).name:
        if moment == "remove-old":
            stop()
        if moment == "removing-old":
            next(Path(path).iterdir()).unlink()       # one file of the old copy gone
            stop()
    real_rmtree(path, *a, **k)
os.rename, shutil.rmtree = rename, rmtree
with atomic.staged_folder(target) as tmp:
    save_model(tiny_model(seed=1, dtype=__import__("torch").float32), tmp)
print("done", flush=True)
"""

# moment -> which model a load must find afterwards
MOMENTS = {"rename-1": "old", "rename-2": "new", "rename-3": "new", "remove-old": "new",
           "removing-old": "new"}


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(model, reference):
    state = model.state_dict()
    return state.keys() == reference.keys() and all(torch.equal(state[k], reference[k])
                                                     for k in state)


def replace_and_kill(target, moment):
    p = subprocess.Popen([sys.executable, "-c", REPLACER, str(target), moment, str(TESTS)],
                         stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert p.stdout.readline() == b"stopped\n"
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_kill_at_any_moment_of_a_replacement_leaves_a_complete_model(tmp_path, moment):
    old, new = tiny_model(seed=0, dtype=torch.float32), tiny_model(seed=1, dtype=torch.float32)
    target = tmp_path / "model"
    with staged_folder(target) as tmp:
        save_model(old, tmp)
    replace_and_kill(target, moment)
    assert any(p.name.startswith(".") for p in tmp_path.iterdir())    # the killed writer's
    loaded = load_model(target)                                        # recovers, then loads
    assert same(loaded, weights(new if MOMENTS[moment] == "new" else old))
    # Whatever is left (an unfinished .tmp- folder) goes with the next write, and the model
    # found stays: a second recovery finds nothing to do.
    remove_orphans(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert recover(target) == []
    assert same(load_model(target), weights(loaded))


def test_the_next_write_recovers_before_it_writes(tmp_path):
    """The killed writer's new model becomes the folder; a later write then replaces it."""
    target = tmp_path / "model"
    with staged_folder(target) as tmp:
        save_model(tiny_model(seed=0, dtype=torch.float32), tmp)
    replace_and_kill(target, "rename-3")               # no `model` at all, .old- and .new-
    assert not target.exists()
    third = tiny_model(seed=2, dtype=torch.float32)
    with staged_folder(target) as tmp:
        save_model(third, tmp)
    assert same(load_model(target), weights(third))
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_lone_old_copy_is_put_back_not_removed(tmp_path):
    """Should the folder vanish with only the old copy left, recovery puts it back."""
    target = tmp_path / "model"
    model = tiny_model(seed=0, dtype=torch.float32)
    save_model(model, tmp_path / ".model.old-999999999-abc")           # no such process
    assert recover(target) == ["renamed .model.old-999999999-abc back to model"]
    assert same(load_model(target), weights(model))
