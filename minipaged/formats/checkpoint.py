"""Llama 3 checkpoints in Meta's layout and Hugging Face's: read them, and write them.

    Meta:          params.json + consolidated.00.pth        (keys as in model.py)
    Hugging Face:  config.json + model*.safetensors         (keys renamed, q/k rows permuted)

`read_meta` and `read_hf` return the same thing — `ModelArgs` and a state dict with Meta's
names — so `loading.load_model` builds one `Llama` from either. The embedded default model in
`minipaged/embedded/model/` is stored in the Hugging Face layout, so it takes exactly the path a
real Llama 3 does.

Every value read from params.json or config.json is checked (a CheckpointError names the file
and the key). A key that sets the model's shape (its width, layers, heads, vocabulary) must be
there; the others, when absent, take the default of the format's own reference code (Meta's
`ModelArgs`, transformers' `LlamaConfig`), so a file reads here as it reads there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checks import check_model_args
from ..errors import CheckpointError, UsageError
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


REQUIRED = object()      # `setting(...)`'s default for a key with no safe default
LARGEST = 2**31 - 1      # no size of a Llama comes near it; past it, products of sizes overflow
KINDS = {
    "count": (f"a whole number from 1 to {LARGEST:,}",
              lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= LARGEST),
    "number": ("a positive number", lambda v: isinstance(v, (int, float))
               and not isinstance(v, bool) and math.isfinite(v) and v > 0),
    "flag": ("true or false", lambda v: isinstance(v, bool)),
    "token ids": ("a token id or a list of them", lambda v: all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= LARGEST
        for t in (v if isinstance(v, list) else [v]))),
    "text": ("a string", lambda v: isinstance(v, str)),
}


def setting(cfg: dict, key: str, kind: str, source, default=REQUIRED, nullable: bool = False):
    """cfg[key], checked to be of `kind` (see KINDS); `default` if the key is absent (or null,
    when `nullable`). A CheckpointError names the file and the key."""
    if key not in cfg or (nullable and cfg[key] is None):
        if default is REQUIRED:
            raise CheckpointError(f"{source} lacks {key!r}, which sets the model's shape and has "
                                  f"no default; this file is incomplete")
        return default
    what, valid = KINDS[kind]
    if not valid(cfg[key]):
        raise CheckpointError(f"{source}: {key!r} must be {what}, not {cfg[key]!r}")
    return cfg[key]


def model_args(source, **fields) -> ModelArgs:
    """ModelArgs from a checkpoint's settings; the model's own checks (`checks.check_model_args`)
    name `source`."""
    try:
        return ModelArgs(**fields)
    except UsageError as e:
        raise CheckpointError(f"{source}: {e}; this checkpoint cannot be right") from None


def check_args(args: ModelArgs, source) -> ModelArgs:
    """`checks.check_model_args` once more on a loaded config (its values may have been set
    after ModelArgs was built), as a CheckpointError naming `source`."""
    try:
        check_model_args(args)
    except UsageError as e:
        raise CheckpointError(f"{source}: {e}; this checkpoint cannot be right") from None
    return args


def _settings(data, source) -> dict:
    if not isinstance(data, dict):
        raise CheckpointError(f"{source} holds a JSON {type(data).__name__}, not the object of "
                              f"settings a checkpoint's config is")
    return data


def args_from_params(params: dict, source="params.json") -> ModelArgs:
    """Meta's params.json -> ModelArgs (absent keys: the defaults of Meta's llama3 ModelArgs)."""
    p = _settings(params, source)
    args = model_args(
        source, dim=setting(p, "dim", "count", source),
        n_layers=setting(p, "n_layers", "count", source),
        n_heads=setting(p, "n_heads", "count", source),
        n_kv_heads=setting(p, "n_kv_heads", "count", source, None, nullable=True),
        vocab_size=setting(p, "vocab_size", "count", source),
        multiple_of=setting(p, "multiple_of", "count", source, 256),
        ffn_dim_multiplier=setting(p, "ffn_dim_multiplier", "number", source, None,
                                   nullable=True),
        norm_eps=setting(p, "norm_eps", "number", source, 1e-5),
        rope_theta=setting(p, "rope_theta", "number", source, 500000.0),
        use_scaled_rope=setting(p, "use_scaled_rope", "flag", source, False),
        max_seq_len=setting(p, "max_seq_len", "count", source, 8192))
    for key in ("rope_scaling_factor", "rope_scale_factor"):       # the second wins
        args.rope_scale_factor = setting(p, key, "number", source, args.rope_scale_factor)
    args.stop_tokens = setting(p, "stop_tokens", "token ids", source, None, nullable=True) or \
        _llama3_stop_tokens(args.vocab_size)
    return args


def args_from_hf_config(cfg: dict, source="config.json") -> ModelArgs:
    """Hugging Face's config.json -> ModelArgs (rope settings from `rope_scaling` or the newer
    `rope_parameters`; the scale factor read, never assumed; absent keys: the defaults of
    transformers' LlamaConfig)."""
    c = _settings(cfg, source)
    rope_key = "rope_scaling" if c.get("rope_scaling") is not None else "rope_parameters"
    rope = c.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: {rope_key!r} must be an object or null, not {rope!r}")
    n_heads = setting(c, "num_attention_heads", "count", source)
    args = model_args(
        source, dim=setting(c, "hidden_size", "count", source),
        n_layers=setting(c, "num_hidden_layers", "count", source), n_heads=n_heads,
        n_kv_heads=setting(c, "num_key_value_heads", "count", source, n_heads, nullable=True),
        vocab_size=setting(c, "vocab_size", "count", source),
        hidden_dim=setting(c, "intermediate_size", "count", source),
        norm_eps=setting(c, "rms_norm_eps", "number", source, 1e-6),
        rope_theta=setting(c, "rope_theta", "number", source,
                           setting(rope, "rope_theta", "number", f"{source} ({rope_key})",
                                   10000.0)),
        max_seq_len=setting(c, "max_position_embeddings", "count", source, 2048),
        tie_word_embeddings=setting(c, "tie_word_embeddings", "flag", source, False),
    )
    rope_type = rope.get("rope_type", rope.get("type"))
    where = f"{source} ({rope_key})"
    if rope_type == "llama3":
        args.use_scaled_rope = True
        args.rope_scale_factor = setting(rope, "factor", "number", where)
        args.rope_low_freq_factor = setting(rope, "low_freq_factor", "number", where, 1.0)
        args.rope_high_freq_factor = setting(rope, "high_freq_factor", "number", where, 4.0)
        args.rope_original_max_len = setting(rope, "original_max_position_embeddings", "count",
                                             where, 8192)
    elif rope_type not in (None, "default"):
        raise CheckpointError(f"{source} asks for rope type {rope_type!r}; minipaged "
                              "implements Llama 3's ('llama3') and plain rotary only")
    head_dim = setting(c, "head_dim", "count", source, None, nullable=True)
    if head_dim not in (None, args.head_dim):
        raise CheckpointError(f"{source} says head_dim {head_dim} but hidden_size / "
                              f"num_attention_heads is {args.head_dim}; minipaged needs them equal")
    eos = setting(c, "eos_token_id", "token ids", source, None, nullable=True)
    args.stop_tokens = ([eos] if isinstance(eos, int) else list(eos)) if eos is not None \
        else _llama3_stop_tokens(args.vocab_size)
    return args


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:        # ValueError: bad JSON, or bytes that are not UTF-8
        raise CheckpointError(f"could not read {path}: {e}") from None


# -- reading the tensors ------------------------------------------------------------------------
def read_meta(folder: Path):
    """(ModelArgs, state dict) of a Meta checkpoint folder."""
    args = args_from_params(_read_json(folder / "params.json"), folder / "params.json")
    shards = sorted(folder.glob("consolidated.*.pth"))
    if len(shards) != 1:
        raise CheckpointError(
            f"{folder} has {len(shards)} consolidated.*.pth files; minipaged reads single-file "
            "Meta checkpoints (Llama 3.2 1B/3B, 3.1 8B). Use the Hugging Face layout for larger ones.")
    try:  # weights_only: tensors come back, arbitrary pickled objects are refused
        state = torch.load(shards[0], map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"could not read {shards[0]} as a PyTorch checkpoint: {e}") from None
    if not (isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in state.items())):
        raise CheckpointError(f"{shards[0]} holds a {type(state).__name__}"
                              f"{'' if not isinstance(state, dict) else ' with values that are not tensors'}"
                              f", not the dict of named tensors a Meta checkpoint is")
    state.pop("rope.freqs", None)   # older Meta files carry the rotary table; we compute it
    return args, state


def read_hf(folder: Path):
    """(ModelArgs, state dict with Meta's names) of a Hugging Face checkpoint folder."""
    args = args_from_hf_config(_read_json(folder / "config.json"), folder / "config.json")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _settings(_read_json(index), index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and "/" not in f
                                                        for f in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must be an object of tensor names and "
                                  f"the shard files (in this folder) that hold them")
        files = sorted(set(weight_map.values()))
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
            if inner in ("self_attn.q_proj", "self_attn.k_proj") and parts[-1] == "weight":
                heads = args.n_heads if inner == "self_attn.q_proj" else args.n_kv_heads
                if tuple(w.shape) != (heads * args.head_dim, args.dim):   # before reordering
                    raise CheckpointError(
                        f"{folder}: tensor {key} has shape {tuple(w.shape)}, but config.json "
                        f"implies {(heads * args.head_dim, args.dim)}")
                w = hf_to_meta_rows(w, heads)
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
