"""What every command line of minipaged does alike: a mistake is one line `error: ...` and exit
status 2, Ctrl-C is exit status 130 with no traceback, and bad values are refused while the
arguments are read, before any slow work.

Not a stage of the course: the programs in chat/, embedded/ and benchmarks/ use it, no stage
does. Each program is written as

    @cli.program
    def main(argv=None):
        args = build_parser().parse_args(argv)      # a cli.ArgumentParser
        ...

    if __name__ == "__main__":
        raise SystemExit(main())

and its parser's types refuse a bad value with a sentence: `whole(1)` (an integer of at least
1), `number(above=0)`, `size` ('4MiB'), `seed`, `output_file`, `output_folder`. A default
that is only sometimes used (a plot's path) is given as a Path, which argparse leaves alone,
and checked with `check` when it is used.
"""

from __future__ import annotations

import argparse
import errno
import functools
import math
import os
import re
import sys
import tempfile
from pathlib import Path

from .errors import MiniPagedError, OutputError, UsageError

SIGINT_STATUS, SIGPIPE_STATUS = 130, 141        # 128 + the signal's number, as a shell reports


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that a bad argument raises UsageError (one line and exit 2,
    from `program`) instead of printing the usage and exiting itself."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def program(main):
    """Wrap a program's `main(argv=None)` so that it returns the exit status: main's own (0 if
    it returns None), 2 after a minipaged error (its sentence printed on one line as
    `error: ...`, no traceback), 2 with `error: cannot write the output: ...` when standard
    output (or a file, named) cannot be written (a full disk, `> /dev/full`) or was closed
    before the start (`>&-`, refused before any work), 130 after Ctrl-C, 141 when whoever
    read the output went away (`... | head`; output printed through rich's Console stops
    there with rich's own status 1, as quietly). Characters the output's encoding lacks
    (`PYTHONIOENCODING=ascii`) print as `?`. The wrapped `main` is also what the console
    scripts call."""
    @functools.wraps(main)
    def wrapped(argv=None) -> int:
        return _run(main, argv)
    return wrapped


def _run(main, argv) -> int:
    if sys.stdout is None:                      # started with standard output closed (`>&-`)
        if sys.stderr is not None:
            print(error_line("standard output is closed, so nothing this program prints could "
                             "be read; run it with its output going to a terminal, a file, a "
                             "pipe or /dev/null"), file=sys.stderr, flush=True)
        return 2
    for stream in (sys.stdout, sys.stderr):     # a character the terminal's encoding lacks
        if hasattr(stream, "reconfigure"):      # (PYTHONIOENCODING=ascii) prints as "?"
            stream.reconfigure(errors="replace")
    try:
        try:
            status = main(argv)
        except SystemExit as e:                 # (--help): what it printed is flushed below
            if e.code not in (0, None):
                raise
            status = 0
        sys.stdout.flush()                      # a closed pipe shows up here, not at exit
        return status or 0
    except MiniPagedError as e:
        print(error_line(e), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return SIGINT_STATUS
    except BrokenPipeError:
        _drop_stdout()
        return SIGPIPE_STATUS
    except OSError as e:
        if e.errno not in FULL_OR_FAILING:      # a write that no program could have made
            raise
        what = f"cannot write {e.filename}" if e.filename else "cannot write the output"
        try:
            sys.stdout.flush()
        except (OSError, ValueError):           # it was standard output (`> /dev/full`)
            _drop_stdout()
        print(error_line(f"{what}: {e.strerror or e}"), file=sys.stderr, flush=True)
        return 2


FULL_OR_FAILING = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


def _drop_stdout() -> None:
    """Whatever is still buffered cannot be written either: point stdout at /dev/null so that
    Python's own flush at exit does not raise again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):               # no file descriptor (a test's StringIO)
        pass


def error_line(e: Exception) -> str:
    """`error: <the sentence>`, on one line whatever the message holds."""
    return "error: " + " ".join(str(e).split())


# -- argument types: each returns the value or raises ArgumentTypeError with a sentence -----------

def whole(low: int = 1, high: int | None = None):
    """An integer in [low, high] (no upper bound by default)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            upper = f" and at most {high:,}" if high is not None else ""
            raise argparse.ArgumentTypeError(f"{value} is out of range: give a whole number of "
                                             f"at least {low}{upper}")
        return value
    return parse


def number(above: float | None = None, at_least: float | None = None,
           at_most: float | None = None):
    """A finite float, optionally > `above`, >= `at_least`, <= `at_most` (NaN and inf refused)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        wrong = []
        if above is not None and not value > above:
            wrong.append(f"above {above:g}")
        if at_least is not None and not value >= at_least:
            wrong.append(f"at least {at_least:g}")
        if at_most is not None and not value <= at_most:
            wrong.append(f"at most {at_most:g}")
        if wrong or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a number "
                                             f"{' and '.join(wrong) or 'that is finite'}")
        return value
    return parse


seed = whole(0, 2**63 - 1)          # a non-negative 64-bit seed, as torch and numpy take

UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3,
         "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3}


def size(text: str) -> int:
    """'4MiB', '512KiB', '1.5GB' or '1048576' -> bytes (at least one)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write a number of bytes, or a number and one of the units "
            f"B, KB, MB, GB, KiB, MiB, GiB (e.g. 4MiB, 512KiB)")
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: a size is at least 1 byte")
    return int(value)


def output_file(text) -> Path:
    """A file the program will write: its folder must exist and take new files."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; give the name of a file to write")
    _check_writable(path.parent)
    return path


def output_folder(text) -> Path:
    """A folder the program will write into (and create): the folder holding it must exist and
    take new files, and the path must not be a file."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; give a folder")
    _check_writable(path if path.is_dir() else path.parent)
    return path


def figure_file(text) -> Path:
    """A PNG the program will draw: an `output_file` whose name ends in .png."""
    path = output_file(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"figures are written as PNG: name the file "
                                         f"{path.stem}.png, not {path.name}")
    return path


# The figures the README and lessons show: a benchmark redraws them only when asked to with
# --readme-figures; by default its figures go where the user says, or to a new temporary folder.
README_FIGURES = Path(__file__).resolve().parents[1] / "assets"


def add_figure_options(parser, what: str, aliases=()) -> None:
    """--figures DIR (or its older names, `aliases`) and --readme-figures, for a program that
    draws `what`."""
    parser.add_argument("--figures", *aliases, dest="figures", type=output_folder, metavar="DIR",
                        help=f"folder for {what} (default: a new temporary folder, printed)")
    parser.add_argument("--readme-figures", action="store_true",
                        help=f"redraw {what} in the repository's assets/, the copies the README "
                             f"and lessons show")


def figures_folder(args, parser) -> Path | None:
    """Where to draw, checked while the arguments are read: --figures, the repository's assets/
    with --readme-figures (not both), or None for a new temporary folder (`drawing_folder`)."""
    if args.figures is not None and args.readme_figures:
        parser.error("give --figures DIR or --readme-figures, not both")
    if args.readme_figures:
        return check(parser, "--readme-figures", output_folder, README_FIGURES)
    return args.figures


def drawing_folder(folder: Path | None, program: str) -> Path:
    """`folder` (made if need be), or a new temporary folder named after `program`: called
    when the figures are drawn, so a run that fails first leaves no empty folder behind."""
    try:
        if folder is None:
            return Path(tempfile.mkdtemp(prefix=f"minipaged-{program}-"))
        folder.mkdir(exist_ok=True)
        return folder
    except OSError as e:
        raise OutputError(f"could not make the folder {folder or tempfile.gettempdir()} for "
                          f"the figures: {e.strerror or e}") from None


def _check_writable(folder: Path) -> None:
    """Create and remove a file in `folder`: the one test that also holds for root and for
    read-only file systems."""
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist")
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".minipaged-write-test-")
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write in {folder}: {e.strerror}") from None


def check(parser, flag: str, parse, value):
    """Apply an argument type to a value the parser took as it was (a default, read only when
    it is used): the value, or the parser's one-line error naming `flag`."""
    try:
        return parse(value)
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument {flag}: {e}")
