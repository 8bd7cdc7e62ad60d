"""Stage 4: request traces for the fragmentation simulator — chat-like synthetic lengths, or a
user's file.

A trace is only what memory depends on: each request's prompt length and output length.

The vLLM paper (Kwon et al., SOSP 2023, Fig. 11) prints the mean lengths of its datasets and
nothing else: ShareGPT 161.31 prompt / 337.99 output tokens, Alpaca 19.31 / 58.45. We draw
each length from a geometric distribution (the exponential, on whole tokens) with that mean.
Of all distributions on 1, 2, 3, ... with a given mean it has the largest entropy, so it adds
no assumption the paper's numbers do not carry; its one parameter is the mean. Real chat lengths
have heavier tails (a few very long answers) and prompts and outputs that are not independent:
a real trace file (`load_trace`) is the way to study those.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import TraceError

SHAREGPT = (161.31, 337.99)    # mean prompt, mean output tokens (vLLM paper, Fig. 11)
ALPACA = (19.31, 58.45)


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order: prompt and output lengths, int64 arrays of shape (N,)."""
    name: str
    prompt_lens: np.ndarray
    output_lens: np.ndarray

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def final_lens(self) -> np.ndarray:
        """Tokens a request's cache holds when it ends: its last output token is returned to the
        user but never fed back, so its K and V are never computed."""
        return self.prompt_lens + self.output_lens - 1

    def describe(self) -> str:
        return (f"{self.name}: {len(self)} requests, mean prompt {self.prompt_lens.mean():.1f}, "
                f"mean output {self.output_lens.mean():.1f} tokens")


def synthetic(n: int, mean_prompt: float, mean_output: float, seed: int = 0,
              max_seq_len: int = 2048, name: str = "synthetic") -> Workload:
    """`n` requests with geometric prompt and output lengths of the given means, drawn
    independently from `seed`. A request longer than `max_seq_len` is cut there, as a server
    stops a request at the context length: the prompt keeps at most max_seq_len - 1 tokens,
    the output what is left (about 0.5% of ShareGPT-like requests at 2048, none at 8192)."""
    if n < 1 or max_seq_len < 2:
        raise TraceError(f"need at least one request and max_seq_len >= 2, got n={n}, "
                         f"max_seq_len={max_seq_len}")
    if not (mean_prompt >= 1 and mean_output >= 1):       # (NaN fails too)
        raise TraceError(f"mean lengths must be at least 1 token, got {mean_prompt:g} (prompt) "
                         f"and {mean_output:g} (output)")
    rng = np.random.default_rng(seed)
    prompt = np.minimum(rng.geometric(1 / mean_prompt, n), max_seq_len - 1)   # (N,)
    output = np.minimum(rng.geometric(1 / mean_output, n), max_seq_len - prompt)
    return Workload(name, prompt.astype(np.int64), output.astype(np.int64))


def sharegpt_like(n: int = 2000, seed: int = 0, max_seq_len: int = 2048) -> Workload:
    return synthetic(n, *SHAREGPT, seed=seed, max_seq_len=max_seq_len, name="ShareGPT-like")


def alpaca_like(n: int = 2000, seed: int = 0, max_seq_len: int = 2048) -> Workload:
    return synthetic(n, *ALPACA, seed=seed, max_seq_len=max_seq_len, name="Alpaca-like")


# -- trace files -----------------------------------------------------------------------------------

def load_trace(path, max_seq_len: int | None = None) -> Workload:
    """Read a trace: a CSV with `prompt_len` and `output_len` columns (others are ignored), or a
    JSON list of {"prompt_len": ..., "output_len": ...} objects or [prompt_len, output_len] pairs.
    Lengths are whole numbers >= 1; with `max_seq_len`, prompt + output must fit in it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist (give a .csv or .json file of "
                         f"prompt_len, output_len)")
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json"):
        raise TraceError(f"{path.name}: a trace must be a .csv or .json file, not '{suffix}'")
    try:
        rows = _read_csv(path) if suffix == ".csv" else _read_json(path)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise TraceError(f"cannot read {path.name} as a {suffix[1:]} trace of UTF-8 text: "
                         f"{err}") from None
    if not rows:
        raise TraceError(f"{path.name} holds no requests")
    for where, p, o in rows:
        if max_seq_len is not None and p + o > max_seq_len:
            raise TraceError(f"{path.name}, {where}: prompt {p} + output {o} = {p + o} tokens do "
                             f"not fit in max_seq_len={max_seq_len}; raise max_seq_len or cut "
                             f"the request")
    prompt = np.array([p for _, p, _ in rows], dtype=np.int64)
    output = np.array([o for _, _, o in rows], dtype=np.int64)
    return Workload(path.name, prompt, output)


def _length(value, where: str, column: str, name: str) -> int:
    """A length from a file: a whole number >= 1 (a CSV cell, or a JSON integer)."""
    if isinstance(value, str):
        text = value.strip()
        value = int(text) if text.lstrip("+").isdigit() else text
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{name}, {where}: {column} must be a whole number of tokens >= 1, "
                         f"not {value!r}")
    return value


def _read_csv(path: Path) -> list:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in ("prompt_len", "output_len") if c not in columns]
        if missing:
            raise TraceError(f"{path.name}: the header must name the columns prompt_len and "
                             f"output_len; missing {', '.join(missing)} (found: "
                             f"{', '.join(columns) or 'no header'})")
        reader.fieldnames = columns
        rows = []
        for row in reader:
            where = f"line {reader.line_num}"
            rows.append((where, _length(row["prompt_len"], where, "prompt_len", path.name),
                         _length(row["output_len"], where, "output_len", path.name)))
    return rows


def _read_json(path: Path) -> list:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TraceError(f"{path.name} is not valid JSON: {err.msg} at line {err.lineno}, "
                         f"column {err.colno}") from None
    if not isinstance(data, list):
        raise TraceError(f"{path.name}: expected a JSON list of requests, found a "
                         f"{type(data).__name__}")
    rows = []
    for i, item in enumerate(data):
        where = f"request {i}"
        if isinstance(item, dict) and {"prompt_len", "output_len"} <= item.keys():
            p, o = item["prompt_len"], item["output_len"]
        elif isinstance(item, list) and len(item) == 2:
            p, o = item
        else:
            raise TraceError(f"{path.name}, {where}: expected {{\"prompt_len\": ..., "
                             f"\"output_len\": ...}} or [prompt_len, output_len], got {item!r}")
        if isinstance(p, str) or isinstance(o, str):
            raise TraceError(f"{path.name}, {where}: lengths must be JSON numbers, not strings")
        rows.append((where, _length(p, where, "prompt_len", path.name),
                     _length(o, where, "output_len", path.name)))
    return rows


def load(spec: str, n: int = 2000, seed: int = 0, max_seq_len: int = 2048) -> Workload:
    """"sharegpt" or "alpaca" (synthetic, `n` requests from `seed`), or a trace file's path."""
    if spec.lower() in ("sharegpt", "alpaca"):
        make = sharegpt_like if spec.lower() == "sharegpt" else alpaca_like
        return make(n, seed=seed, max_seq_len=max_seq_len)
    return load_trace(spec, max_seq_len=max_seq_len)
