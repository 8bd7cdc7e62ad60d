"""The GGUF cache is keyed on the file's content: a file rewritten in place with its size and
modification time put back (as `cp -p`, rsync or a tool restoring timestamps would leave it)
loads its new weights, not the cached old ones; an unchanged file is not hashed again."""

import os

import pytest
import torch
from conftest import tiny_model
from gguf_files import write_llama

from minipaged import load_model
from minipaged.formats import gguf_checkpoint


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def same_weights(model, reference):
    return all(torch.equal(model.state_dict()[k], v) for k, v in reference.state_dict().items())


def rewrite_in_place(path, new_bytes):
    """Overwrite the bytes of `path` (same inode, same size), then put its times back."""
    st = os.stat(path)
    assert len(new_bytes) == st.st_size
    with open(path, "r+b") as f:
        f.write(new_bytes)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == \
        (st.st_size, st.st_mtime_ns, st.st_ino)


@pytest.fixture
def hashes(monkeypatch):
    """How many times a file's bytes were hashed."""
    count, real = [0], gguf_checkpoint.hashlib.sha256

    def sha256(*a):
        count[0] += 1
        return real(*a)
    monkeypatch.setattr(gguf_checkpoint.hashlib, "sha256", sha256)
    return count


@pytest.mark.parametrize("racy", [False, True], ids=["settled stamp", "racy stamp"])
def test_a_file_rewritten_with_the_same_size_and_mtime_loads_its_new_weights(
        tmp_path, monkeypatch, hashes, racy):
    """Settled: the stamp is kept, and only the change time (which no program can set back)
    tells the rewrite apart. Racy: a stamp younger than the clock's tick is never trusted."""
    if not racy:
        monkeypatch.setattr(gguf_checkpoint, "RACY_SECONDS", 0.0, raising=False)
    old, new = tiny_model(seed=0, dtype=torch.float32), tiny_model(seed=1, dtype=torch.float32)
    path = write_llama(tmp_path / "m.gguf", old)
    other = write_llama(tmp_path / "other.gguf", new)
    assert same_weights(load_model(path), old)
    assert same_weights(load_model(path), old)            # from the cache
    if not racy:
        assert hashes[0] == 1                              # an unchanged file: hashed once
    rewrite_in_place(path, other.read_bytes())
    assert same_weights(load_model(path), new)
    assert same_weights(load_model(path, dtype=torch.bfloat16), new.to(torch.bfloat16))
