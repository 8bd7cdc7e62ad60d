"""Writing files and folders all at once or not at all.

A file (the GGUF cache's weights) or a folder (a trained checkpoint) is first written in a
temporary folder beside its target, then renamed onto it: a reader sees the old version or the
new one, never half of one. A failure or Ctrl-C removes the temporary; a kill (SIGKILL, a power
cut) cannot, so temporaries carry their writer's process id, and `remove_orphans` clears those
whose writer is gone the next time anything is written or read there.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\w+")


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}.tmp-{os.getpid()}-"


def _usual_mode(path: Path, temporary, default: int) -> None:
    """Give a temporary (created private, 0600/0700) the mode its target has, or would get
    from a plain open/mkdir under the current umask."""
    if path.exists():
        shutil.copymode(path, temporary)
    else:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, default & ~umask)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:           # someone else's process: alive
        pass
    return True


def remove_orphans(folder: Path) -> list[str]:
    """Delete the temporaries in `folder` left by writers that were killed; return their names."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TEMPORARY.fullmatch(entry.name)
        if m and not _alive(int(m["pid"])):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def write_file(path: Path, write) -> None:
    """Call `write(temporary path)`, then rename the temporary onto `path`. The temporary sits
    alone in a folder of this process's own, so whatever `write` leaves beside it (safetensors,
    for one, writes through a temporary file of its own) goes when the folder goes."""
    path = Path(path)
    folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=_temporary_prefix(path)))
    tmp = folder / path.name
    try:
        write(tmp)
        _usual_mode(path, tmp, 0o666)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def staged_folder(folder: Path):
    """Yield an empty temporary folder beside `folder` to write into. When the block ends
    without an error, the temporary becomes `folder` (an old `folder` is removed after the
    rename); on any error, Ctrl-C included, it is removed and `folder` stays as it was."""
    folder = Path(folder)
    remove_orphans(folder.parent)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=_temporary_prefix(folder)))
    try:
        yield tmp
        _usual_mode(folder, tmp, 0o777)
        if folder.exists():
            # Two renames: between them `folder` is absent for a moment, never half-written.
            old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=_temporary_prefix(folder)))
            os.rename(folder, old / folder.name)
            os.rename(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
