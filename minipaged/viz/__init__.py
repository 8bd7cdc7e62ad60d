"""Drawings shared by the notebooks, the chat and the README: matplotlib figures, rich renderables.
One module per stage (pool, kernel_walk, waste_plots, timeline, token_budget, shared_blocks,
beam_tree) plus the chat's terminal views and the training curve; every name is exported here.

Stage 1 (the contiguous cache): `plot_contiguous_cache` draws each sequence's reserved row of
slots, coloured by what each slot holds — prompt, generated token, or nothing yet.

Stage 2 (the block pool): `plot_pool` draws a layer's physical blocks coloured by the sequence
that owns them, filled as far as that sequence has written; `plot_block_tables` draws each
sequence's logical blocks with an arrow to the physical block holding it; `rich_pool` renders
the same picture in a terminal. Every function reads a CacheManager, never changes it.

Stage 3 (paged attention): `plot_gather` draws one layer's pool slot by slot and, below it, the
contiguous (B, L) view that attention gathers each row's scattered blocks into (`packed=True`:
a decode step's gather of the blocks rows own, one row's after the other);
`plot_slots_held` draws the slots each cache holds over a static batch, beside the tokens stored.

Stage 3b (inside the kernel): `plot_program_grid` (the kernel's programs, one per sequence and
KV head, with arrows to the blocks each reads), `plot_running_softmax` (one row's running max
and sum, block by block, from `paged_attention_v1(..., trace=...)`), `plot_partitions` (v2's
partitions and their merge), `plot_key_layouts` (one block of keys in memory, flash-attn's
layout and vLLM's), `plot_tiles_over_blocks` (the kernel's tiles over blocks of each size).

Stage 4 (fragmentation): stacked bars of where KV memory goes per policy, block-size sweeps,
concurrency under a budget, slot maps, and the policy table in rich.

Stage 4b (int8 blocks): `plot_int8_block` (one block's codes and scales beside the floats
written), `plot_capacity` (tokens a budget holds per format), `quantization_error` and
`plot_error_by_layer_and_position`, `plot_key_channels` (the keys' outlier channels);
`stored_kv` reads what a cache holds.

Stage 5 (scheduling): `plot_timeline` (a Gantt chart of requests: waiting, running, preempted,
swapped), `plot_pool_over_time` (blocks per request, stacked, preemptions marked), both from an
`Engine(record=True).history`; `plot_preemption_costs` (recompute vs swap); `plot_bench` and
`plot_throughput_vs_budget` (`python -m minipaged.benchmarks.serving`).

Stage 5b (chunked prefill): `plot_token_budget` (each step a bar of the tokens it ran, split per
request — decodes solid, prompt tokens hatched — with the budget as a line),
`plot_token_latency` (the tokens a running request waits between two of its tokens, and the
steps a trace took); `token_gaps`, `time_to_first_token` and `step_tokens` count them, all from
an `Engine(record=True).history`.

Stage 6 (sharing): `plot_shared_blocks` (tables pointing at shared blocks, counts written in
the pool), `plot_copy_on_write` (before and after a write into a shared block),
`plot_hash_chain` (a prompt's blocks and their chained hashes), `plot_sharing_savings`; all
from `sharing_snapshot(cache_manager)`.

Stage 6b (beam search): `plot_beam_tree` (the beams over time: forks, stops, pruned beams),
`plot_beam_blocks` (blocks held per forward, shared and unshared), `plot_beam_savings` (beam
search beside parallel sampling); from a `BeamSearch`'s `history` and `blocks_held`.

Stage 9 (tensor parallelism): `plot_head_split` (the heads and MLP features each rank owns),
`plot_block_across_ranks` (one block id in one process's pool and in each rank's, holding its
own heads), `plot_messages` (a worker's block tables before each of rank 0's messages, and what
each changes); `plot_pool` draws rank 0's pool.

Stage 9b (disaggregation): `plot_move` (one request's blocks in the prefill side's pool and in
the decode side's, an arrow for each block moved with its remapped id, the skipped ones marked),
from a recorded `Move`; `plot_step_times` (the chats' engine's steps on a timeline, colocated
and disaggregated, from `benchmarks.disaggregated_latency`).

The chat (`terminal`): rich views of a live cache — `pool_grid`, `block_table`, `layers_table`,
`blocks_view` (what `/blocks` prints), `contiguous_view`, `stats_table`, `status_line`.
"""

from .pool import (EDGE_COLOR, FREE_COLOR, plot_block_tables, plot_contiguous_cache,
                     plot_gather, plot_pool, plot_slots_held, rich_pool, seq_color)
from .kernel_walk import (key_layout_order, plot_key_layouts, plot_partitions,
                          plot_program_grid, plot_running_softmax, plot_tiles_over_blocks)
from .waste_plots import (KIND_COLORS, plot_block_size_sweep, plot_concurrency,
                            plot_slot_map, plot_waste_bars, plot_waste_over_time, plot_workload,
                            rich_policy_table)
from .int8_blocks import (FORMAT_COLORS, plot_capacity, plot_error_by_layer_and_position,
                          plot_int8_block, plot_key_channels, quantization_error, stored_kv)
from .timeline import (BENCH_COLORS, STATE_COLORS, _runs, plot_bench, plot_pool_over_time,
                         plot_preemption_costs, plot_throughput_vs_budget, plot_timeline)
from .token_budget import (CHUNK_HATCH, plot_token_budget, plot_token_latency, step_tokens,
                           time_to_first_token, token_gaps)
from .shared_blocks import (CACHED_COLOR, SHARED_COLOR, plot_copy_on_write, plot_hash_chain,
                      plot_shared_blocks, plot_sharing_savings, sharing_snapshot)
from .beam_tree import PRUNED_COLOR, plot_beam_blocks, plot_beam_savings, plot_beam_tree
from .loss_curve import plot_loss_curve
from .disaggregation import plot_move, plot_step_times
from .tensor_parallel import (RANK_COLORS, plot_block_across_ranks, plot_head_split,
                              plot_messages, rank_color)
from .terminal import (block_table, blocks_view, contiguous_view, layers_table, pool_grid,
                       stats_table, status_line)
