/* The vectors the C kernels compute with, on whatever CPU builds them (panels.c; cpu_attention.c
   reads SIMD_ISA only). One kernel is written once over these names, and the compiler's
   predefined macros pick the width when it is built, as llama.cpp's simd-mappings.h picks its
   GGML_F32_VEC for each ISA:

     ISA        built with                              VL (floats a vector)   vector registers
     avx512     -march=native on a CPU with AVX-512F    16                     32
     avx2       AVX2 and FMA (-march=x86-64-v3)          8                     16
     neon       any 64-bit Arm (Apple M, Graviton)       4                     32
     plain      anything else                            4                     16 (a guess)

   The vectors are GCC's and Clang's vector extensions: `a * b + c` on them is an FMA where the
   CPU has one (both compilers contract it), and a scalar in an expression stands for that value
   in every lane. Half-precision weights become floats as they are loaded: bfloat16 is the top
   half of a float32, so a shift; float16 needs a conversion instruction (F16C on x86, NEON's
   fcvtl on Arm), one line per ISA below, and on the plain path a few integer operations.

   Where the CPU multiplies bfloat16 pairs in one instruction (AVX512_BF16's vdpbf16ps: built
   with -march=native on AMD Zen 4 and 5, Intel Cooper Lake and later), DOT_BF16 is defined and
   panels.c's bf16 passes take k two at a time with `pair_rows`, `dot_bf16` and `unpair_store`:
   one instruction adds the products of two k's into 16 sums, where widening adds one k's. */
#ifndef MINIPAGED_SIMD_H
#define MINIPAGED_SIMD_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define SIMD_ISA "avx512"
#define VL 16
#define VREGS 32
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_ISA "avx2"
#define VL 8
#define VREGS 16
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define SIMD_ISA "neon"
#define VL 4
#define VREGS 32
#else
#define SIMD_ISA "plain"
#define VL 4
#define VREGS 16
#endif

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

typedef float vfloat __attribute__((vector_size(4 * VL)));      /* VL floats */
typedef uint32_t vu32 __attribute__((vector_size(4 * VL)));
typedef uint16_t vu16 __attribute__((vector_size(2 * VL)));      /* VL half-precision bits */

static inline vfloat load_f32(const float *p) {       /* memcpy: any alignment, one load */
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_f32(float *p, vfloat v) { memcpy(p, &v, sizeof v); }

static inline vfloat load_bf16(const uint16_t *p) {   /* bfloat16: the top half of a float32 */
#if defined(__AVX512F__)           /* (gcc 12 widens a vector of 8 or 16 in halves otherwise) */
    return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)),
                                     16);
#elif defined(__AVX2__)
    return (vfloat)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16);
#else
    vu16 h;
    memcpy(&h, p, sizeof h);
    vu32 bits = __builtin_convertvector(h, vu32) << 16;
    return (vfloat)bits;
#endif
}

/* float16 on the plain path: sign, exponent and fraction moved into a float32's places */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = h >> 10 & 0x1f, fraction = h & 0x3ff;
    union { uint32_t bits; float value; } f;
    if (exponent == 0x1f) {                                   /* infinity, NaN */
        f.bits = sign | 0x7f800000 | fraction << 13;
    } else if (exponent) {                                    /* normal */
        f.bits = sign | (exponent + 112) << 23 | fraction << 13;
    } else {                                                  /* zero, subnormal: fraction * 2^-24 */
        f.value = (float)fraction * 0x1p-24f;
        f.bits |= sign;
    }
    return f.value;
}

static inline vfloat load_f16(const uint16_t *p) {
#if defined(__F16C__) && VL == 16
    return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VL == 8
    return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#elif defined(__ARM_NEON) && defined(__aarch64__)
    return (vfloat)vcvt_f32_f16(vld1_f16((const __fp16 *)p));
#else
    vfloat v;
    for (int i = 0; i < VL; i++) v[i] = f16_to_f32(p[i]);
    return v;
#endif
}

/* float32 to bfloat16, rounded to nearest even (exact for a float32 widened from bfloat16) */
static inline uint16_t round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fff + (bits >> 16 & 1)) >> 16);
}

#if defined(__AVX512BF16__) && VL == 16
#define DOT_BF16 1
typedef __m512bh vpairs;                /* 16 pairs of bfloat16, a pair in each float's place */

/* Two rows of 32 bfloat16 weights (a panel's rows k and k + 1) as 32 pairs (w[k][o], w[k+1][o]),
   in two vectors: `lo` holds the pairs of outputs 0-3, 8-11, 16-19 and 24-27, `hi` the others
   (the unpack instructions pair within each 128 bits). */
static inline void pair_rows(const uint16_t *a, const uint16_t *b, vpairs *lo, vpairs *hi) {
    const __m512i ra = _mm512_loadu_si512(a), rb = _mm512_loadu_si512(b);
    *lo = (vpairs)_mm512_unpacklo_epi16(ra, rb);
    *hi = (vpairs)_mm512_unpackhi_epi16(ra, rb);
}

/* sum + w's pairs times the pair x (x[k] in the low 16 bits, x[k+1] in the high), lane by lane */
static inline vfloat dot_bf16(vfloat sum, vpairs w, uint32_t x) {
    return (vfloat)_mm512_dpbf16_ps((__m512)sum, w, (vpairs)_mm512_set1_epi32((int)x));
}

/* The sums of `lo` and `hi` (pair_rows's order) as y[0..31], in order. */
static inline void unpair_store(float *y, vfloat lo, vfloat hi) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7,
                                            20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15,
                                             28, 29, 30, 31);
    _mm512_storeu_ps(y, _mm512_permutex2var_ps((__m512)lo, first, (__m512)hi));
    _mm512_storeu_ps(y + 16, _mm512_permutex2var_ps((__m512)lo, second, (__m512)hi));
}
#endif

static inline void cpu_pause(void) {                  /* a spin loop's breath */
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#endif
