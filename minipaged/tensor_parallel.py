"""Stage 9: tensor parallelism — the model and its KV cache split by heads over N processes.

A rank is one process (one device, on GPUs). Megatron's split of stage 1's Llama: each rank
holds `n_heads / N` query heads and `n_kv_heads / N` KV heads of every layer (wq, wk, wv split
by columns — their output features), `hidden_dim / N` of the MLP (w1, w3 by columns), and the
matching rows of wo and w2, whose partial outputs one all-reduce per layer sums. So each rank's
cache (stage 3's, unchanged) holds only its own heads, in the same block ids as every other
rank's: a block is one id and N slices, one per rank.

One scheduler decides for all of them, as in vLLM: rank 0's (`tp_engine.py`), which sends the
other ranks each model call's tokens and what changed in the block tables (`step_changes`
below; a worker applies them with `apply_changes`). `run_ranks` (`ranks.py`) starts the N
processes (torch.distributed: gloo on CPUs, NCCL on CUDA GPUs), and ends them all, with one
error naming the rank, if any of them fails or dies.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .errors import TensorParallelError, UsageError
from .model import Llama

COLUMNS = ("wq", "wk", "wv", "w1", "w3")   # split by output features: each rank a slice of heads
ROWS = ("wo", "w2")                        # split by input features: partial sums, all-reduced


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


# -- what rank 0 sends: each step's changes to the block tables --------------------------------
def block_tables(manager) -> dict:
    """A layer's block tables as {seq_id: [block ids]}, for the sequences that hold blocks."""
    return {s: manager.blocks_of(s) for s in manager.live_seq_ids()}


def step_changes(before: dict, after: dict) -> dict:
    """What the scheduler sends its workers since its last message, as vLLM's `SchedulerOutput`
    does in spirit: the block ids appended to each table that only grew, the whole table of
    each one that is new or changed otherwise (resumed, a block copied on write, rolled back),
    and the sequences whose blocks all went back."""
    appended, replaced = {}, {}
    for s, blocks in after.items():
        old = before.get(s)
        if old is not None and blocks[:len(old)] == old:
            if len(blocks) > len(old):
                appended[s] = blocks[len(old):]
        else:
            replaced[s] = blocks
    return {"appended": appended, "replaced": replaced,
            "freed": sorted(set(before) - set(after))}


def apply_changes(tables: dict, changes: dict) -> dict:
    """A worker's side: its copy of the tables, after one step's `step_changes` — a new dict
    without the freed sequences, the appended ids added, the replaced tables whole. Neither
    `tables` nor `changes` is changed."""
    out = {s: list(b) for s, b in tables.items() if s not in changes["freed"]}
    for s, ids in changes["appended"].items():
        out[s] += ids
    out.update({s: list(b) for s, b in changes["replaced"].items()})
    return out
