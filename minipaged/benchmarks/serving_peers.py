"""minipaged's engine beside the serving engines a CPU user would pick: vLLM's CPU build and
llama.cpp's own continuous batching, on SmolLM2-135M-Instruct, requests arriving together.

    python -m minipaged.benchmarks.serving_peers --vllm-python /path/to/venv-vllm/bin/python
    python -m minipaged.benchmarks.serving_peers --vllm-python ... --requests 16 --runs 1 --busy

(the second beside a busy loop too). The engines run each in a process of its own (`work`
here for minipaged, `peer_worker` for the peers), loaded once per dtype and given the same jobs
in turns, the order rotating from run to run; the next turn starts only once every engine's
processes are idle (an idle vLLM worker spins its threads for a while after a call, and
llama.cpp's threads spin-wait), and the engines not being timed are paused meanwhile (SIGSTOP,
their children too: idle, vLLM's processes still woke now and then), so nothing runs beside
the engine being timed; the CPU they used during each turn is printed:

  * minipaged: `minipaged.fast`'s engine (`FastEngine` on `FusedLlama`, its steps compiled,
    `compile_decode(fast, batches=True)`, unless --no-compile; with --busy, for one thread
    fewer too, `fewer_threads=True`, so that its steps may drop a thread beside the busy loop),
    stage 5b's token budget of 512 a step;
  * vLLM's CPU build, when --vllm-python names an interpreter that imports vllm (it pins its own
    torch and transformers, so it lives in a virtual environment of its own): greedy,
    `ignore_eos`, no prefix caching, 512 tokens a step, its threads bound to the first
    --threads cores. It reads a Hugging Face folder, which this program writes once into
    --cache-dir from the GGUF (transformers dequantizes it). It runs twice over: "vLLM" as
    vLLM starts by default and as `vllm serve` runs, its engine core in a process of its own
    beside the caller's; "vLLM in-process" with both in one process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), which on a machine of few cores is the faster;
  * llama.cpp (when `llama_cpp`, llama-cpp-python, imports): its C API, as `llama-server
    --parallel N` serves: every request a sequence of one unified KV cache, and each step one
    `llama_batch` of every running sequence's next token and prompt tokens in chunks, 512 tokens
    at most; the F32 file against float32, F16 against bfloat16 (its own quantizer's copies).

The work: --requests N ShareGPT-like requests (stage 4's `workloads.synthetic`: geometric
lengths with the vLLM paper's ShareGPT means, 161.31 prompt and 337.99 output tokens, divided
by --scale; random token ids as prompts, the same as `benchmarks.serving`), every request
generating exactly its drawn length, greedy; tokens/s = all generated tokens over the wall
time, prefill included. Batch 1: one prompt's decode rate, (--new-tokens - 1) tokens over the
time a run of --new-tokens takes beyond a run of one token.

Each of --runs rows is printed with the load average before it and the CPU other programs used
during it, with minipaged's rate over each peer's ("mp / vLLM"...). The greedy tokens are
compared (requests equal from first to last token, and tokens before the first difference).
--busy runs every job again with one more CPU-bound process beside the engine: a Python busy
loop pinned to the last of the --threads cores. --isa avx2 limits minipaged's kernels to AVX2
(as `benchmarks.products --isa` does) on a CPU with AVX-512, and vLLM's to its AVX2 build
(`vllm_limited_to`), to be measured beside the llama.cpp built for AVX2 (install that one);
minipaged's line under the table says what its kernels were built for and which ran.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .. import cli
from ..api import generate
from ..errors import PeerError
from ..fast import FastEngine, FusedLlama, compile_decode, kernels
from ..fast.kernels import cpu_name
from ..formats import load_model, packaged_model_path
from ..formats.atomic import write_file
from . import peer_worker
from .products import ISAS, isa_environment
from .serving import sharegpt_like_trace
from .smollm2 import LLAMA_CPP_TYPES, cache_folder, llama_cpp, llama_cpp_file

BUDGET = peer_worker.BUDGET   # tokens a step may run: max_num_batched_tokens, llama.cpp's n_batch
ENGINES = ("minipaged", "vLLM", "vLLM in-process", "llama.cpp")
PEERS = ENGINES[1:]
VOCAB = 49152                 # SmolLM2's vocabulary: the prompts' random ids lie below it


# -- the engines, each in its worker process ------------------------------------------------------
def minipaged_engine(dtype: str, threads: int, compiled: bool, fewer_threads: bool = False):
    torch.set_num_threads(threads)
    fast = FusedLlama(load_model(packaged_model_path("smollm2"), dtype=getattr(torch, dtype)))
    if compiled:
        compile_decode(fast, batches=True, fewer_threads=fewer_threads)

    def run(requests):
        prompts, lengths = zip(*requests)
        return generate(fast, list(prompts), list(lengths), cache="paged", stop_tokens=[],
                        engine_class=FastEngine, max_num_batched_tokens=BUDGET,
                        max_seq_len=max(len(p) + n for p, n in requests))
    args = fast.args
    ran = kernels(getattr(torch, dtype), args.head_dim, args.n_heads // args.n_kv_heads)
    return run, "minipaged.fast, FastEngine" + ("" if compiled else ", not compiled") + \
        f"; built for {ran['built for']}; products: {ran['products']}; attention: " \
        f"{ran['attention']}" + (f"; decode steps: {ran['decode step']}" if compiled else "")


def work():
    """minipaged's worker: `python -c '...work()' JSON_OPTIONS` (see `Worker`)."""
    say = peer_worker.reply_channel()
    peer_worker.serve_jobs(say, *minipaged_engine(**json.loads(sys.argv[1])))


# -- the processes --------------------------------------------------------------------------------
def processes() -> dict:
    """{pid: (parent pid, CPU clock ticks used)} of every process, from /proc."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue                                # it ended meanwhile
            found[int(name)] = int(fields[1]), int(fields[11]) + int(fields[12])
    return found


def process_tree(root: int, found: dict | None = None) -> set:
    """Process `root` and every process below it."""
    found = processes() if found is None else found
    parents = {pid: parent for pid, (parent, _) in found.items()}
    tree = {root}
    for pid in parents:                                 # walk up from each: below the root?
        p = pid
        while p in parents and p not in tree and p > 1:
            p = parents[p]
        if p in tree:
            tree.add(pid)
    return tree


def cpu_seconds(root: int) -> float:
    """CPU seconds used so far by process `root` and every process below it."""
    found = processes()
    return sum(found[pid][1] for pid in process_tree(root, found) if pid in found) / \
        os.sysconf("SC_CLK_TCK")


def machine() -> str:
    """The CPU's model name and the vector features it offers (`fast.kernels.cpu_name`)."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, *rest = map(int, f.readline().split()[1:])
    return (user + nice + system + sum(rest[:3])) / os.sysconf("SC_CLK_TCK")


class Worker:
    """One engine in its own process: started, told jobs, stopped; its output in a log file."""

    def __init__(self, name: str, argv: list, log: Path, env: dict):
        self.name, self.log, self.version = name, log, None
        here = [str(Path(__file__).resolve().parents[2])]          # this minipaged, first
        env = dict(env, PYTHONPATH=os.pathsep.join(
            here + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
        with open(log, "w") as f:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=f, text=True, env=env)

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            raise PeerError(f"{self.name} stopped ({' / '.join(tail) or 'no output'}); "
                            f"its log: {self.log}")
        return json.loads(line)

    def job(self, requests) -> dict:
        self.proc.stdin.write(json.dumps({"requests": requests}) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the worker's processes, its children included
        (vLLM's engine core): a paused engine cannot wake during another's turn."""
        for pid in process_tree(self.proc.pid):
            try:
                os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)
            except ProcessLookupError:
                pass                                    # it ended meanwhile

    def stop(self) -> None:
        """End of input ends the worker; one still busy after 30 s is told to stop (SIGTERM, so
        vLLM ends the processes it started), then killed."""
        if self.proc.poll() is None:
            self.pause(False)
            self.proc.stdin.close()
            for end in (self.proc.terminate, self.proc.kill):
                try:
                    self.proc.wait(30)
                    return
                except subprocess.TimeoutExpired:
                    end()
            self.proc.wait()


def start_workers(args, dtype: str, jobs, logs: Path, console) -> dict:
    """The engines of one dtype, loading side by side; {name: Worker} once all are ready."""
    longest = max(len(p) + n for job in jobs for p, n in job)
    most = max(len(job) for job in jobs)
    argv = {"minipaged": [sys.executable, "-c", "from minipaged.benchmarks.serving_peers import "
                          "work; work()", json.dumps(dict(
        dtype=dtype, threads=args.threads, compiled=not args.no_compile,
        fewer_threads=args.busy))]}
    if args.vllm_python:
        for name, one_process in (("vLLM", False), ("vLLM in-process", True)):
            argv[name] = [str(args.vllm_python), peer_worker.__file__, "vLLM", json.dumps(dict(
                folder=str(hf_folder(args.cache_dir, console)), dtype=dtype,
                threads=args.threads, max_num_seqs=most, max_model_len=longest,
                max_num_batched_tokens=BUDGET, one_process=one_process))]
    if llama_cpp is not None:
        path = llama_cpp_file(packaged_model_path("smollm2"),
                              LLAMA_CPP_TYPES[getattr(torch, dtype)], args.cache_dir, console)
        n_ctx = max(sum(len(p) + n for p, n in job) for job in jobs) + 256
        argv["llama.cpp"] = [sys.executable, peer_worker.__file__, "llama.cpp", json.dumps(dict(
            path=str(path), threads=args.threads, n_seq_max=most, n_ctx=n_ctx))]
    limits = isa_environment(args.isa) if args.isa else {}
    env = {"minipaged": {**os.environ, **limits}}  # the peers: without minipaged's OpenMP setting
    if args.isa:
        env["vLLM"] = env["vLLM in-process"] = vllm_limited_to(args.isa, logs, limits)
    workers = {name: Worker(name, a, logs / f"{name}-{dtype}.log", env.get(name, started_with()))
               for name, a in argv.items()}
    console.print(f"{dtype}: loading {', '.join(workers)} ...")
    try:
        for w in workers.values():
            w.version = w.answer()["version"]
    except BaseException:
        for w in workers.values():
            w.stop()
        raise
    return workers


def vllm_limited_to(isa: str, logs: Path, limits: dict) -> dict:
    """The environment that makes vLLM's CPU build run as on a CPU with only `isa` (avx2): its
    processes import a sitecustomize that tells torch's AVX-512 checks no, so vLLM loads its
    kernels built for AVX2 (`vllm._C_AVX2`, chosen by `torch.cpu._is_avx512_supported`), and
    torch's and oneDNN's own kernels are limited as minipaged's are (`limits`)."""
    folder = logs / f"vllm-{isa}"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import torch.cpu\n"
        "torch.cpu._is_avx512_supported = lambda: False\n"
        "torch.cpu._is_avx512_bf16_supported = lambda: False\n")
    env = started_with()
    return {**env, **limits, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(folder), env.get("PYTHONPATH")]))}


def started_with() -> dict:
    """The environment this process was started with (/proc/self/environ), before `import
    minipaged` set GOMP_SPINCOUNT for minipaged's OpenMP threads: the peers run with their own
    defaults."""
    items = Path("/proc/self/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def settle(workers, quiet: float = 0.02, most: float = 20.0) -> None:
    """Wait until no worker uses more than `quiet` CPU seconds in 0.25 s (or `most` seconds)."""
    end = time.perf_counter() + most
    before = sum(w.cpu() for w in workers)
    while time.perf_counter() < end:
        time.sleep(0.25)
        now = sum(w.cpu() for w in workers)
        if now - before < quiet:
            return
        before = now


def hf_folder(cache_dir: Path, console) -> Path:
    """The GGUF as a Hugging Face folder (config.json + model.safetensors) for vLLM, written once:
    transformers dequantizes the file, and a plain model built from its config takes the
    weights (transformers will not save a model it loaded as quantized)."""
    target = cache_dir / "SmolLM2-135M-Instruct-hf"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf = packaged_model_path("smollm2")
    console.print(f"vLLM: writing {gguf.name} as a Hugging Face folder in {target} ...")
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32)
    config = hf.config
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf.state_dict())
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".hf-"))
    plain.save_pretrained(staging)
    staging.rename(target)
    return target


def busy_loop(core: int) -> subprocess.Popen:
    """One more CPU-bound process: a Python busy loop pinned to `core`."""
    return subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})"
                             f"\nwhile True: pass"])


# -- the run --------------------------------------------------------------------------------------
def turn(workers, name, requests, idle: dict) -> dict:
    """One engine's job, the others paused (`Worker.pause`): its answer. Idle, vLLM's processes
    still woke now and then (up to 2% of a core), and each wake-up took a core from the engine
    being timed. `idle` keeps the most CPU (a share of one core) each other engine used during
    a turn: none, paused."""
    settle(workers.values())
    others = {n: w for n, w in workers.items() if n != name}
    before = {n: w.cpu() for n, w in others.items()}
    for w in others.values():
        w.pause(True)
    try:
        answer = workers[name].job(requests)
        for n, w in others.items():         # (read before they continue, and catch up)
            idle[n] = max(idle.get(n, 0.0), (w.cpu() - before[n]) / answer["seconds"])
    finally:
        for w in others.values():
            w.pause(False)
    return answer


def measure(workers, jobs, order, idle: dict) -> dict:
    """{job name: {engine: (tokens/s, tokens)}}, each job run by every engine in `order`."""
    results = defaultdict(dict)
    for job, requests in jobs.items():
        for name in order:
            answer = turn(workers, name, requests, idle)
            made = [len(t) for t in answer["tokens"]]
            if made != [n for _, n in requests]:
                raise PeerError(f"{name} returned {sum(made)} tokens for {job}, not "
                                f"{sum(n for _, n in requests)}")
            if job == "batch 1":               # decode rate: n tokens beyond a run of one
                (prompt, n), = requests
                one = turn(workers, name, [[prompt, 1]], idle)
                rate = (n - 1) / (answer["seconds"] - one["seconds"])
            else:
                rate = sum(made) / answer["seconds"]
            results[job][name] = (rate, answer["tokens"])
    return results


def one_pass(workers, jobs, order, idle, busy_core=None):
    """Every job on every engine, in `order`, beside a busy loop on `busy_core` if one is given:
    the results, the load average before, and the cores' worth of CPU that processes other
    than this program and its children used meanwhile."""
    settle(workers.values())
    load = os.getloadavg()[0]
    start, machine, ours = time.perf_counter(), machine_busy_seconds(), cpu_seconds(os.getpid())
    loop = busy_loop(busy_core) if busy_core is not None else None
    try:
        results = measure(workers, jobs, order, idle)
        others = max(0.0, (machine_busy_seconds() - machine - cpu_seconds(os.getpid()) + ours) /
                     (time.perf_counter() - start))     # clock ticks may round a hair below 0
    finally:
        if loop:
            loop.kill()
            loop.wait()
    return results, load, others


def agreement(a, b) -> tuple[int, int, int]:
    """Requests whose tokens are all equal, tokens before each request's first difference, and
    all tokens."""
    same = before = 0
    for x, y in zip(a, b):
        same += x == y
        before += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    return same, before, sum(map(len, a))


def agreement_lines(dtype, job, by_engine) -> list[str]:
    lines = []
    for peer in PEERS:
        if peer in by_engine:
            same, before, total = agreement(by_engine["minipaged"], by_engine[peer])
            lines.append(f"greedy tokens, {dtype}, {job}: minipaged and {peer} agree on {same} "
                         f"of {len(by_engine[peer])} requests ({before} of {total} tokens before "
                         f"the first difference)")
    return lines


def ratio(rates, a, b) -> str:
    return f"{rates[a] / rates[b]:.2f}x" if a in rates and b in rates else "-"


@cli.program
def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipaged.benchmarks.serving_peers",
                           description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=cli.whole(1, 256), nargs="+", default=[16, 64],
                   help="requests arriving together, one workload per number (default 16 64)")
    p.add_argument("--scale", type=cli.number(at_least=1), default=4.0,
                   help="ShareGPT's mean lengths divided by this (default 4: 40 prompt, "
                        "85 output tokens on average, at most 512 together)")
    p.add_argument("--new-tokens", type=cli.whole(2), default=64,
                   help="batch 1: tokens decoded (default 64)")
    p.add_argument("--no-batch-1", action="store_true", help="leave the batch-1 decode out")
    p.add_argument("--runs", type=cli.whole(1), default=3)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                   default=["float32", "bfloat16"])
    p.add_argument("--threads", type=cli.whole(1, os.cpu_count()), default=os.cpu_count(),
                   help="threads of every engine, on cores 0 to N-1 (default: one per core)")
    p.add_argument("--vllm-python", type=vllm_python, metavar="PATH",
                   help="a Python that imports vllm (its own virtual environment)")
    p.add_argument("--busy", action="store_true",
                   help="run every job again beside a Python busy loop on the last core")
    p.add_argument("--no-compile", action="store_true", help="run minipaged.fast eager")
    p.add_argument("--isa", choices=sorted(ISAS), help="minipaged's kernels limited to this ISA "
                   "(benchmarks.products says how); install the llama.cpp built for it")
    p.add_argument("--cache-dir", type=cache_folder,
                   default=Path.home() / ".cache" / "minipaged" / "llama_cpp",
                   help="where llama.cpp's and vLLM's copies of the model are kept")
    p.add_argument("--json", type=cli.output_file, metavar="FILE",
                   help="also write every rate and every engine's tokens to FILE")
    args = p.parse_args(argv)
    cli.check(p, "--cache-dir", cache_folder, args.cache_dir)
    console = Console()
    jobs = {}
    for k in args.requests:
        trace, _ = sharegpt_like_trace(k, scale=args.scale, vocab=VOCAB, seed=0)
        jobs[f"{k} requests"] = [[prompt, n] for prompt, n in trace]
    if not args.no_batch_1:
        first = next(iter(jobs.values()))[0][0]
        jobs = {"batch 1": [[first, args.new_tokens]], **jobs}
    console.print(f"machine: {machine()}; torch {torch.__version__}; {args.threads} threads")
    if llama_cpp is None:
        console.print("llama.cpp: not importable here (pip install llama-cpp-python): left out")
    if args.vllm_python is None:
        console.print("vLLM: not run (--vllm-python names a Python that imports vllm)")
    logs = Path(tempfile.mkdtemp(prefix="minipaged-serving-peers-"))
    rows, tokens, idle, versions = [], {}, {}, {}
    try:
        for dtype in args.dtypes:
            workers = start_workers(args, dtype, list(jobs.values()), logs, console)
            versions.update({name: w.version for name, w in workers.items()})
            try:
                runs(args, dtype, workers, jobs, console, rows, tokens, idle)
            finally:
                for w in workers.values():
                    w.stop()
    except KeyboardInterrupt:                   # Ctrl-C: the table of the runs so far
        console.print("interrupted; the runs that ended:")
        report(console, rows, idle, versions, args)
        raise
    report(console, rows, idle, versions, args)
    if args.json:
        data = {"rows": rows, "tokens": {f"{d}, {j}": t for (d, j), t in tokens.items()}}
        write_file(args.json, lambda path: path.write_text(json.dumps(data)))
    console.print(f"worker logs: {logs}")


def runs(args, dtype, workers, jobs, console, rows, tokens, idle) -> None:
    """--runs passes over every job (each beside a busy loop too, with --busy) on the loaded
    engines, the engines' order rotating; each pass's rates printed as it ends, and added to
    `rows`; the first quiet pass's tokens kept in `tokens` and compared."""
    for w in workers.values():                          # not timed: a short run of each job
        for requests in jobs.values():
            w.job([[prompt, 2] for prompt, _ in requests])
    names = list(workers)
    for run in range(args.runs):
        order = names[run % len(names):] + names[:run % len(names)]
        for busy in [False, True] if args.busy else [False]:
            results, load, others = one_pass(workers, jobs, order, idle,
                                             args.threads - 1 if busy else None)
            console.print(f"{dtype} run {run + 1}{', busy' if busy else ''}: load {load:.2f}, "
                          f"others {others:.2f}; " + "; ".join(
                              f"{job}: " + ", ".join(f"{n} {r:.1f}" for n, (r, _) in
                                                     by_engine.items())
                              for job, by_engine in results.items()))
            for job, by_engine in results.items():
                rows.append(dict(run=run + 1, dtype=dtype, job=job, busy=busy, load=load,
                                 others=others, rates={n: r for n, (r, _) in by_engine.items()}))
                if run == 0 and not busy:
                    tokens[dtype, job] = {n: t for n, (_, t) in by_engine.items()}
                    for line in agreement_lines(dtype, job, tokens[dtype, job]):
                        console.print(line)


def vllm_python(text) -> Path:
    """--vllm-python: an interpreter that imports vllm (checked by running it)."""
    try:
        r = subprocess.run([text, "-c", "import vllm"], capture_output=True, text=True,
                           timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise argparse.ArgumentTypeError(f"cannot run {text}: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise argparse.ArgumentTypeError(f"{text} cannot import vllm ({last})")
    return Path(text)


def report(console, rows, idle, versions, args) -> None:
    present = [e for e in ENGINES if any(e in r["rates"] for r in rows)]
    table = Table(title=f"tokens/s, SmolLM2-135M-Instruct, {args.threads} threads, greedy; "
                        f"ShareGPT-like lengths / {args.scale:g}, requests arriving together")
    for col in ("run", "dtype", "job", "load", "others", *present,
                *(f"mp / {peer}" for peer in present[1:])):
        table.add_column(col, justify="left" if col in ("dtype", "job") else "right")
    for r in rows:
        table.add_row(str(r["run"]), r["dtype"], r["job"] + (", busy" if r["busy"] else ""),
                      f"{r['load']:.2f}", f"{r['others']:.2f}",
                      *(f"{r['rates'][e]:.1f}" if e in r["rates"] else "-" for e in present),
                      *(ratio(r["rates"], "minipaged", peer) for peer in present[1:]))
    console.print(table)
    console.print("load: the 1-minute load average before the run; others: cores' worth of CPU "
                  "that processes other than this benchmark's used during the run; mp: minipaged")
    for name, version in versions.items():
        console.print(f"{name}: {version}; while it was idle it used at most "
                      f"{idle.get(name, 0):.1%} of a core during another engine's turn")
    groups = defaultdict(list)
    for r in rows:
        groups[r["dtype"], r["job"], r["busy"]].append(r["rates"])
    for (dtype, job, busy), rates in groups.items():
        for peer in PEERS:
            ratios = [x["minipaged"] / x[peer] for x in rates if peer in x]
            if ratios:
                console.print(f"{dtype}, {job}{', busy' if busy else ''}: minipaged / {peer} "
                              f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} run(s), "
                              f"median {statistics.median(ratios):.2f}x")
    if args.busy:
        quiet = {(r["run"], r["dtype"], r["job"]): r["rates"] for r in rows if not r["busy"]}
        for r in (r for r in rows if r["busy"]):
            base = quiet[r["run"], r["dtype"], r["job"]]
            console.print(f"busy / quiet, run {r['run']}, {r['dtype']}, {r['job']}: " + ", ".join(
                f"{e} {r['rates'][e] / base[e]:.2f}x" for e in present if e in r["rates"]))


if __name__ == "__main__":
    raise SystemExit(main())
