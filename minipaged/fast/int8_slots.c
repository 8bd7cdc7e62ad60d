/* Stage 4b's quantize-on-write for the speed layer's decode step (paged.py's DecodeAttention):
   each row's new k (or v), (B, Hk, D) float32, written as int8 slots straight into the pool,
   where kv_quant.py's `quantize_int8` would write them, byte for byte the same:

     scale = max|x| / 127 as a float16 (at most 65504, rounded to nearest even)
     q_i   = round-half-even(x_i / scale) clipped to [-127, 127], 0 where the scale is 0

   In PyTorch that is seven small operations a tensor, a few dozen microseconds a layer, more
   than the attention itself at short contexts; here it is one pass over the row.

   Built WITHOUT -ffast-math (cpu_attention.py's `build_function`, its flags without it): the
   divisions must stay divisions, rounded as PyTorch rounds them, not become products by a
   reciprocal. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* float -> float16 bits, rounded to nearest even, for 0 <= f <= 65504 */
static uint16_t half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const int e = (int)(x >> 23) - 127 + 15;                 /* the float16 exponent */
    uint32_t m = x & 0x7fffff, h, rest, half;
    int shift;
    if (e >= 1) {                                            /* a normal float16 */
        h = ((uint32_t)e << 10) | (m >> 13);
        rest = m & 0x1fff, half = 0x1000;
    } else {                                                 /* subnormal: units of 2^-24 */
        shift = 14 - e;
        if (shift > 24) return 0;                            /* below half of 2^-24 */
        m |= 0x800000;
        h = m >> shift;
        rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    }
    if (rest > half || (rest == half && (h & 1))) h++;       /* a carry may reach the exponent */
    return (uint16_t)h;
}

static float half_value(uint16_t h) {                        /* its value, exactly */
    return (h & 0x7c00) ? ldexpf((float)((h & 0x3ff) | 0x400), ((h >> 10) & 0x1f) - 25)
                        : ldexpf((float)(h & 0x3ff), -24);
}

/* x (B, Hk, D) float32; row b's Hk slots of D + 2 bytes go to slot slots[b] of `pool`, seen as
   (num_slots, Hk, D + 2) int8 */
void write_int8_slots(const float *x, int8_t *pool, const int64_t *slots, int B, int Hk, int D) {
    const int64_t row = D + 2;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hk; h++) {
            const float *xs = x + ((int64_t)b * Hk + h) * D;
            int8_t *out = pool + (slots[b] * Hk + h) * row;
            float amax = 0.0f;
            for (int d = 0; d < D; d++) amax = fmaxf(amax, fabsf(xs[d]));
            float scale = amax / 127.0f;
            const uint16_t bits = half_bits(scale < 65504.0f ? scale : 65504.0f);
            const float s = half_value(bits);
            for (int d = 0; d < D; d++) {
                float q = s > 0.0f ? rintf(xs[d] / s) : 0.0f;
                out[d] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
            }
            out[D] = (int8_t)(bits & 0xff);                  /* little-endian, as a float16 */
            out[D + 1] = (int8_t)(bits >> 8);
        }
}
