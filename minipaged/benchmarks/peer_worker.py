"""The worker side of `serving_peers`: one engine in a process of its own, answering jobs.

`serving_peers` starts one worker per engine and gives them jobs in turns. A worker loads its
engine, says it is ready, then answers each job (one JSON line on its standard input:
{"requests": [[prompt token ids, new tokens], ...]}) with one JSON line: the seconds the
engine took and the greedy tokens of each request. Everything the engine's libraries print
goes to standard error, so the replies stay readable.

This file imports the standard library only: vLLM's worker runs it by path in vLLM's own
interpreter (vLLM pins its own torch and transformers, so it lives in a virtual environment
of its own, without minipaged's requirements).
"""

from __future__ import annotations

import json
import os
import sys
import time


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
                max_num_batched_tokens: int):
    """vLLM's offline engine on a Hugging Face folder: greedy, every request to its length
    (`ignore_eos`), no prefix caching, its OpenMP threads bound to the first `threads` cores,
    1 GiB of KV cache. Token ids in and out, so no tokenizer is loaded."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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


if __name__ == "__main__":          # vLLM starts processes of its own: this guard is needed
    say = reply_channel()
    serve_jobs(say, *vllm_engine(**json.loads(sys.argv[1])))
