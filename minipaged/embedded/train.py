"""Train the embedded default model from scratch: `python -m minipaged.embedded.train`.

Everything it needs ships with the repository: the corpus is generated (`corpus.py`), the
tokenizer is a byte-level BPE trained here (`bpe.py`) in Llama 3's tiktoken format, and the
model is the Llama 3 architecture of `minipaged/model.py` (GQA, scaled rope), saved in the Hugging Face
layout so `load_model()` reads it through the same path as a real Llama 3.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..formats import DEFAULT_MODEL_DIR, ChatFormat, Tokenizer, save_model
from ..model import Llama, ModelArgs
from ..viz import plot_loss_curve
from .bpe import save_tiktoken_bpe, train_bpe
from .corpus import build_corpus

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


def train(out_dir: Path = DEFAULT_MODEL_DIR, steps: int = 450, batch_size: int = 24,
          seq_len: int = 256, lr: float = 3e-3, seed: int = 0, threads: int = 2,
          plot_path: Path | None = None):
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
        "params": model.num_params(), "train_tokens": len(train_stream),
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
    if plot_path is not None:
        plot_loss_curve(history, report, plot_path)
    return model, tokenizer, report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="folder to write the model to")
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=DEFAULT_MODEL_DIR.parent / "loss_curve.png")
    a = parser.parse_args(argv)
    _, _, report = train(a.out, steps=a.steps, seed=a.seed, plot_path=a.plot)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
