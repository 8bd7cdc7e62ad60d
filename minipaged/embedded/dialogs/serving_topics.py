"""Training-corpus topics: continuous batching, scheduling, preemption and sharing."""

from .phrasing import _i

SERVING_TOPICS = {
    "continuous_batching": {
        "keywords": ["continuous batching"],
        "subjects": ["continuous batching", "iteration-level scheduling", "in-flight batching"],
        "what": _i([
            "what is continuous batching in LLM serving?", "what does continuous batching mean?",
            "what is the difference between static and continuous batching?",
        ], [
            "Continuous batching schedules at the level of single decode steps: when a sequence "
            "finishes, a waiting request takes its place at the next step instead of waiting for "
            "the whole batch. Orca (OSDI 2022) introduced it as iteration-level scheduling, and "
            "vLLM uses it.",
            "With continuous batching the batch changes at every step: finished requests leave "
            "and new ones join after their prefill. The hardware never idles while short requests "
            "wait for long ones.",
            "Continuous batching is iteration-level scheduling: the server rebuilds the batch at "
            "every decode step from the running requests, so requests of very different lengths "
            "share the hardware efficiently.",
        ]),
        "why": _i([
            "why is continuous batching faster than static batching?", "what is wrong with static batching?",
            "why does continuous batching raise throughput?",
        ], [
            "In static batching a batch runs until its longest request ends, so finished slots sit "
            "idle and new requests wait. Continuous batching refills those slots at every step, "
            "which raises throughput when output lengths vary.",
        ]),
        "more": _i([
            "why does continuous batching need a paged cache?", "how do continuous batching and paging work together?",
            "does continuous batching need PagedAttention?",
        ], [
            "Continuous batching works best when memory can be handed out one block at a time: a "
            "joining request only needs a few free blocks, not a max_seq_len reservation. "
            "PagedAttention makes that cheap, so vLLM uses the two together.",
        ]),
        "how": _i([
            "how does continuous batching work?", "how does a new request join a running batch?",
            "how does minipaged do continuous batching?",
        ], [
            "With continuous batching, at each step the scheduler drops finished sequences and "
            "frees their blocks, admits waiting requests while free blocks remain, runs their "
            "prefill, and then runs one decode step for every running sequence.",
        ]),
    },
    "scheduler": {
        "keywords": ["scheduler", "waiting"],
        "subjects": ["the scheduler", "vLLM's scheduler", "the request scheduler",
                     "the waiting, running and swapped queues"],
        "what": _i([
            "what does the scheduler do?", "what are the scheduler's queues?",
            "what decides which requests run?", "what is the job of the scheduler?",
        ], [
            "The scheduler decides at every step which requests run. It keeps three queues, "
            "waiting (not started), running (in the batch) and swapped (preempted to CPU memory), "
            "and moves requests between them as blocks come and go.",
            "vLLM's scheduler is first-come, first-served: it admits waiting requests while the "
            "pool has free blocks for them, and when blocks run out it preempts the most recently "
            "arrived running request.",
            "In minipaged's stage 5 the scheduler sits above the cache managers: it admits requests "
            "from the waiting queue, runs the running ones, and preempts one by swap or recompute "
            "when the pool runs dry, without touching attention.",
        ]),
        "how": _i([
            "how does the scheduler pick requests?", "how does the scheduler decide what to run?",
            "in what order does the scheduler serve requests?",
        ], [
            "The scheduler serves requests in arrival order. A waiting request is admitted only if "
            "enough free blocks exist for its prompt; if a running request needs a new block and "
            "none is free, the latest-arrived running request is preempted to make room.",
        ]),
        "more": _i([
            "what does the scheduler do when memory runs out?", "how does a request move between queues?",
            "what happens to a request when the blocks run out?",
        ], [
            "When the pool runs dry the scheduler preempts a running request: with swap its blocks "
            "move to CPU memory and it joins the swapped queue; with recompute its blocks are "
            "freed and it goes back to the waiting queue, to be prefilled again later.",
        ]),
    },
    "preemption": {
        "keywords": ["preempt", "swap", "recompute"],
        "subjects": ["preemption", "preemption by swap", "preemption by recompute",
                     "swapping KV blocks to the CPU"],
        "what": _i([
            "what is preemption in vLLM?", "what happens when a request is preempted?",
            "what does preempting a request mean?",
        ], [
            "Preemption means pausing a running request to free its KV cache blocks when the pool "
            "runs out. vLLM can preempt by swapping the blocks out to CPU memory or by dropping "
            "them and recomputing them later.",
            "When no free block is left, the scheduler preempts a running request. With swap, its "
            "blocks are copied to CPU memory and back later; with recompute, they are discarded "
            "and rebuilt by a prefill over the prompt plus the tokens generated so far.",
            "Preemption lets a server accept more requests than fit in the worst case: if memory "
            "runs out, one request steps aside, by swap or by recompute, and resumes when blocks "
            "free up.",
        ]),
        "why": _i([
            "when is recompute better than swap?", "should I use swap or recompute?",
            "why recompute instead of swapping?", "which preemption mode is faster?",
            "what is the difference between swap and recompute?",
        ], [
            "Recompute costs compute but no transfers, and its prefill is fast because it is "
            "parallel; swap costs CPU memory and bandwidth on the CPU–GPU link. The vLLM paper "
            "found recompute cheaper at small block sizes, where swapping means many small "
            "transfers.",
            "Swap keeps the keys and values and moves them over the CPU–GPU link; recompute throws "
            "them away and rebuilds them with one prefill pass. Which wins depends on the block "
            "size, the sequence length and the link's bandwidth.",
        ]),
        "api": _i([
            "how do I choose the preemption mode in minipaged?", "how do I turn on swap preemption in minipaged?",
            "what does preemption='recompute' do in minipaged?",
        ], [
            "In minipaged, generate(..., num_blocks=N, preemption='recompute') or "
            "preemption='swap' picks the mode. With recompute the preempted request's blocks are "
            "freed and it is prefilled again on resume; with swap its blocks go to CPU memory and "
            "come back into free blocks with a new block table.",
        ]),
        "how": _i([
            "how does recompute preemption work?", "how does swap preemption work?",
            "how does a preempted request resume?", "how is a preempted request brought back?",
        ], [
            "Recompute: free the request's blocks, put it back in the waiting queue, and on resume "
            "run prefill over the prompt and the tokens generated so far. Swap: copy its blocks to "
            "the CPU, move it to the swapped queue, and copy them back when memory allows.",
        ]),
    },
    "copy_on_write": {
        "keywords": ["copy-on-write", "copies", "copy"],
        "subjects": ["copy-on-write", "copy on write", "copy-on-write for KV blocks"],
        "what": _i([
            "what does copy-on-write mean for KV blocks?", "what is CoW in vLLM?",
            "how can two sequences share a block safely?",
        ], [
            "Copy-on-write lets several sequences share one physical block until one of them needs "
            "to write into it. At that moment the writer gets its own copy of the block, and the "
            "others keep the original.",
            "It is the operating-system trick applied to KV blocks: a sequence that must append to "
            "a shared block first copies it to a fresh block, updates its block table and "
            "decrements the old block's reference count.",
        ]),
        "how": _i([
            "when does copy-on-write happen?", "which blocks get copied on write?",
            "how does copy-on-write work in vLLM?", "how does copy-on-write work with forked samples?",
        ], [
            "A copy happens only when a sequence writes into a block whose reference count is "
            "above one. In practice that is the last, partly filled block shared after a fork: full "
            "blocks are never written again, so they stay shared.",
            "When two samples forked from the same prompt each append a token, the first to write "
            "into the shared last block copies it to a new block, writes there and points its block "
            "table at the copy; the shared full blocks are left alone.",
        ]),
        "example": _i([
            "can you give an example of copy-on-write?", "show me copy-on-write with numbers.",
            "walk me through a copy-on-write.",
        ], [
            "Two samples share a 20-token prompt in blocks [4, 9] with block size 16, so block 9 "
            "holds 4 tokens and has reference count 2. When sample 1 writes its next token it "
            "copies block 9 to free block 2 and its table becomes [4, 2]; sample 0 keeps [4, 9], "
            "and block 9's count drops to 1.",
        ]),
        "why": _i([
            "why use copy-on-write?", "what does copy-on-write save?", "why not copy the whole prompt per sample?",
        ], [
            "Without copy-on-write every sample or beam would need its own copy of the prompt's KV "
            "cache. With it they share everything except the block being written, which is why "
            "the vLLM paper saves 6 to 30% memory in parallel sampling and 37 to 66% in beam search.",
        ]),
    },
    "reference_counts": {
        "keywords": ["reference count"],
        "subjects": ["a reference count", "reference counting", "block reference counts",
                     "the reference count of a block"],
        "what": _i([
            "what does a block's reference count mean?", "what is refcounting in a block manager?",
            "how does the block manager know a block is shared?",
        ], [
            "A reference count records how many sequences' block tables point at a physical block. "
            "Sharing a block increments it, freeing a sequence decrements it, and the block returns "
            "to the free pool only when the count reaches zero.",
            "Reference counting is how a block manager knows whether a block is shared: a reference "
            "count of 1 means one owner, more means several sequences share it and writing "
            "requires copy-on-write.",
        ]),
        "how": _i([
            "how are reference counts updated?", "when does a shared block get freed?",
            "how do reference counts work with forking?",
        ], [
            "Forking a sequence copies its block table and adds one to the reference count of every "
            "block in it. Freeing a sequence subtracts one from each of its blocks, and blocks "
            "whose reference count falls to zero go back to the free pool.",
        ]),
        "why": _i([
            "why do we need reference counts?", "what goes wrong without reference counts?",
            "why count references to blocks?",
        ], [
            "With shared blocks, freeing one sequence must not free blocks another sequence still "
            "reads. The reference count makes that safe: a block is freed only when no block table "
            "points at it any more.",
        ]),
    },
    "prefix_caching": {
        "keywords": ["prefix", "hash"],
        "subjects": ["prefix caching", "automatic prefix caching", "the prefix cache"],
        "what": _i([
            "what does prefix caching reuse?", "what is a prefix-cache hit?",
            "how can two requests share a system prompt's KV cache?",
        ], [
            "Prefix caching reuses the KV cache blocks of a prompt prefix that an earlier request "
            "already computed, such as a shared system prompt. Full blocks are looked up by a hash "
            "of their tokens, so a hit skips their prefill.",
            "A prefix cache holds full KV blocks keyed by the tokens they hold plus everything before "
            "them. A new request whose prompt starts with the same tokens points its block table at "
            "those blocks and only prefills the rest.",
        ]),
        "how": _i([
            "how does prefix caching find matching blocks?", "how are blocks hashed for prefix caching?",
            "how does a prefix-cache hit work?",
        ], [
            "Each full block gets a hash of its token ids chained with the hash of the block "
            "before it, so a block's hash stands for the whole prefix up to it. A new prompt is "
            "hashed block by block and reuses every leading block whose hash is cached.",
            "Only full blocks are hashed, and a prefix match stops before the prompt's last token, "
            "so at least one token is always prefilled to produce the first new token's logits.",
        ]),
        "more": _i([
            "what happens to cached blocks nobody uses?", "how are prefix-cached blocks evicted?",
            "when are cached prefix blocks evicted?",
        ], [
            "Cached blocks that no sequence uses keep their hash in the pool; a prefix hit reuses "
            "them, and they are evicted, least recently used first, when a new block is needed.",
        ]),
        "why": _i([
            "why use prefix caching?", "what does prefix caching save?", "when does prefix caching help?",
        ], [
            "Many requests share a prefix: the same system prompt, few-shot examples, or earlier "
            "turns of a chat. Prefix caching computes those keys and values once and reuses the "
            "blocks, saving prefill time and memory.",
        ]),
    },
    "parallel_sampling": {
        "keywords": ["parallel sampling", "samples"],
        "subjects": ["parallel sampling", "sampling several outputs per prompt",
                     "generating several completions of one prompt"],
        "what": _i([
            "how do you get several answers for one prompt?", "what does sampling n outputs mean?",
            "what is parallel sampling in vLLM?",
        ], [
            "Parallel sampling generates several different completions for the same prompt. With "
            "paging, all samples share the prompt's KV blocks through reference counts and get "
            "their own blocks only as they diverge, by copy-on-write.",
            "Parallel sampling means asking for n outputs from one prompt, for example n=4 samples "
            "at temperature 0.8. The prompt is prefilled once, and its blocks are shared by all "
            "samples instead of copied.",
        ]),
        "how": _i([
            "how does parallel sampling share memory?", "how does vLLM implement parallel sampling?",
            "how do samples of one prompt share blocks?",
        ], [
            "For parallel sampling the prompt is prefilled once, then the sequence is forked n "
            "times: each sample gets a copy of the block table and each shared block's reference "
            "count goes up. New tokens are written with copy-on-write.",
        ]),
        "api": _i([
            "how do I ask minipaged for several samples?", "what does n mean in minipaged's generate?",
            "how do I get K samples per prompt in minipaged?",
        ], [
            "In minipaged, generate(model, prompts, max_new_tokens, n=K, temperature=0.8) returns "
            "K samples per prompt; the samples share the prompt's blocks through reference counts.",
        ]),
        "why": _i([
            "how much memory does parallel sampling save?", "why share blocks between samples?",
            "is parallel sampling cheaper with paging?",
        ], [
            "Sharing the prompt's blocks means n samples need one copy of the prompt's keys and "
            "values instead of n. The vLLM paper reports 6 to 30% memory saved in parallel sampling "
            "and 37 to 66% in beam search.",
        ]),
    },
}
