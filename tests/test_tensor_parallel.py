"""Stage 9: tensor parallelism. Two processes, each holding half of every layer's heads and
their KV blocks, give one process's tokens; each rank's pool holds its own heads of the same
blocks; a bad number of ranks is refused before any process starts; a rank that dies ends
every other within seconds, with one error naming it, and leaves no process behind.

Each test that starts ranks costs a few seconds (two fresh Python processes import torch)."""

import glob
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import FakeModel, tiny_model
from minipaged import Engine, generate, load_model, load_tokenizer
from minipaged.formats.gguf_checkpoint import packaged_model_path
from minipaged.errors import RequestError, TensorParallelError, UsageError
from minipaged import ranks
from minipaged.ranks import run_ranks
from minipaged.benchmarks import tensor_parallel as tp_benchmark
from minipaged.tensor_parallel import block_tables, rank_state_dict
from minipaged.tp_engine import LocalWorkers, TensorParallelEngine, Worker, check_acks
from minipaged.tp_group import serve_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = list(range(5, 45))                                 # a 40-token shared prefix


def prompts(seed=4, lengths=(3, 14, 17)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (k,), generator=gen).tolist() for k in lengths]


def no_ranks_left():
    """Every rank this process started has been reaped."""
    return not [p for p in multiprocessing.active_children() if p.name.startswith("minipaged-rank")]


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_two_ranks_give_one_process_tokens(preemption):
    """fp32, greedy, chunked prefill, prefix caching, n=2 samples sharing blocks, n-gram
    speculation, a pool too small for every sequence (preemption by swap, by recompute): the
    tokens of one process, whatever the split."""
    model = tiny_model(dtype=torch.float32)
    ps = [PROMPT + p for p in prompts()]
    engine = dict(block_size=4, num_blocks=24, preemption=preemption, max_num_batched_tokens=16,
                  prefix_caching=True, speculative="ngram", num_speculative_tokens=3,
                  prompt_lookup_min=1)
    probe = Engine(model, max_num_seqs=6, num_cpu_blocks=24, **engine)     # what the run meets
    for p in ps:
        probe.add_request(p, 10, stop_tokens=[], n=2)
    probe.run()
    assert probe.stats.preemptions and probe.stats.cached_tokens and probe.spec.draft_tokens
    options = dict(cache="paged", n=2, stop_tokens=[], **engine)
    one = generate(model, ps, 10, **options)
    assert one == [[r.output for r in probe.requests[2 * i:2 * i + 2]] for i in range(3)]
    two = generate(model, ps, 10, tensor_parallel=2, **options)
    assert two == one
    assert no_ranks_left()


def test_each_rank_holds_its_own_heads_of_the_same_blocks():
    """Mid-run, after recompute preemptions: rank r's pool holds the one-process pool's KV heads
    of rank r, in the same block ids; rank 1's tables, built only from rank 0's messages, are
    rank 0's as of the last model call, every layer; rank 0 scheduled as one process does."""
    model = tiny_model(dtype=torch.float32)
    ps = prompts(lengths=(9, 14, 17, 6))
    options = dict(num_blocks=14, block_size=4, max_num_seqs=4)
    one = Engine(model, **options)
    for p in ps:
        one.add_request(p, 16, stop_tokens=[])
    while not one.stats.preemptions:
        one.step()
    for _ in range(3):
        one.step()
    assert len(one.cache.managers[0].live_seq_ids()) >= 2
    reports = serve_ranks(model, ps, 16, world_size=2, steps=one.step_count, **options)
    assert reports[0]["preemptions"] == one.stats.preemptions > 0
    assert reports[0]["outputs"] == [q.output for q in one.requests]
    assert [list(r["kv_heads"]) for r in reports] == [[0], [1]]     # 2 KV heads, one each
    assert reports[1]["tables"] == reports[0]["tables"]
    assert any(reports[1]["tables"][0].values())
    for mine, full in zip(reports[0]["managers"], one.cache.managers):
        assert mine.free_blocks._ids == full.free_blocks._ids
        assert torch.equal(mine.block_table, full.block_table)
    for r in reports:
        for pool, full in zip(r["pools"], one.cache.managers):
            assert pool.k_cache_paged.shape[2] == 1                 # (blocks, slots, Hk / 2, D)
            for cache in ("k_cache_paged", "v_cache_paged"):
                assert torch.allclose(getattr(pool, cache),
                                      getattr(full, cache)[:, :, r["kv_heads"]], atol=1e-5)
    assert no_ranks_left()


def test_a_rank_gets_its_rows_and_columns():
    """Rank r of 2 holds rows r*H/2.. of the column-split weights, columns of the row-split."""
    model = tiny_model(dtype=torch.float32)
    full = model.state_dict()
    half = rank_state_dict(model, 1, 2)
    wk, wo, w2 = (f"layers.0.{m}.weight" for m in ("attention.wk", "attention.wo",
                                                   "feed_forward.w2"))
    assert torch.equal(half[wk], full[wk][16:])                     # KV head 1 of 2: 16 dims
    assert torch.equal(half[wo], full[wo][:, 32:])                  # query heads 2 and 3
    assert torch.equal(half[w2], full[w2][:, model.args.hidden_dim // 2:])
    assert torch.equal(half["tok_embeddings.weight"], full["tok_embeddings.weight"])


@pytest.mark.parametrize("n, says", [(0, "positive integer"), (-2, "positive integer"),
                                     (1.5, "positive integer"), (3, "cannot split"),
                                     (4, "cannot split")])
def test_a_bad_number_of_ranks_is_refused_before_any_process(n, says):
    model = tiny_model(dtype=torch.float32)                         # 2 KV heads
    with pytest.raises(UsageError, match=says) as e:
        generate(model, prompts(), 4, cache="paged", tensor_parallel=n)
    assert "\n" not in str(e.value)
    assert no_ranks_left()


def test_tensor_parallel_needs_the_paged_engine():
    with pytest.raises(Exception, match="cache='paged'"):
        generate(tiny_model(dtype=torch.float32), prompts(), 4, tensor_parallel=2)


def signal_rank_1_once_serving(sig, after=1.0):
    """In a thread: send `sig` to rank 1 `after` seconds after the ranks met (their rendezvous
    file appeared); the moment it was sent goes in the returned list."""
    sent = []

    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if glob.glob(os.path.join(tempfile.gettempdir(), "minipaged-tp-*", "store")):
                time.sleep(after)
                for p in multiprocessing.active_children():
                    if p.name == "minipaged-rank1" and p.pid:
                        os.kill(p.pid, sig)
                        sent.append(time.monotonic())
                return
            time.sleep(0.02)
    threading.Thread(target=watch, daemon=True).start()
    return sent


LONG = dict(cache="paged", tensor_parallel=2, stop_tokens=[], max_seq_len=256)


def test_a_dead_rank_ends_the_others_within_seconds():
    """SIGKILL rank 1 a second after the ranks met (loading or serving: any moment must do):
    the call ends with one error naming rank 1, long before any collective's timeout (60 s),
    and no rank is left running."""
    sent = signal_rank_1_once_serving(signal.SIGKILL)
    with pytest.raises(TensorParallelError, match=r"rank 1 of 2 died \(killed by SIGKILL\)"):
        generate(tiny_model(dtype=torch.float32), prompts(lengths=[100] * 4), 150, **LONG)
    assert sent and time.monotonic() - sent[0] < 5.0
    assert no_ranks_left()


def test_a_silent_rank_ends_the_others_after_the_timeout(monkeypatch):
    """SIGSTOP rank 1 (alive, answering nothing): rank 0's collective times out (3 s here), and
    the call ends with one error naming rank 1; the stopped rank is killed, none is left."""
    monkeypatch.setattr(ranks, "TIMEOUT", 3.0)
    sent = signal_rank_1_once_serving(signal.SIGSTOP)
    with pytest.raises(TensorParallelError, match=r"rank 1 of 2 stopped answering .* 3 s"):
        generate(tiny_model(dtype=torch.float32), prompts(lengths=[100] * 4), 150, **LONG)
    assert sent and time.monotonic() - sent[0] < 3.0 + 7.0
    assert no_ranks_left()


@pytest.mark.parametrize("said", ["RuntimeError: [gloo/transport/tcp/pair.cc:534] Wait timeout",
                                  "DistBackendError: Timed out waiting 3000ms for recv"])
def test_a_timeout_seen_first_still_blames_the_silent_rank(said):
    """Which report comes first is a race: rank 0's collective timing out (gloo's words for it
    vary) is the effect of rank 1's silence, so the error names rank 1, still running."""
    running, reported = SimpleNamespace(exitcode=None, pid=2), SimpleNamespace(exitcode=1, pid=1)
    error = ranks._blame([reported, running], {0: ("failed", said)}, 3.0)
    assert "rank 1 of 2 stopped answering" in str(error)
    other = ranks._blame([reported, running], {0: ("failed", "ValueError: bad shape")}, 3.0)
    assert "rank 0 of 2 failed" in str(other)           # not a timeout: rank 0's own failure


def test_smollm2_on_three_ranks():
    """A real checkpoint: SmolLM2-135M's 3 KV heads, one per rank, give one process's tokens
    (and 2 ranks, which cannot split 3 heads, are refused)."""
    path = packaged_model_path("smollm2")
    model, tok = load_model(path, dtype=torch.float32), load_tokenizer(path)
    ps = [tok.encode("The capital of France is", bos=True, eos=False),
          tok.encode("def add(a, b):", bos=True, eos=False)]
    one = generate(model, ps, 8, cache="paged", stop_tokens=[])
    assert generate(model, ps, 8, cache="paged", stop_tokens=[], tensor_parallel=3) == one
    with pytest.raises(UsageError, match="3 KV heads .* choose one of 1, 3"):
        generate(model, ps, 8, cache="paged", tensor_parallel=2)
    assert no_ranks_left()


def test_a_request_the_ranks_refuse_comes_back_as_the_engines_own_error():
    """A prompt the pool could never hold: every rank refuses it alike, and the caller gets the
    RequestError one process gives, with its sentence; no rank is left."""
    model, long_prompt = tiny_model(dtype=torch.float32), prompts(lengths=[30])
    with pytest.raises(RequestError) as one:
        generate(model, long_prompt, 4, cache="paged", num_blocks=2, block_size=4)
    with pytest.raises(RequestError) as two:
        generate(model, long_prompt, 4, cache="paged", num_blocks=2, block_size=4,
                 tensor_parallel=2)
    assert str(two.value) == str(one.value)
    assert no_ranks_left()


CALLER = """
import torch
from conftest import FakeModel, tiny_model
from minipaged import generate
gen = torch.Generator().manual_seed(4)
ps = [torch.randint(0, 512, (100,), generator=gen).tolist() for _ in range(64)]
generate(tiny_model(dtype=torch.float32), ps, 150, cache="paged", tensor_parallel=2,
         stop_tokens=[], max_seq_len=256)
"""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"      # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's /proc")
def test_ranks_end_when_their_caller_is_killed():
    """SIGKILL the process that called generate(tensor_parallel=2): its ranks (and whatever else
    it started) end within seconds on their own."""
    caller = subprocess.Popen([sys.executable, "-c", CALLER], cwd=os.path.dirname(__file__),
                              env={**os.environ, "PYTHONPATH": ROOT}, stderr=subprocess.DEVNULL)
    children, deadline = set(), time.monotonic() + 60
    try:
        while len(children) < 2 and time.monotonic() < deadline and caller.poll() is None:
            with open(f"/proc/{caller.pid}/task/{caller.pid}/children") as f:
                children = set(map(int, f.read().split()))
            time.sleep(0.05)
        time.sleep(1.0)
    finally:
        caller.kill()
        caller.wait()
    assert len(children) >= 2
    end = time.monotonic() + 5
    while time.monotonic() < end and any(alive(p) for p in children):
        time.sleep(0.05)
    assert not [p for p in children if alive(p)]


def fail_on_rank_1(rank, world_size, device):
    """Run on the ranks by the next test: rank 1 raises, rank 0 waits for it in a barrier."""
    if rank == 1:
        raise ValueError("a bug on rank 1")
    torch.distributed.barrier()
    return rank


def test_a_rank_that_raises_is_named_and_the_others_do_not_wait():
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 of 2 failed .*ValueError: a bug on"):
        run_ranks(fail_on_rank_1, 2)
    assert time.monotonic() - start < 30 and no_ranks_left()
    assert run_ranks(fail_on_rank_1, 1) == [0]                        # one rank: no rank 1


@pytest.mark.parametrize("argv, says", [(["--ranks", "3"], "cannot split"),
                                        (["--ranks", "0"], "--ranks"),
                                        (["--model", "nope"], "--model")])
def test_the_benchmark_refuses_bad_input_before_any_process(argv, says, capsys):
    assert tp_benchmark.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1
    assert no_ranks_left()


def test_the_benchmark_counts_one_message_a_model_call():
    """The benchmark's message figures, on one rank in this process (messages built, sent
    nowhere): a prompt of 20 tokens and 6 new ones, no budget, makes 6 model calls (a prefill,
    5 decodes), so 6 messages; the prefill's, which carries the new table, is the largest. The
    tokens are one Engine's."""
    model = tiny_model(dtype=torch.float32)
    prompt = prompts(5, (20,))
    res = tp_benchmark._measure(0, 1, torch.device("cpu"), model.args,
                                [rank_state_dict(model, 0, 1)], prompt, 6, 1)
    assert (res["steps"], res["messages"]) == (6, 6)
    assert 0 < res["mean_bytes"] < res["max_bytes"] < 4000
    engine = Engine(model, num_blocks=8, block_size=16)
    engine.add_request(prompt[0], 6, stop_tokens=[])
    assert res["outputs"] == [r.output for r in engine.run()]


class RandomDrafts(TensorParallelEngine):
    """Drafts of random length, a random prefix of them accepted: rollbacks of every size."""
    rng: random.Random = None

    def propose(self, req):
        room = min(self.num_speculative_tokens, req.max_new_tokens - len(req.output) - 1)
        return [self.rng.randrange(4) for _ in range(self.rng.randint(0, max(0, room)))]

    def accept(self, r, drafts, logits):
        return drafts[:self.rng.randint(0, len(drafts))] + [self.rng.randrange(4)]


class CheckedWorkers(LocalWorkers):
    """An in-process worker that, at every model call, once the message is applied and before
    anything runs, compares what it holds with rank 0's engine: every layer's tables, its whole
    pool and CPU pool (FakeModel writes each token's id as its key), and its free blocks (those
    no table holds) with rank 0's free and cached-free ones."""
    engine, whole = None, 0                # whole: block ids the tables held at the calls

    def send(self, message):
        self.sent.append(message)
        check_acks([w.apply(message) for w in self.workers], message.number)
        mine, ref = self.workers[0].cache, self.engine.cache
        for layer, m in enumerate(ref.managers):
            assert mine.tables[layer] == block_tables(m), (message.number, layer)
            for name in ("k_cache_paged", "v_cache_paged"):
                assert torch.equal(getattr(mine.managers[layer], name), getattr(m, name))
                if self.engine.swap:
                    assert torch.equal(getattr(mine.cpu[layer], name),
                                       getattr(self.engine.swap.cpu_managers[layer], name))
            held = {b for t in mine.tables[layer].values() for b in t}
            self.whole += sum(map(len, mine.tables[layer].values()))
            free = set(range(m.num_blocks)) - held
            assert len(free) == m.num_free_blocks and set(m.free_blocks._ids) <= free
        self.logits = [w.forward(message) for w in self.workers]


def test_a_worker_built_from_messages_holds_rank_0s_tables_and_kv():
    """The one-scheduler design over many random steps (preemption by recompute and swap, token
    budgets, prefix caching, n=2, speculation with random rollbacks), rank 0 and one worker in
    this process: at every model call the worker's tables, built only from the messages, and
    its pools are rank 0's; every kind of table change and of K/V move occurs, and the
    messages carry fewer block ids than the tables hold."""
    kinds, moves, sent, whole = dict.fromkeys(("appended", "replaced", "freed"), 0), set(), 0, 0
    preempted = {"recompute": 0, "swap": 0}
    for seed in range(12):
        rng = random.Random(seed)
        RandomDrafts.rng = rng
        workers = CheckedWorkers([FakeModel(seed + 100, vocab=4)])
        engine = RandomDrafts(FakeModel(seed, vocab=4), 10, 3, rng.choice(["recompute", "swap"]),
                              max_num_batched_tokens=rng.choice([None, 4, 9]), max_num_seqs=4,
                              prefix_caching=rng.random() < 0.5, speculative="ngram",
                              num_speculative_tokens=rng.randint(1, 4), num_cpu_blocks=18,
                              workers=workers)
        workers.engine = engine
        for step in range(60):
            if len(engine.requests) < 10 and rng.random() < 0.4:
                engine.add_request([rng.randrange(4) for _ in range(rng.randint(1, 10))],
                                   rng.randint(1, 12), stop_tokens=[], n=rng.choice([1, 1, 2]))
            if engine.has_unfinished():
                engine.step()
        preempted[engine.scheduler.preemption] += engine.stats.preemptions
        assert [m.number for m in workers.sent] == list(range(len(workers.sent)))
        for message in workers.sent:
            for changes in message.tables:
                for k in kinds:
                    kinds[k] += bool(changes[k])
                sent += sum(map(len, changes["appended"].values())) + \
                    sum(map(len, changes["replaced"].values()))
            moves |= {kind for kind, *_ in message.moves}
        whole += workers.whole
    assert all(kinds.values()), kinds
    assert moves == {"copy", "out", "in"} and all(preempted.values()), (moves, preempted)
    assert 0 < sent < whole / 2


class Recording:
    """A model that keeps the logits of every call."""

    def __init__(self, model):
        self.model, self.logits = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.logits.append(self.model(*args, **kwargs))
        return self.logits[-1]


class RecordingWorkers(LocalWorkers):
    def send(self, message):
        super().send(message)
        self.every.append(self.logits[0])


def test_a_block_taken_and_freed_within_one_step_reaches_the_worker():
    """A prompt of 12 tokens, 6 new ones, blocks of 16: the last step writes position 16 into a
    block it takes, and the sequence ends and frees it in the same step. The step's message
    carries that block; the tables after the step never hold it (a diff taken after each step,
    the design before, would never send it, and the worker's last forward would have no block
    for position 16). The worker (a whole replica here) gives rank 0's logits at every call."""
    model = tiny_model(dtype=torch.float32)
    workers = RecordingWorkers([model])
    workers.every = []
    engine = TensorParallelEngine(Recording(model), 8, 16, workers=workers)
    engine.add_request(prompts(5, (12,))[0], 6, stop_tokens=[])
    after = []
    while engine.has_unfinished():
        engine.step()
        after.append(block_tables(engine.cache.managers[0]))
    (new,) = workers.sent[-1].tables[0]["appended"][0]             # position 16's block
    assert all(new not in t.get(0, []) for t in after) and after[-1] == {}
    assert len(workers.every) == len(engine.model.logits) == 6
    assert all(torch.equal(a, b) for a, b in zip(workers.every, engine.model.logits))
    one = Engine(model, num_blocks=8, block_size=16)
    one.add_request(prompts(5, (12,))[0], 6, stop_tokens=[])
    assert [r.output for r in engine.requests] == [r.output for r in one.run()]


def test_a_lost_or_reordered_message_is_refused_before_it_runs():
    """Each message has a number and the worker expects them in order: a message that comes
    out of order (one lost before it, or a repeat) is refused with one line naming the rank and
    both numbers, and changes nothing; rank 0 refuses an acknowledgement of another number."""
    workers = LocalWorkers([FakeModel(1)])
    engine = TensorParallelEngine(FakeModel(0), 16, 4, workers=workers, max_num_seqs=2)
    engine.add_request([1, 2, 3], 6, stop_tokens=[])
    for _ in range(3):
        engine.step()
    fresh = Worker(FakeModel(1), workers.spec, rank=1)
    with pytest.raises(TensorParallelError, match="rank 1 got message 1 where it expected 0: "
                                                  "a message was lost or reordered") as e:
        fresh.apply(workers.sent[1])
    assert "\n" not in str(e.value) and fresh.cache.tables == [{}, {}]
    assert fresh.apply(workers.sent[0]) == 0
    with pytest.raises(TensorParallelError, match="got message 0 where it expected 1"):
        fresh.apply(workers.sent[0])                                # the same one again
    with pytest.raises(TensorParallelError, match="rank 2 acknowledged message 4, not 5"):
        check_acks([5, 4], 5)

    class Dropping(LocalWorkers):                                   # loses message 2
        def send(self, message):
            if message.number != 2:
                super().send(message)
    engine = TensorParallelEngine(FakeModel(0), 16, 4, workers=Dropping([FakeModel(1)]))
    engine.add_request([1, 2, 3], 6, stop_tokens=[])
    with pytest.raises(TensorParallelError, match="got message 3 where it expected 2"):
        for _ in range(6):
            engine.step()


def test_the_engine_with_tensor_parallel_is_rank_0_here(monkeypatch):
    """`Engine(..., tensor_parallel=2)`: this process runs rank 0's engine, one new process
    follows; the tokens are one process's, also after idling past the collectives' timeout
    (the follower waits on its inbox, not in a collective); close() ends it. A bad N starts
    nothing."""
    monkeypatch.setattr(ranks, "TIMEOUT", 2.0)
    model, ps = tiny_model(dtype=torch.float32), prompts()
    engine = Engine(model, 32, 4, tensor_parallel=2, max_num_seqs=4)
    try:
        assert isinstance(engine, TensorParallelEngine) and not no_ranks_left()
        engine.add_request(ps[0], 10, stop_tokens=[])
        engine.run()
        time.sleep(3.0)                                             # idle past the timeout
        for p in ps[1:]:
            engine.add_request(p, 10, stop_tokens=[])
        out = [r.output for r in engine.run()]
    finally:
        engine.close()
    assert out == generate(model, ps, 10, cache="paged", stop_tokens=[])
    assert no_ranks_left()
    with pytest.raises(UsageError, match="tensor_parallel=3 cannot split"):
        Engine(model, 32, 4, tensor_parallel=3)
    assert no_ranks_left() and not torch.distributed.is_initialized()
