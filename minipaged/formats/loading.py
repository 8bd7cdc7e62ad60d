"""One loader for every format: `load_model(path)` and `load_tokenizer(path)`.

    a folder with params.json + consolidated.00.pth     Meta's layout          (checkpoint.py)
    a folder with config.json + *.safetensors           Hugging Face's layout  (checkpoint.py)
    a .gguf file, or a folder holding one               llama.cpp's format     (gguf_checkpoint.py)
    nothing                                             the embedded model (embedded/model/)

Each reader returns `ModelArgs` and a state dict with Meta's names; the checks and the `Llama`
they become are the same for all of them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checks import check_device
from ..errors import CheckpointError, TokenizerError
from ..model import Llama
from .atomic import recover
from .checkpoint import check_args, read_hf, read_meta
from .gguf_checkpoint import find_gguf, read_gguf
from .gguf_tokenizer import load_gguf_tokenizer
from .tokenizer import Tokenizer

# Inside the package, so `pip install` ships it as package data (see pyproject.toml).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "embedded" / "model"


def load_model(path=None, device="cpu", dtype=None) -> Llama:
    """Load a Llama 3 checkpoint folder (Meta or Hugging Face layout) or a GGUF file (or a folder
    holding one) as a `Llama` in eval mode, its parameters without grad (a model run for
    inference must not record a graph; training sets `requires_grad` back on).

    path=None loads the embedded default model; dtype=None keeps the checkpoint's dtype
    (float32 for a GGUF file, whose quantized blocks have no PyTorch dtype).
    """
    check_device(device, dtype)        # before reading anything: a checkpoint may be large
    folder = Path(path).expanduser() if path is not None else DEFAULT_MODEL_DIR
    recover(folder)                   # a writer killed while replacing it: finish its renames
    if not folder.exists():
        raise CheckpointError(f"no such file or folder: {folder}")
    if not folder.is_dir() and folder.suffix != ".gguf":
        raise CheckpointError(f"{folder} is a file; give the folder that holds the checkpoint "
                              "(params.json + consolidated.00.pth, or config.json + *.safetensors)"
                              ", or a .gguf file")
    if folder.is_dir() and (folder / "params.json").exists() and any(folder.glob("consolidated.*.pth")):
        (args, state), config_name = read_meta(folder), "params.json"
    elif folder.is_dir() and (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        (args, state), config_name = read_hf(folder), "config.json"
    elif (gguf_file := find_gguf(folder)) is not None:
        (args, state), config_name = read_gguf(gguf_file, dtype), "GGUF metadata"
    else:
        found = ", ".join(sorted(p.name for p in folder.iterdir())[:8]) or "nothing"
        raise CheckpointError(
            f"{folder} holds no checkpoint minipaged can read: expected params.json + "
            f"consolidated.00.pth (Meta), config.json + *.safetensors (Hugging Face) or a .gguf "
            f"file; found {found}")
    check_args(args, f"{folder} ({config_name})")
    _check_layers(state, args.n_layers, folder, config_name)   # before building that many layers
    with torch.device("meta"):        # shapes only, no memory: the real tensors come next
        model = Llama(args)
    _check_state(state, model, folder, config_name)
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    dtype = dtype or next(iter(state.values())).dtype
    model.source = folder
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _check_layers(state: dict, n_layers: int, folder: Path, config_name: str):
    """The config's layer count is the tensors' (a config that says 100,000,000 layers would
    otherwise build them all, shapes only, before any tensor is compared)."""
    found = {k.split(".")[1] for k in state if k.startswith("layers.")}
    if len(found) != n_layers or found != {str(i) for i in range(n_layers)}:
        raise CheckpointError(f"{folder}: its {config_name} says the model has {n_layers:,} "
                              f"layers, but its tensors are those of {len(found):,}; the config "
                              f"and the weights do not belong together")


def _check_state(state: dict, model: Llama, folder: Path, config_name: str):
    """Every tensor the model needs is there, with the shape the config implies, and no others."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.args.tie_word_embeddings:
        expected.pop("output.weight", None)
        state.pop("output.weight", None)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        what = []
        if missing:
            what.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if extra:
            what.append(f"{len(extra)} unexpected tensors (e.g. {', '.join(extra[:3])})")
        raise CheckpointError(f"{folder} does not match its {config_name}: " + "; ".join(what))
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise CheckpointError(f"{folder}: tensor {k} has shape {tuple(state[k].shape)}, "
                                  f"but {config_name} implies {shape}")
        if not state[k].is_floating_point():
            raise CheckpointError(f"{folder}: tensor {k} holds {state[k].dtype} values; a "
                                  f"model's weights are floating-point numbers")



def load_tokenizer(path=None):
    """Load a tiktoken `tokenizer.model`: a file, a folder holding one (or its `original/`, as in
    Hugging Face's Llama 3 repos), or None for the embedded model (embedded/model/). A GGUF file
    (or a folder holding one and no tokenizer.model) gives the tokenizer stored in it."""
    if path is None:
        file = DEFAULT_MODEL_DIR / "tokenizer.model"
        if not file.is_file():
            raise TokenizerError(
                f"the embedded model's tokenizer is missing: expected {file}. Create it with "
                "`python -m minipaged.embedded.train`, or pass the path of a Llama 3 "
                "tokenizer.model.")
        return Tokenizer(file)
    path = Path(path).expanduser()
    recover(path)
    if not path.exists():
        raise TokenizerError(f"{path} does not exist; expected a Llama 3 tokenizer.model "
                             "(tiktoken format) or a folder holding one.")
    if path.is_dir():
        for file in (path / "tokenizer.model", path / "original" / "tokenizer.model"):
            if file.exists():         # a FIFO or a folder of that name: Tokenizer says so
                return Tokenizer(file)
        if any(path.glob("*.gguf")):
            return _gguf_tokenizer(path)
        found = sorted(p.name for p in path.iterdir())
        hint = (" (tokenizer.json is Hugging Face's format; their Llama 3 repos keep Meta's "
                "tokenizer.model under original/)" if "tokenizer.json" in found else "")
        raise TokenizerError(
            f"found no tokenizer.model in {path} or {path / 'original'}; the folder holds "
            f"{', '.join(found[:8]) or 'nothing'}{' ...' if len(found) > 8 else ''}{hint}.")
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    return Tokenizer(path)


def check_pair(model: Llama, tokenizer) -> None:
    """A tokenizer and a model belong together: every id the tokenizer can give (its
    vocabulary, its special tokens, its stop tokens) is a row of the model's embedding."""
    vocab = model.args.vocab_size
    ids = {"its vocabulary runs to": tokenizer.n_words - 1,
           **{f"its {k} is": getattr(tokenizer, k, None) for k in ("bos_id", "eos_id", "eot_id")}}
    for what, top in ids.items():
        if isinstance(top, int) and top >= vocab:
            raise TokenizerError(f"the tokenizer does not belong to the model: {what} id {top:,}, "
                                 f"but the model's vocabulary holds ids 0 to {vocab - 1:,}; load "
                                 f"the tokenizer that came with the checkpoint")


def _gguf_tokenizer(path):
    try:
        return load_gguf_tokenizer(find_gguf(path))
    except CheckpointError as e:
        raise TokenizerError(str(e)) from None
