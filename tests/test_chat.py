"""`python -m minipaged.chat` as a user runs it: one-shot, piped, the demo (bad input: test_cli_chat.py)."""

import re
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_chat(*args, stdin=None, env=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))  # one thread, as in conftest
    return subprocess.run([sys.executable, "-m", "minipaged.chat", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=300, env=env)


def test_prompt_mode_answers_and_exits():
    r = run_chat("--prompt", "what is a block table?", "--max-new-tokens", "60")
    assert r.returncode == 0, r.stderr
    assert "block" in r.stdout.lower()


def test_piped_stdin_is_one_message_per_line():
    r = run_chat("--max-new-tokens", "40", stdin="hello!\nwhat is paged attention?\n")
    assert r.returncode == 0, r.stderr
    replies = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(replies) >= 2 and "attention" in r.stdout.lower()


def test_piped_commands_are_commands_not_messages():
    r = run_chat("--max-new-tokens", "40",
                 stdin="what is a block table?\n/blocks\n/quit\nhello!\n")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "logical -> physical" in out                  # /blocks drew the block table
    assert "minipaged's tiny demo model" not in out      # nothing answered "/blocks", "/quit"
    assert "Hello" not in out                            # or the line after /quit


def test_blocks_on_a_narrow_terminal_and_on_the_contiguous_cache():
    env = {"COLUMNS": "40"}
    paged = run_chat("--max-new-tokens", "8", stdin="hi\n/blocks\n", env=env)
    assert paged.returncode == 0, paged.stderr
    grid = paged.stdout.split("blocks used")[1].split("you (*)")[0].splitlines()[1:-1]
    rows = [re.findall(r"\d+", line) for line in grid]
    full = rows[:-1]                                     # the last row may be short
    assert len(full) > 2 and all(len(r) == len(full[0]) for r in full)   # no row wrapped
    assert len(rows[-1]) <= len(full[0])
    contiguous = run_chat("--cache", "contiguous", stdin="/blocks\n", env=env)
    assert contiguous.returncode == 0 and "Traceback" not in contiguous.stderr
    assert "contiguous cache: row 0 reserves" in contiguous.stdout


def test_contiguous_cache_gives_the_same_replies():
    lines = "what is a block table?\nwhat is paged attention?\n"   # two turns, kept cache
    paged = run_chat("--max-new-tokens", "16", "--block-size", "8", stdin=lines)
    contiguous = run_chat("--max-new-tokens", "16", "--cache", "contiguous", stdin=lines)
    assert paged.returncode == contiguous.returncode == 0, paged.stderr + contiguous.stderr
    assert paged.stdout == contiguous.stdout and len(paged.stdout.splitlines()) == 2


def test_demo_serves_conversations_in_one_batch():
    r = run_chat("--demo", "3", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert all(f"conv {c}" in out for c in range(3))
    assert out.count("you> ") == 6 and out.count("model> ") == 6     # two turns each
    assert re.search(r"conversations / requests\s*│\s*3 / 6", out)
    assert re.search(r"largest batch \(requests in one step\)\s*│\s*3 ", out)
    free, total = map(int, re.search(r"blocks free at the end\s*│\s*(\d+) of (\d+)", out).groups())
    assert free == total                                # every block came back
    cached = int(re.search(r"found in the prefix cache.*?│\s*(\d+)", out).group(1))
    assert cached > 0                                   # follow-ups found their histories
    busiest = out.split("when it was busiest")[1]
    for mark in "abc":                                  # every conversation's blocks in one pool
        assert re.search(rf"\d+{mark}", busiest)
