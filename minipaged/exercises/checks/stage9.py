"""Stage 9's checks: the weights a rank holds, and a worker's block tables after a step's
changes."""

from __future__ import annotations

import functools
import random

import torch

from ... import tensor_parallel
from ...model import Llama, ModelArgs
from ..grader import expect

COLUMNS = {"wq": "query heads", "wk": "KV heads", "wv": "KV heads", "w1": "MLP features",
           "w3": "MLP features"}
ROWS = {"wo": "query heads", "w2": "MLP features"}


@functools.lru_cache(maxsize=None)
def _model(tied: bool) -> Llama:
    """A random tiny Llama: 8 query heads, 4 KV heads of 4 dimensions, an MLP 96 wide."""
    torch.manual_seed(9)
    args = ModelArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=40, multiple_of=16,
                     max_seq_len=64, tie_word_embeddings=tied)
    return Llama(args).to(torch.float64).eval()


def _expected(model: Llama, rank: int, world: int) -> dict:
    """Rank `rank`'s weights, written another way: by heads (a head is head_dim rows of wq, wk,
    wv and head_dim columns of wo) and by features, listed one by one."""
    a = model.args
    units = {"query heads": a.n_heads, "KV heads": a.n_kv_heads, "MLP features": a.hidden_dim}
    mine = {k: [u for u in range(n) if u * world // n == rank] for k, n in units.items()}
    out = {}
    for name, w in model.state_dict().items():
        kind = name.split(".")[-2]
        if kind in COLUMNS:
            idx = mine[COLUMNS[kind]]
            size = a.head_dim if "heads" in COLUMNS[kind] else 1
            out[name] = torch.cat([w[u * size:(u + 1) * size] for u in idx])
        elif kind in ROWS:
            idx = mine[ROWS[kind]]
            size = a.head_dim if "heads" in ROWS[kind] else 1
            out[name] = torch.cat([w[:, u * size:(u + 1) * size] for u in idx], dim=1)
        elif not (name == "output.weight" and a.tie_word_embeddings):
            out[name] = w
    return out, mine


def rank_weights_are_its_heads_and_features():
    """rank_state_dict(model, r, N) holds rank r's query and KV heads (rows of wq, wk, wv; columns
    of wo) and its share of the MLP features (rows of w1, w3; columns of w2), every other weight
    whole, no output.weight when it is tied to the embeddings; each tensor its own contiguous
    copy, so that changing the model changes no rank's weights."""
    for tied in (False, True):
        model = _model(tied)
        storages = {w.untyped_storage().data_ptr() for w in model.state_dict().values()}
        for world in (1, 2, 4):
            for rank in range(world):
                got = tensor_parallel.rank_state_dict(model, rank, world)
                want, mine = _expected(model, rank, world)
                where = f"rank {rank} of {world}{' (tied embeddings)' if tied else ''}"
                missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
                expect(not missing and not extra,
                       f"{where}: the weights are missing {missing or 'none'} and should not "
                       f"hold {extra or 'none'} (a tied output.weight is the embeddings' own)")
                for name, w in want.items():
                    kind = name.split(".")[-2]
                    what = COLUMNS.get(kind) or ROWS.get(kind)
                    share = (f"{what} {mine[what]} ({'rows' if kind in COLUMNS else 'columns'})"
                             if what else "the whole tensor")
                    g = got[name]
                    expect(g.shape == w.shape and torch.equal(g, w),
                           f"{where}: {name} should be {share}, shape {tuple(w.shape)}; yours "
                           f"has shape {tuple(g.shape)}"
                           + ("" if g.shape != w.shape else " and other values"))
                    expect(g.is_contiguous(), f"{where}: {name} is not contiguous: a slice of "
                                              f"columns needs .contiguous()")
                    expect(g.untyped_storage().data_ptr() not in storages,
                           f"{where}: {name} shares memory with the model's weight; a rank's "
                           f"weights must be a copy (they travel to another process)")


def _random_steps(seed: int, steps: int):
    """A scheduler's tables over `steps` steps of random work: sequences arrive, grow by whole
    blocks, finish, are preempted and come back with other blocks, copy a block on write, or
    roll back. Yields (before, after) for every step."""
    rng = random.Random(seed)
    free, tables, next_seq = list(range(40)), {}, 0
    for _ in range(steps):
        before = {s: list(b) for s, b in tables.items()}
        for _ in range(rng.randint(0, 3)):
            op = rng.choice(["new", "grow", "grow", "free", "cow", "rollback"])
            live = sorted(tables)
            if op == "new" or not live:
                if len(free) >= 2:
                    tables[next_seq] = [free.pop(rng.randrange(len(free))) for _ in range(2)]
                    next_seq += 1
                continue
            s = rng.choice(live)
            if op == "grow" and free:
                tables[s].append(free.pop(rng.randrange(len(free))))
            elif op == "free":
                free += tables.pop(s)
            elif op == "cow" and free:
                free.append(tables[s][-1])
                tables[s][-1] = free.pop(rng.randrange(len(free) - 1))
            elif op == "rollback" and len(tables[s]) > 1:
                free.append(tables[s].pop())
        yield before, {s: list(b) for s, b in tables.items()}


def worker_tables_follow_the_scheduler():
    """apply_changes(tables, changes) gives the scheduler's tables after the step, for messages
    with appended blocks, new sequences, replaced tables (a copied block, a rollback) and freed
    sequences, step after step; it changes neither the tables it is given nor any message it
    was sent."""
    cases = [({0: [3]}, {0: [3, 7]}), ({0: [3], 1: [4]}, {1: [4]}), ({}, {2: [5, 6]}),
             ({0: [3, 7]}, {0: [3, 9]}), ({0: [3, 7]}, {0: [3]}), ({0: [1], 1: [2]}, {1: [2, 5]})]
    for before, after in cases:
        _one_step(before, after, {s: list(b) for s, b in before.items()}, [])
    for seed in range(20):
        worker, sent = {}, []
        for step, (before, after) in enumerate(_random_steps(seed, 30)):
            worker = _one_step(before, after, worker, sent, f"step {step} of a random run: ")


def _one_step(before, after, worker, sent, where=""):
    changes = tensor_parallel.step_changes(before, after)
    given = {s: list(b) for s, b in worker.items()}
    message = {k: ({s: list(b) for s, b in v.items()} if isinstance(v, dict) else list(v))
               for k, v in changes.items()}
    got = tensor_parallel.apply_changes(worker, changes)
    expect(got == after, f"{where}tables {given}, message {message}: apply_changes gave {got}; "
                         f"the scheduler holds {after}")
    expect(worker == given, f"{where}tables {given}, message {message}: apply_changes changed "
                            f"the tables it was given to {worker}; return a new copy")
    sent.append((changes, message))
    for m, copy in sent:
        expect(m == copy, f"{where}a message sent earlier, {copy}, was changed to {m} by a "
                          f"later apply_changes: the worker's tables share lists with it; copy "
                          f"the block ids")
    return got
