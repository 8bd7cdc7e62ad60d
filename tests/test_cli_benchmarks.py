"""Bad input to the benchmarks (`python -m minipaged.benchmarks.<name>`): every one refused
with one `error: ...` line and exit 2 before any work (a KV budget the machine cannot hold
included), nothing written; a small run of each cheap one still works."""

import json
import os
import signal
import sys
import time

import pytest
import torch
from cli_probes import ROOT, answered, digest, refused, run_many

from minipaged import generate
from minipaged.benchmarks.serving import sharegpt_like_trace
from minipaged.formats import load_model, packaged_model_path

CASES = {   # module: {argv: what the error line names (None: answered)}
    "policies": {
        ("--requests", "0"): ["--requests"],
        ("--requests", "-5"): ["--requests"],
        ("--kv-budget-tokens", "0"): ["--kv-budget-tokens"],
        ("--max-seq-len", "0"): ["--max-seq-len"],
        ("--bytes-per-token", "0"): ["--bytes-per-token"],
        ("--seed", "-1"): ["--seed"],
        ("--workload", "/nonexistent/trace.csv"): ["does not exist"],
        ("--workload", "nope"): ["nope"],
        ("--workload", "BINARY_CSV"): ["cannot read", "UTF-8"],
        ("--workload", "NEGATIVE_CSV"): ["output_len", "-5"],
        ("--figures", "/proc/figures", "--requests", "50"): ["--figures", "cannot write"],
        ("--figures", "FIGURES", "--readme-figures"): ["not both"],
        ("--figures", "FIGURES", "--no-plots"): ["--no-plots"],
        ("--figures", "DRAWN", "--requests", "50"): None,
        ("--requests", "50", "--no-plots"): None,
    },
    "serving": {
        ("--random-model", "--requests", "0"): ["--requests"],
        ("--random-model", "--scale", "0"): ["--scale"],
        ("--random-model", "--scale", "nan"): ["--scale"],
        ("--random-model", "--scale", "1000"): ["mean lengths"],
        ("--random-model", "--budget-rows", "0"): ["--budget-rows"],
        ("--random-model", "--block-size", "0"): ["--block-size"],
        ("--random-model", "--threads", "0"): ["--threads"],
        ("--random-model", "--budget-rows", "100000000"): ["needs", "available",
                                                           "rows (--budget-rows)"],
        ("--random-model", "--sweep", "--figures", "/nonexistent/x"): ["--figures"],
        ("--random-model", "--figures", "FIGURES", "--readme-figures"): ["not both"],
        ("--model", "/nonexistent/model"): ["/nonexistent/model"],
        ("--random-model", "--requests", "3", "--budget-rows", "1"): None,
    },
    "bookkeeping": {
        ("--batch", "0"): ["--batch"],
        ("--layers", "0"): ["--layers"],
        ("--steps", "0"): ["--steps"],
        ("--repeats", "0"): ["--repeats"],
        ("--block-size", "0"): ["--block-size"],
        ("--kv-budget", "0"): ["--kv-budget"],
        ("--kv-budget", "1TiB"): ["--kv-budget", "not a size"],
        ("--kv-budget", "100B"): ["holds no block"],
        ("--batch", "100000000", "--steps", "5"): ["--batch", "blocks per layer"],
        ("--steps", "5", "--repeats", "1", "--batch", "8", "--layers", "2"): None,
    },
    "decode_step": {
        ("--batch", "0"): ["--batch"],
        ("--layers", "0"): ["n_layers"],
        ("--heads", "3"): ["heads must split evenly"],
        ("--kv-heads", "3"): ["heads must split evenly"],
        ("--min-context", "100", "--max-context", "50"): ["--min-context"],
        ("--steps", "0"): ["--steps"],
        ("--block-size", "0"): ["--block-size"],
        ("--vocab", "0"): ["vocab_size"],
        ("--threads", "0"): ["--threads"],
        ("--max-context", str(10 ** 12)): ["needs", "available"],
        ("--batch", "2", "--layers", "1", "--dim", "64", "--heads", "4", "--kv-heads", "2",
         "--min-context", "8", "--max-context", "16", "--steps", "2", "--warmup", "0"): None,
    },
    "sharing_savings": {
        ("--random-model", "--samples", "0"): ["--samples"],
        ("--random-model", "--requests", "0"): ["--requests"],
        ("--random-model", "--scale", "0"): ["--scale"],
        ("--random-model", "--block-size", "0"): ["--block-size"],
        ("--random-model", "--chats", "0"): ["--chats"],
        ("--random-model", "--turns", "0"): ["--turns"],
        ("--random-model", "--new-tokens", "0"): ["--new-tokens"],
        ("--random-model", "--threads", "0"): ["--threads"],
        ("--model", "/nonexistent/model"): ["/nonexistent/model"],
    },
    "beam_savings": {
        ("--random-model", "--requests", "0"): ["--requests"],
        ("--random-model", "--scale", "0"): ["--scale"],
        ("--random-model", "--widths", "0"): ["--widths"],
        ("--random-model", "--block-size", "0"): ["--block-size"],
        ("--random-model", "--threads", "0"): ["--threads"],
        ("--model", "/nonexistent/model"): ["/nonexistent/model"],
    },
    "chunked_latency": {
        ("--random-model", "--chats", "0"): ["--chats"],
        ("--random-model", "--budgets", "0"): ["--budgets"],
        ("--random-model", "--repeats", "0"): ["--repeats"],
        ("--random-model", "--long-every", "-1"): ["--long-every"],
        ("--random-model", "--block-size", "0"): ["--block-size"],
        ("--random-model", "--long-prompt", "5000"): ["positions"],
        ("--model", "/nonexistent/model"): ["/nonexistent/model"],
    },
    "disaggregated_latency": {
        ("--chats", "0"): ["--chats"],
        ("--repeats", "0"): ["--repeats"],
        ("--budget", "-1"): ["--budget"],
        ("--long-prompt", "5000"): ["positions"],
        ("--chats", "1", "--chat-tokens", "4", "--long-prompt", "40", "--long-every", "2",
         "--repeats", "1"): None,
    },
    "smollm2": {
        ("--new-tokens", "0"): ["--new-tokens"],
        ("--repeats", "0"): ["--repeats"],
        ("--dtypes", "float64"): ["--dtypes"],
        ("--threads", "0"): ["--threads"],
        ("--new-tokens", "1"): ["--new-tokens"],
        ("--cache-dir", "/proc/llama_cpp"): ["--cache-dir"],
        ("--figures", "/nonexistent/x"): ["--figures", "does not exist"],
        ("--figures", "FIGURES", "--readme-figures"): ["not both"],
    },
    "serving_peers": {
        ("--requests", "0"): ["--requests"],
        ("--requests", "300"): ["--requests"],
        ("--runs", "0"): ["--runs"],
        ("--scale", "0.5"): ["--scale"],
        ("--new-tokens", "1"): ["--new-tokens"],
        ("--dtypes", "float64"): ["--dtypes"],
        ("--threads", "0"): ["--threads"],
        ("--threads", "100000"): ["--threads"],
        ("--vllm-python", "/nonexistent/python"): ["--vllm-python", "cannot run"],
        ("--vllm-python", "PYTHON"): ["--vllm-python", "cannot import vllm"],
        ("--cache-dir", "/proc/llama_cpp"): ["--cache-dir"],
        ("--json", "/nonexistent/out.json"): ["--json", "does not exist"],
        ("--isa", "sse2"): ["--isa"],
    },
    "soak": {
        ("--requests", "2"): ["--requests"],
        ("--clients", "0"): ["--clients"],
        ("--seconds", "0"): ["--seconds"],
        ("--requests", "8", "--clients", "2", "--streams", "2", "--seconds", "1"): None,
    },
    "products": {
        ("--rows", "0"): ["--rows"],
        ("--rows", "513"): ["--rows"],
        ("--repeats", "0"): ["--repeats"],
        ("--dtypes", "float64"): ["--dtypes"],
        ("--isa", "sse2"): ["--isa"],
        ("--rows", "2", "--repeats", "1", "--dtypes", "float16"): None,
    },
}


@pytest.mark.parametrize("module", CASES)
def test_bad_arguments_are_refused_and_small_runs_work(module, tmp_path):
    binary, negative = tmp_path / "binary.csv", tmp_path / "negative.csv"
    binary.write_bytes(b"prompt_len,output_len\n" + bytes(range(128, 256)) * 8)
    negative.write_text("prompt_len,output_len\n10,-5\n")
    figures = tmp_path / "figures"
    paths = {"BINARY_CSV": binary, "NEGATIVE_CSV": negative, "FIGURES": figures,
             "DRAWN": tmp_path / "drawn", "PYTHON": sys.executable}
    cases = CASES[module]
    probes = [([paths.get(a, a) for a in argv], None) for argv in cases]
    assets = digest(ROOT / "assets")       # a probe that runs by mistake may draw over them
    results = run_many(f"minipaged.benchmarks.{module}", probes, MPLBACKEND="Agg")
    assert digest(ROOT / "assets") == assets, "a probe wrote into assets/"
    for words, result in zip(cases.values(), results):
        if words is None:
            answered(result)
        else:
            refused(result, *words)
    drawn = {"policies": ["drawn"]}.get(module, [])       # the answered --figures run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.csv", *drawn, "negative.csv"]
    if drawn:
        assert sorted(p.name for p in (tmp_path / "drawn").iterdir()) == [
            "fragmentation_block_size.png", "fragmentation_concurrency.png",
            "fragmentation_policies.png"]


def test_by_default_figures_go_to_a_new_temporary_folder_and_the_run_says_where(tmp_path):
    """The README's figures in assets/ are redrawn only with --readme-figures."""
    assets = digest(ROOT / "assets")
    result = run_many("minipaged.benchmarks.policies", [(["--requests", "50"], None)],
                      MPLBACKEND="Agg", TMPDIR=str(tmp_path))[0]
    answered(result)
    assert digest(ROOT / "assets") == assets
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("minipaged-policies-")
    drawn = sorted(p.name for p in folder.iterdir())
    assert drawn == ["fragmentation_block_size.png", "fragmentation_concurrency.png",
                     "fragmentation_policies.png"]
    for name in drawn:
        assert f"wrote {folder / name}" in result["stdout"]


def test_serving_peers_short_run_gives_the_reference_tokens(tmp_path):
    """A short run of the serving comparison: one row per job, and minipaged's greedy tokens (and
    llama.cpp's, where llama_cpp imports) are the ones stage 1's contiguous cache picks in
    float64. vLLM needs its own environment and is not run here; the run says so."""
    out = tmp_path / "peers.json"
    result = run_many("minipaged.benchmarks.serving_peers", [(
        ["--requests", "4", "--scale", "32", "--new-tokens", "4", "--runs", "1", "--dtypes",
         "float32", "--threads", "1", "--no-compile", "--cache-dir", tmp_path / "cache", "--json", out], None)],
        TMPDIR=str(tmp_path))[0]
    answered(result)
    assert "vLLM: not run" in result["stdout"]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["run"], r["job"]) for r in rows] == [(1, "batch 1"), (1, "4 requests")]
    engines = set(rows[0]["rates"])
    assert engines in ({"minipaged"}, {"minipaged", "llama.cpp"})
    if engines == {"minipaged"}:
        assert "llama.cpp: not importable" in result["stdout"]
    trace, _ = sharegpt_like_trace(4, scale=32, vocab=49152, seed=0)
    jobs = {"batch 1": [(trace[0][0], 4)], "4 requests": trace}
    model = load_model(packaged_model_path("smollm2"), dtype=torch.float64)
    tokens = json.loads(out.read_text())["tokens"]
    for job, requests in jobs.items():
        want = generate(model, [p for p, _ in requests], [n for _, n in requests],
                        cache="contiguous", stop_tokens=[])
        for engine in engines:
            assert tokens[f"float32, {job}"][engine] == want, (engine, job)
        assert f"greedy tokens, float32, {job}" in result["stdout"] or engines == {"minipaged"}


def test_a_paused_worker_and_its_children_use_no_cpu_until_continued(tmp_path):
    """serving_peers pauses the engines that are not being timed: a worker whose child spins
    (as vLLM's engine core is a child of its worker) uses no CPU while paused, and spins again
    once continued."""
    from minipaged.benchmarks.serving_peers import Worker, process_tree
    spin = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])" \
           "\nwhile True: pass"
    worker = Worker("spinner", [sys.executable, "-c", spin], tmp_path / "spinner.log",
                    dict(os.environ))
    try:
        deadline = time.monotonic() + 30
        while len(process_tree(worker.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(process_tree(worker.proc.pid)) == 2               # the worker and its child

        def used(seconds):
            before = worker.cpu()
            time.sleep(seconds)
            return worker.cpu() - before
        assert used(0.5) > 0.2
        worker.pause(True)
        time.sleep(0.1)
        assert used(0.5) == 0
        worker.pause(False)
        assert used(0.5) > 0.2
    finally:
        for pid in process_tree(worker.proc.pid):
            os.kill(pid, signal.SIGKILL)
        worker.proc.wait()


def test_vllm_limited_to_avx2_sees_no_avx512(tmp_path):
    """serving_peers --isa avx2 starts vLLM with a sitecustomize that answers torch's AVX-512
    checks no (vLLM then loads its AVX2 kernels) and torch's own kernels limited to AVX2."""
    import subprocess
    from minipaged.benchmarks.products import isa_environment
    from minipaged.benchmarks.serving_peers import vllm_limited_to
    env = vllm_limited_to("avx2", tmp_path, isa_environment("avx2"))
    seen = subprocess.run([sys.executable, "-c", "import torch; print(torch.cpu._is_avx512_supported("
                           "), torch.cpu._is_avx512_bf16_supported(), "
                           "torch.backends.cpu.get_cpu_capability())"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert seen.stdout.split() == ["False", "False", "AVX2"], seen.stdout + seen.stderr
