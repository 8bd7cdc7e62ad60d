"""Training-corpus topics: blocks, block tables, the free pool and fragmentation."""

from .phrasing import _i

BLOCK_TOPICS = {
    "blocks": {
        "keywords": ["block size", "block_size"],
        "subjects": ["a KV block", "a block", "a cache block", "the block size", "block_size"],
        "what": _i([
            "what is a block in PagedAttention?", "what is a block in the KV cache?",
            "what does block size mean?", "what is a block of the paged cache?",
            "what is inside one KV block?",
        ], [
            "A block is a fixed-size chunk of the KV cache that holds the keys and values of "
            "block_size consecutive tokens of one sequence, in one layer. The block size is the "
            "same for the whole pool, 16 tokens by default in vLLM.",
            "Paging cuts the KV cache into equal blocks, each with room for block_size tokens. A "
            "sequence takes one block at a time as it grows, so it never holds more than one "
            "partly filled block.",
            "The block size is the number of tokens one block of the KV cache holds. vLLM's "
            "default is 16; flash-attn 2's paged kernel needs a multiple of 256, so minipaged's "
            "CUDA path uses 256 while its PyTorch path accepts any block size.",
        ]),
        "why": _i([
            "how do I choose the block size?", "why not use a block size of 1?",
            "is a bigger block size better?", "what is the trade-off in the block size?",
            "why does the block size matter?", "which block size is best?",
        ], [
            "Small blocks waste less, since at most block_size − 1 slots of a sequence's last block "
            "sit empty, but they make block tables longer and memory reads less efficient. Large "
            "blocks read faster but waste more in the last block.",
            "The vLLM paper found block sizes from 16 to 128 work best on ShareGPT traffic and "
            "chose 16 as the default. A block size of 1 would waste nothing but make the block "
            "table as long as the sequence and the attention reads scattered.",
        ]),
        "how": _i([
            "how many blocks does a sequence need?", "how do tokens map to blocks?",
            "which block holds token number p?", "how do you find the block of a token?",
            "when does a sequence get a new block?",
        ], [
            "A sequence of n tokens needs ceil(n / block_size) blocks. Token position p lives in "
            "logical block p // block_size, at offset p % block_size inside it.",
            "With a block size of 16, tokens 0 to 15 go to the first block, 16 to 31 to the second, "
            "and so on: position p is in block p // 16 at slot p % 16. A new block is taken only "
            "when the last one is full.",
        ]),
        "example": _i([
            "can you give an example of how blocks are used?", "show me blocks with real numbers.",
            "how many blocks does a 792-token request need?", "what does block size 16 mean for a 792-token request?",
        ], [
            "With a block size of 16, a 792-token request needs ceil(792 / 16) = 50 blocks: 49 "
            "full ones and a last block holding 8 tokens, so only 8 slots are wasted.",
            "A 792-token request fills 50 blocks at block size 16, with 8 empty slots in the last "
            "one; at block size 256 it takes 4 blocks and leaves 232 slots of the last one empty.",
        ]),
    },
    "block_table": {
        "keywords": ["block table", "block_table"],
        "subjects": ["a block table", "the block table", "block_table", "a sequence's block table"],
        "what": _i([
            "what does a block table map?", "what is a block table in vLLM?",
            "what is the block table for?", "what is stored in a block table?",
            "what maps logical blocks to physical blocks?",
        ], [
            "A block table maps each sequence's logical blocks to the physical blocks where its "
            "keys and values actually live. Entry i of a sequence's block table is the physical "
            "block that holds its tokens i × block_size to (i + 1) × block_size − 1.",
            "It is the page table of the KV cache: for every sequence, a list of physical block ids "
            "in logical order. The attention kernel follows the block table to gather the "
            "sequence's keys and values from scattered blocks.",
            "The block table records, per sequence, which physical block holds each logical block. "
            "Logical blocks are contiguous from the sequence's point of view; the physical blocks "
            "can be anywhere in the pool.",
        ]),
        "example": _i([
            "can you show an example of a block table?", "what does a block table look like?",
            "what does {0: [7, 1, 3], 1: [5, 2]} mean?", "give me a concrete block table.",
            "explain the block table {0: [7, 1, 3], 1: [5, 2]}.",
        ], [
            "Take the block table {0: [7, 1, 3], 1: [5, 2]}: sequence 0's logical blocks 0, 1 and 2 "
            "are stored in physical blocks 7, 1 and 3, and sequence 1's logical blocks 0 and 1 in "
            "physical blocks 5 and 2. The physical blocks need not be adjacent or in order.",
            "In the block table {0: [7, 1, 3], 1: [5, 2]}, sequence 0 has three blocks and sequence "
            "1 has two. With block size 4, token 9 of sequence 0 is in its logical block 2, which "
            "is physical block 3, at offset 1.",
        ]),
        "how": _i([
            "how does the kernel use the block table?", "how is a block table passed to flash-attn?",
            "how does the block table grow?", "how do you look up a token through the block table?",
            "how is the block table updated?",
        ], [
            "To read token p, the kernel takes logical block p // block_size, looks up its physical "
            "block in the block table, and reads slot p % block_size there. flash-attn receives "
            "the tables as an int32 block_table tensor of shape (batch, max_blocks).",
            "When a sequence fills its last block, the cache manager takes a free physical block "
            "and appends its id to that sequence's block table. When the sequence ends, every "
            "block in its block table goes back to the free pool.",
        ]),
        "more": _i([
            "does each layer have its own block table?", "is there one block table per layer?",
            "why does minipaged keep a block table per layer?", "do all layers share one block table?",
        ], [
            "minipaged keeps a block table per layer, one CacheManager per layer, like its seed "
            "code and the vLLM paper's implementation. vLLM v1 and nano-vllm share one block table "
            "across all layers, which saves bookkeeping because every layer uses the same block ids.",
            "In minipaged each layer's CacheManager holds its own block table per sequence, and the "
            "bookkeeping is vectorised so a step costs one tensor operation, not a loop per layer. "
            "Newer engines such as vLLM v1 use one block table per sequence for all layers.",
        ]),
    },
    "free_pool": {
        "keywords": ["free pool", "free set", "free block", "free-block"],
        "subjects": ["the free-block pool", "the pool of free blocks", "the free block set",
                     "the free list of blocks"],
        "what": _i([
            "where do new blocks come from?", "what happens to blocks that no one uses?",
            "what does the cache manager allocate from?", "what holds the unused blocks?",
        ], [
            "The free-block pool is the set of physical blocks no sequence is using. The cache "
            "manager takes blocks from it when a sequence needs room for more tokens and puts them "
            "back when the sequence finishes.",
            "All KV memory is allocated once as num_blocks physical blocks; the ones not in any "
            "block table form the free pool. Allocation picks a free block, and freeing a sequence "
            "returns all of its blocks.",
            "It is the allocator's stock of unused blocks. minipaged keeps the free blocks in a set "
            "and picks one at random, like its seed code, with random.Random(seed) so runs are "
            "reproducible.",
        ]),
        "how": _i([
            "how are blocks allocated from the pool?", "how does the cache manager hand out blocks?",
            "what happens when a sequence finishes?", "how are blocks freed?",
            "how does allocation work in the cache manager?",
        ], [
            "When a sequence's last block is full, the cache manager removes one block from the "
            "free set and appends it to the sequence's block table. Allocation either fully "
            "succeeds or raises without changing anything, and free returns every block of the "
            "sequence.",
            "Freeing a finished sequence puts all its physical blocks back into the free pool at "
            "once, so any other request can reuse them right away.",
        ]),
        "more": _i([
            "what happens when the pool runs out of free blocks?", "what if there are no free blocks left?",
            "what happens when the KV cache is full?", "what is OutOfBlocksError?",
        ], [
            "If no free block is left, minipaged's cache manager raises OutOfBlocksError with a "
            "sentence saying the pool is too small. With the stage 5 scheduler, a running request "
            "is preempted instead, by swap or recompute, to free its blocks.",
            "When the free pool is empty a new block cannot be allocated and the cache manager "
            "raises OutOfBlocksError. The scheduler avoids that by admitting fewer requests and "
            "preempting one when the pool runs dry.",
        ]),
        "why": _i([
            "why pick free blocks at random?", "does the order of free blocks matter?",
            "why use a random free set?",
        ], [
            "Any free block is as good as any other, because the block table hides where blocks "
            "physically are. minipaged picks at random, as its seed code did, to show that "
            "scattered blocks work; vLLM v1 keeps free blocks in a queue and evicts the least "
            "recently freed cached block first, which helps prefix caching.",
        ]),
    },
    "slot_mapping": {
        "keywords": ["slot_mapping", "slot"],
        "subjects": ["slot_mapping", "the slot mapping", "a slot mapping"],
        "what": _i([
            "what does slot_mapping contain?", "what is a slot in the paged KV cache?",
            "where is a new token's key written?",
        ], [
            "slot_mapping gives, for each new token, the flat cache slot where its key and value "
            "are written: physical_block × block_size + offset. vLLM computes it from the block "
            "table so prefill can scatter a whole prompt's keys and values in one write.",
            "A slot mapping is the per-token version of the block table: the slot of position p is "
            "block_table[p // block_size] × block_size + p % block_size. It tells the cache write "
            "exactly where each new key and value go.",
        ]),
        "how": _i([
            "how is the slot mapping computed?", "how do you compute the slot of a token?",
            "how does vLLM write keys and values into the cache?", "how is the slot of position 9 found?",
        ], [
            "Take the token's position p, find its physical block in the block table at index "
            "p // block_size, and add the offset: slot = physical_block × block_size + p % "
            "block_size. With block table [7, 1, 3] and block size 4, position 9 goes to slot "
            "3 × 4 + 1 = 13.",
            "vLLM writes new keys and values into the cache with a kernel driven by slot_mapping, "
            "then attention reads them back through the block table: one map for writing, one for "
            "reading.",
        ]),
        "why": _i([
            "why is a slot mapping needed?", "why not write keys by position?",
            "why compute slot_mapping at all?",
        ], [
            "A sequence's tokens are scattered over physical blocks, so a position alone does not "
            "say where its key and value go. slot_mapping turns positions into flat slot indices "
            "once per step, so writing into the cache is a single scatter.",
        ]),
    },
    "internal_fragmentation": {
        "keywords": ["internal fragmentation"],
        "subjects": ["internal fragmentation", "internal memory fragmentation"],
        "what": _i([
            "what is fragmentation inside an allocation?", "what does internal mean in internal fragmentation?",
            "what kind of fragmentation does a paged cache still have?",
        ], [
            "Internal fragmentation is memory allocated to a request that the request never uses. "
            "In a contiguous cache it is the part of the max_seq_len reservation beyond the "
            "request's final length; in a paged cache it is only the empty slots of each "
            "sequence's last block.",
            "It is waste inside an allocation: slots a request owns but never fills. With paging, "
            "internal fragmentation is at most block_size − 1 slots per sequence, because only the "
            "last block can be partly empty.",
            "Internal fragmentation means space reserved for a request that it will never use. The "
            "vLLM paper measured 57.3% of KV memory lost to internal fragmentation in Orca (Max), "
            "which reserves the maximum length per request.",
        ]),
        "why": _i([
            "how does paging reduce internal fragmentation?", "why does paging have less internal fragmentation?",
            "how much internal fragmentation does a paged cache have?",
            "does the block size affect internal fragmentation?",
        ], [
            "Paging allocates a block only when a sequence needs it, so the only unused slots are "
            "in the last, partly filled block: at most block_size − 1 per sequence. A smaller block "
            "size shrinks internal fragmentation further.",
            "In a paged cache internal fragmentation is bounded by one block per sequence, at most "
            "15 slots with block size 16, instead of everything between the final length and "
            "max_seq_len.",
        ]),
        "example": _i([
            "give an example of internal fragmentation.", "can you show internal fragmentation with numbers?",
            "how much internal fragmentation does a 792-token request cause?",
        ], [
            "A request that ends at 792 tokens in an 8,192-slot contiguous reservation has 7,400 "
            "slots of internal fragmentation. With blocks of 16 it uses 50 blocks, and internal "
            "fragmentation is just the 8 empty slots of the last block.",
        ]),
    },
    "external_fragmentation": {
        "keywords": ["external fragmentation"],
        "subjects": ["external fragmentation", "external memory fragmentation"],
        "what": _i([
            "what is fragmentation between allocations?", "what does external mean in external fragmentation?",
            "why can free memory be unusable?",
        ], [
            "External fragmentation is free memory that cannot be used because it is split into "
            "gaps between allocations, each too small for a new request. Contiguous caches suffer "
            "from it when requests of different sizes come and go.",
            "It is waste between allocations: enough free memory in total, but not in one piece of "
            "the needed size. The vLLM paper counted 41.6% of KV memory as external fragmentation "
            "and other losses in Orca (Pow2).",
        ]),
        "why": _i([
            "why does paging remove external fragmentation?", "does a paged cache have external fragmentation?",
            "how does PagedAttention avoid external fragmentation?",
        ], [
            "All blocks have the same size and any free block can serve any sequence, because the "
            "block table can point anywhere. Free memory is never too scattered to use, so a paged "
            "cache has no external fragmentation.",
            "With paging a request needs no contiguous region, only enough free blocks anywhere in "
            "the pool, so external fragmentation disappears; what remains is at most one partly "
            "filled block per sequence.",
        ]),
        "example": _i([
            "give an example of external fragmentation.", "show me external fragmentation in a contiguous cache.",
            "can you show external fragmentation with numbers?",
        ], [
            "Suppose 1,000 slots are free, but as gaps of 300, 400 and 300 slots left by finished "
            "requests. A new request that needs a 512-slot contiguous region cannot start although "
            "memory is free: that is external fragmentation.",
        ]),
    },
    "reservation": {
        "keywords": ["reservation", "reserved"],
        "subjects": ["reservation", "reserved slots", "memory reservation", "reservation in the KV cache"],
        "what": _i([
            "what are reserved slots in the KV cache?", "what does reservation mean in the vLLM paper?",
            "what is reserved memory in a KV cache?",
        ], [
            "Reservation is memory set aside for tokens a request will generate later: it will be "
            "used, just not yet. In the vLLM paper it is counted apart from internal "
            "fragmentation, which is reserved memory that will never be used.",
            "Reserved slots hold nothing now but belong to a request that will fill them as it "
            "decodes. A contiguous cache reserves a whole max_seq_len row at the start, so reserved "
            "memory sits idle for most of the request's lifetime.",
            "In the vLLM paper, reservation took 13.3% of KV memory in Orca (Max), 17.9% in Orca "
            "(Pow2) and 25.2% in Orca (Oracle): memory held for future tokens that other requests "
            "could have used.",
        ]),
        "why": _i([
            "how does paging avoid reservation?", "does a paged cache reserve memory?",
            "why is reservation wasteful if the slots are used later?",
        ], [
            "A paged cache makes no reservation ahead: a sequence gets a new block only when its "
            "last block is full. Reserved memory in a contiguous cache is wasteful because, while "
            "it waits for future tokens, it could hold other requests' keys and values.",
            "Paging allocates blocks on demand, so reservation shrinks to the unused part of the "
            "last block. That is why vLLM keeps 96.3% of KV memory for token states, against 20.4% "
            "to 38.2% for Orca's reserved layouts.",
        ]),
    },
}
