"""Bad values at the Python API of stages 5 and later (the engine, `generate`, `beam_search`,
the shared cache): each is a RequestError or UsageError naming the argument, raised before
anything changes. A refused request leaves the engine's queues, pool and counters as they were.

Probes by class: bools where integers go (True is an int to Python), strings where numbers go,
NaN and infinities, fractions where whole numbers go, counts past what memory can hold, unknown
names, and blocks that hold nothing."""

import copy

import pytest
import torch
from conftest import tiny_model

from minipaged import Engine, beam_search, generate, load_model
from minipaged.cache_manager import CacheManager
from minipaged.errors import MiniPagedError, NotEnoughMemoryError, RequestError, UsageError
from minipaged.sharing import SharedPagedCache

NAN, INF = float("nan"), float("inf")
P = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def model():
    return tiny_model(dtype=torch.float32)


def refused(call, *words):
    """call() raises one of minipaged's named errors whose message names each of `words`:
    RequestError or UsageError, or NotEnoughMemoryError for what no memory could hold."""
    with pytest.raises(MiniPagedError) as e:
        call()
    assert isinstance(e.value, (RequestError, UsageError, NotEnoughMemoryError)), repr(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


ENGINE_PROBES = [   # Engine(model, num_blocks=16, **kwargs): what the error names
    ({"kv_budget": NAN, "num_blocks": None}, "kv_budget"),
    ({"kv_budget": "1MiB", "num_blocks": None}, "kv_budget"),
    ({"kv_budget": True, "num_blocks": None}, "kv_budget"),
    ({"watermark": NAN}, "watermark"),
    ({"watermark": -0.1}, "watermark"),
    ({"watermark": 1.5}, "watermark"),
    ({"watermark": "0.01"}, "watermark"),
    ({"watermark": True}, "watermark"),
    ({"seed": 0.5}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"seed": True}, "seed"),
    ({"backend": "gpu"}, "backend"),
    ({"max_num_batched_tokens": True}, "max_num_batched_tokens"),
    ({"max_num_batched_tokens": NAN}, "max_num_batched_tokens"),
    ({"prefix_caching": "yes"}, "prefix_caching"),
    ({"static_batches": "no"}, "static_batches"),
    ({"record": 1.5}, "record"),
    ({"num_blocks": 1.5}, "num_blocks"),
    ({"num_blocks": True}, "num_blocks"),
    ({"block_size": True}, "block_size"),
    ({"max_num_seqs": 2.5}, "must be a positive integer"),
    ({"max_seq_len": 10.5}, "max_seq_len"),
    ({"preemption": None}, "preemption"),
]


@pytest.mark.parametrize("kwargs, word", ENGINE_PROBES, ids=[str(p[0]) for p in ENGINE_PROBES])
def test_engine_options(model, kwargs, word):
    refused(lambda: Engine(model, **{"num_blocks": 16, **kwargs}), word)


def state(engine):
    """Everything a refused request must leave as it was."""
    s = engine.scheduler
    return (len(engine.requests), list(engine.pending), list(s.waiting), list(s.running),
            list(s.swapped), list(s.free_rows), engine.cache.num_free_blocks, engine.step_count,
            copy.deepcopy(engine.stats), dict(getattr(s, "siblings", {})))


REQUEST_PROBES = [   # add_request(**kwargs): what the error names
    ({"prompt": [True, 2]}, "True or False"),
    ({"prompt": [1, False]}, "True or False"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"max_new_tokens": NAN}, "max_new_tokens"),
    ({"max_new_tokens": 2**31}, "max_new_tokens=2147483648"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"top_p": "1"}, "top_p"),
    ({"top_p": NAN}, "top_p"),
    ({"arrival_step": 1.5}, "arrival_step"),
    ({"arrival_step": NAN}, "arrival_step"),
    ({"arrival_step": -1}, "arrival_step"),
    ({"arrival_step": "3"}, "arrival_step"),
    ({"arrival_step": True}, "arrival_step"),
    ({"stop_tokens": [True]}, "stop_tokens"),
    ({"stop_tokens": [-1]}, "stop_tokens"),
    ({"stop_tokens": [512]}, "stop_tokens"),
    ({"stop_tokens": 5}, "stop_tokens"),
    ({"stop_tokens": ["a"]}, "stop_tokens"),
    ({"generator": "x", "temperature": 1.0}, "generator"),
    ({"n": 2.0}, "n must be"),
    ({"n": True}, "n must be"),
    ({"n": 2**31}, "max_num_seqs"),
    ({"n": 2, "generators": [1, 2]}, "torch.Generator"),
    ({"n": 2, "generators": "ab"}, "torch.Generator"),
    ({"n": 2, "generators": [torch.Generator()]}, "one generator"),
]


@pytest.mark.parametrize("kwargs, word", REQUEST_PROBES, ids=[str(p[0]) for p in REQUEST_PROBES])
def test_a_refused_request_changes_nothing(model, kwargs, word):
    engine = Engine(model, num_blocks=16, max_num_seqs=8, prefix_caching=True)
    engine.add_request(P * 4, 3)                           # one running, one waiting: real state
    engine.add_request([7, 8, 9], 3, n=2)
    engine.step()
    before = state(engine)
    refused(lambda: engine.add_request(**{"prompt": P, "max_new_tokens": 3, **kwargs}), word)
    assert state(engine) == before
    done = engine.run()                                    # and it still serves what it had
    assert [len(r.output) for r in done] == [3, 3, 3]


GENERATE_PROBES = [   # generate(model, [P], 3, **kwargs): what the error names
    ({"cache": "pagd"}, "unknown cache"),
    ({"cache": 5}, "cache interface"),
    ({"cache": object()}, "cache interface"),
    ({"n": True}, "n (samples"),
    ({"n": 2**31}, "n=2147483648 samples"),
    ({"n": 2**31, "cache": "paged"}, "n=2147483648 samples"),
    ({"seed": 0.5, "temperature": 1.0}, "seed"),
    ({"seed": 0.5, "temperature": 1.0, "cache": "paged"}, "seed"),
    ({"seed": "1", "temperature": 1.0}, "seed"),
    ({"seed": NAN, "temperature": 1.0, "cache": "paged"}, "seed"),
    ({"seed": True}, "seed"),
    ({"watermark": NAN, "cache": "paged"}, "watermark"),
    ({"kv_budget": NAN, "cache": "paged"}, "kv_budget"),
    ({"callback": 5, "cache": "paged"}, "callback"),
    ({"stop_tokens": [1.5]}, "stop_tokens"),
    ({"stop_tokens": [True], "cache": "paged"}, "stop_tokens"),
    ({"temperature": "1", "cache": "paged"}, "temperature"),
    ({"backend": "gpu", "cache": "paged"}, "backend"),
    ({"max_num_batched_tokens": True, "cache": "paged"}, "max_num_batched_tokens"),
    ({"prefix_caching": 1, "cache": "paged"}, "prefix_caching"),
]


@pytest.mark.parametrize("kwargs, word", GENERATE_PROBES,
                         ids=[str(p[0]) for p in GENERATE_PROBES])
def test_generate(model, kwargs, word):
    refused(lambda: generate(model, [P], 3, **kwargs), word)


@pytest.mark.parametrize("prompts, max_new_tokens, word", [
    ([], 3, "non-empty"),                              # an empty batch
    ([[True, 1]], 3, "True or False"),
    ([P], [], "max_new_tokens"),
    ([P], [True], "max_new_tokens"),
], ids=["empty batch", "bool token", "no limits", "bool limit"])
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_generate_batches(model, prompts, max_new_tokens, word, cache):
    refused(lambda: generate(model, prompts, max_new_tokens, cache=cache), word)


BEAM_PROBES = [   # beam_search(model, P, 2, 3, **kwargs), with the positional ones overridden
    ({"beam_width": True}, "beam_width"),
    ({"beam_width": 2.0}, "beam_width"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"prompt": [True, 2]}, "True or False"),
    ({"length_penalty": NAN}, "length_penalty"),
    ({"block_size": 2.5, "cache": "contiguous"}, "block_size"),
    ({"seed": 0.5}, "seed"),
    ({"num_blocks": NAN}, "num_blocks"),
    ({"kv_budget": "x"}, "kv_budget"),
    ({"backend": "gpu"}, "backend"),
    ({"cache": None}, "cache=None"),
    ({"stop_tokens": [True]}, "stop_tokens"),
    ({"stop_tokens": 3}, "stop_tokens"),
]


@pytest.mark.parametrize("kwargs, word", BEAM_PROBES, ids=[str(p[0]) for p in BEAM_PROBES])
def test_beam_search(model, kwargs, word):
    args = {"prompt": P, "beam_width": 2, "max_new_tokens": 3, **kwargs}
    refused(lambda: beam_search(model, **args), word)


def cache_state(cache):
    m = cache.managers[0]
    return (sorted(m.free_blocks.ids()), m.refs.copy().tolist(), len(m.prefix), sorted(m._live),
            [m.blocks_of(s) for s in sorted(m._live)])


@pytest.mark.parametrize("blocks", [[7], [99], [-1], [1.5], [True], "twice", "unnamed",
                                    "more tokens than the sequence"],
                         ids=["free block", "out of range", "negative", "fraction", "bool",
                              "repeated", "held but not a prefix-cache entry", "too many"])
def test_prefix_blocks_that_hold_nothing(model, blocks):
    cache = SharedPagedCache(model.args, 8, 4, 4, 32, prefix_caching=True)
    cache.prepare([0], 10)                    # sequence 0 holds 3 blocks: 2 full, 1 partial
    cache.name_blocks(0, list(range(10)))     # the 2 full ones become prefix-cache entries
    m = cache.managers[0]
    held = [int(b) for b in m.blocks_of(0)]
    n = 8
    if blocks == "twice":
        blocks = [held[0], held[0]]
    elif blocks == "unnamed":                 # sequence 0's partial last block, still written
        blocks = [held[2]]
    elif blocks == "more tokens than the sequence":
        blocks, n = held[:2], 6               # 8 cached tokens cannot start a 6-token sequence
    assert 7 not in held and m.refs[7] == 0                # a really free block
    before = cache_state(cache)
    refused(lambda: m.reserve(1, n, prefix_blocks=blocks), "prefix")
    assert cache_state(cache) == before
    m.reserve(1, 8, prefix_blocks=held[:2])   # prefix-cache entries are shared, as before
    assert m.refs[held[0]] == m.refs[held[1]] == 2


@pytest.mark.parametrize("tokens", [[True, 1, 2, 3], [], "abcd", [1.5] * 8, [-1, 2, 3, 4]],
                         ids=["bool", "empty", "string", "fraction", "negative"])
def test_prompts_the_prefix_cache_would_hash_wrong(model, tokens):
    cache = SharedPagedCache(model.args, 8, 4, 4, 32, prefix_caching=True)
    cache.prepare([0], 8)
    before = cache_state(cache)
    refused(lambda: cache.start(1, tokens), "tokens")
    refused(lambda: cache.prefix_hits(tokens), "tokens")
    assert cache_state(cache) == before


@pytest.mark.parametrize("kwargs, word", [
    ({"device": "xyz"}, "device"), ({"device": 3.5}, "device"),
    ({"dtype": "float16"}, "dtype"), ({"dtype": torch.int8}, "dtype"),
])
def test_load_model_device_and_dtype(kwargs, word):
    refused(lambda: load_model(**kwargs), word)


def test_load_model_on_cuda_loads_or_says_there_is_no_gpu():
    if torch.cuda.is_available():
        assert next(load_model(device="cuda").parameters()).is_cuda
    else:
        refused(lambda: load_model(device="cuda"), "device='cuda'", "GPU", "device='cpu'")


def test_a_cache_manager_of_integers_or_of_huge_block_tables_is_refused_by_name():
    """An int64 pool was accepted (and failed later, in attention); 2**40 sequences were
    refused as "a pool of 8 blocks of 4 tokens needs 16.0 TiB ... room for 46 million blocks":
    the 16 TiB are the block tables, and more blocks would not help."""
    refused(lambda: CacheManager(8, 4, 2, 8, max_seqs=4, max_blocks_per_seq=4,
                                 dtype=torch.int64), "dtype", "floating-point")
    refused(lambda: CacheManager(8, 4, 2, 8, max_seqs=2**40, max_blocks_per_seq=4),
            "block tables for 1,099,511,627,776 sequences", "16.0 TiB")
