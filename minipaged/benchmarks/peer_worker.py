"""The worker side of `serving_peers`: one engine in a process of its own, answering jobs; the
peers' engines, vLLM's and llama.cpp's, are here.

`serving_peers` starts one worker per engine and gives them jobs in turns. A worker loads its
engine, says it is ready, then answers each job (one JSON line on its standard input:
{"requests": [[prompt token ids, new tokens], ...]}) with one JSON line: the seconds the
engine took and the greedy tokens of each request. Everything the engine's libraries print
goes to standard error, so the replies stay readable.

This file imports the standard library, numpy and the peers only, and is run by path: vLLM's
worker runs in vLLM's own interpreter (vLLM pins its own torch and transformers, so it lives in
a virtual environment of its own, without minipaged's requirements); llama.cpp's needs no torch.

    python peer_worker.py vLLM|llama.cpp JSON_OPTIONS
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

try:
    import llama_cpp
except ImportError:          # a peer, never a requirement (and absent from vLLM's environment)
    llama_cpp = None

BUDGET = 512                  # tokens a step may run: max_num_batched_tokens, llama.cpp's n_batch


def reply_channel():
    """A function that sends one JSON line to whoever started this worker. Called first: from
    then on whatever else writes to standard output lands on standard error."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def say(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()
    return say


def serve_jobs(say, run, version: str) -> None:
    """Answer jobs until standard input closes; `run(requests)` -> each request's tokens."""
    say({"ready": True, "version": version})
    for line in sys.stdin:
        requests = json.loads(line)["requests"]
        start = time.perf_counter()
        tokens = run(requests)
        say({"seconds": time.perf_counter() - start, "tokens": tokens})


def vllm_engine(folder: str, dtype: str, threads: int, max_num_seqs: int, max_model_len: int,
                max_num_batched_tokens: int, one_process: bool = False):
    """vLLM's offline engine on a Hugging Face folder: greedy, every request to its length
    (`ignore_eos`), no prefix caching, its OpenMP threads bound to the first `threads` cores,
    1 GiB of KV cache. Token ids in and out, so no tokenizer is loaded. By default vLLM runs
    its engine core in a process of its own beside the one that called it, as `vllm serve`
    does; `one_process` keeps both in one (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if one_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm

    llm = vllm.LLM(folder, dtype=dtype, enable_prefix_caching=False, seed=0,
                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                   max_model_len=max_model_len, skip_tokenizer_init=True)

    def run(requests):
        prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
        params = [vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                      detokenize=False) for _, n in requests]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    return run, f"vllm {vllm.__version__}"


class LlamaCppBatched:
    """llama.cpp's continuous batching through its C API: one sequence id per request in a
    unified KV cache (`kv_unified`), and each step one `llama_batch` holding every decoding
    sequence's last token first, then prompt tokens in order up to `budget` tokens (a long
    prompt is fed in chunks over several steps). The greedy pick is numpy's argmax over the
    logits llama.cpp returns, one row per sequence that needs a token."""

    def __init__(self, path: str, threads: int, n_seq_max: int, n_ctx: int, budget: int = BUDGET):
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            path.encode(), llama_cpp.llama_model_default_params())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, budget, budget
        params.n_seq_max, params.kv_unified = n_seq_max, True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.model or not self.ctx:
            raise RuntimeError(f"llama.cpp could not load {path} with {n_seq_max} sequences")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(budget, 0, 1)
        self.budget = budget

    def add(self, token: int, pos: int, seq: int, wants_logits: bool) -> None:
        b, i = self.batch, self.batch.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = token, pos, 1, seq
        b.logits[i] = wants_logits
        b.n_tokens = i + 1

    def run(self, requests):
        memory = llama_cpp.llama_get_memory(self.ctx)
        llama_cpp.llama_memory_clear(memory, True)
        fed = [0] * len(requests)                       # prompt tokens in the cache so far
        out = [[] for _ in requests]
        running = list(range(len(requests)))
        while running:
            self.batch.n_tokens = 0
            rows = []                                   # the sequence of each logits row
            for i in running:
                if out[i]:                              # decoding: its last token goes in
                    self.add(out[i][-1], len(requests[i][0]) + len(out[i]) - 1, i, True)
                    rows.append(i)
            for i in running:                           # prompts, in chunks, within the budget
                prompt = requests[i][0]
                take = max(0, min(len(prompt) - fed[i], self.budget - self.batch.n_tokens))
                for pos in range(fed[i], fed[i] + take):
                    self.add(prompt[pos], pos, i, pos == len(prompt) - 1)
                fed[i] += take
                if take and fed[i] == len(prompt):
                    rows.append(i)
            if llama_cpp.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama.cpp's llama_decode failed (its KV cache is full?)")
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx),
                                           shape=(len(rows), self.vocab))      # (rows, vocab)
            for i, token in zip(rows, logits.argmax(axis=1).tolist()):
                out[i].append(token)
            for i in [i for i in running if len(out[i]) == requests[i][1]]:
                running.remove(i)
                llama_cpp.llama_memory_seq_rm(memory, i, -1, -1)     # its cells go back
        return out


def llama_cpp_engine(path: str, threads: int, n_seq_max: int, n_ctx: int):
    return LlamaCppBatched(path, threads, n_seq_max, n_ctx).run, \
        f"llama-cpp-python {llama_cpp.__version__}, {os.path.basename(path)}"


if __name__ == "__main__":          # vLLM starts processes of its own: this guard is needed
    say = reply_channel()
    make = {"vLLM": vllm_engine, "llama.cpp": llama_cpp_engine}[sys.argv[1]]
    serve_jobs(say, *make(**json.loads(sys.argv[2])))
