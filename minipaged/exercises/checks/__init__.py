"""The checks the tasks run, a module per stage (`stage2.py` holds stage 2's): the project's
kind of checks, against independent references.

Each check is a function of no arguments that raises `CheckFailed` with a sentence a learner
understands. Property checks draw their inputs with hypothesis (few examples, derandomized,
so a run is quick and repeatable); a failing input is shrunk and shown. Token checks run a
tiny random Llama 3 built in `common.py` (no file is read) and compare exact greedy tokens.
"""

from . import (common, stage1, stage2, stage3, stage4, stage4b, stage5, stage6,  # noqa: F401
               stage7, stage9, stage9b)
from .stage1 import (  # noqa: F401
    contiguous_cache_tokens, contiguous_attend_matches_dense)
from .stage2 import (  # noqa: F401
    take_matches_the_documented_draw, allocator_matches_a_list_model, paged_cache_tokens,
    later_stages_build_on_your_allocator)
from .stage3 import (  # noqa: F401
    paged_attention_matches_dense, paged_call_tokens, kernel_walk_matches_dense)
from .stage4 import (  # noqa: F401
    split_allocated_counts_slot_by_slot, split_free_matches_the_definition)
from .stage4b import (  # noqa: F401
    quantize_matches_the_reference, dequantize_matches_the_reference,
    int8_attention_reads_what_was_written)
from .stage5 import (  # noqa: F401
    engine_is_fcfs_and_preempts_the_newest, chunked_engine_keeps_the_budget,
    admissible_is_the_largest_chunk_that_fits, chunks_fill_the_budget)
from .stage6 import (  # noqa: F401
    sharing_keeps_counts_and_isolation, sampling_shares_blocks_and_keeps_tokens,
    hash_chain_properties, beams_fork_prune_and_match)
from .stage7 import (  # noqa: F401
    ngram_propose_matches_brute_force, speculative_greedy_tokens,
    rollback_keeps_the_allocator_whole)
from .stage9 import (  # noqa: F401
    rank_weights_are_its_heads_and_features, worker_tables_follow_the_scheduler)
from .stage9b import (  # noqa: F401
    remap_pairs_the_same_logical_blocks, disaggregated_tokens_and_moved_kv)
