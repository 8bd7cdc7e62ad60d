"""The chat's memory stays flat turn after turn: no path that runs the model outside training
records an autograd graph. (With autograd on, every key and value written into the KV pool kept
the graph that computed it alive: about 18 MiB a turn for the embedded model once the history
overflowed the context and was rebuilt.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from minipaged import load_model, load_tokenizer
from minipaged.chat.conversation import Conversation
from minipaged.kv_cache import ContiguousCache
from minipaged.sharing import SharedPagedCache

ROOT = Path(__file__).resolve().parents[1]


def test_load_model_holds_parameters_without_grad():
    model = load_model()
    assert [n for n, p in model.named_parameters() if p.requires_grad] == []


def cache_tensors(cache):
    if hasattr(cache, "managers"):
        return [t for m in cache.managers for t in (m.k_cache_paged, m.v_cache_paged)]
    return list(cache.k_cache) + list(cache.v_cache)


def test_a_reply_leaves_no_graph_in_the_cache():
    """Even a model whose parameters require grad (one built or trained by hand) leaves the
    cache's keys and values free of any graph: the conversation runs under inference mode."""
    model, tokenizer = load_model(dtype=torch.float32), load_tokenizer()
    model.requires_grad_(True)
    for cache in (SharedPagedCache(model.args, 16, 16, 1, 256, prefix_caching=True),
                  ContiguousCache(model.args, 1, 256)):
        conv = Conversation(model, tokenizer, cache, max_new_tokens=8)
        conv.reply("what is a block table?")
        conv.reply("and a block?")
        stored = cache_tensors(cache)
        assert any(bool(t.abs().sum() > 0) for t in stored)      # the reply was written there
        assert all(t.grad_fn is None and not t.requires_grad for t in stored)


PROBE = """
import json, os, sys
import torch
from minipaged import load_model, load_tokenizer
from minipaged.chat.conversation import Conversation
from minipaged.sharing import SharedPagedCache
torch.set_num_threads(1)
model, tokenizer = load_model(dtype=torch.float32), load_tokenizer()
model.requires_grad_(True)      # as a hand-built model would: the conversation must not care
cache = SharedPagedCache(model.args, 16, 16, 1, 256, prefix_caching=True)
conv = Conversation(model, tokenizer, cache, max_new_tokens=16)
page = os.sysconf("SC_PAGE_SIZE")
rss, rebuilt = [], 0
for i in range(int(sys.argv[1])):
    info = conv.reply(f"what is a block table? turn {i}")
    rebuilt += info["rebuilt"]
    with open("/proc/self/statm") as f:
        rss.append(int(f.read().split()[1]) * page / 2**20)
print(json.dumps({"rss": rss, "rebuilt": rebuilt}))
"""


def test_chat_memory_stays_flat_over_many_turns():
    """60 turns in a 256-token context, so the history overflows and is rebuilt again and
    again: after a warm-up of 10 turns, the resident memory grows by less than 16 MiB (a graph
    kept alive grew it by ~18 MiB a turn, ~900 MiB over these 50 turns)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", PROBE, "60"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    rss = out["rss"]
    assert len(rss) == 60 and out["rebuilt"] >= 20        # the path that leaked, many times
    assert max(rss[10:]) - rss[10] < 16, [round(r) for r in rss]
