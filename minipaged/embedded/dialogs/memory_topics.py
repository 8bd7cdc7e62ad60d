"""Training-corpus topics: the KV cache and its contiguous reservation."""

from .phrasing import _i

KV_CACHE_TOPICS = {
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
}
