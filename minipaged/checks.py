"""Support, not a stage (not needed on a first read): the checks that refuse bad values before
anything changes, so the stages can read as the idea alone.

Each check raises a named error from `errors.py` with one sentence saying what is wrong and
what to do: sizes, token counts and sequence ids (`check_sizes`, `check_count`, `check_ids`),
whole numbers, flags and stop tokens, a model's config (`check_model_args`) and a request
(`check_request`, `check_sampling`). The checks a cache and an attention call make (memory,
pools, block tables) are in `cache_checks.py`.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .errors import RequestError, UsageError

MAX_COUNT = 2**31 - 1       # block tables and lengths are int32


# -- sizes, counts, ids --------------------------------------------------------------------------

def check_sizes(**sizes) -> None:
    """RequestError unless every named size (`max_batch=4`, ...) is a positive integer."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise RequestError(f"{name} must be a positive integer, got {value!r}")


def _whole(value) -> bool:
    """A whole number (int, numpy or 0-d integer tensor), not a bool, that fits in int32."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            return False
        value = value.item()
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, numbers.Integral) \
        and -MAX_COUNT <= int(value) <= MAX_COUNT


def check_count(num_tokens) -> int:
    """A token count: a non-negative whole number below 2**31; RequestError otherwise."""
    if not _whole(num_tokens) or int(num_tokens) < 0:
        raise RequestError(f"a token count must be a non-negative integer below 2**31, "
                           f"got {num_tokens!r}")
    return int(num_tokens)


def check_id(seq_id) -> int:
    """A sequence id: a whole number (not 1.5, NaN, True or 2**31); RequestError otherwise."""
    if not _whole(seq_id):
        raise RequestError(f"a sequence id must be an integer, got {seq_id!r}")
    return int(seq_id)


def check_ids(seq_ids) -> list[int]:
    """Sequence ids (list, tuple, tensor or array) as a list of ints."""
    if isinstance(seq_ids, (torch.Tensor, np.ndarray)):
        if seq_ids.dtype in (torch.bool, np.bool_) or (seq_ids.dtype.is_floating_point
                                                      if isinstance(seq_ids, torch.Tensor)
                                                      else seq_ids.dtype.kind not in "iu"):
            raise RequestError(f"sequence ids must be integers, got a {seq_ids.dtype} array")
        seq_ids = seq_ids.tolist()
    if not isinstance(seq_ids, (list, tuple, range)):
        raise RequestError(f"sequence ids must be a list of integers, got {seq_ids!r}")
    return [check_id(s) for s in seq_ids]


# -- whole numbers, flags, stop tokens -------------------------------------------------------

def whole(value) -> bool:
    """An integer (Python or numpy), not a bool: True is not a token id, nor a count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_whole(name: str, value, low: int = 0) -> int:
    """`value` as an int, if it is a whole number >= low (not 1.5, NaN, "3" or True)."""
    if not whole(value) or value < low:
        raise RequestError(f"{name} must be an integer >= {low}, not {value!r}")
    return int(value)


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise UsageError(f"{name} must be True or False, not {value!r}")


def check_stop_tokens(model, stop_tokens) -> frozenset:
    """The stop tokens as a set (None: the model's), each a token id in [0, vocab)."""
    if stop_tokens is None:
        return frozenset(model.args.stop_tokens)
    vocab = model.args.vocab_size
    if not isinstance(stop_tokens, (list, tuple, set, frozenset)) or \
            not all(whole(t) and 0 <= t < vocab for t in stop_tokens):
        raise RequestError(f"stop_tokens must be a list of token ids in [0, {vocab}) (None: the "
                           f"model's, []: never stop early), not {stop_tokens!r}")
    return frozenset(int(t) for t in stop_tokens)


def check_tokens(tokens) -> None:
    """A prompt as the prefix cache hashes it: a non-empty list of token ids (1.5 and True
    would hash as 1 and find blocks that hold other tokens)."""
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(
            whole(t) and t >= 0 for t in tokens):
        raise RequestError(f"tokens must be a non-empty list of token ids, not {tokens!r}")


def check_device(device, dtype=None) -> None:
    """UsageError for a device torch does not know or this machine does not have (device="cuda"
    without a GPU), or a dtype that is not a floating-point torch dtype."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"device must be a torch device such as 'cpu' or 'cuda', not {device!r}") \
            from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device={str(device)!r} needs a CUDA GPU, and torch sees none here; "
                         f"load the model with device='cpu'")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise UsageError(f"dtype must be a floating-point torch dtype such as torch.bfloat16 "
                         f"(or None: the checkpoint's), not {dtype!r}")


# -- a model, a request ---------------------------------------------------------------------------

MAX_WEIGHT = 2**50          # numbers in one weight matrix: 4 PiB in float32, more than any machine


def _check_weight_sizes(args) -> None:
    """UsageError for a feed-forward width or a weight matrix too large to exist (a `dim` of 1e9,
    an `ffn_dim_multiplier` of 1e308), before the width is computed or a tensor shaped: past
    these, Python's int() of the width or torch's size of the tensor overflows."""
    hidden = args.hidden_dim
    if hidden is None:            # about the width ModelArgs computes (Meta's FeedForward sizing)
        multiplier = args.ffn_dim_multiplier if args.ffn_dim_multiplier is not None else 1
        if not (_finite(multiplier) and multiplier > 0):
            raise UsageError(f"ffn_dim_multiplier must be a positive number (Llama 3 8B: 1.3), "
                             f"not {args.ffn_dim_multiplier!r}")
        hidden = 8 * args.dim / 3 * multiplier + args.multiple_of
        if hidden > MAX_COUNT:
            raise UsageError(f"the feed-forward width 8/3 x dim {args.dim:,} x ffn_dim_multiplier "
                             f"{multiplier!r} is past 2**31; no Llama is that wide")
    rows = max(args.vocab_size, hidden, args.dim)
    if rows * args.dim > MAX_WEIGHT:
        raise UsageError(f"a weight matrix of {int(rows):,} x {args.dim:,} numbers is larger than "
                         f"any machine holds (dim {args.dim:,}, feed-forward width "
                         f"{int(hidden):,}, vocabulary {args.vocab_size:,})")


def check_model_args(args) -> None:
    """UsageError for a ModelArgs the model would run with and answer nonsense (a negative RMS
    epsilon gives NaN, then the same token over and over) or fail deep inside a forward pass:
    sizes that are not positive whole numbers, heads that do not split evenly, an odd head
    size, rope settings out of range, stop tokens outside the vocabulary."""
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len",
                 "hidden_dim", "rope_original_max_len"):
        value = getattr(args, name)
        if value is None and name == "hidden_dim":      # None: computed from dim
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be a positive whole number, not {value!r}")
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads:
        raise UsageError(f"the heads must split evenly: dim {args.dim} into n_heads "
                         f"{args.n_heads}, and n_heads into n_kv_heads {args.n_kv_heads} "
                         f"groups (grouped-query attention)")
    _check_weight_sizes(args)
    head_dim = args.dim // args.n_heads
    if head_dim % 2:
        raise UsageError(f"the head size dim / n_heads = {args.dim} / {args.n_heads} = "
                         f"{head_dim} is odd, and rotary embeddings turn pairs of numbers")
    if not (_finite(args.norm_eps) and 0 < args.norm_eps < 1):
        raise UsageError(f"the RMS norm epsilon is {args.norm_eps!r}; it must be a small "
                         f"positive number (Llama 3: 1e-05)")
    if not (_finite(args.rope_theta) and args.rope_theta > 1):
        raise UsageError(f"the rope base (theta) is {args.rope_theta!r}; it must be a number "
                         f"above 1 (Llama 3: 500000)")
    if args.use_scaled_rope:
        for name in ("rope_scale_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            if not (_finite(getattr(args, name)) and getattr(args, name) > 0):
                raise UsageError(f"{name} is {getattr(args, name)!r}, not a positive number")
        if not args.rope_high_freq_factor > args.rope_low_freq_factor:
            raise UsageError(f"the rope scaling's high_freq_factor ({args.rope_high_freq_factor}) "
                             f"must be above its low_freq_factor ({args.rope_low_freq_factor})")
    factors = args.rope_freq_factors
    if factors is not None and not (len(factors) == head_dim // 2 and
                                    all(_finite(f) and f > 0 for f in factors)):
        raise UsageError(f"the rope frequency factors must be {head_dim // 2} positive numbers")
    wrong = [t for t in args.stop_tokens or [] if not (whole(t) and 0 <= t < args.vocab_size)]
    if wrong:
        raise UsageError(f"the stop token {wrong[0]!r} is not an id of its vocabulary of "
                         f"{args.vocab_size:,}")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_sampling(temperature: float, top_p: float) -> None:
    """Refuse sampling settings that mean nothing (NaN included: it fails every comparison)."""
    if not temperature >= 0 or not 0 < top_p <= 1:
        raise RequestError(f"need temperature >= 0 and 0 < top_p <= 1; got {temperature}, {top_p}")


def check_request(model, prompts, max_new_tokens, temperature, top_p, max_seq_len) -> list[int]:
    """Refuse a request that cannot be served, before any work is done. Returns the limit of
    new tokens for each prompt (`max_new_tokens` may be one int or one per prompt)."""
    vocab = model.args.vocab_size
    # first the kinds of value the checks below let through: bools as token ids or counts
    # (True is an int to Python), and sampling settings that are not finite real numbers
    for i, p in enumerate(prompts if isinstance(prompts, (list, tuple)) else []):
        if isinstance(p, (list, tuple)) and any(isinstance(t, bool) for t in p):
            raise RequestError(f"prompt {i} holds True or False; token ids are integers in "
                               f"[0, {vocab})")
    counts = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens]
    if any(isinstance(m, bool) for m in counts):
        raise RequestError(f"max_new_tokens must be an integer, not {max_new_tokens!r}")
    for name, x in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
            raise RequestError(f"{name} must be a finite number, not {x!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise RequestError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise RequestError(f"prompt {i} is empty or not a list of token ids")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in p):
            raise RequestError(f"prompt {i} holds a token id outside [0, {vocab}) or a non-integer")
    limits = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else \
        [max_new_tokens] * len(prompts)
    if len(limits) != len(prompts) or not all(isinstance(m, int) and m >= 0 for m in limits):
        raise RequestError(f"max_new_tokens must be a non-negative integer, or one per prompt, "
                           f"not {max_new_tokens!r}")
    check_sampling(temperature, top_p)
    for i, (p, m) in enumerate(zip(prompts, limits)):
        if len(p) + m > max_seq_len:
            raise RequestError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={m} it needs "
                f"{len(p) + m} positions, but the cache holds {max_seq_len} per sequence. "
                "Shorten the prompt, ask for fewer new tokens, or raise max_seq_len.")
    return limits
