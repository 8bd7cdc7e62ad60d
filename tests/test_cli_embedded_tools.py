"""Bad input to the embedded model's other programs, `python -m minipaged.embedded.bpe` and
`python -m minipaged.embedded.corpus`: one `error: ...` line, exit 2, nothing written."""

import subprocess
import sys

from cli_probes import ROOT, answered, env, refused, run_many


def test_bpe_refuses_what_it_cannot_read_or_write(tmp_path):
    text, binary = tmp_path / "text.txt", tmp_path / "binary.txt"
    text.write_text("the block table maps logical blocks to physical blocks. " * 50)
    binary.write_bytes(bytes(range(256)) * 8)
    out = tmp_path / "out.model"
    probes = {   # argv: what the error line names
        (tmp_path / "missing.txt", "--out", out): ["missing.txt"],
        (tmp_path, "--out", out): ["cannot read", str(tmp_path)],
        (binary, "--out", out): ["binary.txt", "not UTF-8"],
        ("/dev/zero", "--out", out): ["/dev/zero", "not a regular file"],   # was a MemoryError
        (text, "--vocab-size", "100", "--out", out): ["at least 256", "100"],
        (text, "--vocab-size", "-1", "--out", out): ["at least 256"],
        (text, "--vocab-size", "300", "--out", "/proc/t.model"): ["--out", "cannot write"],
        (text, "--vocab-size", "300", "--out", tmp_path): ["--out", "is a folder"],
        (text, "--vocab-size", "300", "--out", tmp_path / "no" / "t.model"): ["does not exist"],
    }
    results = run_many("minipaged.embedded.bpe", [(argv, None) for argv in probes])
    for words, result in zip(probes.values(), results):
        refused(result, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.txt", "text.txt"]
    good = run_many("minipaged.embedded.bpe", [((text, "--vocab-size", "300", "--out", out),
                                                None)])[0]
    answered(good)
    assert 256 < len(out.read_bytes().splitlines()) <= 300      # the text ran out of pairs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.txt", "out.model", "text.txt"]


def test_corpus_refuses_bad_numbers_and_stops_quietly_when_its_reader_does():
    bad, negative, huge, good = run_many("minipaged.embedded.corpus", [
        (["--samples", "-1"], None), (["--seed", "-1"], None), (["--seed", "9" * 25], None),
        (["--samples", "0"], None)])
    refused(bad, "--samples")
    refused(negative, "--seed", "-1")                  # was accepted: exit 0
    refused(huge, "--seed")
    answered(good)
    # `| head`: the reader goes away after a few bytes of far more than a pipe holds (64 KiB)
    r = subprocess.run(f"{sys.executable} -m minipaged.embedded.corpus --samples 300 | "
                       "head -c 10 >/dev/null; exit ${PIPESTATUS[0]}", shell=True,
                       executable="/bin/bash", cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=300)
    # rich's console ends the program with status 1 on a broken pipe, cli.program with 141
    # (128 + SIGPIPE, as `cat` would): either way quietly
    assert r.returncode in (1, 141) and not r.stderr, r.stderr
