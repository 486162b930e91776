/* nvfp4.c - E2M1 / E4M3 / bf16 conversions and ModelOpt-exact NVFP4
 * quantization in plain C (the host-side ground truth for every kernel).
 *
 * Everything here is bit-exact and independent of the FPU rounding mode only
 * in the default round-to-nearest-even mode, which moed never changes:
 * nearbyintf() is used as the RNE primitive on values that were scaled by
 * powers of two (exact), so the only rounding is the one we ask for.
 */
#include "nvfp4.h"

#include <math.h>
#include <string.h>

/* E2M1 magnitudes, indexed by the low 3 bits of a code. */
static const float e2m1_mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

static inline uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

float nvfp4_e2m1_decode(uint8_t code)
{
    float m = e2m1_mag[code & 7];
    return (code & 8) ? -m : m;
}

float nvfp4_e4m3_decode(uint8_t code)
{
    uint32_t sign = (uint32_t)(code & 0x80) << 24;
    uint32_t e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7)
        return f32_from_bits(sign | 0x7fc00000u); /* the only NaN pattern */
    if (e == 0) /* subnormal: m * 2^-9, exact in float */
        return f32_from_bits(sign | f32_bits((float)m * 0x1p-9f));
    /* Normal: rebias the exponent (7 -> 127) and widen the mantissa (3 -> 23). */
    return f32_from_bits(sign | ((e - 7 + 127) << 23) | (m << 20));
}

/* E2M1 code of x (x not NaN): the magnitude index counts the ModelOpt
 * _cast_fp4 bounds that |x| has passed. At a tie the even index wins: 0.25 ->
 * 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0
 * (even indices have a zero mantissa bit: "ties to even" for a 1-bit
 * mantissa), hence > for bounds below an even index and >= below an odd one.
 * Branch-free so the quantizer's inner loop vectorizes; static so -fPIC does
 * not block inlining. */
static inline uint8_t e2m1_code(float x)
{
    float a = fabsf(x);
    int idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
              (a >= 3.5f) + (a > 5.0f); /* (5, inf] saturates to 6 */
    return (uint8_t)((signbit(x) ? 8 : 0) | idx);
}

uint8_t nvfp4_e2m1_encode(float x)
{
    /* E2M1 has no NaN; NaN encodes as +0 (documented, never produced by
     * nvfp4_quantize on finite input). */
    if (isnan(x))
        return 0;
    return e2m1_code(x);
}

uint8_t nvfp4_e4m3_encode(float x)
{
    if (isnan(x))
        return 0x7f;
    uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    /* Anything that would round above 448 (or is inf) saturates: satfinite.
     * Values in [448, 464) would round to 448 anyway; >= 464 would round to
     * 480, which is the NaN pattern, so clamp. */
    if (a >= NVFP4_E4M3_MAX)
        return sign | 0x7e;
    if (a < 0x1p-6f) {
        /* Subnormal range: steps of 2^-9. a * 2^9 is exact; RNE to 0..8, and
         * 8 is exactly the first normal code 0x08 (e=1, m=0). */
        uint32_t m = (uint32_t)nearbyintf(a * 0x1p9f);
        return (uint8_t)(sign | m);
    }
    int exp2;
    (void)frexpf(a, &exp2); /* a = f * 2^exp2, f in [0.5, 1) */
    int e = exp2 - 1;       /* a in [2^e, 2^(e+1)), e in [-6, 8] */
    /* Mantissa steps are 2^(e-3): a * 2^(3-e) is exact, RNE to [8, 16]. */
    uint32_t q = (uint32_t)nearbyintf(ldexpf(a, 3 - e));
    if (q == 16) { /* rounded up into the next binade */
        q = 8;
        e++;
    }
    uint32_t code = ((uint32_t)(e + 7) << 3) | (q - 8);
    if (code > 0x7e) /* cannot happen for a < 448; kept as a guard */
        code = 0x7e;
    return (uint8_t)(sign | code);
}

uint16_t bf16_from_float(float x)
{
    uint32_t u = f32_bits(x);
    if (isnan(x)) /* keep it a NaN: force a quiet mantissa bit */
        return (uint16_t)((u >> 16) | 0x0040u);
    /* Round to nearest even on the 16 dropped bits. Overflow to inf is the
     * correct RNE result for values just below FLT_MAX. */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float bf16_to_float(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

/* Quantize one row of k floats with a given scale_2. Mirrors ModelOpt's
 * NVFP4QTensor: per_block_scale = block_amax / (6 * scale_2) in fp32, zero
 * -> 1.0, cast to E4M3; then w / (e4m3(per_block_scale) * scale_2) in fp32
 * cast to E2M1. */
static void quantize_row(const float *w, uint32_t k, float scale_2, uint8_t *packed,
                         uint8_t *scales)
{
    const float six_s2 = NVFP4_E2M1_MAX * scale_2;
    for (uint32_t b = 0; b < k / NVFP4_GROUP; b++) {
        const float *blk = w + (size_t)b * NVFP4_GROUP;
        float amax = 0.0f;
        for (int i = 0; i < NVFP4_GROUP; i++) {
            float a = fabsf(blk[i]);
            amax = a > amax ? a : amax;
        }
        float bs = amax / six_s2;
        if (bs == 0.0f)
            bs = 1.0f;
        uint8_t sc = nvfp4_e4m3_encode(bs);
        scales[b] = sc;
        float denom = nvfp4_e4m3_decode(sc) * scale_2;
        uint8_t *out = packed + (size_t)b * (NVFP4_GROUP / 2);
        if (denom == 0.0f) {
            /* Block scale underflowed E4M3 (block amax < 2^-10 * 6 * scale_2,
             * i.e. ~1e-6 of the tensor amax): every value rounds to 0 anyway;
             * write zeros instead of dividing by zero. */
            memset(out, 0, NVFP4_GROUP / 2);
            continue;
        }
        uint8_t code[NVFP4_GROUP];
        for (int i = 0; i < NVFP4_GROUP; i++)
            code[i] = e2m1_code(blk[i] / denom);
        for (int i = 0; i < NVFP4_GROUP; i += 2)
            out[i / 2] = (uint8_t)(code[i] | (code[i + 1] << 4)); /* element 2j: low nibble */
    }
}

void nvfp4_quantize(const float *w, uint32_t n, uint32_t k, uint8_t *packed, uint8_t *scales,
                    float *scale_2)
{
    size_t count = (size_t)n * k;
    float amax = 0.0f;
    for (size_t i = 0; i < count; i++) {
        float a = fabsf(w[i]);
        amax = a > amax ? a : amax;
    }
    if (amax == 0.0f) /* all-zero tensor: any positive scale works; use amax 1 */
        amax = 1.0f;
    float s2 = amax / (NVFP4_E2M1_MAX * NVFP4_E4M3_MAX);
    for (uint32_t r = 0; r < n; r++)
        quantize_row(w + (size_t)r * k, k, s2, packed + (size_t)r * (k / 2),
                     scales + (size_t)r * (k / NVFP4_GROUP));
    *scale_2 = s2;
}

/* E2M1 values of all 16 codes, sign included (branch-free dequant). */
static const float e2m1_val[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void nvfp4_dequant_row(const struct nvfp4_mat *m, uint32_t r, float *out, int with_scale_2)
{
    const uint32_t k = m->k;
    const uint8_t *w = m->w + (size_t)r * (k / 2);
    const uint8_t *sc = m->scale + (size_t)r * (k / NVFP4_GROUP);
    const float s2 = with_scale_2 ? m->scale_2 : 1.0f;
    for (uint32_t b = 0; b < k / NVFP4_GROUP; b++) {
        /* e2m1 * e4m3 is exact in fp32 (<= 2+4 significant bits); the
         * scale_2 multiply is the only rounding, as in ModelOpt's dequant. */
        const float s = nvfp4_e4m3_decode(sc[b]);
        const uint8_t *p = w + (size_t)b * (NVFP4_GROUP / 2);
        float v[NVFP4_GROUP];
        for (int j = 0; j < NVFP4_GROUP / 2; j++) {
            v[2 * j] = e2m1_val[p[j] & 15];
            v[2 * j + 1] = e2m1_val[p[j] >> 4];
        }
        float *o = out + (size_t)b * NVFP4_GROUP;
        for (int j = 0; j < NVFP4_GROUP; j++)
            o[j] = v[j] * s * s2;
    }
}

size_t nvfp4_e4m3_find_nan(const uint8_t *s, size_t n)
{
    const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x;
        memcpy(&x, s + i, sizeof x); /* mmap data carries no alignment promise */
        /* sign bits set: a NaN byte becomes 0xff, so its complement is 0 */
        uint64_t v = ~(x | highs);
        if (((v - ones) & ~v & highs) != 0)
            break; /* one of these 8 is NaN: find it below */
    }
    for (; i < n; i++)
        if ((s[i] & 0x7f) == 0x7f)
            return i;
    return n;
}

double bf16_rel_l2(const uint16_t *y, const uint16_t *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double a = bf16_to_float(y[i]), r = bf16_to_float(ref[i]);
        num += (a - r) * (a - r);
        den += r * r;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
