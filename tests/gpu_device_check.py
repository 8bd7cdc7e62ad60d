"""What a lent GPU machine checks and times; `tests/gpu_device_check.sh` runs it there.

Not a test file (pytest does not collect it): a GPU machine is lent to some sessions only, for
minutes, so everything it should show is prepared here and run as one command. Parts:

  trim DIR   cut flash-attn 2.8.3.post2's unpacked sdist to what `flash_attn_with_kvcache` with
             a block table runs (the paged call always takes the split-KV kernels): head dims
             32, 64 and 128, fp16 and bf16, causal or not, sm90, no backward, dropout, ALiBi,
             softcap or local windows. 12 kernel objects and the API instead of 73 objects.
  engines    the embedded model on CUDA in bf16, on Triton (blocks of 16 and 256) and flash-attn
             (256): stage 3's static batch, stages 5-7's engines through `generate(...,
             cache="paged")` (preemption by recompute and by swap, chunked prefill, prefix
             caching, two samples a prompt, speculation) and stage 6b's beam search give the
             contiguous cache's tokens.
  bench      decode-call latency at batch 1, 8 and 64, 512 to 8,192 keys a row, Llama-3-8B
             attention (32 query heads, 8 KV heads, head_dim 128, bf16): Triton with its merge
             kernel, Triton with the PyTorch merge it replaced, the partition kernel alone, and
             flash-attn's kernel, each the median of CUDA-graph replays.

`--small` shrinks every size so that a CPU runs the script in Triton's interpreter: the dry run
before the machine is asked for.
"""

import argparse
import contextlib
import os
import pathlib
import shutil
import statistics
import sys
import time

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("part", choices=["trim", "engines", "bench"])
p.add_argument("folder", nargs="?", help="trim: the unpacked sdist")
p.add_argument("--small", action="store_true", help="tiny sizes, on a CPU: the dry run")
p.add_argument("--batches", default="1,8,64", help="bench: batch sizes")
p.add_argument("--backends", default="triton,flash_attn", help="engines: backends to run")
args = p.parse_args()

if args.small:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported
if args.part != "trim":                                 # trim needs neither torch nor minipaged
    import torch

    from minipaged import backends
    from minipaged import triton_attention as ta
    from minipaged.online_softmax import combine_partitions

    DEV = "cpu" if args.small else "cuda"
    HAVE_FLASH = backends.flash_attn_available()


# ---------------------------------------------------------------------------------- trim
def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"not found once in the sdist: {old[:60]!r}"
    return text.replace(old, new)


def trim(root: pathlib.Path):
    """Edit the sdist in place; every edit asserts that the text it replaces is there."""
    setup = root / "setup.py"
    s = setup.read_text()
    start = s.index('"csrc/flash_attn/flash_api.cpp",')
    end = s.index("],", start)
    keep = ['"csrc/flash_attn/flash_api.cpp",'] + [
        f'"csrc/flash_attn/src/flash_fwd_split_hdim{d}_{t}{c}_sm80.cu",'
        for d in (32, 64, 128) for t in ("fp16", "bf16") for c in ("", "_causal")]
    s = s[:start] + "\n                ".join(keep) + "\n            " + s[end:]
    flags = ["BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "UNEVEN_K", "LOCAL"]
    for f in flags:          # setup.py lists these switches commented out: switch them on
        switch_on = f'    "-DFLASHATTENTION_DISABLE_{f}",'
        s = s.replace(switch_on.replace('"', '# "', 1), switch_on)
        assert f'    "-DFLASHATTENTION_DISABLE_{f}",' in s, f
    s = s.replace('compiler_c17_flag=["-O3", "-std=c++17"]',
                  'compiler_c17_flag=["-O3", "-std=c++17"] + '
                  + repr([f"-DFLASHATTENTION_DISABLE_{f}" for f in flags]), 1)
    assert "-DFLASHATTENTION_DISABLE_BACKWARD'" in s
    setup.write_text(s)

    api = root / "csrc/flash_attn/flash_api.cpp"
    a = api.read_text()
    # the forward calls the split kernels only (the paged call always does), the backward refuses
    a = replace_once(a, """\
                if (params.num_splits <= 1 && !force_split_kernel) {"""
                     """  // If we don't set it num_splits == 0
                    run_mha_fwd_<elem_type, kHeadDim, Is_causal>(params, stream);
                } else {
                    run_mha_fwd_splitkv_dispatch<elem_type, kHeadDim, Is_causal>(params, stream);
                }""", """\
                run_mha_fwd_splitkv_dispatch<elem_type, kHeadDim, Is_causal>(params, stream);""")
    a = replace_once(a, """\
    FP16_SWITCH(!params.is_bf16, [&] {
        HEADDIM_SWITCH(params.d, [&] {
            BOOL_SWITCH(params.is_causal, Is_causal, [&] {
                run_mha_bwd_<elem_type, kHeadDim, Is_causal>(params, stream);
            });
        });
    });""", """\
    TORCH_CHECK(false, "This trimmed flash attention build has no backward.");""")
    api.write_text(a)

    switch = root / "csrc/flash_attn/src/static_switch.h"     # the macro ends the file
    w = switch.read_text()
    w = w[:w.index("#define HEADDIM_SWITCH")] + """\
#define HEADDIM_SWITCH(HEADDIM, ...)   \\
  [&] {                                    \\
    TORCH_CHECK(HEADDIM == 32 || HEADDIM == 64 || HEADDIM == 128, \\
                "This trimmed flash attention build has head dims 32, 64 and 128 only."); \\
    if (HEADDIM == 32) {                   \\
      constexpr static int kHeadDim = 32;  \\
      return __VA_ARGS__();                \\
    } else if (HEADDIM == 64) {            \\
      constexpr static int kHeadDim = 64;  \\
      return __VA_ARGS__();                \\
    } else {                               \\
      constexpr static int kHeadDim = 128; \\
      return __VA_ARGS__();                \\
    }                                      \\
  }()
"""
    switch.write_text(w)
    for d in ("csrc/composable_kernel", "csrc/cutlass/test", "csrc/cutlass/examples",
              "csrc/cutlass/tools", "csrc/cutlass/python", "csrc/cutlass/docs",
              "csrc/cutlass/media", "hopper", "tests", "csrc/flash_attn_ck", "csrc/layer_norm",
              "csrc/fused_dense_lib"):
        shutil.rmtree(root / d, ignore_errors=True)
    kept = "".join(keep)
    for f in (root / "csrc/flash_attn/src").glob("flash_*_hdim*.cu"):
        if f"flash_attn/src/{f.name}" not in kept:
            f.unlink()
    print(f"trimmed: {len(keep)} sources to compile")


# ------------------------------------------------------------------------------- engines
def compare(name, got, want, note=""):
    """A line: how many prompts' tokens equal the reference's, and where the first differs."""
    same = sum(a == b for a, b in zip(got, want))
    line = f"- {name}: {same}/{len(want)} identical{note}"
    if same < len(want):
        first = min(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                    for a, b in zip(got, want) if a != b)
        line += f"  <-- DIFFERS (first at token {first})"
    print(line, flush=True)
    return same == len(want)


def engines():
    from minipaged import Engine, beam_search, generate, load_model
    from minipaged.formats.loading import load_tokenizer
    from minipaged.paged_generation import generate_paged

    tok = load_tokenizer()
    texts = ["Once upon a time", "The little dog ran to the", "She opened the box and",
             "In the morning the sun"]
    prefix = tok.encode(" ".join(texts * (2 if args.small else 12)), bos=True)
    # two short prompts, two that share a long prefix (prefix caching has whole blocks to share)
    prompts = [tok.encode(texts[0], bos=True), tok.encode(texts[1], bos=True),
               prefix + tok.encode(" " + texts[2]), prefix + tok.encode(" " + texts[3])]
    n = 6 if args.small else 48
    dtype = torch.float32 if args.small else torch.bfloat16
    model = load_model(device=DEV, dtype=dtype)
    print(f"\n## The embedded model on {DEV} ({str(dtype)[6:]}): paged tokens == contiguous\n"
          f"prompts of {[len(q) for q in prompts]} tokens, {n} new tokens each\n", flush=True)

    def contiguous(**kw):
        return generate(model, prompts, n, cache="contiguous", stop_tokens=[], **kw)
    want = contiguous()
    try:
        want_sampled = contiguous(temperature=0.8, n=2, seed=3)
    except RuntimeError as e:                   # a report, not a test: say so and go on
        want_sampled = None
        print(f"- the contiguous cache's sampled reference: ERROR {e}", flush=True)
    want_beams = beam_search(model, prompts[2], 3, n // 2, cache="contiguous", stop_tokens=[])

    runs = [(b, bs) for b in args.backends.split(",") for bs in (16, 256)
            if b != "flash_attn" or (bs == 256 and HAVE_FLASH)]
    if args.small:
        runs = [(b, 16 if bs == 256 else 4) for b, bs in runs]

    class Watched(Engine):
        """The engine `generate` builds, kept so that its preemptions can be read after."""
        last = None

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            Watched.last = self

    merges = []                                # the merge kernel's calls, counted
    merge = ta.combine
    ta.combine = lambda *a: merges.append(1) or merge(*a)
    ok = True
    for backend, bs in runs:
        print(f"### {backend}, blocks of {bs}", flush=True)
        merges.clear()
        longest = max(len(q) for q in prompts) + n
        tight = max(-(-longest // bs) + 1, sum(-(-(len(q) + n) // bs) for q in prompts) // 2)
        paged = dict(cache="paged", block_size=bs, backend=backend, stop_tokens=[],
                     engine_class=Watched)
        checks = [
            ("stage 3, static batch (generate_paged)",
             lambda: generate_paged(model, prompts, n, block_size=bs, backend=backend,
                                    stop_tokens=[]), want),
            ("stage 5, the engine", lambda: generate(model, prompts, n, **paged), want),
            (f"stage 5, preemption by recompute ({tight} blocks)",
             lambda: generate(model, prompts, n, num_blocks=tight, **paged), want),
            (f"stage 5, preemption by swap ({tight} blocks)",
             lambda: generate(model, prompts, n, num_blocks=tight, preemption="swap", **paged),
             want),
            ("stage 5b, chunked prefill (32 tokens a step)",
             lambda: generate(model, prompts, n, max_num_batched_tokens=32, **paged), want),
            ("stage 6, prefix caching",
             lambda: generate(model, prompts, n, prefix_caching=True, **paged), want),
            ("stage 6, two samples a prompt (temperature 0.8)",
             lambda: generate(model, prompts, n, temperature=0.8, n=2, seed=3, **paged),
             want_sampled),
            ("stage 7, speculation (ngram, 4 drafts)",
             lambda: generate(model, prompts, n, speculative="ngram", num_speculative_tokens=4,
                              **paged), want),
            ("stage 6b, beam search (width 3)",
             lambda: [t for t, _ in beam_search(model, prompts[2], 3, n // 2, block_size=bs,
                                                backend=backend, stop_tokens=[])],
             [t for t, _ in want_beams]),
        ]
        for name, run, expected in checks:
            if expected is None:
                continue
            try:
                Watched.last = None
                got = run()
                preempted = Watched.last.stats.preemptions if Watched.last else 0
                ok &= compare(name, got, expected,
                              f" (preempted {preempted} times)" if preempted else "")
            except Exception as e:                  # noqa: BLE001 (a report, not a test)
                ok = False
                print(f"- {name}: ERROR {type(e).__name__}: {e}", flush=True)
        if backend == "triton":
            print(f"  (the merge kernel ran {len(merges)} times)", flush=True)
    ta.combine = merge
    print("\nengines:", "ALL IDENTICAL" if ok else "SOME DIFFER OR FAILED", flush=True)


# --------------------------------------------------------------------------------- bench
def time_us(fn, calls=20, replays=25):
    """Microseconds a call: the median over `replays` replays of a CUDA graph of `calls` calls
    (the graph keeps the host's launch cost out, as a serving engine's graphs do). Every call
    reads the same keys, so as much of them as fits stays in L2, for every column alike."""
    fn()                                                     # compile, warm up
    if DEV != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


@contextlib.contextmanager
def merged_by(combine):
    """Run the Triton path with another merge in place of `ta.combine` (the old PyTorch one, or
    none: the partition kernel alone)."""
    kept = ta.combine
    ta.combine = combine
    try:
        yield
    finally:
        ta.combine = kept


def pytorch_merge(m, l, acc, out):
    return combine_partitions(m, l, acc).to(out.dtype)       # the code the kernel replaced


def no_merge(m, l, acc, out):
    return out


def bench():
    Hq, Hk, D, dtype = 32, 8, 128, torch.bfloat16
    contexts = (512, 1024, 2048, 4096, 8192)
    batches = [int(b) for b in args.batches.split(",")]
    blocks = (16, 256)
    if args.small:
        Hq, Hk, D, dtype, contexts, blocks = 4, 2, 32, torch.float32, (128, 256), (4, 16)
        batches = [1, 2]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 132
    if DEV == "cuda":
        import triton
        pr = torch.cuda.get_device_properties(0)
        print(f"\ndevice: {pr.name}, {pr.multi_processor_count} SMs; torch {torch.__version__}, "
              f"triton {triton.__version__}, flash_attn "
              f"{'importable' if HAVE_FLASH else 'absent'}")
    flash = None
    if HAVE_FLASH:
        from flash_attn import flash_attn_with_kvcache as flash
    scale = D ** -0.5
    print(f"\n## Decode-call latency, µs (median of CUDA-graph replays, 20 calls a graph): "
          f"{Hq} query heads, {Hk} KV heads, head_dim {D}, {str(dtype)[6:]}, one query token a "
          f"row, every row `keys` long, blocks scattered over the pool by randperm\n")
    cols = ["flash-attn (256)", "Triton (256)", "Triton (16)", "Triton (256), PyTorch merge",
            "partition kernel alone (256)", "splits", "Triton / flash-attn",
            "largest difference, Triton and flash-attn"]
    print("| batch | keys | " + " | ".join(cols) + " |")
    print("|---" * (2 + len(cols)) + "|", flush=True)
    variants, ratios = [], []
    gen = torch.Generator(device=DEV).manual_seed(0)
    for B in batches:
        for L in contexts:
            q = torch.randn(B, 1, Hq, D, generator=gen, device=DEV, dtype=dtype)
            lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
            pools = {}
            for bs in blocks:
                per_row = -(-L // bs)
                kc, vc = (torch.randn(B * per_row, bs, Hk, D, generator=gen, device=DEV,
                                      dtype=dtype) for _ in range(2))
                table = torch.randperm(B * per_row, generator=gen, device=DEV,
                                       dtype=torch.int32).view(B, per_row)
                pools[bs] = (kc, vc, table)
            splits = ta.choose_splits(B * Hk, L, sms)      # what the backend picks on this GPU

            def triton_call(bs, n_splits=splits):
                kc, vc, table = pools[bs]
                how = ta.launch(B, 1, Hq, Hk, n_splits)
                return lambda: ta.run_kernels(how, q, kc, vc, table, lens, L, True, scale)

            row = {}
            big = blocks[-1]
            if flash is not None:
                kc, vc, table = pools[big]
                row["flash"] = time_us(lambda: flash(q, kc, vc, cache_seqlens=lens,
                                                     block_table=table, causal=True))
            row["t_big"] = time_us(triton_call(big))
            row["t_small"] = time_us(triton_call(blocks[0]))
            with merged_by(pytorch_merge):
                row["t_old"] = time_us(triton_call(big)) if splits > 1 else row["t_big"]
            with merged_by(no_merge):
                row["kernel"] = time_us(triton_call(big))
            diff = "–"
            if flash is not None:
                kc, vc, table = pools[big]
                want = flash(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True)
                diff = f"{(triton_call(big)().float() - want.float()).abs().max():.1e}"
            ratio = f"{row['t_big'] / row['flash']:.2f}" if "flash" in row else "–"
            if "flash" in row and B == 1 and 1024 <= L <= 8192:
                ratios.append(row["t_big"] / row["flash"])
            fa = f"{row['flash']:.1f}" if "flash" in row else "–"
            print(f"| {B} | {L} | {fa} | {row['t_big']:.1f} | "
                  f"{row['t_small']:.1f} | {row['t_old']:.1f} | {row['kernel']:.1f} | {splits} | "
                  f"{ratio} | {diff} |", flush=True)
            if B == 1:                           # the split count's floor, tried two other ways
                for min_keys in (128, 256):
                    n_splits = ta.choose_splits(B * Hk, L, sms, min_keys)
                    variants.append((L, min_keys, n_splits, time_us(triton_call(big, n_splits))))
            pools.clear()
            if DEV == "cuda":
                torch.cuda.empty_cache()
    print(f"\n## Batch 1, Triton (256) with partitions of at least 128 or 256 keys (the table: "
          f"at least {ta.MIN_SPLIT_KEYS})\n")
    print("| keys | at least | splits | µs |\n|---|---|---|---|")
    for L, min_keys, n_splits, t in variants:
        print(f"| {L} | {min_keys} | {n_splits} | {t:.1f} |", flush=True)
    if ratios:
        print(f"\nbatch 1, 1,024 to 8,192 keys: Triton takes {min(ratios):.2f}-{max(ratios):.2f}x "
              f"flash-attn's time (target: at most 1.3x): "
              f"{'MET' if max(ratios) <= 1.3 else 'MISSED'}", flush=True)


if args.part == "trim":
    trim(pathlib.Path(args.folder))
elif args.part == "engines":
    engines()
else:
    bench()
sys.exit(0)
