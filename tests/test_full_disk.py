"""A disk that fills up while a program writes: one `error: ...` line, exit 2, nothing
half-written, and what was there before left as it was. Two real faults, no mocks: a file-size
limit (`ulimit -f`: every write past it fails with EFBIG, whoever makes it: Python, safetensors'
Rust, matplotlib's C), and, where this runs as root, a full tmpfs (ENOSPC)."""

import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch
from cli_probes import DRIVER, ROOT, env, refused
from conftest import tiny_model
from gguf_files import write_llama

LIMIT = 4096          # bytes a file may hold under the size limit


@pytest.fixture(params=["size-limit", "full-tmpfs"])
def full(request, tmp_path):
    """(folder that cannot take a file of more than a few KiB, preexec_fn for the writer)."""
    folder = tmp_path / "full"
    folder.mkdir()
    if request.param == "size-limit":
        yield folder, limited_to(LIMIT)                  # (SIGXFSZ ignored: EFBIG, not a kill)
        return
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs",
                                            str(folder)], capture_output=True).returncode:
        pytest.skip("a tmpfs needs root and mount(8); the size limit tests the same paths")
    try:
        fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)   # fill it to the last block
        try:
            while os.write(fd, b"\0" * 1024):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield folder, None
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def run(module, argv, preexec, **extra_env):
    r = subprocess.run([sys.executable, "-c", DRIVER, module], cwd=ROOT, preexec_fn=preexec,
                       input=json.dumps([[list(map(str, argv)), None]]), capture_output=True,
                       text=True, timeout=600, env=env(MPLBACKEND="Agg", **extra_env))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])[0]


def files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name != "filler")


def test_bpe_on_a_full_disk(full, tmp_path):
    folder, preexec = full
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i} block{i % 97} table{i % 13}" for i in range(3000)))
    old = folder / "tokenizer.model"
    if preexec:                                   # (the tmpfs has no room for an old one)
        old.write_text("old")
    refused(run("minipaged.embedded.bpe", [text, "--vocab-size", "2000", "--out", old],
                preexec), "could not write", str(old))
    assert files(folder) == (["tokenizer.model"] if preexec else [])
    if preexec:
        assert old.read_text() == "old"


def limited_to(size):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return limit


def test_train_on_a_full_disk(full):
    """The tmpfs is refused before any work (it has less room than the model); under the size
    limit the disk seems roomy, and the first file written fails: the staging folder goes."""
    folder, preexec = full
    result = run("minipaged.embedded.train", ["--out", folder / "model", "--steps", "1"],
                 preexec)
    refused(result, *(["could not write", "model"] if preexec else ["MiB free", "--out"]))
    assert files(folder) == []


def test_train_whose_weights_meet_a_full_disk(tmp_path):
    """The tokenizer (tens of KiB) fits, the weights (MiB, written by safetensors) do not."""
    code = ("import sys; from minipaged import cli; from minipaged.embedded.train import train; "
            "run = cli.program(lambda argv: train(sys.argv[1], steps=1, batch_size=2, "
            "seq_len=32, threads=1)); raise SystemExit(run())")
    r = subprocess.run([sys.executable, "-c", code, tmp_path / "model"], cwd=ROOT,
                       preexec_fn=limited_to(1 << 20), capture_output=True, text=True,
                       timeout=600, env=env())
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "could not write" in lines[0] and "File too large" in lines[0]
    assert files(tmp_path) == []


def test_policies_on_a_full_disk(full):
    folder, preexec = full
    result = run("minipaged.benchmarks.policies", ["--requests", "50", "--figures",
                                                   folder / "figures"], preexec)
    refused(result, "could not write", "fragmentation_policies.png")
    assert [f for f in files(folder) if f != "figures"] == []


def test_a_gguf_cache_on_a_full_disk_is_skipped_with_a_warning(full, tmp_path):
    """The chat's model and tokenizer still load (the cache only saves time), the warning says
    so, and the cache holds no half-written file."""
    folder, preexec = full
    path = write_llama(tmp_path / "tiny.gguf", tiny_model(dtype=torch.float32))
    code = ("import sys; from minipaged import load_model; "
            f"m = load_model({str(path)!r}); print(m.args.n_layers)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, preexec_fn=preexec,
                       capture_output=True, text=True, timeout=300,
                       env=env(XDG_CACHE_HOME=str(folder / "cache")))
    assert r.returncode == 0 and r.stdout.strip() == "2" and "Traceback" not in r.stderr, r.stderr
    assert "could not" in r.stderr
    for name in files(folder):
        p = folder / name
        assert ".tmp-" not in name
        if p.suffix == ".json":
            json.loads(p.read_text())                            # whole, or absent
