"""Stage 9: N processes joined in one torch.distributed group — and all of them ended, with one
error naming the rank, when any of them fails, dies or goes silent.

    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, 2, device, *args) on each

Each rank is a fresh Python (multiprocessing's spawn: no state copied from the caller) that joins
the group over gloo between CPU processes or NCCL between CUDA GPUs, one per rank, with a timeout
on every collective; the caller watches them all, and each rank watches the caller. What runs
on the ranks is `tp_engine.py`'s and `tp_group.py`'s; this module is the plumbing.
"""

from __future__ import annotations

import importlib
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import MiniPagedError, TensorParallelError, UsageError

TIMEOUT = 60.0                             # seconds any rank waits for the others, at most


def backend_for(device: torch.device, world_size: int) -> str:
    """gloo between CPU processes, NCCL between CUDA GPUs (one GPU per rank)."""
    if device.type == "cuda":
        if torch.cuda.device_count() < world_size:
            raise UsageError(f"tensor_parallel={world_size} needs one GPU per process; this "
                             f"machine has {torch.cuda.device_count()}")
        return "nccl"
    if device.type != "cpu":
        raise UsageError(f"tensor parallelism runs on CPUs (gloo) or CUDA GPUs (NCCL), not "
                         f"{device.type}")
    return "gloo"


def _rank_main(rank, world_size, backend, store, timeout, threads, parent, fn, args, results):
    """One rank: join the group, run fn(rank, world_size, device, *args), report, leave."""
    def orphaned():                     # the caller died: no rank outlives it
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(3)
    threading.Thread(target=orphaned, daemon=True).start()
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    try:
        if backend == "nccl":
            torch.cuda.set_device(device)
        if backend is not None:             # (None: processes that need no collective)
            dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout))
        value = fn(rank, world_size, device, *args)
        results.put(("ok", rank, pickle.dumps(value)))   # a copy: the rank exits after this
    except MiniPagedError as e:          # the request or the model refused: the same on every rank
        results.put(("refused", rank, type(e).__name__, str(e)))
    except BaseException as e:           # noqa: BLE001 — reported to the caller, named by rank
        first = (str(e).splitlines() or [""])[0][:300]
        results.put(("failed", rank, f"{type(e).__name__}: {first}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, args=(), device="cpu", timeout: float | None = None,
              threads: int | None = None, grace: dict | None = None) -> list:
    """Run fn(rank, world_size, device, *args) in `world_size` new processes joined in one
    torch.distributed group; return each rank's result, in rank order. If a rank fails, dies or
    goes silent for `timeout` seconds, every rank is ended and one TensorParallelError names it
    (its `results`: what the ranks that finished returned); a refusal (a MiniPagedError) comes
    back as itself. The others may finish for a second after a rank failed, or `grace[rank]`
    seconds. No process outlives this call."""
    device, timeout, backend, fn, threads, ctx, results, folder = _prepare(
        fn, world_size, device, timeout, threads)
    procs = [ctx.Process(target=_rank_main, name=f"minipaged-rank{r}", daemon=True,
                         args=(r, world_size, backend, os.path.join(folder, "store"), timeout,
                               threads, os.getpid(), fn, args, results))
             for r in range(world_size)]
    try:
        with _main_not_rerun():
            for p in procs:
                p.start()
        return _collect(procs, results, timeout, grace or {})
    finally:
        _end(procs)
        shutil.rmtree(folder, ignore_errors=True)


def _prepare(fn, world_size, device, timeout, threads):
    """What starting the ranks needs, for `run_ranks` and `start_followers`: the device, the
    timeout, the backend, `fn` as the ranks will import it, threads a rank, the spawn context,
    the results queue and a folder for the group's store file."""
    device, timeout = torch.device(device), timeout or TIMEOUT
    backend = backend_for(device, world_size)
    threads = threads or max(1, torch.get_num_threads() // world_size)
    ctx = mp.get_context("spawn")
    return (device, timeout, backend, _importable(fn), threads, ctx, ctx.Queue(),
            tempfile.mkdtemp(prefix="minipaged-tp-"))


def _importable(fn):
    """The ranks import `fn` by its module's name. A function of a module run with `python -m`
    has the module `__main__`: find it under its real name."""
    if fn.__module__ != "__main__":
        return fn
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None or not spec.name:
        raise UsageError(f"the ranks cannot import {fn.__name__}() from a script: define it in "
                         f"a module and import it")
    return getattr(importlib.import_module(spec.name), fn.__name__)


@contextmanager
def _main_not_rerun():
    """A spawned process re-runs the caller's script (its `__main__`) unless that is guarded by
    `if __name__ == "__main__"`; the ranks need only the package, so hide the script while they
    start."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _collect(procs, results, timeout, grace):
    """Wait for every rank's report; on the first failure, name the rank that caused it."""
    reports = {}          # a rank that hangs makes the others' collectives time out: they report
    first = None          # the rank that failed or died first
    while len(reports) < len(procs):
        try:
            kind, rank, *rest = results.get(timeout=0.1)
            reports[rank] = (kind, *rest)
            if kind != "ok":
                first = rank
                break
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            first = dead[0]
            break
    else:
        return [pickle.loads(reports[r][1]) for r in range(len(procs))]
    deadline = time.monotonic() + grace.get(first, 1.0)   # the others notice: hear them out
    while time.monotonic() < deadline and len(reports) < len(procs):
        try:
            kind, rank, *rest = results.get(timeout=0.05)
            reports[rank] = (kind, *rest)
        except queue.Empty:
            if all(p.exitcode is not None or p.pid is None for p in procs):
                break
    error = _blame(procs, reports, timeout)
    error.results = {r: pickle.loads(rest[0]) for r, (kind, *rest) in reports.items()
                     if kind == "ok"}
    raise error


def _blame(procs, reports, timeout) -> MiniPagedError:
    """The one error to raise: a rank that died, else a refusal (the caller's to fix, passed on
    as itself), else a rank that stopped answering, else the first rank that failed."""
    n = len(procs)
    for r, p in enumerate(procs):
        if r not in reports and p.exitcode not in (None, 0):
            how = (f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                   else f"exited with status {p.exitcode}")
            return TensorParallelError(f"tensor parallel: rank {r} of {n} died ({how}); the "
                                       f"other ranks were stopped (timeout {timeout:g} s)")
    for kind, *rest in reports.values():
        if kind == "refused":
            cls = next((c for c in _errors() if c.__name__ == rest[0]), MiniPagedError)
            return cls(rest[1])
    failed = [(r, rest[0]) for r, (kind, *rest) in reports.items() if kind == "failed"]
    silent = [r for r, p in enumerate(procs) if r not in reports and p.exitcode is None]
    timed_out = failed and any(w in failed[0][1].lower() for w in ("timed out", "timeout"))
    if silent and (not failed or timed_out):      # (gloo says "Timed out" or "Wait timeout")
        return TensorParallelError(f"tensor parallel: rank {silent[0]} of {n} stopped answering "
                                   f"(the others waited {timeout:g} s); every rank was stopped")
    if failed:
        return TensorParallelError(f"tensor parallel: rank {failed[0][0]} of {n} failed "
                                   f"(timeout {timeout:g} s): {failed[0][1]}")
    return TensorParallelError(f"tensor parallel: a rank of {n} ended without a result "
                               f"(timeout {timeout:g} s)")


def _errors():
    todo, seen = [MiniPagedError], []
    while todo:
        c = todo.pop()
        seen.append(c)
        todo += c.__subclasses__()
    return seen


def _end(procs) -> None:
    """Stop every rank still running (SIGTERM, then SIGKILL) and reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(0.5)
            if p.is_alive():                  # SIGTERM waits while a process is stopped
                p.kill()
                p.join()


# -- the caller as rank 0, for a program that runs on (the chat, the server) ---------------------
class Followers:
    """Ranks 1..N-1 of a group whose rank 0 is the caller's own process (`start_followers`).
    `send(message)` puts one message in every follower's inbox; `check()` raises one
    TensorParallelError naming a follower that died; `close()` ends them all and leaves the
    group. No follower outlives `close()`, nor the caller."""

    def __init__(self, procs, inboxes, results, folder, timeout, group=True):
        self.procs, self.inboxes, self.results, self.group = procs, inboxes, results, group
        self.folder, self.timeout, self.closed = folder, timeout, None

    def check(self) -> None:
        n = len(self.procs) + 1
        if self.closed:
            raise TensorParallelError(f"tensor parallel: the other {n - 1} rank(s) were stopped "
                                      f"({self.closed}); restart the program")
        try:
            kind, rank, *rest = self.results.get_nowait()     # a follower reports only a failure
            raise TensorParallelError(f"tensor parallel: rank {rank} of {n} {kind}: {rest[-1]}; "
                                      f"restart the program")
        except queue.Empty:
            pass
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                how = (f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                       else f"exited with status {p.exitcode}")
                raise TensorParallelError(f"tensor parallel: rank {r} of {n} died ({how}); "
                                          f"restart the program")

    def send(self, message) -> None:
        self.check()
        for box in self.inboxes:
            box.put(message)

    def close(self, why: str = "closed") -> None:
        if self.closed:
            return
        self.closed = why
        for box in self.inboxes:
            box.put(None)                       # "stop": a follower returns from its loop
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        _end(self.procs)
        if self.group and dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_followers(fn, world_size: int, rank_args, device="cpu", timeout: float | None = None,
                    threads: int | None = None, group: bool = True) -> Followers:
    """Start ranks 1..N-1, each running fn(rank, world_size, device, inbox, *rank_args[rank - 1])
    (inbox: the queue `Followers.send` fills; None in it means stop), and join the caller's own
    process to their group as rank 0. For programs that answer one request after another (the
    chat, the server), where `run_ranks`' one call and its results do not fit. `group=False`:
    the same processes, watched the same way, with no torch.distributed group (stage 9b's
    prefill engine talks through queues and shared memory)."""
    if group and dist.is_initialized():
        raise UsageError("this process is already in a torch.distributed group; tensor "
                         "parallelism starts its own")
    device, timeout, backend, fn, threads, ctx, results, folder = _prepare(
        fn, world_size, device, timeout, threads)
    backend = backend if group else None
    inboxes = [ctx.Queue() for _ in range(1, world_size)]
    store = os.path.join(folder, "store")
    procs = [ctx.Process(target=_rank_main, name=f"minipaged-rank{r}", daemon=True,
                         args=(r, world_size, backend, store, timeout, threads, os.getpid(),
                               fn, (inboxes[r - 1], *rank_args[r - 1]), results))
             for r in range(1, world_size)]
    followers = Followers(procs, inboxes, results, folder, timeout, group)
    try:
        with _main_not_rerun():
            for p in procs:
                p.start()
        if device.type == "cuda":
            torch.cuda.set_device(torch.device("cuda", 0))
        if group:
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0,
                                    world_size=world_size, timeout=timedelta(seconds=timeout))
    except BaseException:
        followers.close()
        raise
    return followers
