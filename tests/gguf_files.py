"""Small GGUF files for the tests, written with ggml's own GGUFWriter the way llama.cpp's
converter lays out a Llama: llama.cpp's tensor names, Meta's (interleaved) q/k row order."""

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# Meta's name inside a layer -> llama.cpp's (convert_hf_to_gguf / gguf.constants spelling).
LLAMA_CPP_LAYER = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
                   "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate",
                   "feed_forward.w2": "ffn_down", "feed_forward.w3": "ffn_up",
                   "attention_norm": "attn_norm", "ffn_norm": "ffn_norm"}
LLAMA_CPP_TOP = {"tok_embeddings": "token_embd", "norm": "output_norm", "output": "output"}


def llama_cpp_name(meta_name):
    parts = meta_name.split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{LLAMA_CPP_LAYER['.'.join(parts[2:-1])]}.{parts[-1]}"
    return f"{LLAMA_CPP_TOP[parts[0]]}.{parts[-1]}"


def add_tensor(writer, name, values, qtype=Q.F32):
    """Store a float array as `qtype`, quantized by gguf's own quantizer."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == Q.F32:
        writer.add_tensor(name, values)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


def write_llama(path, model, qtype=Q.F32, arch="llama", rope_freqs=None, tokenizer=None,
                kv=None):
    """Write `model` (a minipaged Llama) as a GGUF file. Norms stay F32, as llama.cpp keeps
    them; `kv` adds or overrides metadata ({key: (value, GGUFValueType)})."""
    a = model.args
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(a.n_layers)
    w.add_context_length(a.max_seq_len)
    w.add_embedding_length(a.dim)
    w.add_feed_forward_length(a.hidden_dim)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.norm_eps)
    w.add_rope_dimension_count(a.head_dim)
    w.add_vocab_size(a.vocab_size)
    for key, (value, vtype) in (kv or {}).items():
        w.add_key_value(key, value, vtype)
    for key, value in (tokenizer or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for name, t in model.state_dict().items():
        if name == "output.weight" and a.tie_word_embeddings:
            continue
        add_tensor(w, llama_cpp_name(name), t.float().numpy(), qtype if t.dim() == 2 else Q.F32)
    if rope_freqs is not None:
        add_tensor(w, "rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tensors(path, tensors):
    """A GGUF file holding only raw tensors: {name: (uint8 or float array, qtype)}."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        if qtype == Q.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
