"""Output streams a program cannot write as it expects: a full device (`> /dev/full`), a reader
that goes away (`| head -c 10`), an ASCII-only encoding, an unreadable tiktoken cache. Each
ends with one `error: ...` line and exit status 2 (a full device), quietly (a closed pipe), or
by printing what it can (`?` for what the encoding lacks); never a traceback."""

import os
import subprocess
import sys

import pytest
from cli_probes import ROOT, env, run_into_head, run_to

CHAT = ["-m", "minipaged.chat", "--max-new-tokens", "60"]
QUESTION = b"what is a block table?\n"
FULL = {   # name: (argv, stdin)
    "chat --prompt": (CHAT + ["--prompt", "what is a block table?"], None),
    "chat piped, with /blocks and /stats": (CHAT, QUESTION + b"/blocks\n/stats\n"),
    "chat piped, only /blocks": (CHAT, b"/blocks\n"),
    "chat --demo": (["-m", "minipaged.chat", "--demo", "1", "--max-new-tokens", "4"], None),
    "corpus stats": (["-m", "minipaged.embedded.corpus"], None),
}


@pytest.mark.parametrize("name", FULL)
def test_a_full_device_is_one_error_line_and_exit_2(name):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    argv, stdin = FULL[name]
    code, err = run_to(argv, "/dev/full", stdin=stdin)
    lines = err.splitlines()
    assert code == 2 and "Traceback" not in err and len(lines) == 1, (code, err)
    assert lines[0] == "error: cannot write the output: No space left on device"


@pytest.mark.parametrize("argv, stdin", [
    (CHAT + ["--prompt", "what is a block table?"], None),
    (CHAT, QUESTION + b"/blocks\n/stats\n" + QUESTION),
    (["-m", "minipaged.chat", "--demo", "1", "--max-new-tokens", "4"], None)])
def test_a_reader_that_goes_away_ends_the_program_quietly(argv, stdin):
    code, err = run_into_head(argv, stdin=stdin)
    assert "Traceback" not in err and not err.strip(), err
    assert code in (0, 1, 141)     # 141: SIGPIPE's status; 1: rich's own; 0: all was written


def test_an_ascii_only_output_gets_question_marks_not_a_traceback():
    """The embedded model's answer holds `×` and `−`; `/blocks` and `/stats` draw boxes."""
    r = subprocess.run([sys.executable, *CHAT], cwd=ROOT, input=QUESTION + b"/blocks\n/stats\n",
                       capture_output=True, timeout=300, env=env(PYTHONIOENCODING="ascii"))
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    assert r.stdout.isascii() and b"block_size" in r.stdout and b"?" in r.stdout.split(b"\n")[0]
    assert b"logical -> physical" in r.stdout


def test_an_unreadable_tiktoken_cache_is_not_needed(tmp_path):
    cache = tmp_path / "tiktoken"
    cache.mkdir(mode=0)
    try:
        r = subprocess.run([sys.executable, *CHAT, "--prompt", "hi"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300,
                           env=env(TIKTOKEN_CACHE_DIR=str(cache)))
    finally:
        cache.chmod(0o700)
    assert r.returncode == 0 and not r.stderr.strip() and r.stdout.strip(), r.stderr


@pytest.mark.parametrize("argv", [CHAT + ["--prompt", "hi"], ["-m", "minipaged.embedded.corpus"]],
                         ids=["chat --prompt", "corpus stats"])
def test_a_closed_standard_output_is_one_error_line_before_any_work(argv):
    """`python -m minipaged.chat >&-`: Python starts with sys.stdout None."""
    r = subprocess.run(["sh", "-c", 'exec "$0" "$@" >&-', sys.executable, *argv], cwd=ROOT,
                       capture_output=False, stderr=subprocess.PIPE, text=True, timeout=120,
                       env=env())
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: standard output is closed, so nothing this program prints could be read; run "
        "it with its output going to a terminal, a file, a pipe or /dev/null"], r.stderr


def test_a_tiktoken_cache_that_cannot_be_created_is_not_needed():
    """The tokenizer file is read from disk; tiktoken's download cache is never written (a
    folder that cannot be made there was a FileNotFoundError traceback)."""
    r = subprocess.run([sys.executable, *CHAT, "--prompt", "hi"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env(TIKTOKEN_CACHE_DIR="/proc/tiktoken"))
    assert r.returncode == 0 and not r.stderr.strip() and r.stdout.strip(), r.stderr
