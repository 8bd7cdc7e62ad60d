"""The words of the demo model's training corpus: topics, question templates and answers.

`corpus.py` turns these into dialogs. Everything here is plain data, written so that a reader
can check each claim: the numbers come from DESIGN.md's "facts from the field" (the vLLM
paper, flash-attn, Meta's Llama 3 code, the seed articles).

Questions are stored in mid-sentence case ("what is {s}?"); `corpus.py` capitalises them at
the start of a message. `{s}` in a template is filled with one of a topic's `subjects`.
Every answer of a topic contains at least one of that topic's `keywords` (lower-case).
"""

# Definition questions that fit any topic's subject noun phrase.
GENERIC_WHAT = [
    "what is {s}?",
    "what's {s}?",
    "can you explain {s}?",
    "explain {s}.",
    "explain {s} to me.",
    "tell me about {s}.",
    "describe {s}.",
    "what do people mean by {s}?",
    "I keep hearing about {s}. What is it?",
    "give me a short explanation of {s}.",
    "how would you describe {s}?",
    "help me understand {s}.",
    "could you walk me through {s}?",
    "what should I know about {s}?",
    "in a sentence or two, what is {s}?",
    "define {s}.",
    "what is meant by {s}?",
    "can you tell me what {s} is?",
    "I don't really get {s}. Can you explain it?",
    "what's the idea behind {s}?",
    "what exactly is {s}?",
    "do you know what {s} is?",
    "please explain {s} briefly.",
    "summarize {s} for me.",
    "what does {s} refer to?",
    "could you define {s} for me?",
    "I'm reading about {s}. What is it?",
    "{s}: what is it?",
    "so what is {s}, exactly?",
    "what is the gist of {s}?",
]

# Put before a question; those ending in ": " or ", " keep the question in mid-sentence case.
OPENERS = [
    "Hi! ", "Hey, ", "Quick question: ", "Question: ", "I'm new to this. ",
    "Sorry if this is basic, but ", "So, ", "One more thing: ", "I was wondering, ", "Okay, ",
    "Hello. ", "Can I ask something? ", "I'm studying LLM inference. ", "Out of curiosity, ",
    "Here's a question: ", "Help me out: ", "Hey there! ", "Right, ",
]

CLOSERS = [
    " Thanks!", " Keep it short.", " In simple words, please.", " Thanks in advance.",
    " Please be brief.", " I'm a beginner.", " Just the main idea.",
    " One or two sentences is fine.", " Thank you.",
]

# Follow-up questions by intent; the answer comes from the dialog's topic.
FOLLOWUPS = {
    "why": [
        "why does that matter?", "why is that useful?", "why do we need it?",
        "what problem does that solve?", "and why is that important?", "what's the benefit?",
        "why would anyone do that?", "why bother?",
    ],
    "how": [
        "how does that work?", "how does it work in practice?", "how is it done?",
        "and how is that implemented?", "what are the mechanics?", "how does it happen, step by step?",
        "how does that play out at runtime?",
    ],
    "example": [
        "can you give an example?", "example please?", "show me an example.",
        "what would that look like?", "could you make it concrete?", "any concrete numbers?",
        "give me a concrete case.",
    ],
    "more": [
        "tell me more.", "go on.", "can you say more?", "anything else I should know?",
        "what else?", "interesting, tell me more.", "what's the next detail?",
    ],
}

SYSTEM_PROMPTS = [
    "You are minipaged's tiny demo model. Answer briefly.",
    "You are a helpful assistant that explains LLM inference.",
    "Answer in one to three sentences.",
    "You are a concise tutor for KV caches and PagedAttention.",
    "You are a helpful assistant.",
    "Be brief and accurate.",
    "You explain how vLLM manages memory.",
    "You are a friendly teaching assistant for the minipaged repository.",
]


def _i(questions, answers):
    """One intent: the questions that ask for it and the answers that fit all of them."""
    return {"questions": questions, "answers": answers}


TECH_TOPICS = {
    "minipaged": {
        "keywords": ["minipaged"],
        "subjects": ["minipaged", "the minipaged repository", "the minipaged project"],
        "what": _i([
            "what is this project?", "what is the minipaged repo about?",
            "what does minipaged teach?", "what is minipaged for?", "what's in minipaged?",
        ], [
            "minipaged is a small teaching repository that implements vLLM's PagedAttention on a "
            "real Llama 3 in plain Python and PyTorch. Each stage is a module, a lesson and a "
            "notebook: contiguous cache, cache manager, paged attention, fragmentation, "
            "scheduling and sharing.",
            "minipaged is an educational, minimal re-implementation of KV cache paging in the "
            "spirit of nanoGPT: code small enough to read in one sitting and real enough to run "
            "Llama 3 checkpoints.",
            "minipaged teaches how vLLM manages the KV cache, one idea per module, from a "
            "contiguous cache up to block tables, PagedAttention, scheduling and prefix caching.",
        ]),
        "how": _i([
            "how is minipaged organised?", "what are the stages of minipaged?",
            "where should I start reading minipaged?", "how do I use minipaged?",
            "how do I get started with minipaged?", "in what order should I read the modules?",
        ], [
            "Read minipaged in stage order: model.py and kv_cache.py for the contiguous cache, "
            "cache_manager.py for blocks and block tables, then paged_attention.py, "
            "fragmentation.py and scheduler.py, and finally sharing with reference counts, "
            "copy-on-write and prefix caching. Each module has a lesson and a notebook.",
            "Start with python -m minipaged.chat to talk to the embedded model, then open "
            "minipaged's notebooks in order. minipaged.generate(model, prompts, max_new_tokens, "
            "cache='paged') runs the same model on the paged or the contiguous cache.",
        ]),
        "why": _i([
            "why does minipaged exist?", "why was minipaged written?", "who is minipaged for?",
            "why not just read vLLM's source?",
        ], [
            "minipaged exists to teach how vLLM manages the KV cache: production engines are hard "
            "to read, so minipaged keeps each idea in one short module that runs on a CPU and can "
            "be checked token for token against a plain forward pass.",
            "minipaged is for people who want to understand PagedAttention by reading and running "
            "it: vLLM is large and optimised, while minipaged favours clarity over speed.",
        ]),
    },
    "kv_cache": {
        "keywords": ["keys and values"],
        "subjects": ["the KV cache", "a KV cache", "KV caching", "the key-value cache"],
        "what": _i([
            "what does the KV cache store?", "what is kept in the KV cache?",
            "what is KV caching in a transformer?", "what does KV stand for in KV cache?",
            "what lives in the KV cache of a Llama model?", "what is cached in the KV cache?",
        ], [
            "The KV cache stores the keys and values that every attention layer computed for the "
            "tokens seen so far. At each new step the model attends to them instead of "
            "recomputing them from scratch.",
            "It is memory that holds the attention keys and values of earlier tokens, one set per "
            "layer. Decoding then only computes keys and values for the newest token and reads "
            "the rest from the cache.",
            "KV stands for keys and values: the KV cache keeps the key and value vectors of past "
            "tokens for every layer, so each decode step only has to process one new token.",
            "The KV cache is where a transformer keeps the keys and values of the tokens it has "
            "already processed. Reusing them makes each generation step cost one token of work "
            "instead of the whole sequence.",
        ]),
        "why": _i([
            "why do we need a KV cache?", "why does the KV cache exist?",
            "why not recompute everything at each step?", "what problem does the KV cache solve?",
            "why do LLMs cache keys and values?", "what happens without a KV cache?",
            "why is the KV cache important for generation?",
        ], [
            "Without a KV cache, every new token would recompute the keys and values of the whole "
            "sequence, so the work per step would grow with its length. Because causal attention "
            "never changes the keys and values of past tokens, they can be computed once and "
            "reused.",
            "The keys and values of earlier tokens stay the same once computed, because a token "
            "only attends to the tokens before it. Caching them turns each decode step into one "
            "token of work instead of a full pass over the sequence.",
            "The KV cache trades memory for compute: storing keys and values avoids recomputing "
            "them for every past token at every step, which is what makes fast token-by-token "
            "generation possible.",
        ]),
        "how": _i([
            "how does the KV cache work during generation?", "how is the KV cache used at each step?",
            "how does a model read from the KV cache?", "how is the KV cache filled?",
            "how does the KV cache grow?",
        ], [
            "Prefill writes the keys and values of all prompt tokens into the KV cache. Each decode "
            "step then computes keys and values for just the new token, appends them, and attends "
            "over everything stored so far.",
            "At every layer the new token's key and value are written into the KV cache, and its "
            "query attends over all cached keys and values of that sequence. The cache grows by "
            "one token per step until the request ends.",
        ]),
        "more": _i([
            "how big is the KV cache?", "how much memory does the KV cache take?",
            "how much memory does one token use in the KV cache?", "why is the KV cache so large?",
            "how do you compute the size of the KV cache?", "how large does the KV cache get for Llama 3 8B?",
        ], [
            "Each token keeps a key and a value per layer: 2 × n_layers × n_kv_heads × head_dim "
            "numbers. For Llama 3 8B in bf16 that is 2 × 32 × 8 × 128 × 2 bytes = 128 KiB of keys "
            "and values per token, so 8,192 tokens take 1 GiB.",
            "The KV cache grows linearly with the number of tokens, since every token keeps keys "
            "and values in every layer. For Llama 3 8B in bf16 that is 128 KiB per token, about "
            "1 GiB for one 8,192-token sequence.",
        ]),
    },
    "prefill_decode": {
        "keywords": ["prefill", "decode"],
        "subjects": ["prefill", "the prefill phase", "the decode phase", "prefill versus decode",
                     "the difference between prefill and decode"],
        "what": _i([
            "what is the difference between prefill and decode?", "what are prefill and decode?",
            "what does prefill mean in LLM inference?", "what is a decode step?",
            "what are the two phases of generation?", "prefill or decode, what's the difference?",
        ], [
            "Prefill is the first forward pass over the whole prompt: it computes the keys and "
            "values of every prompt token at once, fills the KV cache and produces the first new "
            "token. Decode then generates one token per step, each step attending over the cache.",
            "Generation has two phases. Prefill runs the prompt through the model in one parallel "
            "pass and writes its keys and values into the cache; decode adds one token at a time, "
            "reading the cache at every step.",
            "Prefill handles the prompt, many tokens in one pass; decode handles the answer, one "
            "token per sequence per step. Both write keys and values into the KV cache, but decode "
            "reads far more than it computes.",
        ]),
        "why": _i([
            "why is decode slower per token than prefill?", "why are prefill and decode treated differently?",
            "why is decoding memory-bound?", "why is prefill compute-bound?",
            "why does the first token take longer than the rest?", "why batch many sequences in decode?",
        ], [
            "Prefill does big matrix multiplications over many tokens at once, so it is limited by "
            "compute. Decode handles one token per sequence per step and must read all the weights "
            "and the whole KV cache for it, so it is limited by memory bandwidth.",
            "Each decode step reads every weight and the cached keys and values to produce one "
            "token per sequence, so batching many sequences in decode spreads that read over more "
            "tokens. Prefill already has many tokens per pass, so it keeps the compute units busy.",
            "The first token waits for prefill over the whole prompt, a large compute-bound pass; "
            "after that, each decode step is a small memory-bound pass for a single new token.",
        ]),
        "how": _i([
            "how does prefill fill the cache?", "how does a decode step work?",
            "what happens in a decode step?", "what happens during prefill?",
            "walk me through one decode step.",
        ], [
            "During prefill the model runs on all prompt tokens with a causal mask, writes their "
            "keys and values into the cache and samples the first token from the last position. "
            "Each decode step feeds that one token back in, appends its key and value, attends "
            "over the cache and samples the next.",
            "A decode step takes the last token of each running sequence, computes its query, key "
            "and value in every layer, writes the key and value at the sequence's current length, "
            "and attends over the cache to predict the next token. Prefill does the same for the "
            "whole prompt at once.",
        ]),
        "example": _i([
            "can you give an example of prefill and decode?", "show me prefill and decode with numbers.",
            "what happens with a 100-token prompt?",
        ], [
            "With a 100-token prompt, prefill is one pass over all 100 tokens that fills 100 cache "
            "slots per layer and yields the first new token. Then each decode step feeds the newest "
            "token back in, adds its key and value to the cache and produces the next one.",
        ]),
    },
    "contiguous_cache": {
        "keywords": ["contiguous"],
        "subjects": ["a contiguous KV cache", "the contiguous cache", "a contiguous cache",
                     "the naive contiguous KV cache"],
        "what": _i([
            "what is a (batch, max_seq_len) cache?", "what does stage 1 of minipaged use as its cache?",
            "how does a naive server store the KV cache?", "what is the naive way to allocate the KV cache?",
        ], [
            "A contiguous KV cache reserves one (batch, max_seq_len) buffer per layer up front, so "
            "each request owns a full row of max_seq_len slots whether it uses them or not. It is "
            "simple, but most of that memory sits unused.",
            "It is the naive layout: every sequence gets a contiguous slab of cache sized for the "
            "longest possible sequence, 8,192 tokens for Llama 3. Stage 1 of minipaged uses it as "
            "the baseline that paging improves on.",
            "The contiguous cache allocates, for each request, one continuous region for "
            "max_seq_len tokens before generation starts, because the output length is unknown. "
            "Tokens are then written in order into that reserved row.",
        ]),
        "why": _i([
            "why is a contiguous cache wasteful?", "what is wrong with a contiguous KV cache?",
            "why reserve max_seq_len slots per request?", "why do naive servers reserve the whole context up front?",
            "why does the contiguous cache limit the batch size?",
        ], [
            "The server cannot know how long an answer will be, so a contiguous cache reserves "
            "max_seq_len slots per request to be safe. A request that ends at 792 tokens in an "
            "8,192-slot reservation leaves 7,400 slots, about 90%, reserved but never used.",
            "Reserving the maximum length for every request in a contiguous cache means most of "
            "that memory holds nothing and cannot be lent to other requests. Fewer requests fit at "
            "once, so the batch size and the throughput drop.",
        ]),
        "example": _i([
            "how much memory does a contiguous cache waste?", "can you give a number for the waste of a contiguous cache?",
            "what is the 792 out of 8,192 example?", "how much of an 8,192-token reservation does a short request use?",
            "what share of a contiguous reservation is wasted by a 792-token request?",
        ], [
            "Take Llama 3 with max_seq_len 8,192: a request that ends at 792 tokens uses 792 slots "
            "of its contiguous reservation and wastes 7,400, that is 7,400 / 8,192 ≈ 90%.",
            "If a 792-token request sits in an 8,192-slot contiguous reservation, only about 10% of "
            "that memory holds keys and values; roughly 90% is reserved for tokens that never come.",
            "The vLLM paper measured that systems with contiguous max-length reservations keep "
            "token states in only 20.4% to 38.2% of KV memory; a 792-token request wasting about "
            "90% of its 8,192-slot slab shows why.",
        ]),
    },
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
    "gqa": {
        "keywords": ["query heads", "kv heads", "grouped-query"],
        "subjects": ["grouped-query attention", "GQA", "grouped query attention", "n_kv_heads"],
        "what": _i([
            "what does n_kv_heads mean?", "what is GQA in Llama 3?",
            "why does Llama 3 have fewer KV heads than query heads?",
        ], [
            "Grouped-query attention lets several query heads share one key/value head. Llama 3 8B "
            "has 32 query heads and 8 KV heads, so each group of 4 query heads reads the same keys "
            "and values.",
            "GQA sits between multi-head attention, with one KV head per query head, and "
            "multi-query attention, with a single KV head for all query heads. The model stores "
            "only n_kv_heads keys and values per token and layer.",
        ]),
        "why": _i([
            "why does GQA shrink the KV cache?", "why use grouped-query attention?",
            "what does GQA save?",
        ], [
            "The KV cache stores keys and values only for the KV heads, so Llama 3 8B with 8 KV "
            "heads instead of 32 needs a cache 4 times smaller than full multi-head attention, with "
            "little loss in quality.",
            "Decoding is limited by reading the KV cache, and grouped-query attention makes that "
            "cache n_heads / n_kv_heads times smaller, 4 times for Llama 3 8B, so more sequences "
            "fit and each step reads less.",
        ]),
        "how": _i([
            "how is grouped-query attention computed?", "how do query heads share KV heads?",
            "how does attention handle n_kv_heads smaller than n_heads?",
        ], [
            "Each KV head serves n_heads / n_kv_heads query heads: query head h uses KV head "
            "h // (n_heads / n_kv_heads). The cache keeps the shape (..., n_kv_heads, head_dim), "
            "and the keys and values are repeated or indexed per group at attention time.",
        ]),
    },
    "rope": {
        "keywords": ["rotary", "rope", "rotate"],
        "subjects": ["rotary embeddings", "RoPE", "rotary position embeddings",
                     "rotary positional encoding"],
        "what": _i([
            "how does Llama know the order of tokens?", "what is RoPE in Llama 3?",
            "what are rotary embeddings used for?",
        ], [
            "Rotary position embeddings (RoPE) encode a token's position by rotating pairs of "
            "dimensions of its query and key by angles proportional to the position. The dot "
            "product of a query and a key then depends on their relative distance.",
            "RoPE is how Llama models know token order: instead of adding a position vector, they "
            "rotate q and k in every attention layer by position-dependent angles, with "
            "frequencies set by rope_theta, 500,000 in Llama 3.",
        ]),
        "how": _i([
            "how does RoPE interact with the KV cache?", "are keys in the KV cache already rotated?",
            "does the KV cache store rotated keys?", "when is RoPE applied during decoding?",
        ], [
            "Keys are rotated before they are written, so the cache stores keys that already carry "
            "their positions and never changes them. Each new token's query and key are rotated at "
            "its own position, which is why the cache must track each sequence's length.",
            "RoPE is applied to k before it enters the KV cache, so cached keys stay valid; after "
            "recompute or swap-in nothing needs rotating again, as long as tokens keep their "
            "positions.",
        ]),
        "more": _i([
            "what is RoPE scaling in Llama 3.1?", "how does Llama 3.1 extend the context?",
            "what are low_freq_factor and high_freq_factor?",
        ], [
            "Llama 3.1 rescales RoPE frequencies to stretch its context from 8,192 to 128K tokens, "
            "with low_freq_factor 1, high_freq_factor 4 and original context 8,192. The factor is "
            "8 in Meta's code and 32 in Hugging Face's Llama 3.2 config, so read it from the "
            "checkpoint.",
        ]),
        "theta": _i([
            "what is rope_theta?", "what rope_theta does Llama 3 use?", "what sets the RoPE frequencies?",
        ], [
            "rope_theta is the base of RoPE's rotation frequencies; Llama 3 uses 500,000, far more "
            "than the original 10,000, so the slowest rotations stay distinct over long contexts.",
        ]),
        "layout": _i([
            "what is the difference between Meta's and Hugging Face's RoPE?",
            "why are q_proj and k_proj permuted in Hugging Face checkpoints?",
            "is RoPE interleaved or rotate-half in Llama?",
        ], [
            "Meta's code rotates interleaved pairs of dimensions, while Hugging Face's rotates the "
            "two halves of each head; that is why converted q_proj and k_proj weights have their "
            "rows permuted.",
        ]),
    },
    "llama3": {
        "keywords": ["llama 3", "llama"],
        "subjects": ["Llama 3", "the Llama 3 architecture", "Meta's Llama 3", "a Llama 3 model"],
        "what": _i([
            "what kind of model is Llama 3?", "what architecture does Llama 3 use?",
            "what is special about Llama 3?", "what are the main features of Llama 3?",
        ], [
            "Llama 3 is Meta's family of open-weight decoder-only transformers, released in 2024 in "
            "8B and 70B sizes, followed by Llama 3.1 (up to 405B) and 3.2 (including 1B and 3B). It "
            "uses RMSNorm, SwiGLU feed-forward layers, rotary embeddings and grouped-query attention.",
            "Llama 3 is the architecture minipaged runs: token embeddings, then layers of RMSNorm, "
            "attention with RoPE and grouped-query attention, and a SwiGLU feed-forward, then a "
            "final norm and the output layer. Its tokenizer has 128,256 tokens.",
            "Meta's Llama 3 models are transformers with an 8,192-token context, a 128,256-token "
            "vocabulary and grouped-query attention; Llama 3 8B has 32 layers, 32 query heads, 8 KV "
            "heads and head_dim 128.",
        ]),
        "how": _i([
            "how does a Llama 3 layer work?", "what is inside a Llama 3 block?",
            "what does one transformer layer of Llama 3 do?",
        ], [
            "Each Llama 3 layer computes x = x + attention(RMSNorm(x)) and then "
            "x = x + feed_forward(RMSNorm(x)). Attention applies RoPE to q and k and reads keys "
            "and values through the cache; the feed-forward is SwiGLU, w2(silu(w1(x)) × w3(x)).",
        ]),
        "more": _i([
            "which Llama 3 models can minipaged load?", "can minipaged run a real Llama 3?",
            "what checkpoints does minipaged support?",
        ], [
            "minipaged loads real Llama 3 checkpoints from a local path, in Meta's format "
            "(params.json and consolidated.*.pth) or Hugging Face's (config.json and safetensors), "
            "for example Llama 3.2 1B or 3B or Llama 3.1 8B. Without a path it uses its tiny "
            "embedded Llama 3 style demo model.",
        ]),
    },
    "tokenizer": {
        "keywords": ["tokenizer", "tiktoken", "bpe"],
        "subjects": ["the Llama 3 tokenizer", "the tokenizer", "the tiktoken tokenizer"],
        "what": _i([
            "how does Llama 3 turn text into tokens?", "how many tokens are in Llama 3's vocabulary?",
            "what tokenizer does Llama 3 use?",
        ], [
            "Llama 3's tokenizer is a byte-level BPE tokenizer in tiktoken's format with 128,000 "
            "regular tokens plus 256 special tokens, 128,256 in total. minipaged reads the same "
            "tokenizer.model file format as Meta's checkpoints.",
            "The tokenizer turns text into token ids with byte-pair encoding (BPE): a regex splits "
            "the text into pieces and tiktoken merges bytes by rank. Llama 3's vocabulary has "
            "128,256 entries, including special tokens such as begin_of_text and eot_id.",
        ]),
        "how": _i([
            "how does the Llama 3 chat format work?", "how is a chat turned into tokens?",
            "how are chat messages encoded for Llama 3?",
        ], [
            "In the Llama 3 tokenizer's chat format a message is a header (start_header_id, the "
            "role, end_header_id), two newlines, the stripped content and an eot_id token; a "
            "prompt starts with begin_of_text and ends with an open assistant header.",
            "In the Llama 3 tokenizer's chat format a message is a header (start_header_id, the "
            "role, end_header_id), two newlines, the stripped content and an eot_id token; the "
            "model's reply is generated after an open assistant header.",
        ]),
        "more": _i([
            "what is eot_id?", "what are the special tokens of Llama 3?", "when does generation stop?",
        ], [
            "The tokenizer's special tokens sit after the 128,000 BPE ranks: 128000 begin_of_text, "
            "128001 end_of_text, 128006 start_header_id, 128007 end_header_id and 128009 eot_id, "
            "which ends each chat message. Generation stops at end_of_text or eot_id.",
        ]),
    },
}

# Small talk: whole questions, no subjects, no openers.
CHAT_TOPICS = {
    "greeting": {
        "keywords": ["hello"],
        "hi": _i([
            "Hi!", "Hello!", "Hey!", "Hi there.", "Hello there!", "Good morning!", "Good afternoon!",
            "Good evening!", "Hey there!", "Hiya!", "Greetings!", "Howdy!", "Hi minipaged!",
            "Hello, anyone there?", "Morning!", "Hey hey!", "Hello hello.", "Hi, nice to meet you.",
        ], [
            "Hello! I'm minipaged's tiny demo model. Ask me about KV caches, block tables or "
            "PagedAttention.",
            "Hello! I can explain how an LLM's KV cache is managed: blocks, block tables, paging and "
            "scheduling. What would you like to know?",
            "Hello there! I'm a tiny Llama 3 style model that knows a little about KV caches and "
            "vLLM. Ask me anything about those.",
        ]),
        "how_are_you": _i([
            "Hi, how are you?", "Hello, how are you doing?", "Hey, how's it going?",
            "How are you today?", "Hi! How are things?", "Hello, how are you?",
        ], [
            "Hello! I'm fine, thank you. Ask me something about the KV cache or PagedAttention.",
            "Hello, I'm doing well! I'm ready to explain prefill, decode, block tables and more.",
        ]),
    },
    "thanks": {
        "keywords": ["welcome", "glad"],
        "thanks": _i([
            "Thanks!", "Thank you!", "Thanks a lot.", "Thank you, that helps.", "Great, thanks!",
            "Thanks, that was clear.", "Cool, thank you.", "Much appreciated!",
            "Thanks for the explanation.", "That makes sense, thanks!", "Perfect, thank you!",
            "Awesome, thanks.", "Ok, thanks.", "Thank you so much!", "Nice, thanks for explaining.",
            "Got it, thanks.",
        ], [
            "You're welcome! Ask me anything else about KV caches or PagedAttention.",
            "You're welcome, glad it helped.",
            "Glad I could help! Feel free to ask about block tables, scheduling or prefix caching "
            "next.",
            "You're welcome! Happy paging.",
        ]),
    },
    "goodbye": {
        "keywords": ["bye"],
        "bye": _i([
            "Bye!", "Goodbye.", "See you later!", "That's all for now, bye.", "Bye, thanks!",
            "I have to go now. Bye!", "Talk to you later.", "See you!", "Good night!",
            "Catch you later.", "Have a nice day, bye.", "I'm done for today.",
        ], [
            "Goodbye! Come back any time with questions about the KV cache.",
            "Bye! Good luck with your inference engine.",
            "Goodbye, and happy reading through minipaged.",
            "See you! Bye for now.",
        ]),
    },
    "identity": {
        "keywords": ["minipaged", "demo model"],
        "who": _i([
            "Who are you?", "What are you?", "Are you ChatGPT?", "What model are you?",
            "Introduce yourself.", "Tell me about yourself.", "What is your name?",
            "Are you a real Llama 3?", "Who made you?", "Are you a large language model?",
            "How big are you?", "Are you human?", "How were you trained?", "Are you an AI?",
        ], [
            "I am minipaged's tiny demo model: a Llama 3 architecture network with a few million "
            "parameters, trained by the repository on a small generated corpus. I can answer short "
            "questions about KV caches and PagedAttention.",
            "I'm minipaged's tiny demo model, not a real Llama 3 checkpoint: the same architecture, "
            "but only a few million parameters trained for a few minutes on a CPU.",
            "I am minipaged's tiny demo model. I was trained on generated questions and answers "
            "about the KV cache, paging and scheduling, so that is all I know.",
        ]),
        "can": _i([
            "What can you do?", "What do you know about?", "What can I ask you?", "Can you help me?",
            "What topics do you know?", "What are you good at?", "How can you help?",
        ], [
            "I am minipaged's tiny demo model, so I can explain KV cache ideas: prefill and decode, "
            "blocks and block tables, fragmentation, PagedAttention, scheduling, preemption and "
            "prefix caching.",
            "Ask me how LLM inference manages memory: the KV cache, block tables, PagedAttention, "
            "vLLM, continuous batching or copy-on-write. I'm minipaged's tiny demo model, so keep "
            "questions short.",
        ]),
    },
    "out_of_scope": {
        "keywords": ["only know"],
        "other": _i([
            "What's the weather like today?", "What is the capital of France?",
            "Can you write me a poem?", "Tell me a joke.", "Who won the football game yesterday?",
            "What is 17 times 23?", "Can you translate this into German?",
            "What's a good recipe for pasta?", "Who is the president of the United States?",
            "Write a Python function to sort a list.", "What is the meaning of life?",
            "Recommend a good movie.", "How do I fix my bicycle?", "What time is it?",
            "What's the best programming language?", "Can you summarize the news?",
            "How tall is Mount Everest?", "What should I eat for dinner?", "Explain quantum physics.",
            "Can you help me with my taxes?", "What is the speed of light?",
            "Write an essay about history.", "Who painted the Mona Lisa?", "How do I learn to swim?",
            "What is photosynthesis?", "Tell me a story about a dragon.",
            "How many planets are in the solar system?", "What's the stock price of Apple?",
            "Can you book a flight for me?", "What is love?", "What is the tallest building?",
            "How do I bake bread?",
        ], [
            "Sorry, I'm a tiny demo model and I only know about KV caches, PagedAttention and "
            "Llama 3 inference. Try asking me what a block table is.",
            "I can't help with that: I only know about how LLM inference manages the KV cache. Ask "
            "me about prefill and decode or paged attention instead.",
            "That is outside what I learned. I only know about KV caches, blocks, scheduling and "
            "vLLM, so ask me something about those.",
        ]),
    },
}
