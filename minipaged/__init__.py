"""minipaged: PagedAttention, the KV-cache paging at the heart of vLLM, built up step by step.

Read the stages in order, each module beside its lesson (`lessons/`) and notebook
(`notebooks/`):

    1   model.py, kv_cache.py, generation.py      a naive Llama 3, a contiguous cache reserved up front
    2   cache_manager.py, kv_budget.py             blocks, a random free set, a block table per layer
    3   paged_attention.py, paged_cache.py         flash_attn_with_kvcache over scattered blocks
    3b  online_softmax.py, triton_attention.py,    inside the kernel: the block walk, in PyTorch,
        cpu_attention.py (+ .c)                    in Triton, and in C for CPUs
    4   fragmentation.py, workloads.py, simulator.py   where the KV memory goes, measured
    4b  kv_quant.py                                int8 blocks that carry their scales
    5   scheduler.py, swap.py, engine.py           continuous batching, preemption by recompute or swap
    5b  chunked_prefill.py, chunked_engine.py      a token budget per step, prompts in chunks
    6   prefix_cache.py, sharing.py, sharing_engine.py   reference counts, copy-on-write, prefix caching
    6b  beams.py                                   beam search: beams fork and free shared blocks
    7   speculative.py, draft_policy.py            speculative decoding: drafts, one verify pass, rollback;
                                                   drafts that adapt to their acceptance and the batch
    8   serve/ (a subpackage)                      an OpenAI-compatible server, the pool live in a browser
    9   tensor_parallel.py, tp_engine.py,          the heads and their KV blocks split over N processes;
        tp_group.py                                one scheduler sends the others each call's changes

Around them: `formats/` (checkpoints and tokenizers), `embedded/` (the shipped model's corpus and
trainer), `chat/` (`python -m minipaged.chat`), `viz/` (the drawings), `benchmarks/`, `fast/`
(the speed layer). Support modules beside the stages, not needed on a first read: `checks.py`
(values and requests), `cache_checks.py` (memory, pools, attention calls), `backends.py` (which
attention implementation runs), `kv_formats.py` (what a pool's slots hold), `rope_scaling.py` (Llama 3.1's longer context), `sampling.py`
(greedy and top-p), `sizing.py`, `cache_queries.py` (what drawings and later stages ask a
cache). `exercises/` is the course's build-it-yourself tasks and grader (`python -m
minipaged.exercises`).
"""

import os
import sys

# OpenMP threads that wait between parallel regions spin 10,000 turns, then sleep, instead of
# GNU OpenMP's 300,000: enough to bridge the gaps inside a step, short enough that a busy core
# beside the engine does not stall every region (benchmarks/busy_machine.py). OpenMP reads this
# once, when torch loads it: set here, before any torch import, unless the user chose.
if "torch" not in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
    os.environ["GOMP_SPINCOUNT"] = "10000"

from . import cpu_attention, triton_attention  # register backend="cpu" and "triton" (asked by name)
from . import kv_quant  # registers kv_dtype="int8" (asked by name)
from .api import Engine, beam_search, generate
from .errors import (CheckpointError, MiniPagedError, NotEnoughMemoryError, OutOfBlocksError,
                     RequestError, TokenizerError, TraceError, UsageError)
from .formats import ChatFormat, Tokenizer, load_model, load_tokenizer, save_model
from .model import Llama, ModelArgs
