/* test_nvfp4.c - E2M1/E4M3/bf16 conversions and ModelOpt quantization against
 * values written out by hand from the format definitions (nvfp4.h). The
 * Python test test_codec.py cross-checks the same codecs against ml_dtypes. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nvfp4.h"
#include "check_main.h"

static const float e2m1_vals[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

START_TEST(test_e2m1_round_trip)
{
    for (uint8_t c = 0; c < 16; c++) {
        float v = nvfp4_e2m1_decode(c);
        ck_assert_msg(v == e2m1_vals[c] && signbit(v) == signbit(e2m1_vals[c]),
                      "code %u decodes to %g", c, (double)v);
        ck_assert_uint_eq(nvfp4_e2m1_encode(v), c);
        /* Only the low nibble counts. */
        ck_assert(nvfp4_e2m1_decode((uint8_t)(c | 0xf0)) == v);
    }
}
END_TEST

START_TEST(test_e2m1_thresholds)
{
    /* ModelOpt bounds .25 .75 1.25 1.75 2.5 3.5 5; at each tie the code with
     * an even index (zero mantissa bit) wins. */
    static const struct {
        float x;
        uint8_t code;
    } cases[] = {
        {0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6},
        {0.2499f, 0}, {0.2501f, 1}, {0.7499f, 1}, {0.7501f, 2}, {1.2501f, 3}, {1.7499f, 3},
        {1.7501f, 4}, {2.5001f, 5}, {3.4999f, 5}, {3.5001f, 6}, {4.9999f, 6}, {5.0001f, 7},
        {6.0f, 7}, {7.0f, 7}, {1e30f, 7}, {INFINITY, 7}, {0.1f, 0},
        {-0.25f, 8}, {-0.75f, 10}, {-1.25f, 10}, {-1.75f, 12}, {-2.5f, 12}, {-3.5f, 14},
        {-5.0f, 14}, {-5.0001f, 15}, {-INFINITY, 15}, {-0.1f, 8}, {-0.0f, 8},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        ck_assert_msg(nvfp4_e2m1_encode(cases[i].x) == cases[i].code, "e2m1(%g) = %u, want %u",
                      (double)cases[i].x, nvfp4_e2m1_encode(cases[i].x), cases[i].code);
    /* Just either side of each threshold. */
    static const float thr[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    for (int i = 0; i < 7; i++) {
        ck_assert_uint_eq(nvfp4_e2m1_encode(nextafterf(thr[i], 0.0f)), (uint8_t)(i + 0));
        ck_assert_uint_eq(nvfp4_e2m1_encode(nextafterf(thr[i], 10.0f)), (uint8_t)(i + 1));
    }
}
END_TEST

/* E4M3 value written from the definition, independent of the decoder. */
static double e4m3_ref(uint8_t c)
{
    int e = (c >> 3) & 15, m = c & 7;
    double v = e == 0 ? m * pow(2, -9) : (1 + m / 8.0) * pow(2, e - 7);
    return (c & 0x80) ? -v : v;
}

START_TEST(test_e4m3_round_trip)
{
    for (int c = 0; c < 256; c++) {
        float v = nvfp4_e4m3_decode((uint8_t)c);
        if ((c & 0x7f) == 0x7f) {
            ck_assert_msg(isnan(v), "code 0x%02x should be NaN", c);
            continue;
        }
        ck_assert_msg((double)v == e4m3_ref((uint8_t)c), "code 0x%02x decodes to %a", c,
                      (double)v);
        ck_assert_msg(nvfp4_e4m3_encode(v) == c, "encode(decode(0x%02x)) = 0x%02x", c,
                      nvfp4_e4m3_encode(v));
    }
    ck_assert(nvfp4_e4m3_decode(0x7e) == 448.0f);
    ck_assert(nvfp4_e4m3_decode(0x01) == 0x1p-9f);
    ck_assert(nvfp4_e4m3_decode(0x08) == 0x1p-6f);
    ck_assert(signbit(nvfp4_e4m3_decode(0x80)));
}
END_TEST

START_TEST(test_e4m3_rounding)
{
    /* Midpoints between neighbouring positive codes tie to the even code;
     * a hair above goes up, a hair below goes down. */
    for (int c = 0; c < 0x7e; c++) {
        float lo = nvfp4_e4m3_decode((uint8_t)c), hi = nvfp4_e4m3_decode((uint8_t)(c + 1));
        float mid = (lo + hi) / 2; /* exact: both have few mantissa bits */
        uint8_t even = (c & 1) ? (uint8_t)(c + 1) : (uint8_t)c;
        ck_assert_msg(nvfp4_e4m3_encode(mid) == even, "tie %a -> 0x%02x, want 0x%02x",
                      (double)mid, nvfp4_e4m3_encode(mid), even);
        ck_assert_uint_eq(nvfp4_e4m3_encode(nextafterf(mid, 0.0f)), (uint8_t)c);
        ck_assert_uint_eq(nvfp4_e4m3_encode(nextafterf(mid, 1000.0f)), (uint8_t)(c + 1));
        ck_assert_uint_eq(nvfp4_e4m3_encode(-mid), (uint8_t)(even | 0x80));
    }
    ck_assert_uint_eq(nvfp4_e4m3_encode(0x1p-10f), 0x00); /* tie 0 / 2^-9 -> 0 */
    ck_assert_uint_eq(nvfp4_e4m3_encode(3 * 0x1p-10f), 0x02);
    ck_assert_uint_eq(nvfp4_e4m3_encode(1e-30f), 0x00);
    ck_assert_uint_eq(nvfp4_e4m3_encode(-0.0f), 0x80);
}
END_TEST

START_TEST(test_e4m3_saturation)
{
    ck_assert_uint_eq(nvfp4_e4m3_encode(448.0f), 0x7e);
    ck_assert_uint_eq(nvfp4_e4m3_encode(463.0f), 0x7e);
    ck_assert_uint_eq(nvfp4_e4m3_encode(464.0f), 0x7e); /* would be 480 = NaN code */
    ck_assert_uint_eq(nvfp4_e4m3_encode(1e6f), 0x7e);
    ck_assert_uint_eq(nvfp4_e4m3_encode(INFINITY), 0x7e);
    ck_assert_uint_eq(nvfp4_e4m3_encode(-1e6f), 0xfe);
    ck_assert_uint_eq(nvfp4_e4m3_encode(-INFINITY), 0xfe);
    ck_assert_uint_eq(nvfp4_e4m3_encode(NAN), 0x7f);
}
END_TEST

START_TEST(test_bf16)
{
    ck_assert_uint_eq(bf16_from_float(1.0f), 0x3f80);
    ck_assert_uint_eq(bf16_from_float(-2.0f), 0xc000);
    ck_assert_uint_eq(bf16_from_float(1.0f + 0x1p-8f), 0x3f80);            /* tie -> even */
    ck_assert_uint_eq(bf16_from_float(1.0f + 3 * 0x1p-8f), 0x3f82);        /* tie -> even */
    ck_assert_uint_eq(bf16_from_float(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81); /* above tie */
    ck_assert_uint_eq(bf16_from_float(1.0f + 0x1p-8f - 0x1p-20f), 0x3f80); /* below tie */
    ck_assert_uint_eq(bf16_from_float(-0.0f), 0x8000);
    ck_assert_uint_eq(bf16_from_float(INFINITY), 0x7f80);
    ck_assert_uint_eq(bf16_from_float(3.3895314e38f), 0x7f7f); /* the largest bf16 */
    ck_assert_uint_eq(bf16_from_float(FLT_MAX), 0x7f80);        /* rounds past it: inf */
    ck_assert(isnan(bf16_to_float(bf16_from_float(NAN))));
    /* A NaN whose payload lives only in the low 16 bits must stay NaN. */
    uint32_t snan = 0x7f800001u;
    float f;
    memcpy(&f, &snan, sizeof f);
    ck_assert(isnan(bf16_to_float(bf16_from_float(f))));
    ck_assert(bf16_to_float(0x3f80) == 1.0f);
    ck_assert(bf16_to_float(0x4049) == 3.140625f);
}
END_TEST

static uint64_t rng_state = 0x1234567887654321ull;
static float frand_normal(void)
{
    /* xorshift64 + Box-Muller; any reasonable spread of magnitudes works. */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    double u1 = ((rng_state >> 11) + 1) * 0x1p-53;
    double u2 = ((rng_state & 0xffffffu)) * 0x1p-24;
    return (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
}

START_TEST(test_quantize_properties)
{
    enum { N = 8, K = 128 };
    float *w = malloc(sizeof(float) * N * K);
    uint8_t packed[N * K / 2], scales[N * K / 16];
    float s2, row[K];
    for (int i = 0; i < N * K; i++)
        w[i] = frand_normal() * (1.0f + (float)(i / 16 % 5)); /* blocks of varied spread */
    for (int i = 0; i < 16; i++)
        w[3 * K + 32 + i] = 0.0f; /* an all-zero block: row 3, block 2 */
    w[5 * K + 77] = 40.0f;         /* the tensor amax, row 5, block 4, element 13 */
    float amax = 0;
    for (int i = 0; i < N * K; i++)
        amax = fmaxf(amax, fabsf(w[i]));
    ck_assert(amax == 40.0f);

    nvfp4_quantize(w, N, K, packed, scales, &s2);
    ck_assert(s2 == 40.0f / 2688.0f);
    /* The amax block's scale is 448 (0x7e) and the amax element is code 6. */
    ck_assert_uint_eq(scales[5 * (K / 16) + 4], 0x7e);
    ck_assert_uint_eq((packed[(5 * K + 77) / 2] >> 4) & 15, 7); /* odd element: high nibble */
    /* Zero block: scale 1.0 (0x38), all codes 0. */
    ck_assert_uint_eq(scales[3 * (K / 16) + 2], 0x38);
    for (int i = 0; i < 8; i++)
        ck_assert_uint_eq(packed[(3 * K + 32) / 2 + i], 0);

    struct nvfp4_mat m = {.n = N, .k = K, .w = packed, .scale = scales, .scale_2 = s2};
    for (int r = 0; r < N; r++) {
        nvfp4_dequant_row(&m, r, row, 1);
        for (int b = 0; b < K / 16; b++) {
            uint8_t sc = scales[r * (K / 16) + b];
            float bamax = 0;
            for (int i = 0; i < 16; i++)
                bamax = fmaxf(bamax, fabsf(w[r * K + b * 16 + i]));
            float want_sc = bamax == 0 ? 1.0f : bamax / (6.0f * s2);
            ck_assert_uint_eq(sc, nvfp4_e4m3_encode(want_sc));
            float denom = nvfp4_e4m3_decode(sc) * s2;
            for (int i = 0; i < 16; i++) {
                int idx = r * K + b * 16 + i;
                uint8_t byte = packed[idx / 2];
                uint8_t code = (idx & 1) ? byte >> 4 : byte & 15;
                /* The chosen code is a nearest E2M1 value of w/denom. */
                float q = w[idx] / denom, best = INFINITY;
                for (int c = 0; c < 16; c++)
                    best = fminf(best, fabsf(q - e2m1_vals[c]));
                ck_assert_msg(fabsf(q - nvfp4_e2m1_decode(code)) == best,
                              "w[%d]=%g q=%g got code %u", idx, (double)w[idx], (double)q, code);
                /* Dequantized error bounded by half the widest E2M1 gap (1.0)
                 * plus the E4M3 scale rounding (<= 1/16 relative). */
                float err = fabsf(row[b * 16 + i] - w[idx]);
                ck_assert_msg(err <= denom * 1.0f + bamax / 16.0f + 1e-6f, "err %g", (double)err);
                ck_assert(row[b * 16 + i] ==
                          nvfp4_e2m1_decode(code) * nvfp4_e4m3_decode(sc) * s2);
            }
        }
        /* Without scale_2 the values are e2m1 * e4m3 exactly. */
        float raw[K];
        nvfp4_dequant_row(&m, r, raw, 0);
        for (int i = 0; i < K; i++)
            ck_assert(raw[i] * s2 == row[i]);
    }
    free(w);
}
END_TEST

START_TEST(test_quantize_zero_and_nibbles)
{
    float w[32] = {0};
    uint8_t packed[16], scales[2];
    float s2;
    nvfp4_quantize(w, 1, 32, packed, scales, &s2);
    ck_assert(s2 == 1.0f / 2688.0f);
    ck_assert_uint_eq(scales[0], 0x38);
    ck_assert_uint_eq(scales[1], 0x38);
    for (int i = 0; i < 16; i++)
        ck_assert_uint_eq(packed[i], 0);

    /* Nibble order: element 0 (= amax, code 6 -> 7) in the low nibble of byte
     * 0, element 1 (= -amax/6, code -1 -> 0xa) in its high nibble. */
    w[0] = 6.0f;
    w[1] = -1.0f;
    w[17] = 0.5f;
    nvfp4_quantize(w, 1, 32, packed, scales, &s2);
    ck_assert(s2 == 6.0f / 2688.0f);
    ck_assert_uint_eq(scales[0], 0x7e);
    ck_assert_uint_eq(packed[0], 0xa7);
    /* block 1: amax 0.5 -> scale 0.5/(6*s2) = 37.33 -> e4m3 36 (0x61);
     * 0.5/(36*s2) = 6.22 -> saturates to 6 (code 7), high nibble of byte 8. */
    ck_assert_uint_eq(scales[1], nvfp4_e4m3_encode(0.5f / (6.0f * s2)));
    ck_assert_uint_eq(scales[1], 0x61); /* 36 = 32 * 1.125 */
    ck_assert_uint_eq(packed[8], 0x70);
}
END_TEST

/* ||y - ref|| / ||ref|| on values exact in bf16: ref = (3, 4), y = (3, 4.5)
 * -> 0.5 / 5; all-zero ref gives the absolute norm; NaN propagates. */
START_TEST(test_bf16_rel_l2)
{
    uint16_t ref[2] = {bf16_from_float(3.0f), bf16_from_float(4.0f)};
    uint16_t y[2] = {bf16_from_float(3.0f), bf16_from_float(4.5f)};
    ck_assert_double_eq_tol(bf16_rel_l2(y, ref, 2), 0.1, 1e-12);
    ck_assert_double_eq(bf16_rel_l2(ref, ref, 2), 0.0);
    uint16_t zero[2] = {0, 0};
    ck_assert_double_eq_tol(bf16_rel_l2(y, zero, 2), sqrt(9.0 + 20.25), 1e-12);
    uint16_t nan[2] = {0x7fc0, bf16_from_float(4.0f)};
    ck_assert(isnan(bf16_rel_l2(nan, ref, 2)));
}
END_TEST

/* nvfp4_e4m3_find_nan: both NaN codes found at every position of buffers of
 * every length up to 40 (the 8-byte loop and the tail), the first of two
 * reported, and none of the 254 other codes taken for NaN. */
START_TEST(test_e4m3_find_nan)
{
    uint8_t buf[40];
    for (size_t n = 0; n <= sizeof buf; n++) {
        for (int v = 0; v < 256; v++) {
            if ((v & 0x7f) == 0x7f)
                continue;
            memset(buf, v, sizeof buf);
            ck_assert_uint_eq(nvfp4_e4m3_find_nan(buf, n), n);
            ck_assert(!isnan(nvfp4_e4m3_decode((uint8_t)v)));
        }
        for (size_t at = 0; at < n; at++) {
            for (int c = 0; c < 2; c++) {
                for (size_t i = 0; i < sizeof buf; i++)
                    buf[i] = (uint8_t)(0x38 + i); /* numbers, not NaN */
                buf[at] = c ? 0xff : 0x7f;
                ck_assert(isnan(nvfp4_e4m3_decode(buf[at])));
                ck_assert_uint_eq(nvfp4_e4m3_find_nan(buf, n), at);
                if (at + 1 < n) {
                    buf[n - 1] = 0x7f;
                    ck_assert_uint_eq(nvfp4_e4m3_find_nan(buf, n), at);
                }
                ck_assert_uint_eq(nvfp4_e4m3_find_nan(buf, at), at); /* outside the range */
            }
        }
    }
    /* unaligned start */
    memset(buf, 0x40, sizeof buf);
    buf[13] = 0xff;
    ck_assert_uint_eq(nvfp4_e4m3_find_nan(buf + 3, 30), 10);
}
END_TEST

static Suite *nvfp4_suite(void)
{
    Suite *s = suite_create("nvfp4");
    TCase *tc = tcase_create("codec");
    tcase_add_test(tc, test_e2m1_round_trip);
    tcase_add_test(tc, test_e2m1_thresholds);
    tcase_add_test(tc, test_e4m3_round_trip);
    tcase_add_test(tc, test_e4m3_rounding);
    tcase_add_test(tc, test_e4m3_saturation);
    tcase_add_test(tc, test_bf16);
    tcase_add_test(tc, test_quantize_properties);
    tcase_add_test(tc, test_quantize_zero_and_nibbles);
    tcase_add_test(tc, test_bf16_rel_l2);
    tcase_add_test(tc, test_e4m3_find_nan);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return moed_check_run(nvfp4_suite());
}
