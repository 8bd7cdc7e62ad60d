/* A float32 matrix product for a few rows: y (M, N) = x (M, K) @ W.T, with W (N, K) stored as
   panels of 32 outputs, (N / 32, K, 32): panel p, row k holds W[32p .. 32p+31, k], so a panel
   is one contiguous stream of K * 128 bytes (matvec.py says why, with the measurements).

   Each thread takes whole panels. For up to 12 rows of x at a time (a "pass"), the kernel keeps
   a row's 32 outputs in two AVX-512 registers (24 of the 32 for 12 rows), and for every k reads
   the panel's 32 weights once and multiplies them by the 12 rows' x[m][k]. More rows than 12
   make several passes over the same panel, which is then in the core's L2 cache.

   Memory: while a thread multiplies one panel it asks for the next one (into L2) at an even
   rate, one or two of its 64-byte lines at every k, spread over all the passes it makes over
   the panel, so weights keep arriving while the core multiplies. Asked for in a burst (all in
   the first pass), the products of 24 to 64 rows took 20-35% longer; left to the hardware
   prefetcher, 5-43% longer; counted out by a branch that varied from one k to the next, some
   row counts ran up to a fifth slower, which ones depending on where the compiler placed the
   loop. Each pass also asks for its own panel's rows PREFETCH rows ahead (into L1). Built with
   -march=native on a CPU with AVX-512F. */
#include <stdint.h>
#include <immintrin.h>
#include <omp.h>

#define NR 32          /* outputs a panel */
#define MR_MAX 12      /* rows of x a pass: 2 * 12 accumulators of the 32 vector registers */
#define PREFETCH 16    /* panel rows (of 128 bytes) ahead */

/* One pass, the j-th of P over the panel w: MR rows of x (M, K) into y (row stride N). `next`:
   the next panel (0 for a thread's last one), whose 2K lines the P passes ask for between them,
   this pass `lines` of them from `line` on, with a prefetch at every k (two where lines > K: a
   single pass), each `step` lines further on (`at`, `step`: lines in 32.32 fixed point; a line
   may be asked for twice). With no next panel a pass asks for its own panel's lines, already
   on their way. A prefetch of an address past the weights does not fault. */
#define PASS(MR)                                                                               \
static void pass_##MR(const float *x, int K, const float *w, float *y, int N,                  \
                      const char *next, int j, int P) {                                        \
    __m512 lo[MR], hi[MR];                                                                     \
    for (int m = 0; m < MR; m++) { lo[m] = _mm512_setzero_ps(); hi[m] = _mm512_setzero_ps(); }  \
    int lines = (2 * K + P - 1) / P;                                                           \
    const char *line = next ? next + (int64_t)j * lines * 64 : (const char *)w;                \
    int twice = lines > K;                                                                     \
    uint64_t step = ((uint64_t)lines << 32) / (twice ? 2 * K : K), at = 0;                     \
    for (int k = 0; k < K; k++) {                                                              \
        const char *a = (const char *)(w + (int64_t)(k + PREFETCH) * NR);                      \
        _mm_prefetch(a, _MM_HINT_T0); _mm_prefetch(a + 64, _MM_HINT_T0);                       \
        _mm_prefetch(line + ((at >> 32) << 6), _MM_HINT_T1); at += step;                      \
        if (twice) { _mm_prefetch(line + ((at >> 32) << 6), _MM_HINT_T1); at += step; }        \
        __m512 w_lo = _mm512_loadu_ps(w + (int64_t)k * NR);                                   \
        __m512 w_hi = _mm512_loadu_ps(w + (int64_t)k * NR + 16);                               \
        for (int m = 0; m < MR; m++) {                                                         \
            __m512 xm = _mm512_set1_ps(x[(int64_t)m * K + k]);                                 \
            lo[m] = _mm512_fmadd_ps(xm, w_lo, lo[m]);                                          \
            hi[m] = _mm512_fmadd_ps(xm, w_hi, hi[m]);                                          \
        }                                                                                      \
    }                                                                                          \
    for (int m = 0; m < MR; m++) {                                                             \
        _mm512_storeu_ps(y + (int64_t)m * N, lo[m]);                                           \
        _mm512_storeu_ps(y + (int64_t)m * N + 16, hi[m]);                                      \
    }                                                                                          \
}
PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6)
PASS(7) PASS(8) PASS(9) PASS(10) PASS(11) PASS(12)

typedef void (*pass_fn)(const float *, int, const float *, float *, int, const char *, int, int);
static const pass_fn PASSES[MR_MAX + 1] = {0, pass_1, pass_2, pass_3, pass_4, pass_5, pass_6,
                                           pass_7, pass_8, pass_9, pass_10, pass_11, pass_12};

void panel_linear(const float *x, const float *panels, float *y, int M, int N, int K,
                  int threads) {
    int count = N / NR;
    int passes = (M + MR_MAX - 1) / MR_MAX, rows = (M + passes - 1) / passes;  /* even passes */
    #pragma omp parallel num_threads(threads)
    {   /* each thread one contiguous run of panels, [first, last) */
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        int first = (int)((int64_t)count * t / n), last = (int)((int64_t)count * (t + 1) / n);
        for (int p = first; p < last; p++) {
            const float *w = panels + (int64_t)p * K * NR;
            const char *next = p + 1 < last ? (const char *)(w + (int64_t)K * NR) : 0;
            for (int m0 = 0, j = 0; m0 < M; m0 += rows, j++) {
                int mr = M - m0 < rows ? M - m0 : rows;
                PASSES[mr](x + (int64_t)m0 * K, K, w, y + (int64_t)m0 * N + p * NR, N, next, j,
                           passes);
            }
        }
    }
}
