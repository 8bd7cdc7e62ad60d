"""Writing files and folders all at once or not at all.

A file (the GGUF cache's weights) or a folder (a trained checkpoint) is first written in a
temporary beside its target, then renamed onto it: a reader sees the old version or the new
one, never half of one. A failure or Ctrl-C removes the temporary; a kill (SIGKILL, a power
cut) cannot, so temporaries carry their writer's process id, and `remove_orphans` clears those
whose writer is gone the next time anything is written or read there.

A folder cannot be renamed onto a folder that exists, so replacing one takes three renames,
each named so that a kill between any two leaves a state the next reader or writer can finish
(`recover`), and at least one complete copy always sits under a name that says it is complete:

    .model.tmp-PID-X   being written             incomplete: removed when PID is gone
    .model.new-PID-X   written, complete         1. .tmp- renamed to .new-
    .model.old-PID-X   the model it replaces     2. model renamed to .old-
    model              the new model             3. .new- renamed to model; .old- removed

A writer killed after 1 leaves .new- (and maybe .old-): `recover` finishes the replacement.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError

log = logging.getLogger(__name__)

_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\w+")
_STAGED = re.compile(r"\.(?P<name>.+)\.(?P<kind>new|old)-(?P<pid>\d+)-(?P<token>\w+)")


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


def _fsync(path: Path) -> None:
    """Push a file's or a folder's contents to the disk, so a power cut after the rename finds
    the bytes the rename promised (a no-op where the system cannot sync a folder)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))


def remove(entry: Path) -> None:
    """Delete a file, a link or a folder with what it holds."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def recover(folder: Path) -> list[str]:
    """Finish the replacements of `folder` that a killed writer left half done, and return
    what was done, one line a step. Never removes the only complete copy: a `.new-` (complete)
    becomes `folder` if `folder` is absent or still the old one, and an `.old-` is removed only
    once `folder` is there (it is put back when nothing else is)."""
    folder = Path(folder)
    steps: list[str] = []
    try:
        entries = list(folder.parent.iterdir())
    except OSError:
        return steps
    groups: dict[tuple[str, str], dict[str, Path]] = {}
    for entry in entries:
        m = _STAGED.fullmatch(entry.name)
        if m and m["name"] == folder.name and not _alive(int(m["pid"])):
            groups.setdefault((m["pid"], m["token"]), {})[m["kind"]] = entry
    try:
        for (pid, token), found in sorted(groups.items()):
            _finish(folder, pid, token, found, steps)
    except OSError as e:               # a read-only folder, say: leave it for a writer
        log.warning("could not finish the replacement of %s (%s)", folder, e)
    if steps:
        _fsync(folder.parent)
    return steps


def _finish(folder: Path, pid: str, token: str, found: dict, steps: list[str]) -> None:
    """One killed writer's replacement of `folder`, finished (see `recover`)."""
    new, old = found.get("new"), found.get("old")
    if new is not None:                      # a complete new copy: finish the replacement
        if folder.exists() or folder.is_symlink():
            if old is None:                  # killed before the old one was moved away
                old = folder.parent / f".{folder.name}.old-{pid}-{token}"
                os.rename(folder, old)
                steps.append(f"renamed {folder.name} to {old.name}")
            else:                            # cannot happen: leave it to a person
                return
        os.rename(new, folder)
        steps.append(f"renamed {new.name} to {folder.name}")
    if old is not None:
        if folder.exists():
            remove(old)
            steps.append(f"removed {old.name}")
        else:                                # the old copy is the only one: put it back
            os.rename(old, folder)
            steps.append(f"renamed {old.name} back to {folder.name}")


def remove_orphans(folder: Path) -> list[str]:
    """Delete the temporaries in `folder` left by writers that were killed (and finish their
    half-done folder replacements, `recover`); return the names of what was deleted."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for name in sorted({m["name"] for e in entries if (m := _STAGED.fullmatch(e.name))}):
        recover(Path(folder) / name)
    for entry in entries:
        m = _TEMPORARY.fullmatch(entry.name)
        if m and not _alive(int(m["pid"])):
            remove(entry)
            removed.append(entry.name)
    return removed


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: `e` itself, or the one a library written in another
    language reports in its message (safetensors: "I/O error: ... (os error 28)")."""
    if isinstance(e, OSError):
        return e
    m = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return OSError(int(m[1]), os.strerror(int(m[1]))) if m else None


def write_error(path: Path, e: OSError) -> OutputError:
    """A failed write as one sentence (a full disk, a read-only folder...)."""
    hint = {errno.ENOSPC: "free some space or write elsewhere",
            errno.EDQUOT: "free some space or write elsewhere",
            errno.EROFS: "write elsewhere", errno.EACCES: "write elsewhere",
            errno.EPERM: "write elsewhere"}.get(e.errno, "check the folder and try again")
    return OutputError(f"could not write {path}: {e.strerror or e}; nothing was written "
                       f"there ({hint})")


def write_file(path: Path, write) -> None:
    """Call `write(temporary path)`, then rename the temporary onto `path`. The temporary sits
    alone in a folder of this process's own, so whatever `write` leaves beside it (safetensors,
    for one, writes through a temporary file of its own) goes when the folder goes. An OSError
    (a full disk) becomes an OutputError, `path` untouched."""
    path = Path(path)
    try:
        folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=_temporary_prefix(path)))
    except OSError as e:
        raise write_error(path, e) from None
    tmp = folder / path.name
    try:
        write(tmp)
        _usual_mode(path, tmp, 0o666)
        _fsync(tmp)
        os.replace(tmp, path)
    except Exception as e:
        if (cause := _os_error(e)) is None:
            raise
        raise write_error(path, cause) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def staged_folder(folder: Path):
    """Yield an empty temporary folder beside `folder` to write into. When the block ends
    without an error, the temporary becomes `folder` (an old `folder` is removed after the
    renames); on any error, Ctrl-C included, it is removed and `folder` stays as it was. An
    OSError (a full disk) becomes an OutputError."""
    folder = Path(folder)
    remove_orphans(folder.parent)
    try:
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=_temporary_prefix(folder)))
    except OSError as e:
        raise write_error(folder, e) from None
    token = tmp.name.rsplit("-", 1)[1]
    new = folder.parent / f".{folder.name}.new-{os.getpid()}-{token}"
    old = folder.parent / f".{folder.name}.old-{os.getpid()}-{token}"
    try:
        try:
            yield tmp
            _usual_mode(folder, tmp, 0o777)
            _fsync_tree(tmp)
            os.rename(tmp, new)              # 1. complete: from here on `recover` rolls forward
            _fsync(folder.parent)
            if folder.exists():
                os.rename(folder, old)       # 2.
            os.rename(new, folder)           # 3.
            _fsync(folder.parent)
        except Exception as e:
            if (cause := _os_error(e)) is None:
                raise
            raise write_error(folder, cause) from None
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if new.exists():                     # a rename failed (not a kill): undo, keep the old
            if not folder.exists() and old.exists():
                os.rename(old, folder)
            shutil.rmtree(new, ignore_errors=True)
