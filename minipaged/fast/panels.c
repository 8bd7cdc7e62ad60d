/* A matrix product for a few rows: y (M, N) = x (M, K) @ W.T, with W (N, K) stored as panels of
   32 outputs, (N / 32, K, 32): panel p, row k holds W[32p .. 32p+31, k], so a panel is one
   contiguous stream of K rows (matvec.py says why, with the measurements). The weights are
   float32 (`panel_linear`), or bfloat16 or float16 (`panel_linear_bf16`, `panel_linear_f16`):
   half the bytes to stream, widened to float32 as they are loaded; x, y and the sums are always
   float32.

   It is written once over ../simd.h's vectors of VL floats: a panel row is NV = 32 / VL of them
   (2 on AVX-512, 4 on AVX2, 8 on NEON). Each thread takes whole panels. For up to MR_MAX rows of
   x at a time (a "pass"), the kernel keeps a row's 32 outputs in NV registers, and for every k
   reads the panel's 32 weights once and multiplies them by the pass's x[m][k]. MR_MAX is as
   many rows as the CPU's vector registers hold sums for, with room for the operands: 12 on
   AVX-512 (24 sums, a panel row of weights, an x: 27 of 32 registers), 3 on AVX2 (12 sums and
   the 3 x's, one vector of weights at a time: all 16; holding a row of weights instead, the
   half-precision products spilled and took twice as long at 16 rows). More rows make several
   passes over the same panel, which is then in the core's L2.

   Memory: while a thread multiplies one panel it asks for the next one (prefetcht0: into L1
   and L2) at an even rate, one or two of its 64-byte lines at every k, spread over all the
   passes it makes over the panel, so weights keep arriving while the core multiplies. Asked
   for in a burst (all in the first pass), the products of 24 to 64 rows took 20-35% longer on
   AVX-512; left to the hardware prefetcher, 5-43% longer; counted out by a branch that varied
   from one k to the next, some row counts ran up to a fifth slower, which ones depending on
   where the compiler placed the loop. Asking for the next panel into L2 only, with each pass
   also asking for its own panel's rows 16 ahead into L1, was 7-11% slower at 1 row, 4-23% at
   4 rows, 3-15% at 16 and 1-7% at 64 (AVX2 and AVX-512 builds, on an AMD EPYC, Zen 5).

   bfloat16 weights on a CPU that multiplies bf16 pairs (../simd.h's DOT_BF16) take k two at a
   time where a product has two rows or more (`pass_dot_*`): x rounded to bf16 once (exact for
   a bf16 model's activations, which the caller widened), a panel's rows k and k + 1 paired in
   registers, one instruction adding both k's products into 16 sums. SmolLM2's 121 products
   took 8.7 ms at 16 rows against 10.3 widened, 15.4 against 22.5 at 32, 29.0 against 42.6 at
   64 (AMD EPYC, Zen 5, 2 threads); level at 2 to 8 rows, and 12% slower at one (7.3 against
   6.5: one row waits on memory, not on multiplications), which stays widened.

   On one thread, a helper may take part in the float32 products (`panel_helper`, at the end of
   this file). Built without OpenMP (Apple's clang), every product runs on the calling thread. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
static int omp_get_num_threads(void) { return 1; }
#endif
#include "../simd.h"

#define NR 32          /* outputs a panel */
#define NV (NR / VL)   /* vectors a panel row */
#ifndef MR_MAX         /* rows of x a pass (-DMR_MAX=... to try others) */
#if VREGS >= 32 && NV <= 2
#define MR_MAX 12      /* AVX-512: 2 * 12 sums of the 32 registers */
#elif NV <= 4
#define MR_MAX 3       /* AVX2: 4 * 3 sums of the 16 */
#else
#define MR_MAX 2       /* NEON, plain: 8 * 2 sums, 8 weights */
#endif
#endif

typedef float w_f32;            /* a weight as stored in the panels */
typedef uint16_t w_bf16, w_f16;

/* One k's prefetch in a pass: the next line of the pass's share, two where `twice`. */
static inline void ask(const char *line, uint64_t *at, uint64_t step, int twice) {
    __builtin_prefetch(line + ((*at >> 32) << 6), 0, 3);
    *at += step;
    if (twice) {
        __builtin_prefetch(line + ((*at >> 32) << 6), 0, 3);
        *at += step;
    }
}

/* One pass, the j-th of P over the panel w: MR rows of x (M, K) into y (row stride N). `next`:
   the next panel (0 for a thread's last one), whose lines the P passes ask for between them,
   this pass `lines` of them from `line` on, with a prefetch at every k (two where lines > K: a
   single pass over a float32 panel), each `step` lines further on (`at`, `step`: lines in 32.32
   fixed point; a line may be asked for twice). With no next panel a pass asks for its own
   panel's lines, already on their way. A prefetch of an address past the weights does not
   fault. KIND: the weights' type, f32, bf16 or f16 (w_KIND, load_KIND). */
#define PASS(MR, KIND)                                                                         \
static void pass_##KIND##_##MR(const float *x, int K, const void *panel, float *y, int N,      \
                               const char *next, int j, int P) {                               \
    const w_##KIND *w = panel;                                                                 \
    enum { ROW = NR * sizeof(w_##KIND) };                  /* bytes a panel row */             \
    vfloat sum[MR][NV];                                                                        \
    for (int m = 0; m < MR; m++)                                                               \
        for (int v = 0; v < NV; v++) sum[m][v] = (vfloat){0};                                  \
    int lines = ((int64_t)K * ROW / 64 + P - 1) / P;                                           \
    const char *line = next ? next + (int64_t)j * lines * 64 : (const char *)w;                \
    int twice = lines > K;                                                                     \
    uint64_t step = ((uint64_t)lines << 32) / (twice ? 2 * K : K), at = 0;                     \
    for (int k = 0; k < K; k++) {                                                              \
        ask(line, &at, step, twice);                                                           \
        const w_##KIND *row = w + (int64_t)k * NR;                                             \
        if (MR * NV + NV + 1 <= VREGS) {       /* a panel row in registers, one x at a time */ \
            vfloat wv[NV];                                                                     \
            for (int v = 0; v < NV; v++) wv[v] = load_##KIND(row + v * VL);                    \
            for (int m = 0; m < MR; m++) {                                                     \
                const float xm = x[(int64_t)m * K + k];                                        \
                for (int v = 0; v < NV; v++) sum[m][v] += xm * wv[v];                          \
            }                                                                                  \
        } else {                               /* (AVX2) every x in registers, one vector */   \
            vfloat xm[MR];                     /* of weights at a time */                      \
            for (int m = 0; m < MR; m++) xm[m] = (vfloat){0} + x[(int64_t)m * K + k];          \
            for (int v = 0; v < NV; v++) {                                                     \
                const vfloat wv = load_##KIND(row + v * VL);                                   \
                for (int m = 0; m < MR; m++) sum[m][v] += xm[m] * wv;                          \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int m = 0; m < MR; m++)                                                               \
        for (int v = 0; v < NV; v++) store_f32(y + (int64_t)m * N + v * VL, sum[m][v]);        \
}

typedef void (*pass_fn)(const float *, int, const void *, float *, int, const char *, int, int);

/* Every pass (1 to 12 rows) for weights of one KIND; a build calls those up to MR_MAX. */
#define PASSES(KIND)                                                                           \
PASS(1, KIND) PASS(2, KIND) PASS(3, KIND) PASS(4, KIND) PASS(5, KIND) PASS(6, KIND)            \
PASS(7, KIND) PASS(8, KIND) PASS(9, KIND) PASS(10, KIND) PASS(11, KIND) PASS(12, KIND)         \
static const pass_fn PASSES_##KIND[13] = {                                                     \
    0, pass_##KIND##_1, pass_##KIND##_2, pass_##KIND##_3, pass_##KIND##_4, pass_##KIND##_5,    \
    pass_##KIND##_6, pass_##KIND##_7, pass_##KIND##_8, pass_##KIND##_9, pass_##KIND##_10,      \
    pass_##KIND##_11, pass_##KIND##_12};
PASSES(f32) PASSES(bf16) PASSES(f16)

#ifdef DOT_BF16
/* A pass over bfloat16 panels, k two at a time (see the top): as PASS, with x as bf16 pairs,
   (x[m][k], x[m][k+1]) in 32 bits at pairs[m * K + k / 2] (so that rows stay K floats apart), and
   two vectors of sums a row (`lo`, `hi`: pair_rows's order). After an odd K's last row, a row
   of zeros. */
static const uint16_t zero_row[NR];

#define PASS_DOT(MR)                                                                           \
static void pass_dot_##MR(const float *x, int K, const void *panel, float *y, int N,           \
                          const char *next, int j, int P) {                                    \
    const w_bf16 *w = panel;                                                                   \
    const uint32_t *pairs = (const uint32_t *)x;                                               \
    vfloat lo[MR], hi[MR];                                                                     \
    for (int m = 0; m < MR; m++) lo[m] = hi[m] = (vfloat){0};                                  \
    int lines = ((int64_t)K * NR * sizeof(w_bf16) / 64 + P - 1) / P;                           \
    const char *line = next ? next + (int64_t)j * lines * 64 : (const char *)w;                \
    int twice = lines > K;                                                                     \
    uint64_t step = ((uint64_t)lines << 32) / (twice ? 2 * K : K), at = 0;                     \
    for (int k = 0; k < K; k += 2) {                                                           \
        ask(line, &at, step, twice);                   /* two k's lines, as PASS asks */       \
        ask(line, &at, step, twice);                                                           \
        vpairs wl, wh;                                                                         \
        pair_rows(w + (int64_t)k * NR, k + 1 < K ? w + (int64_t)(k + 1) * NR : zero_row,       \
                  &wl, &wh);                                                                   \
        for (int m = 0; m < MR; m++) {                                                         \
            const uint32_t xm = pairs[(int64_t)m * K + k / 2];                                 \
            lo[m] = dot_bf16(lo[m], wl, xm);                                                   \
            hi[m] = dot_bf16(hi[m], wh, xm);                                                   \
        }                                                                                      \
    }                                                                                          \
    for (int m = 0; m < MR; m++) unpair_store(y + (int64_t)m * N, lo[m], hi[m]);               \
}
PASS_DOT(1) PASS_DOT(2) PASS_DOT(3) PASS_DOT(4) PASS_DOT(5) PASS_DOT(6)
PASS_DOT(7) PASS_DOT(8) PASS_DOT(9) PASS_DOT(10) PASS_DOT(11) PASS_DOT(12)
static const pass_fn PASSES_dot[13] = {
    0, pass_dot_1, pass_dot_2, pass_dot_3, pass_dot_4, pass_dot_5, pass_dot_6, pass_dot_7,
    pass_dot_8, pass_dot_9, pass_dot_10, pass_dot_11, pass_dot_12};
#endif

/* panels [first, last) of y's columns into y0 (row stride ystride), x: (M, K); `passes` and
   `bytes` (a weight's) for the panels' type */
static void panels_into(const pass_fn *passes, int bytes, const float *x, const void *panels,
                        float *y0, int ystride, int M, int K, int first, int last) {
    int count = (M + MR_MAX - 1) / MR_MAX, rows = (M + count - 1) / count;   /* even passes */
    for (int p = first; p < last; p++) {
        const char *w = (const char *)panels + (int64_t)p * K * NR * bytes;
        const char *next = p + 1 < last ? w + (int64_t)K * NR * bytes : 0;
        for (int m0 = 0, j = 0; m0 < M; m0 += rows, j++) {
            int mr = M - m0 < rows ? M - m0 : rows;
            passes[mr](x + (int64_t)m0 * K, K, w, y0 + (int64_t)m0 * ystride + (p - first) * NR,
                       ystride, next, j, count);
        }
    }
}

static void split_panels(const pass_fn *passes, int bytes, const float *x, const void *panels,
                         float *y, int M, int N, int K, int threads) {
    int count = N / NR;
    #pragma omp parallel num_threads(threads)
    {   /* each thread one contiguous run of panels, [first, last) */
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        int first = (int)((int64_t)count * t / n), last = (int)((int64_t)count * (t + 1) / n);
        panels_into(passes, bytes, x, panels, y + first * NR, N, M, K, first, last);
    }
}

static int shared_linear(const float *x, const float *panels, float *y, int M, int N, int K);

void panel_linear(const float *x, const float *panels, float *y, int M, int N, int K,
                  int threads) {
    if (threads == 1 && shared_linear(x, panels, y, M, N, K))
        return;
    split_panels(PASSES_f32, 4, x, panels, y, M, N, K, threads);
}

void panel_linear_bf16(const float *x, const uint16_t *panels, float *y, int M, int N, int K,
                       int threads) {
#ifdef DOT_BF16
    uint32_t *pairs = M > 1 ? malloc((size_t)M * K * sizeof *pairs) : 0;
    if (pairs) {                       /* x as bf16 pairs (PASS_DOT), rows K words apart */
        for (int64_t m = 0; m < M; m++)
            for (int k = 0; k < K; k += 2)
                pairs[m * K + k / 2] = round_bf16(x[m * K + k]) |
                    (uint32_t)(k + 1 < K ? round_bf16(x[m * K + k + 1]) : 0) << 16;
        split_panels(PASSES_dot, 2, (const float *)pairs, panels, y, M, N, K, threads);
        free(pairs);
        return;
    }
#endif
    split_panels(PASSES_bf16, 2, x, panels, y, M, N, K, threads);
}

void panel_linear_f16(const float *x, const uint16_t *panels, float *y, int M, int N, int K,
                      int threads) {
    split_panels(PASSES_f16, 2, x, panels, y, M, N, K, threads);
}

/* Which of ../simd.h's vector widths this build computes with: "avx512", "avx2", "neon" or
   "plain"; and the rows of x a pass. */
const char *panel_isa(void) { return SIMD_ISA; }
int panel_rows_a_pass(void) { return MR_MAX; }

/* Whether bfloat16 products of two rows or more multiply bf16 pairs (DOT_BF16): 1 or 0. */
int panel_bf16_dot(void) {
#ifdef DOT_BF16
    return 1;
#else
    return 0;
#endif
}

/* The helper: one more thread for when a step runs on one thread because another process holds
   a core (threads.py turns it on and off). It sits on that held core and gets a turn there only
   now and then, for a few milliseconds. A static split would make every product wait for its
   turn; here, as in a work queue, the calling thread and the helper each take the next CHUNK
   panels while any are left, and the calling thread, out of panels, waits for the helper's
   chunk only a little (PATIENCE) before taking it back and multiplying it itself. So no product
   waits for the helper's turn, and while it has one, two cores read weights.

   Each product has a number (`gen`). `claim` holds its low 32 bits, the product's count of
   chunks and the next chunk to take: the caller takes one by adding 1, the helper by a
   compare-and-swap, which fails once the caller has moved on. A chunk's state in `owner`
   carries the product's number too. A chunk the helper is working on (WORKING) becomes either
   its (COMMITTING, then DONE) or the caller's again (TAKEN), by one compare-and-swap, whichever
   comes first: the helper multiplies into a buffer of its own and copies its chunk into y only
   once it has won. It reads x from a copy (`stage`, two of them, one per product in turn), so
   a helper that wakes late finds its chunk taken and its copy of x stale, never x itself, which
   the caller may have freed by then. The weights must outlive the helper: threads.py stops it
   (and waits for it) when a run ends. */
#define CHUNK 4                  /* panels a chunk */
#define MAX_CHUNKS 4096
#define STAGE (1 << 18)          /* floats of x a product may have, and of a chunk's outputs */
#define PATIENCE 1000            /* pauses (tens of cycles or more each) before taking back */
#define IDLE 4000                /* pauses the helper spins with nothing to do, then sleeps */
enum { TAKEN, WORKING, COMMITTING, DONE };
#define STATE(g, s) ((g) << 2 | (s))
#define CLAIM(g, chunks, next) ((uint64_t)(uint32_t)(g) << 32 | (uint64_t)(chunks) << 16 | (next))
#define LEFT(w) (((w) & 0xffff) < ((w) >> 16 & 0xffff))           /* chunks left to take */

static struct { const float *panels; float *y; int M, N, K, count; uint64_t gen; } op;
static _Atomic uint64_t claim;             /* CLAIM(gen, chunks, next chunk) */
static _Atomic uint64_t owner[MAX_CHUNKS]; /* STATE(gen, state) of each chunk */
static float stage[2][STAGE], out[STAGE];  /* copies of x; the helper's outputs */
static _Atomic int on, asleep;
static _Atomic long helped, taken;       /* chunks the helper multiplied, and lost */
static _Atomic int stall;                  /* panel_helper_stall's pauses */
static atomic_flag busy = ATOMIC_FLAG_INIT; /* a product is using the helper */
static pthread_t helper;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static int chunk_end(int c, int count) {        /* the panel after chunk c's last */
    return c * CHUNK + CHUNK < count ? c * CHUNK + CHUNK : count;
}

static void *help(void *arg) {
    (void)arg;
    for (int idle = 0; atomic_load(&on);) {
        uint64_t w = atomic_load(&claim);
        if (!LEFT(w)) {                                 /* nothing to take: spin, then sleep */
            if (++idle < IDLE) { cpu_pause(); continue; }
            pthread_mutex_lock(&lock);
            atomic_store(&asleep, 1);
            while (atomic_load(&on) && !LEFT(atomic_load(&claim)))
                pthread_cond_wait(&wake, &lock);
            atomic_store(&asleep, 0);
            pthread_mutex_unlock(&lock);
            idle = 0;
            continue;
        }
        /* op is product w's as long as claim still reads w: the caller writes the next op only
           after taking the last chunk, and then the swap below fails */
        uint64_t g = op.gen;
        const float *panels = op.panels; float *y = op.y;
        int M = op.M, N = op.N, K = op.K, count = op.count, c = (int)(w & 0xffff);
        if ((uint32_t)(w >> 32) != (uint32_t)g ||
                !atomic_compare_exchange_strong(&claim, &w, w + 1))
            continue;
        idle = 0;
        uint64_t o = atomic_load(&owner[c]);            /* mark it ours, unless taken back */
        if (o >> 2 >= g || !atomic_compare_exchange_strong(&owner[c], &o, STATE(g, WORKING)))
            continue;
        int first = c * CHUNK, last = chunk_end(c, count);
        panels_into(PASSES_f32, 4, stage[g & 1], panels, out, CHUNK * NR, M, K, first,
                    last);
        for (int i = atomic_load(&stall); i > 0; i--) cpu_pause();
        uint64_t mine = STATE(g, WORKING);
        if (atomic_compare_exchange_strong(&owner[c], &mine, STATE(g, COMMITTING))) {
            for (int m = 0; m < M; m++)
                memcpy(y + (int64_t)m * N + first * NR, out + (int64_t)m * CHUNK * NR,
                       (size_t)(last - first) * NR * sizeof(float));
            atomic_store(&owner[c], STATE(g, DONE));
            atomic_fetch_add(&helped, 1);
        }
    }
    return 0;
}

/* y = x @ W.T with the helper (see above); 0 where it cannot take part: off, in use by another
   thread's product, or a product too large for its buffers */
static int shared_linear(const float *x, const float *panels, float *y, int M, int N, int K) {
    int count = N / NR, chunks = (count + CHUNK - 1) / CHUNK;
    if (!atomic_load(&on) || (int64_t)M * K > STAGE || (int64_t)M * CHUNK * NR > STAGE ||
        chunks > MAX_CHUNKS || atomic_flag_test_and_set(&busy))
        return 0;
    uint64_t g = op.gen + 1;
    memcpy(stage[g & 1], x, (size_t)M * K * sizeof(float));
    op.panels = panels; op.y = y; op.M = M; op.N = N; op.K = K; op.count = count; op.gen = g;
    atomic_store(&claim, CLAIM(g, chunks, 0));          /* go */
    if (atomic_load(&asleep)) {
        pthread_mutex_lock(&lock);
        pthread_cond_signal(&wake);
        pthread_mutex_unlock(&lock);
    }
    char mine[MAX_CHUNKS] = {0};
    for (int c; (c = (int)(atomic_fetch_add(&claim, 1) & 0xffff)) < chunks;) {
        mine[c] = 1;
        panels_into(PASSES_f32, 4, x, panels, y + c * CHUNK * NR, N, M, K, c * CHUNK,
                    chunk_end(c, count));
    }
    for (int c = 0; c < chunks; c++) {                  /* the helper's: done, or take back */
        uint64_t o = atomic_load(&owner[c]);
        for (int waited = 0; !mine[c] && o != STATE(g, DONE); o = atomic_load(&owner[c])) {
            if (o == STATE(g, COMMITTING) || (o == STATE(g, WORKING) && waited++ < PATIENCE)) {
                cpu_pause();
            } else if (atomic_compare_exchange_strong(&owner[c], &o, STATE(g, TAKEN))) {
                panels_into(PASSES_f32, 4, x, panels, y + c * CHUNK * NR, N, M, K,
                            c * CHUNK, chunk_end(c, count));
                atomic_fetch_add(&taken, 1);
                break;
            }
        }
    }
    atomic_flag_clear(&busy);
    return 1;
}

static void forked(void) {      /* a child of fork has no helper thread */
    atomic_store(&on, 0);
    atomic_store(&asleep, 0);
    pthread_mutex_init(&lock, 0);
    pthread_cond_init(&wake, 0);
}

static void register_fork(void) { pthread_atfork(0, 0, forked); }

/* Start the helper (start: 1), or stop it and wait for it to end (0). Started, it is placed on
   this process's cores other than the one the calling thread runs on now (where there are
   any), and placed again at each call with start = 1. Returns 0, or an errno. */
int panel_helper(int start) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (!start) {
        if (!atomic_load(&on))
            return 0;
        pthread_mutex_lock(&lock);
        atomic_store(&on, 0);
        pthread_cond_signal(&wake);
        pthread_mutex_unlock(&lock);
        return pthread_join(helper, 0);
    }
    if (!atomic_load(&on)) {
        pthread_once(&once, register_fork);
        atomic_store(&claim, CLAIM(op.gen, 0, 0));     /* nothing to take */
        atomic_store(&on, 1);
        int error = pthread_create(&helper, 0, help, 0);
        if (error) {
            atomic_store(&on, 0);
            return error;
        }
    }
#ifdef __linux__                /* elsewhere the scheduler places it */
    cpu_set_t cores;
    int here = sched_getcpu();
    if (here < 0 || sched_getaffinity(0, sizeof cores, &cores) || !CPU_ISSET(here, &cores))
        return 0;
    CPU_CLR(here, &cores);
    return CPU_COUNT(&cores) ? pthread_setaffinity_np(helper, sizeof cores, &cores) : 0;
#else
    return 0;
#endif
}

/* For tests: the helper pauses this many times after multiplying each chunk, before it commits
   it, as if the scheduler had stopped it there (0, unless set here); returns the setting it
   replaces. Long enough, every chunk the helper takes is taken back from it. */
int panel_helper_stall(int pauses) {
    int before = stall;
    stall = pauses;
    return before;
}

/* Whether the helper is on, how many chunks it has multiplied and how many were taken back
   from it, so far. */
void panel_helper_state(long *state) { state[0] = on; state[1] = helped; state[2] = taken; }
