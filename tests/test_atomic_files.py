"""Files and folders are written whole or not at all, and what a killed writer leaves behind is
removed by the next one (formats/atomic.py: the GGUF cache and the trainer write through it)."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model
from gguf_files import write_llama

from minipaged import load_model
from minipaged.formats.atomic import remove_orphans, staged_folder, write_file
from minipaged.formats.gguf_checkpoint import cache_dir

KILLED_WRITER = """
import sys, time
from pathlib import Path
from minipaged.formats.atomic import write_file
def slow(tmp):
    (Path(tmp).parent / ".tmpAbC123").write_bytes(b"a library's own temporary")  # (safetensors)
    Path(tmp).write_bytes(b"half of it")
    print("writing", flush=True)
    time.sleep(600)
write_file(Path(sys.argv[1]), slow)
"""


def killed_writer(target):
    """A real process killed with SIGKILL in the middle of `write_file(target, ...)`."""
    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)],
                         stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"writing\n"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    return p.pid


def hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    for error in (OSError("disk full"), KeyboardInterrupt()):
        def fail(tmp, error=error):
            open(tmp, "w").write("half")
            raise error
        with pytest.raises(type(error)):
            write_file(target, fail)
        assert target.read_text() == "old" and hidden(tmp_path) == []
    write_file(target, lambda tmp: open(tmp, "w").write("new"))
    assert target.read_text() == "new" and hidden(tmp_path) == []


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path):
    target = tmp_path / "model"
    with staged_folder(target) as tmp:
        (tmp / "a").write_text("1")
    assert [p.name for p in target.iterdir()] == ["a"]
    assert target.stat().st_mode & 0o777 != 0o700        # a usual folder, not mkdtemp's
    with pytest.raises(KeyboardInterrupt):
        with staged_folder(target) as tmp:
            (tmp / "b").write_text("2")
            raise KeyboardInterrupt
    assert [p.name for p in target.iterdir()] == ["a"] and hidden(tmp_path) == []
    with staged_folder(target) as tmp:
        (tmp / "c").write_text("3")
    assert [p.name for p in target.iterdir()] == ["c"] and hidden(tmp_path) == []


def test_a_killed_writers_temporary_is_removed_a_live_ones_kept(tmp_path):
    """What a killed writer leaves — its temporary, and what its libraries put beside it — is
    one folder named by its pid, removed by the next writer or reader there."""
    target = tmp_path / "weights.safetensors"
    killed_writer(target)
    orphan = hidden(tmp_path)
    assert len(orphan) == 1 and not target.exists()
    live = tmp_path / f".other.tmp-{os.getpid()}-abc"     # this process: still writing
    live.write_text("mine")
    assert remove_orphans(tmp_path) == orphan
    assert hidden(tmp_path) == [live.name]


def test_the_next_gguf_load_removes_what_a_killed_one_left(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_llama(tmp_path / "tiny.gguf", tiny_model(dtype=torch.float32))
    load_model(path)
    folder = cache_dir(path)
    killed_writer(folder / "weights-bfloat16.safetensors")    # killed while caching bf16
    assert len(hidden(folder)) == 1
    assert load_model(path, dtype=torch.bfloat16).args.n_layers == 2
    assert hidden(folder) == []
    assert sorted(p.name for p in folder.iterdir()) == [
        "metadata.json", "source.json", "weights-bfloat16.safetensors",
        "weights-float32.safetensors"]
