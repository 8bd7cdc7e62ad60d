/* Stage 3b: paged attention for a decode step, as a C kernel for CPUs (cpu_attention.py).

   The walk of online_softmax.py and of vLLM's paged_attention_v1, for one query token per
   row: every (row, KV head) walks its row's block table and reads each block's keys and
   values where they lie in the pool, keeping a running max, a running sum and an
   accumulator per query head of its group. Nothing is gathered, nothing is masked: the walk
   stops at the row's last key. It asks the memory for each block one block ahead, since the
   block table knows where the next one lies and the hardware does not: the first block all at
   once (`prefetch_block`), each later one a key at a time (`prefetch_key`), the next block's
   key t while it reads this block's key t, its keys while scoring and its values while
   weighting. Asked for a block at a time, a step's attention took 10-30% longer (float32 and
   bfloat16, 16 and 64 rows of 40-400 keys, AVX2 and AVX-512 builds on an AMD EPYC, Zen 5):
   a burst of requests fills the core's queue of misses, and it waits on its own prefetches.

   cpu_attention.py compiles this file once per (KV dtype, head dim, group size), the first
   time a step needs it, with those three set by -D flags: the compiler then knows every loop's
   length and unrolls and vectorizes the products over the head dim.

     KV_BF16      keys and values are bfloat16 (else float32); q and the output are float32
     KV_INT8      keys and values are stage 4b's int8 slots: HEAD_DIM codes, then the row's
                  float16 scale in the next 2 bytes; a dot product and a value are scaled once
     HEAD_DIM     D, the head dim
     GROUP        query heads per KV head (grouped-query attention)

   Shapes (all C-contiguous):
     q            (B, Hk * GROUP, D) float32: the step's one query per row
     k_cache      (num_blocks, block_size, Hk, D), v_cache likewise ((..., Hk, D + 2) for KV_INT8)
     block_table  (B, table_width) int64: row b's key j is in block block_table[b][j / block_size]
     seqlens      (B,) int64: keys per row, the new one included
     out          (B, Hk * GROUP, D) float32
*/
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"      /* for SIMD_ISA: the loops below are vectorized by the compiler */

#ifdef KV_BF16
typedef uint16_t kv_t;
static inline float load(kv_t x) {   /* a bfloat16 is the top half of a float32 */
    union { uint32_t bits; float value; } f = { (uint32_t)x << 16 };
    return f.value;
}
#elif defined(KV_INT8)
typedef int8_t kv_t;
static inline float load(kv_t x) { return (float)x; }
#else
typedef float kv_t;
static inline float load(kv_t x) { return x; }
#endif

#ifdef KV_INT8
#define ROW (HEAD_DIM + 2)     /* elements of one (slot, KV head): the codes, then the scale */
/* The float16 scale stored in the 2 bytes after a row's codes (little-endian), never negative
   (max|x| / 127). Without a branch: a normal float16's exponent and mantissa move into a float's
   places, its exponent rebiased (15 -> 127); a subnormal one is its mantissa times 2^-24.
   Both are worked out and one is picked, which the compiler does with a select, not a jump. */
static inline float row_scale(const kv_t *row) {
    const uint32_t h = (uint32_t)((uint8_t)row[HEAD_DIM] | ((uint8_t)row[HEAD_DIM + 1] << 8));
    union { uint32_t bits; float value; } normal = { ((h & 0x7fffu) << 13) + (112u << 23) };
    const float subnormal = (float)(h & 0x3ffu) * 0x1p-24f;
    return (h & 0x7c00u) ? normal.value : subnormal;
}
#else
#define ROW HEAD_DIM
static inline float row_scale(const kv_t *row) { (void)row; return 1.0f; }
#endif

#define TILE 32   /* keys scored at a time: a block's keys, or a slice of a longer block */

/* Keys of a row of n keys in the block that starts at key `start`. */
static inline int keys_in_block(int64_t n, int64_t start, int block_size) {
    return n - start < block_size ? (int)(n - start) : block_size;
}

/* Ask the memory for one key's (or value's) lines of one KV head, the slot at `slot`. */
static inline void prefetch_key(const kv_t *slot) {
    for (int byte = 0; byte < ROW * (int)sizeof(kv_t); byte += 64)
        __builtin_prefetch((const char *)slot + byte);
}

/* Ask the memory now for the first `count` keys and values of one KV head in `block`, which
   the walk reads soon. Blocks lie anywhere in the pool and a head's keys are a slice of each
   slot, so the hardware's own prefetching guesses badly; the block table knows. Without this,
   over pools not already in the CPU's caches, the walk waits on memory more than it computes. */
static inline void prefetch_block(const kv_t *k_cache, const kv_t *v_cache, int64_t block,
                                  int block_size, int64_t key_stride, int kv_head, int count) {
    const int64_t first = block * block_size * key_stride + kv_head * ROW;
    for (int t = 0; t < count; t++) {
        prefetch_key(k_cache + first + t * key_stride);
        prefetch_key(v_cache + first + t * key_stride);
    }
}

void paged_attention_decode(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                            const int64_t *block_table, int64_t table_width,
                            const int64_t *seqlens, int B, int Hk, int block_size,
                            float scale, float *out, int threads) {
    const int D = HEAD_DIM, G = GROUP;
    const int64_t key_stride = (int64_t)Hk * ROW;        /* from one slot to the next */
    /* dynamic: a thread takes the next (row, KV head) when it is done with one, so rows of
       different lengths, or a thread that another process holds up, leave no one idle */
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int work = 0; work < B * Hk; work++) {          /* one (row, KV head) each */
        const int b = work / Hk, kv_head = work % Hk;
        const float *qs = q + ((int64_t)b * Hk + kv_head) * G * D;   /* its G query heads */
        float *acc = out + ((int64_t)b * Hk + kv_head) * G * D;
        float m[GROUP], l[GROUP], p[GROUP][TILE];        /* running max, sum; a tile's weights */
        float o[GROUP][HEAD_DIM] = {{0.0f}};             /* the weighted values, summed */
        for (int h = 0; h < G; h++) { m[h] = -FLT_MAX; l[h] = 0.0f; }
        const int64_t n = seqlens[b];
        const int64_t *table = block_table + b * table_width;            /* row b's blocks */
        if (n > 0)                                        /* the first block's, all at once */
            prefetch_block(k_cache, v_cache, table[0], block_size, key_stride, kv_head,
                           keys_in_block(n, 0, block_size));
        for (int64_t start = 0; start < n; start += block_size) {    /* block after block */
            const int64_t block = table[start / block_size];
            const kv_t *keys = k_cache + block * block_size * key_stride + kv_head * ROW;
            const kv_t *values = v_cache + block * block_size * key_stride + kv_head * ROW;
            const int in_block = keys_in_block(n, start, block_size);
            /* the next block's keys and values, asked for one by one while this one runs */
            const int next = start + block_size < n ?
                keys_in_block(n, start + block_size, block_size) : 0;
            const int64_t ahead = next ? (table[start / block_size + 1] - block) * block_size *
                key_stride : 0;                          /* from this block to the next */
            for (int t0 = 0; t0 < in_block; t0 += TILE) {
                const int count = in_block - t0 < TILE ? in_block - t0 : TILE;
                /* scores: each key of the tile, read once, against the group's queries */
                for (int t = 0; t < count; t++) {
                    const kv_t *k = keys + (t0 + t) * key_stride;
                    if (t0 + t < next) prefetch_key(k + ahead);
                    float dot[GROUP] = {0.0f};
                    for (int d = 0; d < D; d++) {
                        const float key = load(k[d]);
                        for (int h = 0; h < G; h++) dot[h] += qs[h * D + d] * key;
                    }
                    const float k_scale = row_scale(k) * scale;    /* 1 unless KV_INT8 */
                    for (int h = 0; h < G; h++) p[h][t] = dot[h] * k_scale;
                }
                /* online softmax: a new max rescales what was summed so far */
                for (int h = 0; h < G; h++) {
                    float new_max = m[h], sum = 0.0f;
                    for (int t = 0; t < count; t++) new_max = fmaxf(new_max, p[h][t]);
                    for (int t = 0; t < count; t++) {
                        p[h][t] = expf(p[h][t] - new_max);
                        sum += p[h][t];
                    }
                    const float rescale = expf(m[h] - new_max);
                    l[h] = l[h] * rescale + sum;
                    m[h] = new_max;
                    for (int d = 0; d < D; d++) o[h][d] *= rescale;
                }
                /* values, weighted: each value read once for the group */
                for (int t = 0; t < count; t++) {
                    const kv_t *v = values + (t0 + t) * key_stride;
                    if (t0 + t < next) prefetch_key(v + ahead);
                    float w[GROUP];                          /* weights, times the row's scale */
                    for (int h = 0; h < G; h++) w[h] = p[h][t] * row_scale(v);
                    for (int d = 0; d < D; d++) {
                        const float value = load(v[d]);
                        for (int h = 0; h < G; h++) o[h][d] += w[h] * value;
                    }
                }
            }
        }
        for (int h = 0; h < G; h++) {                    /* a row with no key: zeros */
            const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
            for (int d = 0; d < D; d++) acc[h * D + d] = o[h][d] * inv;
        }
    }
}

/* The vector width the compiler had for the loops above (simd.h): "avx512", "avx2", "neon" or
   "plain". */
const char *attention_isa(void) { return SIMD_ISA; }
