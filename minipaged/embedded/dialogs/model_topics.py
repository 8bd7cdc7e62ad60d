"""Training-corpus topics: the Llama 3 model: GQA, rotary embeddings, the tokenizer."""

from .phrasing import _i

MODEL_TOPICS = {
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
