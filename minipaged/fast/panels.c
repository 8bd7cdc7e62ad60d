/* A float32 matrix product for a few rows: y (M, N) = x (M, K) @ W.T, with W (N, K) stored as
   panels of 32 outputs, (N / 32, K, 32): panel p, row k holds W[32p .. 32p+31, k], so a panel
   is one contiguous stream of K * 128 bytes (matvec.py says why, with the measurements).

   Each thread takes whole panels. For up to 12 rows of x at a time (a "pass"), the kernel keeps
   a row's 32 outputs in two AVX-512 registers (24 of the 32 for 12 rows), and for every k reads
   the panel's 32 weights once and multiplies them by the 12 rows' x[m][k]. More rows than 12
   make several passes over the same panel, which is then in the core's L2 cache.

   Memory: the first pass asks for the panel's rows PREFETCH rows ahead of the one it reads; the
   later passes, which read from L2, ask for the next panel meanwhile (into L2), so weights keep
   arriving while the core multiplies. Built with -march=native on a CPU with AVX-512F. */
#include <stdint.h>
#include <immintrin.h>

#define NR 32          /* outputs a panel */
#define MR_MAX 12      /* rows of x a pass: 2 * 12 accumulators of the 32 vector registers */
#define PREFETCH 16    /* panel rows (of 128 bytes) ahead */

/* One pass: MR rows of x (M, K) from x, through the panel w, into y (row stride N). `ahead`:
   the rows to prefetch as k advances; `to_l1`: into L1 (this panel) or L2 (the next one). */
#define PASS(MR)                                                                               \
static void pass_##MR(const float *x, int K, const float *w, float *y, int N,                  \
                      const float *ahead, int to_l1) {                                         \
    __m512 lo[MR], hi[MR];                                                                     \
    for (int m = 0; m < MR; m++) { lo[m] = _mm512_setzero_ps(); hi[m] = _mm512_setzero_ps(); }  \
    for (int k = 0; k < K; k++) {                                                              \
        const char *a = (const char *)(ahead + (int64_t)k * NR);                               \
        if (to_l1) { _mm_prefetch(a, _MM_HINT_T0); _mm_prefetch(a + 64, _MM_HINT_T0); }        \
        else { _mm_prefetch(a, _MM_HINT_T1); _mm_prefetch(a + 64, _MM_HINT_T1); }              \
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

typedef void (*pass_fn)(const float *, int, const float *, float *, int, const float *, int);
static const pass_fn PASSES[MR_MAX + 1] = {0, pass_1, pass_2, pass_3, pass_4, pass_5, pass_6,
                                           pass_7, pass_8, pass_9, pass_10, pass_11, pass_12};

void panel_linear(const float *x, const float *panels, float *y, int M, int N, int K,
                  int threads) {
    int count = N / NR;
    int passes = (M + MR_MAX - 1) / MR_MAX, rows = (M + passes - 1) / passes;  /* even passes */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int p = 0; p < count; p++) {
        const float *w = panels + (int64_t)p * K * NR;
        const float *next = p + 1 < count ? w + (int64_t)K * NR : w;
        for (int m0 = 0; m0 < M; m0 += rows) {
            int mr = M - m0 < rows ? M - m0 : rows;
            PASSES[mr](x + (int64_t)m0 * K, K, w, y + (int64_t)m0 * N + p * NR, N,
                       m0 == 0 ? w + PREFETCH * NR : next, m0 == 0);
        }
    }
}
