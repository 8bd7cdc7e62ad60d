"""Train the embedded default model from scratch: `python -m minipaged.embedded.train`.

Everything it needs ships with the repository: the corpus is generated (`corpus.py`), the
tokenizer is a byte-level BPE trained here (`bpe.py`) in Llama 3's tiktoken format, and the
model is the Llama 3 architecture of `minipaged/model.py` (GQA, scaled rope), saved in the Hugging Face
layout so `load_model()` reads it through the same path as a real Llama 3.

    python -m minipaged.embedded.train --overwrite          # remake the shipped model in model/
    python -m minipaged.embedded.train --out my-model --steps 50

The arguments are checked before any work; the model folder is written in a temporary folder
beside its target and renamed onto it at the end, so an interrupted run leaves nothing behind,
and a folder that already holds files (the shipped model, above all) is replaced only with
--overwrite.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .. import cli
from ..errors import UsageError
from ..formats import DEFAULT_MODEL_DIR, ChatFormat, Tokenizer, save_model
from ..formats.atomic import staged_folder, write_file
from ..model import Llama, ModelArgs
from ..viz import plot_loss_curve
from .bpe import save_tiktoken_bpe, train_bpe
from .corpus import build_corpus

OUTPUTS = ("tokenizer.model", "config.json", "model.safetensors", "training.json",
           "loss_curve.png")     # what a run writes in its folder (the plot unless --plot)
N_RANKS = 4096          # BPE tokens (256 bytes + merges); Llama 3's 256 special tokens follow


def embedded_model_args(vocab_size: int) -> ModelArgs:
    """The embedded model: Llama 3's architecture, scaled down to answer fast on 2 CPU cores."""
    return ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=vocab_size,
                     multiple_of=256, rope_theta=500000.0, use_scaled_rope=True,
                     max_seq_len=2048, tie_word_embeddings=True)


def dialog_tokens(fmt: ChatFormat, dialog) -> list[int]:
    """One training document: begin_of_text, then every message with its header and eot."""
    tokens = [fmt.tokenizer.bos_id]
    for message in dialog["messages"]:
        tokens += fmt.encode_message(message)
    return tokens


def token_stream(fmt, dialogs) -> torch.Tensor:
    return torch.tensor([t for d in dialogs for t in dialog_tokens(fmt, d)], dtype=torch.long)


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of held-out tokens under train-token frequencies (add-one smoothed)."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout].mean())


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss over consecutive windows of the stream."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    losses = []
    for i in range(n):
        chunk = stream[i * seq_len: (i + 1) * seq_len + 1]
        logits = model(chunk[None, :-1])                                   # (1, T, V)
        losses.append(F.cross_entropy(logits[0], chunk[1:]).item())
    model.train()
    return sum(losses) / len(losses)


def _writable(folder: Path) -> str | None:
    """None if a file can be made in `folder`, else why not."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".minipaged-write-test-")
        os.close(fd)
        os.remove(name)
    except OSError as e:
        return e.strerror or str(e)
    return None


def output_bytes() -> int:
    """About what a run writes: the bf16 weights, the tokenizer, the plot, with room to spare."""
    args = embedded_model_args(N_RANKS + 256)
    d, h, layers = args.dim, args.hidden_dim, args.n_layers
    kv = args.n_kv_heads * args.head_dim
    params = args.vocab_size * d + layers * (2 * d * d + 2 * d * kv + 3 * d * h + 2 * d) + d
    return 2 * params + (4 << 20)


def check_outputs(out_dir: Path, plot_path: Path | None, overwrite: bool) -> None:
    """Refuse, before any work, outputs that cannot be written, or that would replace files
    without `overwrite`. The folder is written beside itself and renamed into place, so the
    folder that holds it must take new files, and it cannot be the one a shell stands in."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir} is a file; the model is written as a folder")
    out_dir = out_dir.resolve()
    if out_dir == Path(out_dir.anchor) or os.path.ismount(out_dir):
        raise UsageError(f"{out_dir} is a mount point, which cannot be replaced; write the model "
                         f"to a new folder inside it with --out")
    if out_dir == Path.cwd().resolve() or out_dir in Path.cwd().resolve().parents:
        raise UsageError(f"{out_dir} is the folder you are working in, which the model cannot "
                         f"replace; name a new folder with --out (e.g. --out my-model)")
    for path in (out_dir, plot_path):
        if path is None or path.resolve().parent == out_dir:
            continue
        if not path.parent.is_dir():
            raise UsageError(f"cannot write {path}: the folder {path.parent} does not exist")
        if (why := _writable(path.parent)) is not None:
            raise UsageError(f"cannot write {path}: the folder {path.parent} takes no new "
                             f"files ({why})")
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    foreign = [name for name in held if name not in OUTPUTS]
    if foreign:                           # --overwrite replaces a model, never other files
        raise UsageError(f"{out_dir} holds files this trainer does not write ("
                         f"{', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''}); "
                         f"write the model to a new or empty folder with --out")
    if held and not overwrite:
        what = "the shipped model" if out_dir == DEFAULT_MODEL_DIR.resolve() else \
            ", ".join(held[:4]) + (" ..." if len(held) > 4 else "")
        raise UsageError(f"{out_dir} already holds {what}; pass --overwrite (overwrite=True) to "
                         f"replace it, or write the new model to another folder with --out")
    if plot_path is not None:
        if plot_path.is_dir():
            raise UsageError(f"{plot_path} is a folder; the loss curve is a file (a .png)")
        if not overwrite and plot_path.resolve().parent != out_dir and plot_path.exists():
            raise UsageError(f"{plot_path} exists; pass --overwrite (overwrite=True) to replace "
                             f"it, or name another file with --plot")
        if plot_path.suffix.lower() != ".png":
            raise UsageError(f"the loss curve is written as a PNG: name the file {plot_path.stem}"
                             f".png, not {plot_path.name}")
    free = shutil.disk_usage(out_dir.parent).free
    if free < output_bytes():
        raise UsageError(f"{out_dir.parent} has {free / 2**20:.1f} MiB free, and the model needs "
                         f"about {output_bytes() / 2**20:.0f} MiB; free some space or write "
                         f"elsewhere with --out")


def train(out_dir: Path = DEFAULT_MODEL_DIR, steps: int = 450, batch_size: int = 24,
          seq_len: int = 256, lr: float = 3e-3, seed: int = 0, threads: int = 2,
          plot_path: Path | None = None, overwrite: bool = False):
    """Train the embedded model and write it to `out_dir` (tokenizer.model, config.json,
    model.safetensors, training.json) and its loss curve to `plot_path` (a PNG, in `out_dir` or
    elsewhere): all of them or, if the run fails or is interrupted, none. Existing files are
    replaced only with `overwrite`."""
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len),
                        ("threads", threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be a positive whole number, not {value!r}")
    if not 0 <= seed < 2**63:
        raise UsageError(f"seed must be a whole number from 0 to 2**63 - 1, not {seed!r}")
    if not lr > 0:
        raise UsageError(f"lr must be a positive number, not {lr!r}")
    out_dir = Path(out_dir)
    plot_path = Path(plot_path) if plot_path is not None else None
    check_outputs(out_dir, plot_path, overwrite)
    with staged_folder(out_dir) as staging:
        model, tokenizer, report, history = _train(staging, steps, batch_size, seq_len, lr,
                                                    seed, threads)
        if plot_path is not None:        # written before the folder is renamed into place
            fig = plot_loss_curve(history, report)
            if plot_path.resolve().parent == out_dir.resolve():
                fig.savefig(staging / plot_path.name, format="png", dpi=120)
            else:
                write_file(plot_path, lambda p: fig.savefig(p, format="png", dpi=120))
    return model, tokenizer, report


def _train(out_dir: Path, steps, batch_size, seq_len, lr, seed, threads):
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    started = time.time()

    corpus = build_corpus(seed=seed)
    texts = [m["content"] for d in corpus.train for m in d["messages"]]
    ranks = train_bpe(texts, N_RANKS)
    save_tiktoken_bpe(ranks, out_dir / "tokenizer.model")
    tokenizer = Tokenizer(out_dir / "tokenizer.model")
    fmt = ChatFormat(tokenizer)
    train_stream = token_stream(fmt, corpus.train)
    heldout_stream = token_stream(fmt, corpus.heldout)
    print(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out dialogs, "
          f"{len(train_stream):,} / {len(heldout_stream):,} tokens; tokenizer {tokenizer.n_words} "
          f"ids, trained in {time.time() - started:.0f} s")

    args = embedded_model_args(tokenizer.n_words)
    args.stop_tokens = list(tokenizer.stop_tokens)
    model = Llama(args)
    for name, p in model.named_parameters():      # small init, scaled down on residual outputs
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            torch.nn.init.normal_(p, std=std)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    schedule = lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    data_gen = torch.Generator().manual_seed(seed)

    history = []
    columns = [TextColumn("[bold]training"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
               TimeElapsedColumn(), TimeRemainingColumn()]
    t0 = time.time()
    with Progress(*columns) as progress:
        task = progress.add_task("train", total=steps, loss=float("nan"), tps=0.0)
        for step in range(steps):
            starts = torch.randint(0, len(train_stream) - seq_len - 1, (batch_size,), generator=data_gen)
            batch = torch.stack([train_stream[s: s + seq_len + 1] for s in starts])   # (B, T+1)
            logits = model(batch[:, :-1])                                            # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, args.vocab_size), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            history.append(loss.item())
            tps = (step + 1) * batch_size * seq_len / (time.time() - t0)
            progress.update(task, advance=1, loss=loss.item(), tps=tps)

    model.eval()
    report = {
        "steps": steps, "batch_size": batch_size, "seq_len": seq_len, "seed": seed,
        "params": sum(p.numel() for p in model.parameters()), "train_tokens": len(train_stream),
        "heldout_tokens": len(heldout_stream),
        "train_loss": evaluate(model, train_stream, seq_len),
        "heldout_loss": evaluate(model, heldout_stream, seq_len),
        "unigram_heldout_loss": unigram_loss(train_stream, heldout_stream, args.vocab_size),
        "minutes": (time.time() - started) / 60,
    }
    for k in ("train", "heldout", "unigram_heldout"):
        report[f"{k}_perplexity"] = math.exp(report[f"{k}_loss"])
    save_model(model, out_dir, dtype=torch.bfloat16)
    (out_dir / "training.json").write_text(json.dumps(report, indent=2))
    return model, tokenizer, report, history


@cli.program
def main(argv=None):
    parser = cli.ArgumentParser(prog="python -m minipaged.embedded.train",
                                description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=cli.output_folder, default=DEFAULT_MODEL_DIR,
                        help="folder to write the model to (default: the shipped model's, "
                             "minipaged/embedded/model, which takes --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what --out and --plot hold already")
    parser.add_argument("--steps", type=int, default=450)       # (train() checks both)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=cli.output_file,
                        help="the loss curve, a PNG (default: loss_curve.png in --out)")
    a = parser.parse_args(argv)
    plot = a.plot or a.out / "loss_curve.png"
    _, _, report = train(a.out, steps=a.steps, seed=a.seed, plot_path=plot,
                         overwrite=a.overwrite)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
