/* test_moe_ref.c - the CPU MoE reference on cases small enough to check by
 * hand, its input validation, thread-count independence, and a comparison
 * with a naive per-token implementation of the header's formula. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_ref.h"
#include "moed_err.h"
#include "check_main.h"
#include "gen_fixture.h"

/* One expert whose three matrices hold a single E2M1 code everywhere, with
 * block scale 1.0 (0x38) and the given scale_2. Buffers are static per
 * expert slot so the borrowed pointers stay valid. */
enum { HH = 32, II = 32, MAXE = 4 };
static uint8_t cw[MAXE][3][HH * II / 2];
static uint8_t cs[MAXE][3][HH * II / 16];

static void const_expert(struct moe_expert *ex, int slot, uint8_t code, float scale_2)
{
    struct nvfp4_mat *m[3] = {&ex->gate, &ex->up, &ex->down};
    for (int i = 0; i < 3; i++) {
        memset(cw[slot][i], code | (code << 4), sizeof cw[slot][i]);
        memset(cs[slot][i], 0x38, sizeof cs[slot][i]);
        m[i]->n = i == 2 ? HH : II;
        m[i]->k = i == 2 ? II : HH;
        m[i]->w = cw[slot][i];
        m[i]->scale = cs[slot][i];
        m[i]->scale_2 = scale_2;
    }
}

static float rbf16(float x)
{
    return bf16_to_float(bf16_from_float(x));
}

START_TEST(test_hand_one_expert)
{
    /* Every weight 1.0, x = 0.125 everywhere: g = u = 32 * 0.125 = 4,
     * h = bf16(silu(4) * 4), d = 32 * h, y = bf16(0.5 * d) = 16 h (exact). */
    struct moe_expert ex[2];
    const_expert(&ex[0], 0, 0x2, 1.0f);
    const_expert(&ex[1], 1, 0x2, 1.0f);
    struct moe_layer L = {.hidden = HH, .inter = II, .n_experts = 2, .n_shared = 0,
                          .top_k = 1, .experts = ex};
    uint16_t x[HH], y[HH];
    for (int i = 0; i < HH; i++)
        x[i] = bf16_from_float(0.125f);
    int32_t ids[1] = {1};
    float w[1] = {0.5f};
    ck_assert_int_eq(moe_ref_forward(&L, 1, x, ids, w, y, 1), 0);
    float h = rbf16(4.0f / (1.0f + expf(-4.0f)) * 4.0f);
    for (int i = 0; i < HH; i++)
        ck_assert_msg(bf16_to_float(y[i]) == 16.0f * h, "y[%d] = %g, want %g", i,
                      (double)bf16_to_float(y[i]), (double)(16.0f * h));
}
END_TEST

START_TEST(test_hand_two_slots_and_shared)
{
    /* Expert 0: all 1.0; expert 1: all -0.5 (code 0x9); shared: all 2.0 via
     * scale_2 = 2. x = 1/32 everywhere, so each gate/up dot = sum of one row
     * / 32 = the weight value v; h = bf16(silu(v) v); d = 32 * h * v. */
    struct moe_expert ex[3];
    const_expert(&ex[0], 0, 0x2, 1.0f);
    const_expert(&ex[1], 1, 0x9, 1.0f);
    const_expert(&ex[2], 2, 0x2, 2.0f);
    struct moe_layer L = {.hidden = HH, .inter = II, .n_experts = 2, .n_shared = 1,
                          .top_k = 2, .experts = ex};
    uint16_t x[2 * HH], y[2 * HH];
    for (int i = 0; i < 2 * HH; i++)
        x[i] = bf16_from_float(1.0f / 32);
    int32_t ids[4] = {0, 1, 1, 1}; /* token 1 routes expert 1 twice */
    float w[4] = {0.75f, 0.25f, 0.5f, 0.125f};
    ck_assert_int_eq(moe_ref_forward(&L, 2, x, ids, w, y, 2), 0);
    float v[3] = {1.0f, -0.5f, 2.0f}, d[3];
    for (int e = 0; e < 3; e++)
        d[e] = 32.0f * rbf16(v[e] / (1.0f + expf(-v[e])) * v[e]) * v[e];
    float y0 = rbf16((0.75f * d[0] + 0.25f * d[1]) + d[2]);
    float y1 = rbf16((0.5f * d[1] + 0.125f * d[1]) + d[2]);
    for (int i = 0; i < HH; i++) {
        ck_assert(bf16_to_float(y[i]) == y0);
        ck_assert(bf16_to_float(y[HH + i]) == y1);
    }
}
END_TEST

START_TEST(test_invalid)
{
    struct moe_expert ex[2];
    const_expert(&ex[0], 0, 0x2, 1.0f);
    const_expert(&ex[1], 1, 0x2, 1.0f);
    struct moe_layer L = {.hidden = HH, .inter = II, .n_experts = 2, .n_shared = 0,
                          .top_k = 1, .experts = ex};
    uint16_t x[2 * HH] = {0}, y[2 * HH];
    float w[2] = {1, 1};
    int32_t bad[][2] = {{0, 2}, {-1, 0}, {0, INT32_MAX}, {INT32_MIN, 1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        ck_assert_int_eq(moe_ref_forward(&L, 2, x, bad[i], w, y, 1), MOED_E_INVAL);
    int32_t ok[2] = {1, 0};
    ck_assert_int_eq(moe_ref_forward(&L, 2, x, ok, w, y, 1), 0);
    ck_assert_int_eq(moe_ref_forward(NULL, 2, x, ok, w, y, 1), MOED_E_INVAL);
    /* rows / combine: an id -1 is fine for rows (another device's slot),
     * for combine only with MOE_REF_EMPTY_SLOTS; the shard must be < ep_n */
    float rows[2 * HH];
    int32_t part[2] = {-1, 0};
    ck_assert_int_eq(moe_ref_rows(&L, 2, x, part, rows, 2, 1, 1, 0), 0);
    ck_assert_int_eq(moe_ref_rows(&L, 2, x, part, rows, 2, 2, 1, 0), MOED_E_INVAL);
    ck_assert_int_eq(moe_ref_rows(&L, 2, x, part, rows, 0, 0, 1, 0), MOED_E_INVAL);
    ck_assert_int_eq(moe_ref_rows(&L, 2, x, bad[0], rows, 1, 0, 1, 0), MOED_E_INVAL);
    ck_assert_int_eq(moe_ref_combine(&L, 2, part, w, rows, y, 0), MOED_E_INVAL);
    ck_assert_int_eq(moe_ref_combine(&L, 2, part, w, rows, y, MOE_REF_EMPTY_SLOTS), 0);
    ck_assert_int_eq(moe_ref_combine(&L, 2, bad[0], w, rows, y, MOE_REF_EMPTY_SLOTS),
                     MOED_E_INVAL);
    L.top_k = 3; /* more slots than experts */
    ck_assert_int_eq(moe_ref_forward(&L, 1, x, ok, w, y, 1), MOED_E_INVAL);
    L.top_k = 1;
    L.hidden = 40; /* not a multiple of 16 (whole scale blocks), and the matrices disagree */
    ck_assert_int_eq(moe_ref_forward(&L, 1, x, ok, w, y, 1), MOED_E_INVAL);
    L.hidden = HH;
    ex[1].down.n = 64; /* a matrix with the wrong shape */
    ck_assert_int_eq(moe_ref_forward(&L, 1, x, ok, w, y, 1), MOED_E_INVAL);
}
END_TEST

/* A random layer built with nvfp4_quantize; dims chosen awkward on purpose
 * (E = 5, I = 96, T = 7). */
enum { RH = 64, RI = 96, RE = 5, RS = 1, RK = 2, RT = 7 };
static uint8_t rw[RE + RS][3][RH * RI / 2];
static uint8_t rs[RE + RS][3][RH * RI / 16];
static uint64_t rstate = 88172645463325252ull;

static float rnd(void)
{
    rstate ^= rstate << 13;
    rstate ^= rstate >> 7;
    rstate ^= rstate << 17;
    return (float)((double)(rstate >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static void random_layer(struct moe_layer *L, struct moe_expert *ex)
{
    float buf[RH * RI];
    for (int e = 0; e < RE + RS; e++) {
        struct nvfp4_mat *m[3] = {&ex[e].gate, &ex[e].up, &ex[e].down};
        for (int i = 0; i < 3; i++) {
            for (int j = 0; j < RH * RI; j++)
                buf[j] = rnd() * 0.2f;
            m[i]->n = i == 2 ? RH : RI;
            m[i]->k = i == 2 ? RI : RH;
            nvfp4_quantize(buf, m[i]->n, m[i]->k, rw[e][i], rs[e][i], &m[i]->scale_2);
            m[i]->w = rw[e][i];
            m[i]->scale = rs[e][i];
        }
    }
    *L = (struct moe_layer){.hidden = RH, .inter = RI, .n_experts = RE, .n_shared = RS,
                            .top_k = RK, .experts = ex};
}

START_TEST(test_threads_identical_and_naive)
{
    struct moe_expert ex[RE + RS];
    struct moe_layer L;
    random_layer(&L, ex);
    uint16_t x[RT * RH], y1[RT * RH], y[RT * RH];
    int32_t ids[RT * RK];
    float w[RT * RK];
    for (int i = 0; i < RT * RH; i++)
        x[i] = bf16_from_float(rnd() * 2.0f);
    for (int t = 0; t < RT; t++) {
        ids[t * RK] = t % RE;
        ids[t * RK + 1] = (t * 3 + 1) % RE;
        w[t * RK] = 0.6f;
        w[t * RK + 1] = 0.4f;
    }
    ck_assert_int_eq(moe_ref_forward(&L, RT, x, ids, w, y1, 1), 0);
    int counts[] = {2, 3, 4, 7, 64, 0};
    for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
        memset(y, 0xff, sizeof y);
        ck_assert_int_eq(moe_ref_forward(&L, RT, x, ids, w, y, counts[c]), 0);
        ck_assert_msg(memcmp(y, y1, sizeof y) == 0, "threads=%d differs from 1", counts[c]);
    }

    /* Naive double-precision version of the formula, row by row, with h
     * rounded to bf16 as the contract says. */
    float row[RI > RH ? RI : RH];
    double maxerr = 0, maxref = 0;
    for (int t = 0; t < RT; t++) {
        double acc[RH] = {0};
        for (int s = 0; s < RK + RS; s++) {
            int e = s < RK ? ids[t * RK + s] : RE + (s - RK);
            double wt = s < RK ? w[t * RK + s] : 1.0;
            float h[RI];
            for (int i = 0; i < RI; i++) {
                double g = 0, u = 0;
                nvfp4_dequant_row(&ex[e].gate, i, row, 1);
                for (int j = 0; j < RH; j++)
                    g += (double)row[j] * bf16_to_float(x[t * RH + j]);
                nvfp4_dequant_row(&ex[e].up, i, row, 1);
                for (int j = 0; j < RH; j++)
                    u += (double)row[j] * bf16_to_float(x[t * RH + j]);
                h[i] = rbf16((float)(g / (1 + exp(-g)) * u));
            }
            for (int r = 0; r < RH; r++) {
                double d = 0;
                nvfp4_dequant_row(&ex[e].down, r, row, 1);
                for (int i = 0; i < RI; i++)
                    d += (double)row[i] * h[i];
                acc[r] += wt * d;
            }
        }
        for (int r = 0; r < RH; r++) {
            double got = bf16_to_float(y1[t * RH + r]);
            ck_assert(!isnan(got));
            maxerr = fmax(maxerr, fabs(got - acc[r]));
            maxref = fmax(maxref, fabs(acc[r]));
        }
    }
    ck_assert_msg(maxref > 0.01, "degenerate test: outputs all ~0 (%g)", maxref);
    /* bf16 output rounding (2^-9 relative) dominates; h rounding can flip in
     * rare cases, so allow a few bf16 ulps of the largest value. */
    ck_assert_msg(maxerr <= maxref * 0x1p-6, "max error %g vs max |y| %g", maxerr, maxref);
}
END_TEST

START_TEST(test_zero_tokens)
{
    struct moe_expert ex[RE + RS];
    struct moe_layer L;
    random_layer(&L, ex);
    uint16_t x[1] = {0}, y[1] = {0x1234};
    int32_t ids[1] = {0};
    float w[1] = {1};
    ck_assert_int_eq(moe_ref_forward(&L, 0, x, ids, w, y, 4), 0);
    ck_assert_uint_eq(y[0], 0x1234);
}
END_TEST

/* moe_ref_forward over many random batches of a genmodel layer (T 1..1100:
 * one chunk and two; shared experts, routed-only, empty slots): the hash of
 * every output, printed so that a change to moe_ref.c can be checked to
 * leave forward's results as they were, bit for bit (e4f214bef1fcf8c2 before
 * moe_ref_rows / moe_ref_combine existed). Each batch is also split over
 * ep_n = 1, 2, 3 shards (3 only at T 1100; routed slot j of token t to shard (t + j) % ep_n,
 * the others -1 in its ids): moe_ref_rows of every shard into a rows buffer
 * filled with a NaN pattern, then moe_ref_combine, must give forward's y bit
 * for bit; each shard must write exactly its own entries (the others keep
 * the pattern), and combine must read no entry it should not (an unwritten
 * one is NaN and would show in y). */
static const uint32_t gen_T[] = {1, 2, 3, 5, 7, 16, 64, 256, 1100};
static const unsigned gen_flags[] = {0, MOE_REF_ROUTED_ONLY, MOE_REF_EMPTY_SLOTS,
                                     MOE_REF_ROUTED_ONLY | MOE_REF_EMPTY_SLOTS};
#define ROW_NAN 0x7fc0dead /* a quiet NaN no computation writes */

/* Is entry (t, j) shard d's under the split above? */
static int shard_entry(const struct moe_layer *L, const int32_t *ids, uint32_t t, uint32_t j,
                       uint32_t ep_n, uint32_t d, unsigned fl)
{
    const uint32_t k = L->top_k;
    if (j < k)
        return ids[(size_t)t * k + j] >= 0 && (t + j) % ep_n == d;
    return !(fl & MOE_REF_ROUTED_ONLY) && t % ep_n == d;
}

static void check_rows_combine(const struct moe_layer *L, uint32_t T, const uint16_t *x,
                               const int32_t *ids, const float *w, const uint16_t *y_fwd,
                               unsigned fl, int32_t *ids_d, uint32_t *rows, uint16_t *y)
{
    const size_t H = L->hidden, k = L->top_k, KS = k + L->n_shared;
    /* past one chunk (1024 tokens) only ep_n 3, where the chunk's first
     * token is not a multiple of ep_n (the shared split must count from 0) */
    for (uint32_t ep_n = T > 1024 ? 3 : 1; ep_n <= 3; ep_n++) {
        for (size_t i = 0; i < T * KS * H; i++)
            rows[i] = ROW_NAN;
        for (uint32_t d = 0; d < ep_n; d++) {
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t j = 0; j < k; j++)
                    ids_d[t * k + j] = shard_entry(L, ids, t, j, ep_n, d, fl) ? ids[t * k + j] : -1;
            ck_assert_int_eq(moe_ref_rows(L, T, x, ids_d, (float *)rows, ep_n, d, 2, fl), 0);
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t j = 0; j < KS; j++) {
                    /* written by a shard up to d, and by d exactly when its own */
                    int mine = shard_entry(L, ids, t, j, ep_n, d, fl), before = 0;
                    for (uint32_t q = 0; q < d; q++)
                        before |= shard_entry(L, ids, t, j, ep_n, q, fl);
                    const uint32_t *e = rows + (t * KS + j) * H;
                    int untouched = 1;
                    for (size_t r = 0; r < H; r++)
                        untouched &= e[r] == ROW_NAN;
                    ck_assert_msg(untouched == !(mine || before),
                                  "T %u flags %u ep_n %u shard %u: entry (%u, %u) %s", T, fl,
                                  ep_n, d, t, j, untouched ? "not written" : "written");
                }
        }
        memset(y, 0xff, T * H * sizeof *y);
        ck_assert_int_eq(moe_ref_combine(L, T, ids, w, (const float *)rows, y, fl), 0);
        ck_assert_msg(memcmp(y, y_fwd, T * H * sizeof *y) == 0,
                      "T %u flags %u ep_n %u: rows + combine differ from forward", T, fl, ep_n);
    }
}

START_TEST(test_forward_hash_and_rows)
{
    struct gen_fx fx;
    gen_fx_open(&fx, 7);
    const uint32_t TMAX = 1100;
    const struct moe_layer *L0 = moed_model_layer(fx.m, 0);
    const size_t H = L0->hidden, k = L0->top_k;
    uint16_t *x = malloc(TMAX * H * sizeof *x), *y = malloc(TMAX * H * sizeof *y);
    int32_t *ids = malloc(TMAX * k * sizeof *ids), *ids_d = malloc(TMAX * k * sizeof *ids_d);
    float *w = malloc(TMAX * k * sizeof *w);
    uint32_t *rows = malloc(TMAX * (k + L0->n_shared) * H * sizeof *rows);
    uint16_t *y2 = malloc(TMAX * H * sizeof *y2);
    ck_assert(x && y && ids && w && ids_d && rows && y2);
    uint64_t s = 0x9e3779b97f4a7c15ull, h = 1469598103934665603ull;
    for (uint32_t l = 0; l < GEN_LAYERS; l++) {
        const struct moe_layer *L = moed_model_layer(fx.m, l);
        for (size_t ti = 0; ti < sizeof gen_T / sizeof gen_T[0]; ti++)
            for (size_t fi = 0; fi < sizeof gen_flags / sizeof gen_flags[0]; fi++) {
                const uint32_t T = gen_T[ti];
                const unsigned fl = gen_flags[fi];
                gen_batch(L, T, &s, fl & MOE_REF_EMPTY_SLOTS ? 4 : 0, x, ids, w);
                ck_assert_int_eq(moe_ref_forward_flags(L, T, x, ids, w, y, 2, fl), 0);
                h = gen_hash(h, y, T * H * sizeof *y);
                check_rows_combine(L, T, x, ids, w, y, fl, ids_d, rows, y2);
            }
    }
    printf("moe_ref_forward hash over %zu batches: %016llx\n",
           GEN_LAYERS * (sizeof gen_T / sizeof gen_T[0]) * (sizeof gen_flags / sizeof gen_flags[0]),
           (unsigned long long)h);
    free(x);
    free(y);
    free(y2);
    free(ids);
    free(ids_d);
    free(rows);
    free(w);
    gen_fx_close(&fx);
}
END_TEST

static Suite *moe_ref_suite(void)
{
    Suite *s = suite_create("moe_ref");
    TCase *tc = tcase_create("ref");
    tcase_add_test(tc, test_hand_one_expert);
    tcase_add_test(tc, test_hand_two_slots_and_shared);
    tcase_add_test(tc, test_invalid);
    tcase_add_test(tc, test_threads_identical_and_naive);
    tcase_add_test(tc, test_zero_tokens);
    tcase_add_test(tc, test_forward_hash_and_rows);
    tcase_set_timeout(tc, 300); /* the hash test: about 70 s under ASan on 2 cores */
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return moed_check_run(moe_ref_suite());
}
