/* The C kernels against plain loops, as one program: built for each vector width (native,
   AVX2, plain, and 64-bit Arm under qemu-user) by tests/test_kernels_every_isa.py, which reads
   its output. It checks panels.c's products (float32, bfloat16 and float16 weights; 1 to 30
   rows, so every pass size and split, and bf16 pairs where the CPU multiplies them; 1 and 2
   threads) and cpu_attention.c's decode walk
   (scattered blocks, rows of every length up to a few blocks, an empty row) against sums in
   double precision over the same values, and prints one line per check and the vector width it
   ran. Exit status 0 where everything agreed to float32 rounding.

   cpu_attention.c needs HEAD_DIM and GROUP (and KV_BF16 for bfloat16 keys and values, KV_INT8
   for stage 4b's int8 slots) from -D. */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../minipaged/fast/panels.c"
#include "../minipaged/cpu_attention.c"

static uint64_t state = 42;
static int next_int(int n) {                 /* 0 .. n-1, the same on every machine */
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int)((state >> 33) % (uint64_t)n);
}

/* a weight exactly representable in bfloat16 and float16: k / 256, |k| < 256 */
static float weight(void) { return (float)(next_int(511) - 255) / 256.0f; }

static uint16_t to_bf16(float v) {            /* exact for weight()'s values */
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return (uint16_t)(bits >> 16);
}

static float bf16_value(float v) {             /* v rounded to bfloat16 (simd.h), as a float */
    uint32_t bits = (uint32_t)round_bf16(v) << 16;
    memcpy(&v, &bits, 4);
    return v;
}

static uint16_t to_f16(float v) {             /* exact for weight()'s values: normal or zero */
    if (v == 0.0f) return 0;
    uint32_t bits;
    memcpy(&bits, &v, 4);
    uint32_t sign = bits >> 16 & 0x8000, exponent = (bits >> 23 & 0xff) - 127 + 15;
    return (uint16_t)(sign | exponent << 10 | (bits & 0x7fffff) >> 13);
}

static int failures = 0;

static void verdict(const char *what, double worst) {
    int ok = worst <= 1e-5;
    printf("%s %s: worst error %.2e\n", ok ? "ok" : "FAILED", what, worst);
    failures += !ok;
}

/* panels.c: y = x @ W.T for W (N, K) as panels of 32, every kind of weight */
static void check_products(void) {
    const int shapes[][2] = {{32, 7}, {96, 64}, {160, 37}, {64, 300}};   /* (N, K) */
    for (int kind = 0; kind < 3; kind++) {
        double worst = 0.0;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            const int N = shapes[s][0], K = shapes[s][1], M_MAX = 30;
            float *w = malloc(sizeof(float) * N * K), *x = malloc(sizeof(float) * M_MAX * K);
            float *panels32 = malloc(sizeof(float) * N * K), *y = malloc(sizeof(float) * M_MAX * N);
            uint16_t *panels16 = malloc(sizeof(uint16_t) * N * K);
            for (int i = 0; i < N * K; i++) w[i] = weight();
            for (int i = 0; i < M_MAX * K; i++) x[i] = (float)(next_int(2001) - 1000) / 1000.0f;
            if (kind == 1)            /* bf16 weights take x in bf16 where DOT_BF16 (simd.h) */
                for (int i = 0; i < M_MAX * K; i++) x[i] = bf16_value(x[i]);
            for (int p = 0; p < N / NR; p++)              /* (N / 32, K, 32) */
                for (int k = 0; k < K; k++)
                    for (int o = 0; o < NR; o++) {
                        float v = w[(int64_t)(p * NR + o) * K + k];
                        int64_t at = ((int64_t)p * K + k) * NR + o;
                        panels32[at] = v;
                        panels16[at] = kind == 1 ? to_bf16(v) : to_f16(v);
                    }
            for (int M = 1; M <= M_MAX; M++)
                for (int threads = 1; threads <= 2; threads++) {
                    if (kind == 0) panel_linear(x, panels32, y, M, N, K, threads);
                    if (kind == 1) panel_linear_bf16(x, panels16, y, M, N, K, threads);
                    if (kind == 2) panel_linear_f16(x, panels16, y, M, N, K, threads);
                    for (int m = 0; m < M; m++)
                        for (int n = 0; n < N; n++) {
                            double sum = 0.0, size = 1e-30;
                            for (int k = 0; k < K; k++) {
                                double t = (double)x[m * K + k] * w[(int64_t)n * K + k];
                                sum += t;
                                size += fabs(t);
                            }
                            double error = fabs(y[m * N + n] - sum) / size;
                            worst = error > worst ? error : worst;
                        }
                }
            free(w); free(x); free(panels32); free(y); free(panels16);
        }
        char what[96];
        snprintf(what, sizeof what, "panel products, %s weights, 1-30 rows, 1 and 2 threads",
                 kind == 0 ? "float32" : kind == 1 ? "bfloat16" : "float16");
        verdict(what, worst);
    }
}

/* cpu_attention.c: one query per row over its keys in scattered blocks */
static void check_attention(void) {
    enum { B = 6, HK = 2, BLOCK = 5, WIDTH = 8, BLOCKS = B * WIDTH };
    const int D = HEAD_DIM, G = GROUP;
    const int64_t slot = (int64_t)HK * D;                      /* one key's floats in a block */
    float *k32 = malloc(sizeof(float) * BLOCKS * BLOCK * slot);
    float *v32 = malloc(sizeof(float) * BLOCKS * BLOCK * slot);
    kv_t *k = malloc(sizeof(kv_t) * BLOCKS * BLOCK * HK * ROW);   /* ROW: D, or D + 2 (int8) */
    kv_t *v = malloc(sizeof(kv_t) * BLOCKS * BLOCK * HK * ROW);
    float *q = malloc(sizeof(float) * B * HK * G * D), *out = malloc(sizeof(float) * B * HK * G * D);
    int64_t table[B * WIDTH], seqlens[B] = {1, 0, 7, BLOCK, 23, BLOCK * WIDTH};
    int order[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) order[i] = i;
    for (int i = BLOCKS - 1; i > 0; i--) {                     /* the blocks, shuffled */
        int j = next_int(i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (int i = 0; i < B * WIDTH; i++) table[i] = order[i];
#ifdef KV_INT8
    /* each (key, head) row: codes in [-127, 127] and a float16 scale, every third one subnormal
       (then its mantissa times 2^-24); the values are code x scale, exact in float32 */
    for (int64_t r = 0; r < (int64_t)BLOCKS * BLOCK * HK; r++)
        for (int which = 0; which < 2; which++) {
            float *x32 = which ? v32 : k32;
            kv_t *x = which ? v : k;
            const int tiny = next_int(3) == 0;
            const uint16_t h = tiny ? (uint16_t)(1 + next_int(1023))
                                    : to_f16((float)(1 + next_int(255)) / 2048.0f);
            const float s = tiny ? (float)h * 0x1p-24f : (float)(h & 0x3ff | 0x400) *
                                   ldexpf(1.0f, (h >> 10) - 25);
            for (int d = 0; d < D; d++) {
                const int code = next_int(255) - 127;
                x[r * ROW + d] = (kv_t)code;
                x32[r * D + d] = (float)code * s;
            }
            x[r * ROW + D] = (kv_t)(h & 0xff);
            x[r * ROW + D + 1] = (kv_t)(h >> 8);
        }
#else
    for (int64_t i = 0; i < (int64_t)BLOCKS * BLOCK * slot; i++) {
        k32[i] = weight();
        v32[i] = weight();
#ifdef KV_BF16
        k[i] = to_bf16(k32[i]);
        v[i] = to_bf16(v32[i]);
#else
        k[i] = k32[i];
        v[i] = v32[i];
#endif
    }
#endif
    for (int i = 0; i < B * HK * G * D; i++) q[i] = (float)(next_int(2001) - 1000) / 500.0f;
    const float scale = 1.0f / sqrtf((float)D);
    double worst = 0.0;
    for (int threads = 1; threads <= 2; threads++) {
        paged_attention_decode(q, k, v, table, WIDTH, seqlens, B, HK, BLOCK, scale, out, threads);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < HK * G; h++) {
                const float *qh = q + ((int64_t)b * HK * G + h) * D;
                double score[BLOCK * WIDTH], top = -INFINITY, total = 0.0;
                for (int t = 0; t < seqlens[b]; t++) {
                    int64_t at = (table[b * WIDTH + t / BLOCK] * BLOCK + t % BLOCK) * slot +
                                 (int64_t)(h / G) * D;
                    score[t] = 0.0;
                    for (int d = 0; d < D; d++) score[t] += (double)qh[d] * k32[at + d];
                    score[t] *= scale;
                    top = score[t] > top ? score[t] : top;
                }
                for (int t = 0; t < seqlens[b]; t++) total += exp(score[t] - top);
                for (int d = 0; d < D; d++) {
                    double want = 0.0;
                    for (int t = 0; t < seqlens[b]; t++) {
                        int64_t at = (table[b * WIDTH + t / BLOCK] * BLOCK + t % BLOCK) * slot +
                                     (int64_t)(h / G) * D;
                        want += exp(score[t] - top) / total * v32[at + d];
                    }
                    double error = fabs(out[((int64_t)b * HK * G + h) * D + d] - want);
                    worst = error > worst ? error : worst;
                }
            }
    }
    char what[96];
    snprintf(what, sizeof what, "paged attention, %s keys and values, head dim %d, group %d",
#ifdef KV_BF16
             "bfloat16",
#elif defined(KV_INT8)
             "int8",
#else
             "float32",
#endif
             D, G);
    verdict(what, worst);
    free(k32); free(v32); free(k); free(v); free(q); free(out);
}

int main(void) {
    printf("vector width: %s (%d floats), rows a pass: %d, bf16 pairs: %s\n", panel_isa(), VL,
           panel_rows_a_pass(), panel_bf16_dot() ? "yes" : "no");
    check_products();
    check_attention();
    return failures != 0;
}
