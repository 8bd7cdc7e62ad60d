"""The interactive chat as a person uses it: typed into a pseudo-terminal, read off the screen."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Chat:
    """`python -m minipaged.chat` in a pty, 120 columns (or `size`), no colours (TERM=dumb)."""

    def __init__(self, *args, size=(60, 120)):
        env = dict(os.environ, TERM="dumb", COLUMNS=str(size[1]), LINES=str(size[0]),
                   PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.p = pexpect.spawn(sys.executable, ["-m", "minipaged.chat", *args], cwd=ROOT,
                               env=env, encoding="utf-8", timeout=180, dimensions=size)
        self.p.expect("you> ")
        self.banner = self.clean(self.p.before)

    @staticmethod
    def clean(text):
        return ANSI.sub("", text).replace("\r", "")

    def say(self, line):
        """Type a line, wait for the next prompt, return what the screen showed in between."""
        self.p.sendline(line)
        self.p.expect("you> ")
        return self.clean(self.p.before)

    def quit(self):
        self.p.sendline("/quit")
        self.p.expect(pexpect.EOF)
        self.p.close()
        return self.p.exitstatus


def test_two_turns_and_the_blocks_they_hold():
    chat = Chat("--max-new-tokens", "20")
    assert "paged: 128 blocks of 16 tokens" in chat.banner
    first = chat.say("what is a block table?")
    assert "model>" in first and "block" in first.lower()
    assert "note: reply cut at 20 new tokens (--max-new-tokens)" in " ".join(first.split())
    n1, h1 = map(int, re.search(r"prefill (\d+) new tokens of (\d+)", first).groups())
    assert n1 == h1                                   # the first turn: all of it is new
    second = chat.say("what is paged attention?")
    n2, h2 = map(int, re.search(r"prefill (\d+) new tokens of (\d+)", second).groups())
    assert n2 < h2 - 20 and h2 > h1                   # the second: only the new tokens
    shown = chat.say("/blocks")
    tokens, held = map(int, re.search(r"you: (\d+) tokens in (\d+) blocks of 16", shown).groups())
    assert h2 <= tokens <= h2 + 20 and held == math.ceil(tokens / 16)
    table = [int(b) for b in re.findall(r"L\d+->(\d+) \(\d+/16\)", shown)]
    assert len(table) == held
    grid_marked = {int(b) for b in re.findall(r"(\d+)\*", shown)}
    assert grid_marked == set(table)                  # the pool marks exactly those blocks
    assert f"layer 0 of 4: {held} of 128 blocks used" in shown
    stats = chat.say("/stats")
    assert "internal fragmentation" in stats and "contiguous cache would reserve" in stats
    assert chat.quit() == 0


def test_a_full_pool_is_explained_and_reset_recovers():
    # 96 KiB holds 3 blocks of 16 tokens (32 KiB each in the embedded model's 4 layers).
    chat = Chat("--max-new-tokens", "40", "--kv-budget", "96KiB")
    assert "paged: 3 blocks of 16 tokens" in chat.banner
    cut = chat.say("what is a block table?")
    assert "pool full" in cut and "/reset" in cut and "--kv-budget" in cut
    refused = chat.say("what is paged attention?")
    assert "pool full" in refused and "Traceback" not in refused
    assert "every block is free again" in chat.say("/reset")
    again = chat.say("hello!")
    assert "model>" in again and re.search(r"blocks \d/3 in use", again)
    assert chat.quit() == 0


def test_nothing_typed_ends_the_chat():
    """A message too long for the context is refused and changes nothing; commands with bad
    arguments say what they take; the chat is still there to /quit."""
    chat = Chat("--max-new-tokens", "1900")      # leaves ~140 tokens for history and message
    chat.say("what is a block table?")
    before = chat.say("/stats")
    refused = chat.say("block " * 300)          # (a terminal line holds at most 4095 bytes)
    assert "error:" in refused and "this message takes" in refused and "Traceback" not in refused
    assert chat.say("/stats") == before
    for bad in ("/blocks abc", "/blocks 99", "/blocks \u00b2", "/foo[/]"):
        shown = chat.say(bad)
        assert "Traceback" not in shown and ("0 to 3" in shown or "unknown command" in shown)
    chat.say("/reset")
    assert re.search(r"turns\s*│\s*0\b", chat.say("/stats"))
    assert chat.quit() == 0


def test_an_80_by_24_terminal_wraps_replies_at_words_and_fits_blocks():
    """As a person at an 80x24 terminal: each line of a reply ends at a word (the words are
    those the piped chat, which does not wrap, prints) and `/blocks` fits the screen with the
    next prompt."""
    question = "what is paged attention and why does it use blocks?"
    piped = subprocess.run([sys.executable, "-m", "minipaged.chat", "--max-new-tokens", "60"],
                           cwd=ROOT, input=question + "\n", capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert piped.returncode == 0, piped.stderr
    chat = Chat("--max-new-tokens", "60", "--no-status", size=(24, 80))
    shown = chat.say(question)
    reply = shown.split("model> ", 1)[1].rstrip("\n").split("\n")
    assert len(reply) >= 2                                     # long enough to be wrapped
    assert all(len(line) <= 80 for line in [f"model> {reply[0]}", *reply[1:]]), reply
    assert " ".join(reply).split() == piped.stdout.split()     # no word cut at a line's end
    drawn = chat.say("/blocks").split("\n")[1:]               # (the echoed command first)
    assert "logical -> physical" in "\n".join(drawn)
    assert len(drawn) <= 24 and all(len(line) <= 80 for line in drawn), drawn
    assert chat.quit() == 0
