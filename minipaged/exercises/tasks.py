"""The tasks, in the order a learner builds them: one function or method each.

A task is a small declarative entry: its id, its stage, the workspace file the learner edits,
the package function it stands in for (a dotted name: if a function moves, change that string
and nothing else), what to write, the lesson section it follows, and the checks that grade it.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import checks as c

STAGES = ("1", "2", "3", "3b", "4", "4b", "5", "5b", "6", "6b", "7", "9", "9b")


@dataclass(frozen=True)
class Task:
    id: str
    stage: str
    file: str           # in the workspace
    target: str         # the package function the learner's stands in for
    what: str           # one line: what to write
    lesson: str         # the lesson section it follows
    checks: tuple

    @property
    def name(self) -> str:
        """The function's name in the workspace file."""
        return self.target.rsplit(".", 1)[1]


S2 = (c.take_matches_the_documented_draw, c.allocator_matches_a_list_model, c.paged_cache_tokens,
      c.later_stages_build_on_your_allocator)
S3 = (c.paged_attention_matches_dense, c.paged_call_tokens)
S4B = (c.int8_attention_reads_what_was_written,)
S5 = (c.engine_is_fcfs_and_preempts_the_newest,)
S5B = (c.admissible_is_the_largest_chunk_that_fits, c.chunked_engine_keeps_the_budget,
       c.chunks_fill_the_budget)
S6 = (c.sharing_keeps_counts_and_isolation, c.sampling_shares_blocks_and_keeps_tokens)

TASKS = (
    Task("1.attend", "1", "stage1_kv_cache.py", "minipaged.kv_cache.ContiguousCache.attend",
         "write the step's k/v into each row's next slots, then attend over the row",
         "lessons/01-naive-llama3.md, section 3 (The contiguous cache)",
         (c.contiguous_attend_matches_dense, c.contiguous_cache_tokens)),
    Task("2.take", "2", "stage2_cache_manager.py", "minipaged.cache_manager.FreeBlockSet.take",
         "take k random free block ids: swap the picked one with the last, pop",
         "lessons/02-cache-manager.md, section A random free set", S2),
    Task("2.reserve", "2", "stage2_cache_manager.py",
         "minipaged.cache_manager.CacheManager.reserve",
         "start a sequence with the blocks its prompt fills, all or nothing",
         "lessons/02-cache-manager.md, section The life of a request", S2),
    Task("2.grow", "2", "stage2_cache_manager.py", "minipaged.cache_manager.CacheManager.grow",
         "add tokens to sequences, new blocks only where the last block is full",
         "lessons/02-cache-manager.md, section All or nothing", S2),
    Task("2.free", "2", "stage2_cache_manager.py", "minipaged.cache_manager.CacheManager.free",
         "end a sequence: every block back to the free set, its table row padded",
         "lessons/02-cache-manager.md, section The life of a request", S2),
    Task("3.write", "3", "stage3_paged_attention.py",
         "minipaged.paged_attention.write_new_kv",
         "the slot mapping: write each new k/v into block table[p // bs], offset p % bs",
         "lessons/03-paged-attention.md, section 2 (The PyTorch path: write, gather, attend)", S3),
    Task("3.gather", "3", "stage3_paged_attention.py", "minipaged.paged_attention._gather",
         "copy each row's blocks, in table order, into one contiguous (B, L, Hk, D) tensor",
         "lessons/03-paged-attention.md, section 2 (The PyTorch path: write, gather, attend)", S3),
    Task("3b.walk", "3b", "stage3b_online_softmax.py", "minipaged.online_softmax.walk_blocks",
         "the online-softmax walk over a row's blocks: running max, sum, rescaled accumulator",
         "lessons/03b-inside-the-kernel.md, section v1: the walk, block by block",
         (c.kernel_walk_matches_dense,)),
    Task("3b.combine", "3b", "stage3b_online_softmax.py",
         "minipaged.online_softmax.combine_partitions",
         "merge v2's partitions by their maxes and sums",
         "lessons/03b-inside-the-kernel.md, section v2: partitions, each walked on its own",
         (c.kernel_walk_matches_dense,)),
    Task("4.split", "4", "stage4_fragmentation.py", "minipaged.fragmentation.split_allocated",
         "split held slots into token states, reservation and internal fragmentation",
         "lessons/04-fragmentation.md, section Five kinds of slot",
         (c.split_allocated_counts_slot_by_slot,)),
    Task("4.free", "4", "stage4_fragmentation.py", "minipaged.fragmentation.split_free",
         "split free slots into external fragmentation and idle",
         "lessons/04-fragmentation.md, section Five kinds of slot",
         (c.split_free_matches_the_definition,)),
    Task("4b.quantize", "4b", "stage4b_kv_quant.py", "minipaged.kv_quant.quantize_int8",
         "each row's int8 codes, then its float16 scale max|x| / 127 as 2 bytes: codes "
         "computed with the scale as stored",
         "lessons/04b-kv-in-fewer-bytes.md, section One scale per token and head",
         (c.quantize_matches_the_reference, *S4B)),
    Task("4b.dequantize", "4b", "stage4b_kv_quant.py", "minipaged.kv_quant.dequantize_int8",
         "read a slot back: its codes times the float16 scale in its last 2 bytes",
         "lessons/04b-kv-in-fewer-bytes.md, section One scale per token and head",
         (c.dequantize_matches_the_reference, *S4B)),
    Task("5.decodes", "5", "stage5_scheduler.py",
         "minipaged.scheduler.Scheduler._schedule_decodes",
         "a slot for every running request, oldest first; preempt the newest when dry",
         "lessons/05-scheduling.md, section One step of the scheduler", S5),
    Task("5.admit", "5", "stage5_scheduler.py", "minipaged.scheduler.Scheduler._admit",
         "admit waiting requests in order while rows and blocks (with the watermark) fit",
         "lessons/05-scheduling.md, section One step of the scheduler", S5),
    Task("5b.chunk", "5b", "stage5b_chunked_prefill.py",
         "minipaged.chunked_prefill.ChunkedScheduler._schedule_prompt_chunks",
         "give the request still prefilling a chunk: what the budget and blocks allow",
         "lessons/05b-chunked-prefill.md, section One step under a budget", S5B),
    Task("5b.admissible", "5b", "stage5b_chunked_prefill.py",
         "minipaged.chunked_prefill.ChunkedScheduler._admissible",
         "the largest first chunk whose blocks fit with the watermark, a block at a time",
         "lessons/05b-chunked-prefill.md, section One step under a budget", S5B),
    Task("6.fork", "6", "stage6_sharing.py", "minipaged.sharing.SharedCacheManager.fork",
         "a child shares every block of its parent: copy the table row, counts +1",
         "lessons/06-sharing.md, section Reference counts", S6),
    Task("6.cow", "6", "stage6_sharing.py", "minipaged.sharing.SharedCacheManager._shared_writes",
         "find the rows about to write into a shared partial last block (copy-on-write)",
         "lessons/06-sharing.md, section Copy-on-write", S6),
    Task("6.hash", "6", "stage6_sharing.py", "minipaged.prefix_cache.block_hashes",
         "the chained hashes of a prompt's full blocks",
         "lessons/06-sharing.md, section Names for blocks: a hash chain",
         (c.hash_chain_properties, c.sampling_shares_blocks_and_keeps_tokens)),
    Task("6b.reorder", "6b", "stage6b_beams.py", "minipaged.beams.BeamSearch._reorder",
         "free pruned beams, keep the first child in its parent's row, fork the others",
         "lessons/06b-beam-search.md, section Keep: the survivors fork, the pruned are freed",
         (c.beams_fork_prune_and_match,)),
    Task("7.propose", "7", "stage7_speculative.py", "minipaged.speculative.ngram_propose",
         "up to k drafts: what followed the latest earlier match of the last n tokens, n from "
         "max_n down",
         "lessons/07-speculative-decoding.md, section Drafts with no second model",
         (c.ngram_propose_matches_brute_force, c.speculative_greedy_tokens)),
    Task("7.rollback", "7", "stage7_speculative.py", "minipaged.speculative.rollback",
         "wind a sequence back to num_tokens in every layer, releasing the blocks past "
         "ceil(num_tokens / block_size)",
         "lessons/07-speculative-decoding.md, section Roll back",
         (c.rollback_keeps_the_allocator_whole, c.speculative_greedy_tokens)),
    Task("9.shard", "9", "stage9_tensor_parallel.py",
         "minipaged.tensor_parallel.rank_state_dict",
         "a rank's weights: its heads' rows of wq/wk/wv, columns of wo; its MLP share of w1/w3 "
         "(rows) and w2 (columns); the rest whole",
         "lessons/09-tensor-parallel.md, section Splitting a layer: columns, then rows",
         (c.rank_weights_are_its_heads_and_features,)),
    Task("9.apply", "9", "stage9_tensor_parallel.py", "minipaged.tensor_parallel.apply_changes",
         "a worker's tables after one step's message: drop the freed, append, replace",
         "lessons/09-tensor-parallel.md, section One block table, N pools",
         (c.worker_tables_follow_the_scheduler,)),
    Task("9b.remap", "9b", "stage9b_disaggregated.py", "minipaged.disaggregated.remap",
         "pair the prefill side's block ids with the decode side's, logical block by block, "
         "after the skipped ones",
         "lessons/09b-disaggregation.md, section The remap",
         (c.remap_pairs_the_same_logical_blocks, c.disaggregated_tokens_and_moved_kv)),
)

BY_ID = {t.id: t for t in TASKS}


def select(what: str) -> list[Task]:
    """'2.grow' -> that task; '2' -> the stage's tasks; 'all' -> every task."""
    if what == "all":
        return list(TASKS)
    if what in BY_ID:
        return [BY_ID[what]]
    if what in STAGES:
        return [t for t in TASKS if t.stage == what]
    raise KeyError(what)
