"""Run a minipaged program the way `python -m` does, many command lines per subprocess.

Each subprocess starts Python and torch once (about 2 s) and then runs the program's module
with `runpy.run_module(..., run_name="__main__")` — what `python -m` itself calls — once per
command line, with its own argv, stdin, stdout and stderr. What comes back per command line:
the exit status (or "traceback" if an exception escaped the program) and the two outputs.

    results = run_many("minipaged.chat", [(["--demo", "0"], None), (["--max-new-tokens", "8"], b"hi\\n")])
    refused(results[0], "--demo")
"""

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DRIVER = r"""
import base64, contextlib, io, json, resource, runpy, sys, traceback
# A program that allocates more than it checked for fails here instead of waking the kernel's
# out-of-memory killer on a shared machine (the probes ask for terabytes, never for 16 GiB).
resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
module = sys.argv[1]
probes = json.loads(sys.stdin.read())
results = []
for argv, stdin in probes:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [module, *argv]
    sys.stdin = (None if stdin is None else
                 io.TextIOWrapper(io.BytesIO(base64.b64decode(stdin)), encoding="utf-8"))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = "traceback"
    results.append({"argv": argv, "code": code, "stdout": out.getvalue(),
                    "stderr": err.getvalue()})
print(json.dumps(results))
"""


def env(**extra):
    """The tests' environment: one torch thread (as in conftest), a wide enough terminal."""
    return dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="120", **extra)


def run_many(module, probes, timeout=600, **extra_env):
    """[(argv, stdin bytes or None)] -> one result dict per probe, in order."""
    payload = json.dumps([[list(map(str, argv)), None if stdin is None else
                           base64.b64encode(stdin).decode()] for argv, stdin in probes])
    r = subprocess.run([sys.executable, "-c", DRIVER, module], input=payload, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, env=env(**extra_env))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def error_lines(result):
    return [line for line in result["stderr"].splitlines() if line.startswith("error:")]


def no_traceback(result):
    assert result["code"] != "traceback" and "Traceback" not in result["stderr"] + \
        result["stdout"], result


def refused(result, *words):
    """Exit status 2, exactly one `error: ...` line naming every word, no traceback."""
    no_traceback(result)
    lines = error_lines(result)
    assert result["code"] == 2 and len(lines) == 1, result
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def answered(result):
    """Exit status 0, no error line, no traceback."""
    no_traceback(result)
    assert result["code"] == 0 and not error_lines(result), result


def default_sigint():
    """In the child before it runs Python: Ctrl-C interrupts, even when the tests themselves run
    with SIGINT ignored (a job started in the background with `&`), which a child inherits and
    which keeps Python from installing its KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(argv, ready, stdin=None, timeout=300, **extra_env):
    """Start `python ARGV` in its own process group, press Ctrl-C (SIGINT to the group, as a
    terminal does) once `ready(stdout so far)` is true, and return (exit status, stdout,
    stderr). Waiting for a sign of work, not a time, keeps the key press off Python's start."""
    p = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT,
                         env=env(PYTHONUNBUFFERED="1", **extra_env),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True,
                         preexec_fn=default_sigint)
    chunks = {"out": [], "err": []}
    readers = [threading.Thread(target=lambda f=f, k=k: chunks[k].extend(iter(f.readline, b"")))
               for f, k in ((p.stdout, "out"), (p.stderr, "err"))]
    for t in readers:
        t.start()
    if stdin is not None:
        p.stdin.write(stdin)
    p.stdin.close()
    deadline = time.time() + timeout
    while p.poll() is None and time.time() < deadline and \
            not ready(b"".join(chunks["out"]).decode(errors="replace")):
        time.sleep(0.05)
    assert p.poll() is None, f"finished before the interrupt: {chunks}"
    os.killpg(p.pid, signal.SIGINT)
    p.wait(timeout=timeout)
    for t in readers:
        t.join()
    return (p.returncode, *(b"".join(chunks[k]).decode(errors="replace") for k in ("out", "err")))


def digest(path: Path):
    """Every file under `path` with its bytes: equal before and after means nothing changed."""
    path = Path(path)
    if path.is_file():
        return path.read_bytes()
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts} if path.exists() else None


def run_to(argv, stdout, stdin=None, timeout=300, **extra_env):
    """`python ARGV` with its standard output opened on the file `stdout` (e.g. /dev/full):
    (exit status, stderr)."""
    with open(stdout, "wb") as out:
        r = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, input=stdin,
                           stdout=out, stderr=subprocess.PIPE, timeout=timeout,
                           env=env(**extra_env))
    return r.returncode, r.stderr.decode(errors="replace")


def run_into_head(argv, n_bytes=10, stdin=None, timeout=300, **extra_env):
    """`python ARGV | head -c N_BYTES`: the reader goes away early. (exit status, stderr)."""
    p = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(**extra_env))
    if stdin is not None:
        p.stdin.write(stdin)
    p.stdin.close()
    p.stdout.read(n_bytes)
    p.stdout.close()                             # as head does once it has its bytes
    err = p.stderr.read()
    p.wait(timeout=timeout)
    return p.returncode, err.decode(errors="replace")
