"""Training-corpus topics: paged attention, vLLM, flash-attn."""

from .phrasing import _i

ATTENTION_TOPICS = {
    "paged_attention": {
        "keywords": ["pagedattention", "paged attention"],
        "subjects": ["PagedAttention", "paged attention", "the PagedAttention algorithm",
                     "KV cache paging"],
        "what": _i([
            "what is paged attention in vLLM?", "what does PagedAttention do?",
            "what is the main idea of PagedAttention?", "what does paging mean for the KV cache?",
        ], [
            "PagedAttention is the attention algorithm from vLLM that stores the KV cache in "
            "fixed-size blocks, like pages of virtual memory, and reads a sequence's keys and "
            "values through its block table. The blocks can sit anywhere, so nothing is reserved "
            "up front.",
            "PagedAttention applies operating-system paging to the KV cache: sequences see "
            "contiguous logical blocks, which a block table maps to scattered physical blocks. "
            "Memory is taken one block at a time, so waste is limited to each sequence's last block.",
            "PagedAttention is attention that gathers keys and values from non-contiguous blocks. "
            "Kwon et al. introduced it in the vLLM paper at SOSP 2023 to cut KV cache waste from "
            "fragmentation and reservation.",
        ]),
        "why": _i([
            "why use paged attention?", "what problem does PagedAttention solve?",
            "why is PagedAttention faster overall?", "what does paging buy us?",
            "is PagedAttention worth the extra cost?", "how much does PagedAttention help?",
        ], [
            "Earlier systems kept token states in only 20.4% to 38.2% of KV memory; with "
            "PagedAttention vLLM uses 96.3%. More requests fit at once, so batches grow and the "
            "paper reports 2 to 4 times the throughput of earlier systems.",
            "Paging costs 20 to 26% extra attention-kernel latency in the vLLM paper, because "
            "blocks are gathered through a table, but far more sequences fit in memory. In the code "
            "minipaged grows from, a 24 GB GPU fit a batch of 7 with a contiguous cache and 49 with "
            "PagedAttention.",
        ]),
        "how": _i([
            "how does PagedAttention work?", "how does paged attention find the keys and values?",
            "how does PagedAttention relate to virtual memory?", "how is paged attention computed?",
        ], [
            "Like virtual memory, PagedAttention splits storage into fixed-size pages (blocks), "
            "gives each sequence a table from logical to physical blocks, and allocates a block "
            "only on demand. The kernel walks the block table, loads each block's keys and values "
            "and computes attention as usual.",
            "In PagedAttention blocks are like pages, tokens like bytes and sequences like "
            "processes: each block table maps a sequence's logical blocks to physical blocks "
            "anywhere in the pool. The math of attention is unchanged; only the reads are gathered.",
        ]),
    },
    "vllm": {
        "keywords": ["vllm"],
        "subjects": ["vLLM", "the vLLM engine", "the vLLM project"],
        "what": _i([
            "what is the vLLM paper about?", "what is vLLM used for?",
            "what is vLLM known for?",
        ], [
            "vLLM is an open-source serving engine for large language models, started at UC "
            "Berkeley and built around PagedAttention. It pages the KV cache into blocks and "
            "schedules requests with continuous batching to get high throughput.",
            "vLLM is the system that introduced PagedAttention, in Kwon et al., 'Efficient Memory "
            "Management for Large Language Model Serving with PagedAttention' (SOSP 2023). It "
            "reported 2 to 4 times the throughput of FasterTransformer and Orca at similar latency.",
            "vLLM is a high-throughput inference server: a scheduler with waiting, running and "
            "swapped queues, a block manager for the paged KV cache, and attention kernels that "
            "read blocks through block tables.",
        ]),
        "how": _i([
            "how does vLLM manage memory?", "what are the main parts of vLLM?",
            "how is vLLM organised?", "how does vLLM v1 manage the KV cache?",
        ], [
            "vLLM allocates all KV memory as blocks at startup, gives each request a block table, "
            "and lets a scheduler admit, preempt and finish requests at every step. It shares "
            "blocks between sequences with reference counts, copy-on-write and prefix caching.",
            "vLLM v1 has a KVCacheManager with a BlockPool and a free-block queue, keeps one block "
            "table per request shared by all layers, and hashes full blocks for prefix caching.",
        ]),
        "more": _i([
            "how is minipaged related to vLLM?", "is minipaged a copy of vLLM?",
            "what does minipaged take from vLLM?",
        ], [
            "minipaged re-implements vLLM's core ideas, blocks, block tables, PagedAttention, "
            "scheduling and sharing, in small readable Python modules. It is not vLLM: it favours "
            "clarity over speed and also runs on a CPU.",
        ]),
    },
    "flash_attn": {
        "keywords": ["flash_attn_with_kvcache", "flash-attn"],
        "subjects": ["flash_attn_with_kvcache", "flash-attn's flash_attn_with_kvcache",
                     "the flash_attn_with_kvcache function", "flash-attn"],
        "what": _i([
            "what does flash_attn_with_kvcache do?", "what is the flash-attn library?",
            "which flash-attn function supports a paged KV cache?",
        ], [
            "flash_attn_with_kvcache is flash-attn's attention kernel for inference with a KV "
            "cache. It takes q, k_cache, v_cache, optional new k and v, cache_seqlens and an "
            "optional block_table; it writes the new keys and values in place and attends over "
            "everything cached.",
            "flash_attn_with_kvcache is the flash-attn function that runs attention against a KV "
            "cache, contiguous or paged. With a block_table it reads a paged cache of shape "
            "(num_blocks, block_size, n_kv_heads, head_dim).",
            "flash-attn is Tri Dao's library of fast, memory-efficient attention kernels. Its "
            "flash_attn_with_kvcache function supports paged KV caches through a block_table "
            "argument, and minipaged's CUDA path calls it.",
        ]),
        "how": _i([
            "how do you call flash_attn_with_kvcache with a paged cache?", "what arguments does flash_attn_with_kvcache take?",
            "what shapes does flash_attn_with_kvcache expect?", "how do I pass a block table to flash-attn?",
        ], [
            "Call flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, "
            "block_table=block_table, causal=True). For a paged cache, k_cache and v_cache are "
            "(num_blocks, block_size, n_kv_heads, head_dim), block_table is int32 (batch, "
            "max_blocks) and cache_seqlens is int32 (batch,).",
            "In flash_attn_with_kvcache, q is (batch, seqlen_q, n_heads, head_dim); the new k and "
            "v are written into the cache at cache_seqlens before attention, and the causal mask "
            "is aligned to the bottom right so the new tokens see the whole cache.",
        ]),
        "more": _i([
            "what are the limits of flash_attn_with_kvcache?", "what GPU does flash-attn's paged kernel need?",
            "what block size does flash-attn need?", "can I use block size 16 with flash-attn?",
        ], [
            "flash-attn 2's paged path needs a block size that is a multiple of 256, fp16 or bf16 "
            "tensors and an Ampere or newer GPU (sm80+); block size 16 raises an error. flash-attn "
            "3 on Hopper accepts any page size.",
        ]),
        "cpu": _i([
            "does flash-attn work on a CPU?", "why does minipaged have its own flash_attn_with_kvcache?",
            "what does minipaged do without flash-attn?", "can I run flash_attn_with_kvcache without a GPU?",
        ], [
            "flash-attn runs only on CUDA, so minipaged ships a pure PyTorch "
            "flash_attn_with_kvcache with the same signature for the CPU and for block sizes "
            "flash-attn 2 rejects; on a GPU with flash-attn installed it uses the real kernel at "
            "block size 256.",
        ]),
    },
    "cache_seqlens": {
        "keywords": ["cache_seqlens"],
        "subjects": ["cache_seqlens", "the cache_seqlens argument", "the cache_seqlens tensor"],
        "what": _i([
            "what does cache_seqlens hold?", "what is cache_seqlens in flash-attn?",
            "what does cache_seqlens tell the kernel?",
        ], [
            "cache_seqlens is an int32 tensor of shape (batch,) that tells flash_attn_with_kvcache "
            "how many tokens each sequence already has in the cache. New keys and values are "
            "written starting at that position, and attention covers the cached tokens plus the "
            "new ones.",
            "cache_seqlens holds the current cache length of every sequence in the batch. Because "
            "sequences have different lengths, it lets one kernel call handle them all without "
            "padding the cache.",
        ]),
        "why": _i([
            "why does flash_attn_with_kvcache need cache_seqlens?", "why not just pad every sequence?",
            "what happens if cache_seqlens is wrong?",
        ], [
            "The cache holds sequences of different lengths, and the kernel must know where each "
            "one ends: cache_seqlens says which slots are real and where to append the new keys "
            "and values. A wrong cache_seqlens makes the model attend to stale slots or overwrite "
            "real ones.",
        ]),
        "how": _i([
            "how does cache_seqlens change during decoding?", "how do I update cache_seqlens?",
            "how is cache_seqlens kept up to date?",
        ], [
            "After prefill cache_seqlens equals the prompt lengths, and each decode step adds one "
            "for every running sequence. With a block table, position cache_seqlens[b] lands in "
            "logical block cache_seqlens[b] // block_size of sequence b.",
            "Set cache_seqlens to the number of tokens already cached before the call; the kernel "
            "writes the new k and v at that offset, so afterwards the true length is cache_seqlens "
            "plus the number of new tokens.",
        ]),
    },
}
