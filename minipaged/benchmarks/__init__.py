"""Benchmarks and the figures they draw; each prints ratios measured side by side in one run.

    python -m minipaged.benchmarks.bookkeeping     stage 2: a decode step's block bookkeeping
    python -m minipaged.benchmarks.decode_step     stage 3: one decode step, paged vs contiguous
    python -m minipaged.benchmarks.policies        stage 4: KV memory by kind, per allocation policy
    python -m minipaged.benchmarks.serving         stage 5: one trace, one budget, three servers
    python -m minipaged.benchmarks.chunked_latency stage 5b: chats beside long prompts, by budget
    python -m minipaged.benchmarks.sharing_savings stage 6: memory and prefill that sharing saves
    python -m minipaged.benchmarks.beam_savings    stage 6b: beam search's blocks, shared or not
    python -m minipaged.benchmarks.tensor_parallel stage 9: tokens/s and KV per rank at N ranks
    python -m minipaged.benchmarks.smollm2         a real model: minipaged beside transformers
    python -m minipaged.benchmarks.serving_peers   serving beside vLLM's CPU build and llama.cpp

Not a stage of the course: these modules import the stages and measure them.
"""
