"""Bad input to `python -m minipaged.chat`: every refusal is one `error: ...` line and exit
status 2, no traceback; a refused message changes nothing; no /command ends the chat; piped
input survives bytes that are not UTF-8 and lines that cannot be answered; Ctrl-C is exit 130."""

import os
import re

import pytest
from cli_probes import answered, digest, interrupt, refused, run_many

from minipaged.formats import DEFAULT_MODEL_DIR

WORDS = lambda n: " ".join(["block"] * n)           # about one token a word
QUESTIONS = "what is a block table?\nwhat is paged attention?\n"

PROBES = {   # name: (argv, stdin, what the one error line must name; None: answered)
    # refused while the arguments are read, before the model loads
    "no new tokens": (["--max-new-tokens", "0", "--prompt", "hi"], None, ["--max-new-tokens"]),
    "negative new tokens": (["--max-new-tokens", "-5"], None, ["--max-new-tokens"]),
    "top-p 0": (["--top-p", "0", "--prompt", "hi"], None, ["--top-p"]),
    "top-p nan": (["--top-p", "nan", "--prompt", "hi"], None, ["--top-p"]),
    "temperature nan": (["--temperature", "nan", "--prompt", "hi"], None, ["--temperature"]),
    "temperature inf": (["--temperature", "inf", "--prompt", "hi"], None, ["--temperature"]),
    "temperature -1": (["--temperature", "-1", "--prompt", "hi"], None, ["--temperature"]),
    "block size 0": (["--block-size", "0", "--prompt", "hi"], None, ["--block-size"]),
    "block size -3": (["--block-size", "-3", "--prompt", "hi"], None, ["--block-size"]),
    "budget not a size": (["--kv-budget", "lots", "--prompt", "hi"], None, ["4MiB"]),
    "budget in TiB": (["--kv-budget", "1TiB", "--prompt", "hi"], None, ["'1TiB' is not a size",
                                                                       "GiB"]),
    "budget 0": (["--kv-budget", "0", "--prompt", "hi"], None, ["at least 1 byte"]),
    "negative budget": (["--kv-budget", "-4MiB", "--prompt", "hi"], None, ["--kv-budget"]),
    "overflowing budget": (["--kv-budget", "9" * 400, "--prompt", "hi"], None, ["--kv-budget"]),
    "demo 0": (["--demo", "0"], None, ["--demo"]),
    "unknown dtype": (["--dtype", "float16"], None, ["--dtype"]),
    "unknown flag": (["--frobnicate"], None, ["--frobnicate"]),
    "negative seed": (["--seed", "-1"], None, ["--seed"]),
    "overflowing seed": (["--seed", "9" * 25, "--temperature", "1", "--prompt", "hi"], None,
                         ["--seed"]),
    # refused once the model (and its context) is known
    "new tokens past the context": (["--max-new-tokens", "5000", "--prompt", "hi"], None,
                                    ["--max-new-tokens", "context of 2048"]),
    "same, contiguous": (["--cache", "contiguous", "--max-new-tokens", "5000", "--prompt", "hi"],
                         None, ["--max-new-tokens"]),
    "system prompt too long": (["--system", WORDS(2100), "--prompt", "hi"], None,
                               ["system prompt is", "--system"]),
    "message too long": (["--prompt", WORDS(2100)], None, ["this message takes", "shorter"]),
    "huge block size": (["--block-size", str(10 ** 12), "--prompt", "hi"], None,
                        ["needs", "available", "blocks of 1,000,000,000,000 tokens"]),
    "a billion demo conversations": (["--demo", str(10 ** 9)], None, ["needs", "available"]),
    "budget below a block": (["--kv-budget", "100B", "--prompt", "hi"], None, ["holds no block"]),
    "missing model": (["--model", "/nonexistent/model", "--prompt", "hi"], None,
                      ["/nonexistent/model"]),
    "markup in a path": (["--model", "/nonexistent/x[/red]", "--prompt", "hi"], None,
                         ["x[/red]"]),
    # answered
    "a budget past one context is capped": (["--kv-budget", "100GiB", "--prompt", "hi",
                                             "--max-new-tokens", "8"], None, None),
    "a contiguous cache ignores the block size": (["--block-size", str(10 ** 12), "--cache",
                                                   "contiguous", "--prompt", "hi",
                                                   "--max-new-tokens", "8"], None, None),
    "stdin closed": ([], None, None),
    "piped bytes that are not UTF-8": (["--max-new-tokens", "4"],
                                       b"\xff\xfe hello \xc3\x28\nwhat is a block?\n", None),
    "piped binary garbage": (["--max-new-tokens", "2"], bytes(range(256)) * 4 + b"\n\x00\n",
                             None),
    "/blocks with a word": ([], b"/blocks abc\n", None),
    "/blocks past the last layer": ([], b"hi\n/blocks 99\n", None),
    "/blocks with a superscript digit": ([], "hi\n/blocks \u00b2\n/stats\n".encode(), None),
    "/blocks -1": ([], b"hi\n/blocks -1\n", None),
    "unknown commands with markup": ([], b"/foo[/]\n/bar [bold]\n", None),
    "/stats before any message": ([], b"/stats\n/blocks\n", None),
    "/stats after /reset": (["--max-new-tokens", "8"], b"hi\n/reset\n/stats\n", None),
    # piped lines that cannot be answered: one error line each, the rest answered, exit 2
    "one too-long line among good ones": (["--max-new-tokens", "8"],
                                          f"hello\n{WORDS(2100)}\nwhat is a block?\n".encode(),
                                          ["this message takes"]),
    "a too-long message mid-conversation": (["--max-new-tokens", "1900"],
                                            f"{QUESTIONS}/stats\n{WORDS(200)}\n/stats\n"
                                            "/blocks\nhello\n".encode(), ["this message takes"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    shipped = digest(DEFAULT_MODEL_DIR)
    cache_home = tmp_path_factory.mktemp("xdg")
    out = run_many("minipaged.chat", [(argv, stdin) for argv, stdin, _ in PROBES.values()],
                   XDG_CACHE_HOME=str(cache_home))
    assert digest(DEFAULT_MODEL_DIR) == shipped                 # nothing on disk changed
    assert not (cache_home / "minipaged").exists()            # nor in the GGUF cache
    return dict(zip(PROBES, out))


@pytest.mark.parametrize("name", PROBES)
def test_each_probe_ends_as_it_should(results, name):
    argv, stdin, words = PROBES[name]
    if words is None:
        answered(results[name])
    else:
        refused(results[name], *words)


def replies(result):
    return [line for line in result["stdout"].splitlines() if line.strip()]


def test_piped_lines_after_a_bad_one_are_answered(results):
    assert len(replies(results["piped bytes that are not UTF-8"])) == 2
    assert len(replies(results["one too-long line among good ones"])) == 2


def test_a_refused_message_changes_nothing(results):
    out = results["a too-long message mid-conversation"]["stdout"]
    tables = [t.split("└")[0] for t in out.split("KV memory of this conversation")[1:]]
    assert len(tables) == 2 and tables[0] == tables[1]          # /stats before == /stats after
    held = re.search(r"blocks held / free / in the pool\s*│\s*(\d+) /", tables[0]).group(1)
    tokens, blocks = map(int, re.search(r"you: (\d+) tokens in (\d+) blocks", out).groups())
    cached = int(re.search(r"tokens whose K/V are cached\s*│\s*(\d+)", tables[0]).group(1))
    assert (tokens, blocks) == (cached, int(held))              # /blocks agrees with /stats
    assert out.rstrip().splitlines()[-1].strip()                # and "hello" was answered


def test_commands_say_what_is_wrong_and_the_chat_goes_on(results):
    for name in ("/blocks with a word", "/blocks past the last layer",
                 "/blocks with a superscript digit", "/blocks -1"):
        assert "layer number, from 0 to 3" in results[name]["stdout"], name
    assert "turns" in results["/blocks with a superscript digit"]["stdout"]   # /stats ran after
    assert "unknown command /foo[/]" in results["unknown commands with markup"]["stdout"]
    stats = results["/stats after /reset"]["stdout"]
    assert re.search(r"turns\s*│\s*0\b", stats)
    assert re.search(r"tokens whose K/V are cached\s*│\s*0\b", stats)


def test_ctrl_c_while_piped_exits_130_without_a_traceback():
    code, out, err = interrupt(["-m", "minipaged.chat", "--max-new-tokens", "1900"],
                               ready=lambda out: "\n" in out,
                               stdin=b"what is a block table?\n" * 40)
    assert code == 130 and "Traceback" not in err and not err.strip(), (code, err)
    assert out.strip()                                          # it was answering


def test_ctrl_c_while_the_gguf_cache_is_written_leaves_no_temporary(tmp_path):
    """SmolLM2's first load dequantizes the GGUF file and caches the weights (~540 MB);
    Ctrl-C in the middle of that write: exit 130, no traceback, no half-written file."""
    def temporaries():
        # os.walk, not rglob: while the program writes, a folder can vanish between being
        # listed and being read, and rglob raises FileNotFoundError (it happened once, in a
        # full run on a busy machine); os.walk skips it. Once the program has exited nothing
        # moves, so the final check below sees every temporary either way.
        return [name for _, dirs, files in os.walk(tmp_path) for name in dirs + files
                if ".tmp-" in name]
    code, out, err = interrupt(["-m", "minipaged.chat", "--model", "smollm2", "--prompt", "hi"],
                               ready=lambda out: bool(temporaries()),
                               XDG_CACHE_HOME=str(tmp_path))
    assert code == 130 and "Traceback" not in err and not err.strip(), (code, err)
    assert temporaries() == []
    assert not list(tmp_path.rglob("weights-*.safetensors"))


def test_a_reply_cut_short_by_a_full_pool_is_said_on_stderr_and_exits_1():
    """96 KiB holds 3 blocks of 16 tokens: the first reply stops when they are full. Piped and
    with --prompt, what was said is printed, one `error: reply cut short: ...` line says why,
    and the exit status is 1 (2 if a later line is refused, as the pool stays full)."""
    tight = ["--max-new-tokens", "60", "--kv-budget", "96KiB"]
    piped, prompt, then_refused, roomy = run_many("minipaged.chat", [
        (tight, b"what is a block table?\n"),
        (tight + ["--prompt", "what is a block table?"], None),
        (tight, b"what is a block table?\nwhat is paged attention?\n"),
        (["--max-new-tokens", "60"], b"what is a block table?\n")])
    for r in (piped, prompt):
        assert r["code"] == 1 and "Traceback" not in r["stderr"], r
        lines = r["stderr"].splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: reply cut short: the KV pool "
                                                       "is full") and "--kv-budget" in lines[0]
        said = r["stdout"].strip()
        assert said and roomy["stdout"].strip().startswith(said)    # as far as it went
        assert len(said) < len(roomy["stdout"].strip())
    assert prompt["stdout"] == piped["stdout"]
    assert then_refused["code"] == 2 and len(then_refused["stderr"].splitlines()) == 2
    answered(roomy)


def test_a_reply_cut_at_max_new_tokens_ends_with_a_note_naming_the_flag():
    """A reply that reaches --max-new-tokens before the model ends its turn: printed, then one
    `note: ...` line on stderr naming the flag; exit status 0. A reply that ends by itself
    (the embedded model's greeting is ~30 tokens) has no note."""
    cut, piped, whole = run_many("minipaged.chat", [
        (["--max-new-tokens", "10", "--prompt", "what is a block table?"], None),
        (["--max-new-tokens", "10"], b"what is a block table?\nhi\n"),
        (["--max-new-tokens", "60", "--prompt", "hi"], None)])
    for r, cuts in ((cut, 1), (piped, 2)):
        answered(r)
        notes = r["stderr"].splitlines()
        assert len(notes) == cuts and all(n.startswith("note: reply cut at 10 new tokens") and
                                          "--max-new-tokens" in n for n in notes), r
        assert len(replies(r)) == cuts                          # the notes are not in stdout
    answered(whole)
    assert replies(whole) and not whole["stderr"].strip(), whole
