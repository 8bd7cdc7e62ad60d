"""Llama 3 checkpoints in Meta's layout and Hugging Face's: read them, and write them.

    Meta:          params.json + consolidated.00.pth        (keys as in model.py)
    Hugging Face:  config.json + model*.safetensors         (keys renamed, q/k rows permuted)

`read_meta` and `read_hf` return the same thing — `ModelArgs` and a state dict with Meta's
names — so `loading.load_model` builds one `Llama` from either. The embedded default model in
`assets/model/` is stored in the Hugging Face layout, so it takes exactly the path a real
Llama 3 does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from ..model import Llama, ModelArgs

# Hugging Face name -> Meta name, for the parts inside each layer.
_HF_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
}
_HF_TOP_NAMES = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}


# -- the rotary layouts -----------------------------------------------------------------------
# Meta rotates interleaved pairs (x0, x1), (x2, x3)...; Hugging Face rotates the two halves of a
# head (x0, x_{D/2}), ... . Its conversion script reorders the rows of wq and wk to match.
def hf_to_meta_rows(w, n_heads):
    """Undo Hugging Face's q/k row permutation: (n_heads*D, dim) -> same shape, Meta's order."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def meta_to_hf_rows(w, n_heads):
    """Hugging Face's permutation of Meta's q/k rows (the inverse of `hf_to_meta_rows`)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# -- configs ----------------------------------------------------------------------------------
def _llama3_stop_tokens(vocab_size):
    """Llama 3 keeps 256 special tokens after the ranks: end_of_text, eom_id and eot_id stop."""
    first_special = vocab_size - 256
    return [first_special + 1, first_special + 8, first_special + 9] if first_special > 0 else []


def args_from_params(params: dict) -> ModelArgs:
    """Meta's params.json -> ModelArgs."""
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
            "ffn_dim_multiplier", "norm_eps", "rope_theta", "use_scaled_rope", "max_seq_len")
    args = ModelArgs(**{k: params[k] for k in keys if params.get(k) is not None})
    if "rope_scale_factor" in params or "rope_scaling_factor" in params:
        args.rope_scale_factor = params.get("rope_scale_factor", params.get("rope_scaling_factor"))
    args.stop_tokens = params.get("stop_tokens") or _llama3_stop_tokens(args.vocab_size)
    return args


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """Hugging Face's config.json -> ModelArgs (rope settings from `rope_scaling` or the newer
    `rope_parameters`; the scale factor read, never assumed)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    args = ModelArgs(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads"), vocab_size=cfg["vocab_size"],
        hidden_dim=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
        max_seq_len=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
    )
    if rope.get("rope_type", rope.get("type")) == "llama3":
        args.use_scaled_rope = True
        args.rope_scale_factor = rope["factor"]
        args.rope_low_freq_factor = rope.get("low_freq_factor", 1.0)
        args.rope_high_freq_factor = rope.get("high_freq_factor", 4.0)
        args.rope_original_max_len = rope.get("original_max_position_embeddings", 8192)
    elif rope.get("rope_type", rope.get("type")) not in (None, "default"):
        raise CheckpointError(f"config.json asks for rope type {rope.get('rope_type')!r}; "
                              "minipaged implements Llama 3's ('llama3') and plain rotary only")
    if cfg.get("head_dim") not in (None, args.head_dim):
        raise CheckpointError(f"config.json says head_dim {cfg['head_dim']} but hidden_size / "
                              f"num_attention_heads is {args.head_dim}; minipaged needs them equal")
    eos = cfg.get("eos_token_id")
    args.stop_tokens = ([eos] if isinstance(eos, int) else list(eos)) if eos is not None \
        else _llama3_stop_tokens(args.vocab_size)
    return args


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"could not read {path}: {e}") from None


# -- reading the tensors ------------------------------------------------------------------------
def read_meta(folder: Path):
    """(ModelArgs, state dict) of a Meta checkpoint folder."""
    args = args_from_params(_read_json(folder / "params.json"))
    shards = sorted(folder.glob("consolidated.*.pth"))
    if len(shards) != 1:
        raise CheckpointError(
            f"{folder} has {len(shards)} consolidated.*.pth files; minipaged reads single-file "
            "Meta checkpoints (Llama 3.2 1B/3B, 3.1 8B). Use the Hugging Face layout for larger ones.")
    try:  # weights_only: tensors come back, arbitrary pickled objects are refused
        state = torch.load(shards[0], map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"could not read {shards[0]} as a PyTorch checkpoint: {e}") from None
    state.pop("rope.freqs", None)   # older Meta files carry the rotary table; we compute it
    return args, state


def read_hf(folder: Path):
    """(ModelArgs, state dict with Meta's names) of a Hugging Face checkpoint folder."""
    args = args_from_hf_config(_read_json(folder / "config.json"))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    hf = {}
    for name in files:
        if not (folder / name).exists():
            raise CheckpointError(f"{folder} is missing the shard {name} listed in {index.name}")
        try:
            hf.update(load_file(folder / name))
        except Exception as e:
            raise CheckpointError(f"could not read {folder / name} as safetensors: {e}") from None
    state = {}
    for key, w in hf.items():
        parts = key.split(".")
        if key.startswith("model.layers.") and len(parts) >= 5:
            inner = ".".join(parts[3:-1])
            if inner not in _HF_LAYER_NAMES:
                raise CheckpointError(f"unexpected tensor {key!r} in {folder}: not a Llama weight")
            if inner == "self_attn.q_proj":
                w = hf_to_meta_rows(w, args.n_heads)
            elif inner == "self_attn.k_proj":
                w = hf_to_meta_rows(w, args.n_kv_heads)
            state[f"layers.{parts[2]}.{_HF_LAYER_NAMES[inner]}.{parts[-1]}"] = w
        elif ".".join(parts[:-1]) in _HF_TOP_NAMES:
            state[f"{_HF_TOP_NAMES['.'.join(parts[:-1])]}.{parts[-1]}"] = w
        elif not key.endswith("rotary_emb.inv_freq"):
            raise CheckpointError(f"unexpected tensor {key!r} in {folder}: not a Llama weight")
    return args, state


# -- saving (the training script and the tests write checkpoints) ----------------------------------
def save_model(model: Llama, folder, layout: str = "hf", dtype=None) -> Path:
    """Write `model` as a checkpoint folder in Meta's ("meta") or Hugging Face's ("hf") layout."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    a = model.args
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    if a.tie_word_embeddings:
        state.pop("output.weight")
    if layout == "meta":
        params = {"dim": a.dim, "n_layers": a.n_layers, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads,
                  "vocab_size": a.vocab_size, "multiple_of": a.multiple_of,
                  "ffn_dim_multiplier": a.ffn_dim_multiplier, "norm_eps": a.norm_eps,
                  "rope_theta": a.rope_theta, "use_scaled_rope": a.use_scaled_rope,
                  "rope_scale_factor": a.rope_scale_factor, "max_seq_len": a.max_seq_len,
                  "stop_tokens": a.stop_tokens}
        (folder / "params.json").write_text(json.dumps(params, indent=2))
        torch.save(state, folder / "consolidated.00.pth")
        return folder
    if layout != "hf":
        raise ValueError(f"layout must be 'hf' or 'meta', not {layout!r}")
    hf = {}
    inverse_layer = {v: k for k, v in _HF_LAYER_NAMES.items()}
    inverse_top = {v: k for k, v in _HF_TOP_NAMES.items()}
    for key, w in state.items():
        parts = key.split(".")
        if parts[0] == "layers":
            inner = ".".join(parts[2:-1])
            if inner == "attention.wq":
                w = meta_to_hf_rows(w, a.n_heads)
            elif inner == "attention.wk":
                w = meta_to_hf_rows(w, a.n_kv_heads)
            hf[f"model.layers.{parts[1]}.{inverse_layer[inner]}.{parts[-1]}"] = w.contiguous()
        else:
            hf[f"{inverse_top[parts[0]]}.{parts[-1]}"] = w
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": a.dim, "intermediate_size": a.hidden_dim, "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
        "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_seq_len, "tie_word_embeddings": a.tie_word_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "head_dim": a.head_dim, "eos_token_id": a.stop_tokens or None,
        "bos_token_id": a.vocab_size - 256 if a.vocab_size > 256 else None,
        "torch_dtype": str(next(iter(hf.values())).dtype).removeprefix("torch."),
        "rope_scaling": {"rope_type": "llama3", "factor": a.rope_scale_factor,
                         "low_freq_factor": a.rope_low_freq_factor,
                         "high_freq_factor": a.rope_high_freq_factor,
                         "original_max_position_embeddings": a.rope_original_max_len}
        if a.use_scaled_rope else None,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(hf, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
