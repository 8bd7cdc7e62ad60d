"""Int8 KV blocks (stage 4b) against fp32 and bf16 ones: capacity, accuracy and attention speed.

    python -m minipaged.benchmarks.kv_int8                  # embedded model + SmolLM2 (~5 min)
    python -m minipaged.benchmarks.kv_int8 --models embedded --skip-speed   # quicker

1. Capacity: bytes one token's K and V take in every layer, and tokens a KV budget
   (`--budget-mib`) holds as blocks of 16, for the embedded model, SmolLM2-135M and Llama 3 8B's
   KV shape. An int8 slot is head_dim codes + a 2-byte float16 scale per token and head.
2. Accuracy against fp32 blocks, the model in fp32: greedy tokens of 16 chat prompts x
   `--new-tokens` (how many match before the first difference); the largest logit error per
   decode step, both caches fed the fp32 run's tokens (teacher-forced), beside the spread (std)
   of the logits; where int8's tokens differ, how close fp32's best two tokens were there;
   perplexity of the embedded corpus's held-out dialogs in windows of 256 tokens.
3. Speed: one layer's decode attention at `--contexts` tokens of context, batch 1 and 16,
   SmolLM2's heads (9 query, 3 KV, head_dim 64), on stage 3's PyTorch path (write, gather,
   attend), on stage 3b's C kernel (`backend="cpu"`, which reads the blocks where they lie) and
   on the speed layer's decode step (`minipaged.fast`: the step planned once, each layer's new
   k/v written as slots, int8 ones quantized, then the C kernel); the median of `--repeats`
   calls, int8 beside fp32 and bf16 in the same run.
4. The scale's bytes: the float16 scale kept here (2 bytes per head_dim codes) against a 1-byte
   power-of-two one (the OCP MX formats' E8M0: scale 2^ceil(log2(max|x| / 127)), so no code
   clips): tokens a budget holds beside bf16's, and the error each leaves on the model's own
   K and V rows (every layer, a held-out window), ||x - read back|| / ||x|| per row.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from .. import cli
from ..api import generate
from ..embedded.corpus import build_corpus
from ..embedded.train import token_stream
from ..fast import FastPagedCache, kernels
from ..formats import chat_format, load_model, load_tokenizer, packaged_model_path
from ..kv_budget import num_blocks_for_budget
from ..kv_cache import kv_bytes_per_token
from ..kv_formats import stored_layout
from ..kv_quant import QMAX, dequantize_int8, flash_attn_with_int8_kvcache, quantize_int8
from ..model import ModelArgs
from ..paged_attention import flash_attn_with_kvcache
from ..paged_cache import PagedCache
from .smollm2 import chat_prompts

LLAMA3_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8)


def capacity(shapes: dict, budget: int, block_size: int = 16) -> list[tuple]:
    """Per model: bytes per token (fp32, bf16, int8) and tokens `budget` bytes hold as blocks."""
    rows = []
    for name, a in shapes.items():
        per_token, tokens = [], []
        for dtype, kv in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8")):
            slot, store = stored_layout(a.head_dim, dtype, kv)
            per_token.append(kv_bytes_per_token(a.n_kv_heads, slot, store, a.n_layers))
            tokens.append(block_size * num_blocks_for_budget(budget, block_size, a.n_kv_heads,
                                                             slot, store, a.n_layers))
        rows.append((name, a, per_token, tokens))
    return rows


@torch.inference_mode()
def greedy_agreement(model, prompts, new_tokens: int):
    """(fp32 outputs, per prompt the tokens int8 matched before its first difference)."""
    want = generate(model, prompts, new_tokens, cache="paged", stop_tokens=[])
    got = generate(model, prompts, new_tokens, cache="paged", stop_tokens=[], kv_dtype="int8")
    same = [next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w))
            for w, g in zip(want, got)]
    return want, same


@torch.inference_mode()
def logit_errors(model, prompts, outputs, first_differences):
    """Per decode step (over every prompt): the largest |logit int8 - logit fp32| and the mean
    std of the fp32 logits, both caches fed the same tokens (the fp32 run's); and per prompt
    whose tokens differ, the fp32 logits' margin between its best two tokens where they do."""
    errors, spreads, margins = [], [], []
    for prompt, out, first in zip(prompts, outputs, first_differences):
        caches = [PagedCache(model.args, -(-(len(prompt) + len(out)) // 16), 16, 1,
                             len(prompt) + len(out), kv_dtype=kv) for kv in (None, "int8")]
        for c in caches:
            c.prepare([0], len(prompt))
        logits = [model(torch.tensor([prompt]), cache=c, last_only=True) for c in caches]
        for step, t in enumerate(out):
            if len(errors) <= step:
                errors.append(0.0)
                spreads.append([])
            errors[step] = max(errors[step], float((logits[1] - logits[0]).abs().max()))
            spreads[step].append(float(logits[0].std()))
            if step == first:
                top2 = logits[0].flatten().topk(2).values
                margins.append(float(top2[0] - top2[1]))
            for c in caches:
                c.prepare([0], 1)
            logits = [model(torch.tensor([[t]]), cache=c) for c in caches]
    return errors, [statistics.mean(s) for s in spreads], margins


@torch.inference_mode()
def perplexity(model, stream, window: int = 256, windows: int = 32, kv_dtype=None) -> float:
    """exp(mean next-token loss) over consecutive windows, each prefilled into a PagedCache."""
    losses = []
    for i in range(min(windows, (len(stream) - 1) // window)):
        chunk = stream[i * window:(i + 1) * window + 1]
        cache = PagedCache(model.args, window // 16, 16, 1, window, kv_dtype=kv_dtype)
        cache.prepare([0], window)
        logits = model(chunk[None, :-1], cache=cache)                          # (1, T, V)
        losses.append(float(F.cross_entropy(logits[0].float(), chunk[1:])))
    return float(torch.tensor(losses).mean().exp())


def attention_speed(contexts, batches, repeats: int, backend: str, Hq=9, Hk=3, D=64,
                    block_size=16):
    """Median microseconds of one layer's decode attention, per (context, batch) and format,
    through `backend` ("torch" or "cpu")."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for ctx in contexts:
        for B in batches:
            per_row = -(-(ctx + 1) // block_size)
            table = torch.randperm(B * per_row, generator=g).view(B, per_row).int()
            lens = torch.full((B,), ctx, dtype=torch.int32)
            kv = [torch.randn(B * per_row, block_size, Hk, D, generator=g) for _ in range(2)]
            q, k, v = (torch.randn(B, 1, h, D, generator=g) for h in (Hq, Hk, Hk))
            for name in ("fp32", "bf16", "int8"):                 # k and v: pools of their own
                if name == "int8":
                    kc, vc = map(quantize_int8, kv)
                    call = lambda: flash_attn_with_int8_kvcache(  # noqa: E731
                        q, kc, vc, k, v, lens, table, backend=backend)
                else:
                    dt = torch.float32 if name == "fp32" else torch.bfloat16
                    (kc, vc), qd, kd, vd = (x.to(dt) for x in kv), q.to(dt), k.to(dt), v.to(dt)
                    call = lambda: flash_attn_with_kvcache(  # noqa: E731
                        qd, kc, vc, kd, vd, cache_seqlens=lens, block_table=table,
                        causal=True, backend=backend)
                call()
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
                out[ctx, B, name] = statistics.median(times) * 1e6
    return out


def speed_layer_speed(contexts, batches, repeats: int, Hq=9, Hk=3, D=64, block_size=16):
    """Median microseconds of one layer's decode attention on the speed layer's cache
    (`FastPagedCache.decode_attention().attend`: the new k/v into their slots, quantized for
    int8, then the C kernel), per (context, batch) and format."""
    g = torch.Generator().manual_seed(0)
    args = ModelArgs(dim=Hq * D, n_layers=1, n_heads=Hq, n_kv_heads=Hk,
                     max_seq_len=max(contexts) + 1)
    out = {}
    for ctx in contexts:
        for B in batches:
            per_row = -(-(ctx + 1) // block_size)
            q, k, v = (torch.randn(B, 1, h, D, generator=g) for h in (Hq, Hk, Hk))
            kv = [torch.randn(B * per_row, block_size, Hk, D, generator=g) for _ in range(2)]
            for name, dt, kv_dtype in (("fp32", torch.float32, None),
                                       ("bf16", torch.bfloat16, None),
                                       ("int8", torch.float32, "int8")):
                cache = FastPagedCache(args, B * per_row, block_size, B, ctx + 1, dtype=dt,
                                       kv_dtype=kv_dtype)
                m = cache.managers[0]
                for pool, x in zip((m.k_cache_paged, m.v_cache_paged), kv):
                    pool.copy_(quantize_int8(x) if kv_dtype else x.to(dt))
                cache.prepare(list(range(B)), ctx)
                cache.prepare(list(range(B)), 1)
                step = cache.decode_attention()
                qd, kd, vd = q.to(dt), k.to(dt), v.to(dt)
                step.attend(0, qd, kd, vd)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    step.attend(0, qd, kd, vd)
                    times.append(time.perf_counter() - start)
                out[ctx, B, name] = statistics.median(times) * 1e6
                del cache, step
    return out


def pow2_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Rows (..., D) through int8 codes with a power-of-two scale (what a 1-byte E8M0 scale
    stores): scale = 2^ceil(log2(max|x| / 127)), codes = round(x / scale); read back."""
    amax = x.abs().amax(-1, keepdim=True).float()
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / QMAX))), 0)
    codes = torch.where(scale > 0, x / scale, 0).round().clamp(-QMAX, QMAX)
    return codes * scale


@torch.inference_mode()
def scale_formats(model, stream, window: int = 256) -> dict:
    """Per scale format (float16, E8M0): (bytes a (token, head) row takes, mean relative error
    of the model's K rows, of its V rows), the rows of every layer over one held-out window."""
    cache = PagedCache(model.args, window // 16, 16, 1, window)
    cache.prepare([0], window)
    model(stream[None, :window], cache=cache)
    rows = {"K": [], "V": []}
    for m in cache.managers:
        table = m.block_table[0, :window // 16].long()
        rows["K"].append(m.k_cache_paged[table].flatten(0, 2))         # (tokens * Hk, D)
        rows["V"].append(m.v_cache_paged[table].flatten(0, 2))
    D, out = model.args.head_dim, {}
    for name, bytes_, roundtrip in (("float16", D + 2, lambda x: dequantize_int8(quantize_int8(x))),
                                    ("E8M0", D + 1, pow2_roundtrip)):
        errors = []
        for kv in ("K", "V"):
            x = torch.cat(rows[kv])
            errors.append(float(((roundtrip(x) - x).norm(dim=-1) / x.norm(dim=-1)).mean()))
        out[name] = (bytes_, *errors)
    return out


def load(name: str):
    path = None if name == "embedded" else packaged_model_path("smollm2")
    return load_model(path, dtype=torch.float32), load_tokenizer(path)


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.kv_int8",
                           description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=["embedded", "smollm2"],
                   default=["embedded", "smollm2"])
    p.add_argument("--new-tokens", type=cli.whole(1), default=64)
    p.add_argument("--budget-mib", type=cli.whole(1), default=64)
    p.add_argument("--contexts", type=cli.whole(16), nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--repeats", type=cli.whole(1), default=20)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--threads", type=cli.whole(1), default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 160)
    loaded = {name: load(name) for name in args.models}

    shapes = {name: m.args for name, (m, _) in loaded.items()} | {"Llama 3 8B": LLAMA3_8B}
    t = Table(title=f"1. Capacity: tokens a {args.budget_mib} MiB KV budget holds (blocks of 16)")
    for c in ("model", "KV heads x head_dim x layers", "bytes/token fp32 / bf16 / int8",
              "tokens fp32", "tokens bf16", "tokens int8", "int8 / bf16", "int8 / fp32"):
        t.add_column(c, justify="right")
    for name, a, per_token, tokens in capacity(shapes, args.budget_mib * 2**20):
        t.add_row(name, f"{a.n_kv_heads} x {a.head_dim} x {a.n_layers}",
                  " / ".join(f"{b:,}" for b in per_token), *(f"{n:,}" for n in tokens),
                  f"{tokens[2] / tokens[1]:.2f}x", f"{tokens[2] / tokens[0]:.2f}x")
    console.print(t)

    t = Table(title=f"2. Accuracy of int8 blocks against fp32 blocks (model in fp32, 16 chat "
                    f"prompts x {args.new_tokens} greedy tokens)")
    for c in ("model", "prompts identical", "tokens matched before the 1st difference (mean, min)",
              "max |logit error|, any step", "mean logit std",
              "fp32 top-2 margin at the 1st difference (median, max)",
              "held-out perplexity fp32 / int8"):
        t.add_column(c, justify="right")
    for name, (model, tok) in loaded.items():
        if args.skip_accuracy:
            break
        prompts = chat_prompts(tok)
        want, same = greedy_agreement(model, prompts, args.new_tokens)
        errors, spreads, margins = logit_errors(model, prompts, want, same)
        stream = token_stream(chat_format(tok), build_corpus().heldout)
        ppl = [perplexity(model, stream, kv_dtype=kv) for kv in (None, "int8")]
        t.add_row(name, f"{sum(s == args.new_tokens for s in same)} / {len(same)}",
                  f"{statistics.mean(same):.1f}, {min(same)}", f"{max(errors):.4f}",
                  f"{statistics.mean(spreads):.2f}",
                  f"{statistics.median(margins):.3f}, {max(margins):.3f}" if margins else "-",
                  f"{ppl[0]:.5f} / {ppl[1]:.5f}")
        console.print(f"[dim]{name}: max |logit error| per decode step: "
                      + " ".join(f"{e:.3f}" for e in errors[:16]) + " ...[/dim]")
    if not args.skip_accuracy:
        console.print(t)

    t = Table(title="4. The scale: float16 (kept) against a 1-byte power of two (E8M0), on the "
                    "model's own K/V rows (all layers, 256 held-out tokens)")
    for c in ("model", "scale", "bytes per head_dim values", "tokens / bf16's at one budget",
              "mean relative error, K rows", "V rows"):
        t.add_column(c, justify="right")
    for name, (model, tok) in loaded.items():
        stream = token_stream(chat_format(tok), build_corpus().heldout)
        D = model.args.head_dim
        for scale, (nbytes, k_err, v_err) in scale_formats(model, stream).items():
            t.add_row(name, scale, f"{nbytes} per {D}", f"{2 * D / nbytes:.2f}x",
                      f"{k_err:.4f}", f"{v_err:.4f}")
    console.print(t)

    for backend, path in (("torch", "stage 3's PyTorch path"), ("cpu", "stage 3b's C kernel"),
                          ("fast", "the speed layer's decode step")):
        if args.skip_speed:
            break
        speed = speed_layer_speed(args.contexts, (1, 16), args.repeats) if backend == "fast" \
            else attention_speed(args.contexts, (1, 16), args.repeats, backend)
        t = Table(title=f"3. One layer's decode attention, {path}, microseconds (median), "
                        f"SmolLM2's heads: 9 query, 3 KV, head_dim 64")
        for c in ("context", "batch", "fp32", "bf16", "int8", "int8 / fp32", "int8 / bf16"):
            t.add_column(c, justify="right")
        for ctx in args.contexts:
            for B in (1, 16):
                f32, b16, i8 = (speed[ctx, B, n] for n in ("fp32", "bf16", "int8"))
                t.add_row(f"{ctx:,}", str(B), f"{f32:,.0f}", f"{b16:,.0f}", f"{i8:,.0f}",
                          f"{i8 / f32:.2f}", f"{i8 / b16:.2f}")
        console.print(t)
    console.print(f"[dim]CPU: {kernels()['cpu']}; attention kernel: "
                  f"{kernels(torch.float32, 64, 3)['attention']}[/dim]")
    console.print(f"[dim]{torch.get_num_threads()} torch thread(s), load average "
                  f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.[/dim]")


if __name__ == "__main__":
    raise SystemExit(main())
