"""`GET /metrics`: the engine's state in Prometheus' text format (version 0.0.4), the names
vLLM's server exposes translated to minipaged's."""

from __future__ import annotations

# name, type, help, the key of the loop's `counters` it reads
METRICS = [
    ("minipaged_kv_blocks_used", "gauge",
     "KV blocks per layer held by requests now (cached free blocks not counted)", "used"),
    ("minipaged_kv_blocks_total", "gauge", "KV blocks per layer in the pool", "num_blocks"),
    ("minipaged_kv_blocks_cached_free", "gauge",
     "free KV blocks that still hold a cached prefix", "cached_free"),
    ("minipaged_requests_running", "gauge", "requests holding blocks in the pool", "running"),
    ("minipaged_requests_waiting", "gauge", "requests waiting for blocks", "waiting"),
    ("minipaged_requests_swapped", "gauge", "requests swapped out to the CPU pool", "swapped"),
    ("minipaged_preemptions_total", "counter", "requests preempted since the start",
     "preemptions"),
    ("minipaged_prefix_cache_hit_tokens_total", "counter",
     "prompt tokens found in the prefix cache instead of computed", "cached_tokens"),
    ("minipaged_generated_tokens_total", "counter", "tokens generated since the start",
     "generated_tokens"),
    ("minipaged_engine_steps_total", "counter", "engine steps since the start", "steps"),
    ("minipaged_requests_refused_total", "counter",
     "requests answered 503 because the waiting queue was full", "refused"),
    ("minipaged_requests_aborted_total", "counter",
     "samples ended early: the client went away, or a stop string", "aborted"),
    ("minipaged_requests_failed_total", "counter",
     "samples ended by an engine step that failed (the server logged why)", "failed"),
]

TRANSFER_METRICS = [   # --disaggregated (stage 9b): the decode engine's loads from the prefill one
    ("minipaged_kv_transfer_blocks_total", "counter",
     "KV blocks loaded from the prefill engine (each block: every layer)", "blocks_sent"),
    ("minipaged_kv_transfer_bytes_total", "counter", "bytes of K and V loaded", "bytes_sent"),
    ("minipaged_kv_transfer_skipped_blocks_total", "counter",
     "blocks not loaded: the decode engine's prefix cache held them", "blocks_skipped"),
    ("minipaged_kv_transfer_failed_total", "counter",
     "loads given up (failed, or not read by the deadline): the prompt was recomputed",
     "loads_failed"),
    ("minipaged_kv_transfer_seconds_total", "counter", "seconds spent writing loaded blocks",
     "transfer_seconds"),
]


def prometheus_text(state: dict) -> str:
    """One `# HELP`, one `# TYPE` and one sample line per metric."""
    lines = []
    for name, kind, help_text, key in METRICS + (TRANSFER_METRICS if "blocks_sent" in state
                                                 else []):
        value = state[key]
        value = len(value) if isinstance(value, list) else value
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """The sample lines of a Prometheus text page, name -> value (for tests and the benchmark)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
