"""Stage 9: how rank 0's messages travel, and how the ranks start — not needed to follow the
idea (`tp_engine.py`), needed to run it on N processes.

    Group()              rank 0's side of the torch.distributed group: send, acknowledgements
    follow(shard)        a worker's loop: receive, apply, acknowledge, run its forward
    start_workers(...)   this process as rank 0, N - 1 new processes following it (the chat,
                         the server, `Engine(..., tensor_parallel=N)`)
    serve_ranks(...)     N new processes serve some prompts and report what each rank holds
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from .ranks import run_ranks, start_followers
from .tensor_parallel import check_world_size, load_shard, owned, rank_state_dict
from .tp_engine import PoolSpec, StepMessage, TensorParallelEngine, Worker, check_acks


class Group:
    """Rank 0's side of the torch.distributed group. A message goes to every worker in one
    broadcast, or, with `followers` (rank 0 is the caller's own process: `start_workers`), into
    each follower's inbox, where a worker can wait for it as long as the program idles; the
    acknowledgements come back in one all-gather of the numbers. A broken collective is
    reported as the follower that died."""

    def __init__(self, device="cpu", followers=None):
        self.device = device if dist.get_backend() == "nccl" else "cpu"
        self.followers = followers

    def start(self, spec: PoolSpec) -> None:
        self._post(spec)

    def send(self, message: StepMessage) -> None:
        self._post(message)
        acks = self._talk(lambda: _gather(message.number, self.device))
        check_acks(acks[1:], message.number)

    def check(self) -> None:
        """With followers: one TensorParallelError if one died or they were stopped."""
        if self.followers is not None:
            self.followers.check()

    def abandon(self, why: str) -> None:
        """Stop the followers without a word: rank 0 was cut off in the middle of a call, so
        they may be waiting in a collective it will never join."""
        self.followers.close(why)

    def close(self) -> None:
        """Stop: the workers return from `follow` (followers are also reaped)."""
        if self.followers is None:
            dist.broadcast_object_list([None], src=0)
        else:
            self.followers.close()               # None in every inbox, then every one reaped

    def _post(self, obj) -> None:
        if self.followers is None:
            dist.broadcast_object_list([obj], src=0)
        else:
            self.followers.send(obj)             # names a follower that died

    def _talk(self, collective):
        if self.followers is None:
            return collective()
        try:
            return collective()
        except RuntimeError:               # a collective broke: name the rank that broke it
            time.sleep(1.0)
            self.followers.check()
            raise


def _gather(number: int, device) -> list[int]:
    mine = torch.tensor([number], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(x) for x in every]


def _receive():
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def follow(model, device="cpu", inbox=None) -> Worker:
    """A worker's whole life: the pools rank 0 sizes, then each message applied, acknowledged
    and run, until rank 0 says stop. Messages come by broadcast, or from `inbox` (a queue:
    `start_workers`' followers). Returns the worker (its cache: for tests and drawings)."""
    receive = inbox.get if inbox is not None else _receive
    worker = Worker(model, receive(), dist.get_rank())
    ack_device = device if dist.get_backend() == "nccl" else "cpu"
    while (message := receive()) is not None:
        _gather(worker.apply(message), ack_device)
        worker.forward(message)
    return worker


def serve_ranks(model, prompts, max_new_tokens: int, world_size: int, steps: int | None = None,
                **engine_options) -> list[dict]:
    """Serve greedy `prompts` on `world_size` ranks for `steps` steps (None: until done) and
    report what each rank holds: {"tables" (per layer, as of the last model call), "pools" (per
    layer, K and V of its heads), "kv_heads" (the full model's KV heads it owns)}, and rank 0's
    "outputs", "preemptions" and "managers". For drawings and tests; the way to generate is
    `minipaged.generate(..., tensor_parallel=N)`."""
    check_world_size(model.args, world_size)
    states = [rank_state_dict(model, r, world_size) for r in range(world_size)]
    return run_ranks(_serve_and_report, world_size, (model.args, states, prompts, max_new_tokens,
                     steps, engine_options), device=next(model.parameters()).device)


def _serve_and_report(rank, world_size, device, args, states, prompts, max_new_tokens, steps,
                      options) -> dict:
    shard = load_shard(args, rank, world_size, states[rank], device)
    heads = range(args.n_kv_heads)[owned(args.n_kv_heads, rank, world_size)]
    if rank:
        worker = follow(shard, device)
        return {"tables": worker.cache.tables, "pools": worker.cache.managers, "kv_heads": heads}
    engine = TensorParallelEngine(shard, workers=Group(device), **options)
    for p in prompts:
        engine.add_request(p, max_new_tokens, stop_tokens=[])
    while engine.has_unfinished() and (steps is None or engine.step_count < steps):
        engine.step()
    engine.close()
    return {"tables": engine.messenger.sent_tables, "pools": engine.cache.managers, "kv_heads": heads,
            "managers": engine.cache.managers, "outputs": [r.output for r in engine.requests],
            "preemptions": engine.stats.preemptions}


def start_workers(model, world_size: int):
    """This process as rank 0 of `world_size`, with N - 1 new processes following it: returns
    rank 0's shard and the `Group` its messages go to. Refused before any process starts
    unless N splits the heads."""
    check_world_size(model.args, world_size)
    device = next(model.parameters()).device
    states = [rank_state_dict(model, r, world_size) for r in range(world_size)]
    followers = start_followers(_follow, world_size, [(model.args, states[r])
                                                      for r in range(1, world_size)], device)
    try:
        return load_shard(model.args, 0, world_size, states[0], device), \
            Group(device, followers)
    except BaseException:
        followers.close()
        raise


def start_engine(model, world_size: int, *args, **options) -> TensorParallelEngine:
    """`minipaged.Engine(model, ..., tensor_parallel=N)`: this process becomes rank 0 and runs
    the engine on its shard (`start_workers`). `engine.close()` ends the other processes (a
    server closes it when it stops)."""
    shard, group = start_workers(model, world_size)
    try:
        return TensorParallelEngine(shard, *args, workers=group, **options)
    except BaseException:
        group.close()
        raise


def _follow(rank, world_size, device, inbox, args, state) -> None:
    """A follower of `start_workers`: its shard, then `follow` its inbox. Ctrl-C at the
    terminal reaches every rank; only rank 0 acts on it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    follow(load_shard(args, rank, world_size, state, device), device, inbox)
