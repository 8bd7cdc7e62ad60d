"""Stage 9: tensor parallelism — the model and its KV cache split by heads over N processes.

A rank is one process (one device, on GPUs). Megatron's split of stage 1's Llama: each rank
holds `n_heads / N` query heads and `n_kv_heads / N` KV heads of every layer (wq, wk, wv split
by columns — their output features), `hidden_dim / N` of the MLP (w1, w3 by columns), and the
matching rows of wo and w2, whose partial outputs one all-reduce per layer sums. So each rank's
cache (stage 3's, unchanged) holds only its own heads, in the same block ids as every other
rank's: a block is one id and N slices, one per rank.

The ranks run in lockstep, as mini-sglang's do: each runs the same engine (stages 5-7's) on
the same requests, and since after the all-reduces every rank sees the same logits, each
schedules, allocates and samples the same. After every step the ranks compare a digest of
their block tables, free blocks and tokens (one all-gather): the acknowledgement that they
still agree, and an error naming the rank if one does not. vLLM instead keeps one scheduler
and sends the workers each step's new block ids (lessons/09-tensor-parallel.md compares them).

    outs = run_ranks(serve_rank, world_size=2, args=(...))   # one result per rank

`run_ranks` starts the N processes (torch.distributed: gloo on CPUs, NCCL on CUDA GPUs), and
ends them all, with one error naming the rank, if any of them fails or dies.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
import torch.nn as nn
import torch.nn.functional as F

from .errors import MiniPagedError, TensorParallelError, UsageError
from .model import Llama
from .speculative import SpeculativeEngine

COLUMNS = ("wq", "wk", "wv", "w1", "w3")   # split by output features: each rank a slice of heads
ROWS = ("wo", "w2")                        # split by input features: partial sums, all-reduced
TIMEOUT = 60.0                             # seconds any rank waits for the others, at most


# -- which heads and columns a rank owns ---------------------------------------------------------
def check_world_size(args, world_size) -> None:
    """N ranks split the heads and the MLP evenly, or the split is refused here, before any
    process starts. (Replicating KV heads, as mini-sglang does when N > n_kv_heads, would store
    the same head on two ranks; this stage keeps a head on one rank only.)"""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"tensor_parallel is a number of processes, a positive integer, not "
                         f"{world_size!r}")
    sizes = {"KV heads": args.n_kv_heads, "query heads": args.n_heads,
             "MLP width": args.hidden_dim}
    uneven = [f"{v} {k}" for k, v in sizes.items() if v % world_size]
    if uneven:
        fits = [n for n in range(1, args.n_kv_heads + 1) if all(v % n == 0 for v in sizes.values())]
        raise UsageError(f"tensor_parallel={world_size} cannot split this model's "
                         f"{' and '.join(uneven)} evenly over {world_size} processes; choose "
                         f"one of {', '.join(map(str, fits))}")


def owned(size: int, rank: int, world_size: int) -> slice:
    """The contiguous share of `size` (heads, or features) that rank `rank` holds."""
    share = size // world_size
    return slice(rank * share, (rank + 1) * share)


def rank_state_dict(model: Llama, rank: int, world_size: int) -> dict:
    """Rank `rank`'s weights, on the CPU: its rows of the column-split matrices, its columns
    of the row-split ones, a copy of everything else (embeddings, norms, the output layer)."""
    out = {}
    for name, w in model.state_dict().items():
        kind = name.split(".")[-2] if name.endswith(".weight") else ""
        if kind in COLUMNS:
            w = w[owned(w.shape[0], rank, world_size)]          # (out / N, in)
        elif kind in ROWS:
            w = w[:, owned(w.shape[1], rank, world_size)]       # (out, in / N)
        elif name == "output.weight" and model.args.tie_word_embeddings:
            continue                                            # tied: tok_embeddings' own
        out[name] = w.detach().to("cpu", copy=True).contiguous()
    return out


class RowParallelLinear(nn.Linear):
    """A linear layer holding a slice of the input features: each rank's product is a partial
    sum of the full one, and one all-reduce adds them up (the only place ranks talk)."""

    def forward(self, x):
        y = F.linear(x, self.weight)                            # (B, T, out), this rank's part
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(y)                                  # sum over ranks, in place
        return y


def shard_llama(model: Llama, rank: int, world_size: int, state: dict) -> Llama:
    """Turn a full Llama (on the meta device: no memory) into rank `rank`'s shard holding
    `state` (`rank_state_dict`): narrower linear layers, the rank's head counts, and
    `model.args` saying how many KV heads its cache holds (what stage 3's cache reads)."""
    a = model.args
    for layer in model.layers:
        att, ff = layer.attention, layer.feed_forward
        att.n_heads, att.n_kv_heads = a.n_heads // world_size, a.n_kv_heads // world_size
        att.wq = nn.Linear(a.dim, att.n_heads * a.head_dim, bias=False)       # columns
        att.wk = nn.Linear(a.dim, att.n_kv_heads * a.head_dim, bias=False)
        att.wv = nn.Linear(a.dim, att.n_kv_heads * a.head_dim, bias=False)
        att.wo = RowParallelLinear(att.n_heads * a.head_dim, a.dim, bias=False)  # rows
        hidden = a.hidden_dim // world_size
        ff.w1 = nn.Linear(a.dim, hidden, bias=False)
        ff.w3 = nn.Linear(a.dim, hidden, bias=False)
        ff.w2 = RowParallelLinear(hidden, a.dim, bias=False)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"output.weight"} if a.tie_word_embeddings else set()
    if set(missing) != tied or unexpected:
        raise TensorParallelError(f"rank {rank}'s weights do not fit its shard: missing "
                                  f"{sorted(set(missing) - tied)}, unexpected {unexpected}")
    if a.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.full_args = a
    model.args = dataclasses.replace(a, n_kv_heads=a.n_kv_heads // world_size)  # this rank's
    model.rank, model.world_size = rank, world_size
    return model.eval()


def load_shard(args, rank: int, world_size: int, state: dict, device="cpu") -> Llama:
    """Rank `rank`'s model from its weights: built on the meta device, then sharded."""
    with torch.device("meta"):
        model = Llama(args)
    return shard_llama(model, rank, world_size, state).to(device)


# -- the engine each rank runs -------------------------------------------------------------------
class LockstepEngine(SpeculativeEngine):
    """Stage 7's engine, run by every rank; after each step the ranks check they still agree."""

    def step(self):
        finished = super().step()
        check_agreement(self)
        return finished


def engine_digest(engine) -> int:
    """What every rank must hold alike after a step: layer 0's free blocks and block tables,
    and every request's tokens. Eight bytes of a hash, as one int64."""
    m = engine.cache.managers[0]
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(m.free_blocks.ids()).encode())
    h.update(m.block_table.numpy().tobytes())
    h.update(repr([r.output for r in engine.requests]).encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def check_agreement(engine) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    device = engine.device if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([engine_digest(engine)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    for r, d in enumerate(every):
        if d.item() != every[0].item():
            raise TensorParallelError(f"rank {r} disagrees with rank 0 about the blocks or "
                                      f"tokens after step {engine.step_count - 1}")


def serve_ranks(model, prompts, max_new_tokens: int, world_size: int, steps: int | None = None,
                **engine_options) -> list[dict]:
    """Serve greedy `prompts` on `world_size` ranks for `steps` steps (None: until done) and
    report what each rank holds: {"outputs", "preemptions", "managers" (its CacheManager per
    layer, K/V included), "kv_heads" (the full model's KV heads it owns)}. For drawings and tests; the
    way to generate is `minipaged.generate(..., tensor_parallel=N)`."""
    check_world_size(model.args, world_size)
    states = [rank_state_dict(model, r, world_size) for r in range(world_size)]
    return run_ranks(_serve_and_report, world_size, (model.args, states, prompts, max_new_tokens,
                     steps, engine_options), device=next(model.parameters()).device)


def _serve_and_report(rank, world_size, device, args, states, prompts, max_new_tokens, steps,
                      options) -> dict:
    engine = LockstepEngine(load_shard(args, rank, world_size, states[rank], device), **options)
    for p in prompts:
        engine.add_request(p, max_new_tokens, stop_tokens=[])
    while engine.has_unfinished() and (steps is None or engine.step_count < steps):
        engine.step()
    return {"outputs": [r.output for r in engine.requests], "managers": engine.cache.managers,
            "preemptions": engine.stats.preemptions,
            "kv_heads": range(args.n_kv_heads)[owned(args.n_kv_heads, rank, world_size)]}


# -- starting the ranks, and ending them all ------------------------------------------------------
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
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        value = fn(rank, world_size, device, *args)
        results.put(("ok", rank, pickle.dumps(value)))   # a copy: the rank exits after this
    except MiniPagedError as e:          # the request or the model refused: the same on every rank
        results.put(("refused", rank, type(e).__name__, str(e)))
    except Exception as e:               # noqa: BLE001 — reported to the caller, named by rank
        results.put(("failed", rank, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, args=(), device="cpu", timeout: float | None = None,
              threads: int | None = None) -> list:
    """Run fn(rank, world_size, device, *args) in `world_size` new processes joined in one
    torch.distributed group; return each rank's result, in rank order. If a rank fails, dies or
    goes silent for `timeout` seconds, every rank is ended and one TensorParallelError names it;
    a refusal (a MiniPagedError) comes back as itself. No process outlives this call."""
    device, timeout = torch.device(device), timeout or TIMEOUT
    backend = backend_for(device, world_size)
    fn = _importable(fn)
    threads = threads or max(1, torch.get_num_threads() // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    folder = tempfile.mkdtemp(prefix="minipaged-tp-")
    procs = [ctx.Process(target=_rank_main, name=f"minipaged-rank{r}", daemon=True,
                         args=(r, world_size, backend, os.path.join(folder, "store"), timeout,
                               threads, os.getpid(), fn, args, results))
             for r in range(world_size)]
    try:
        with _main_not_rerun():
            for p in procs:
                p.start()
        return _collect(procs, results, timeout)
    finally:
        _end(procs)
        shutil.rmtree(folder, ignore_errors=True)


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


def _collect(procs, results, timeout):
    """Wait for every rank's report; on the first failure, name the rank that caused it."""
    reports = {}          # a rank that hangs makes the others' collectives time out: they report
    while len(reports) < len(procs):
        try:
            kind, rank, *rest = results.get(timeout=0.1)
            reports[rank] = (kind, *rest)
            if kind != "ok":
                break
        except queue.Empty:
            pass
        if any(p.exitcode not in (None, 0) for p in procs):
            break
    else:
        return [pickle.loads(reports[r][1]) for r in range(len(procs))]
    deadline = time.monotonic() + 1.0       # the others notice the broken group; hear them out
    while time.monotonic() < deadline and len(reports) < len(procs):
        try:
            kind, rank, *rest = results.get(timeout=0.05)
            reports[rank] = (kind, *rest)
        except queue.Empty:
            if all(p.exitcode is not None or p.pid is None for p in procs):
                break
    raise _blame(procs, reports, timeout)


def _blame(procs, reports, timeout) -> MiniPagedError:
    """The one error to raise: a rank that died, else a refusal (the caller's to fix, passed on
    as itself), else a rank that stopped answering, else the first rank that failed."""
    n = len(procs)
    for r, p in enumerate(procs):
        if r not in reports and p.exitcode not in (None, 0):
            how = (f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                   else f"exited with status {p.exitcode}")
            return TensorParallelError(f"tensor parallel: rank {r} of {n} died ({how}); the "
                                       f"other ranks were stopped")
    for kind, *rest in reports.values():
        if kind == "refused":
            cls = next((c for c in _errors() if c.__name__ == rest[0]), MiniPagedError)
            return cls(rest[1])
    failed = [(r, rest[0]) for r, (kind, *rest) in reports.items() if kind == "failed"]
    silent = [r for r, p in enumerate(procs) if r not in reports and p.exitcode is None]
    if silent and (not failed or "timed out" in failed[0][1].lower()):
        return TensorParallelError(f"tensor parallel: rank {silent[0]} of {n} stopped answering "
                                   f"(the others waited {timeout:g} s); every rank was stopped")
    if failed:
        return TensorParallelError(f"tensor parallel: rank {failed[0][0]} of {n} failed: "
                                   f"{failed[0][1]}")
    return TensorParallelError(f"tensor parallel: a rank of {n} ended without a result")


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
