/* test_chan_check.c - the doorbell channel's descriptor checks
 * (kernels/moe_gpu_abi.h: moe_gpu_chan_check, moe_gpu_ids_check), the code
 * the persistent kernel is to run on descriptors written by untrusted GPU
 * code, here on the CPU: a good descriptor resolves to the right addresses,
 * and each malformed one (T 0 or too large, not an MoE layer, unknown or
 * empty buffer id, a range past the end or overflowing, misaligned, y
 * overlapping an input, an expert id out of range, a wrong key, unknown
 * flags) gets its own status. */
#include <check.h>
#include <stdint.h>
#include <string.h>

#include "moe_gpu_abi.h"
#include "check_main.h"

enum { H = 64, K = 2, MAXT = 8, E = 6 };
#define KEY 0x5eed1234abcdull
static const int32_t slot_of[4] = {-1, 0, 1, -1};
static struct moe_gpu_reg tab[MOE_GPU_CHAN_BUFS];

/* x | ids | w | y of T = 4 in buffer 1 (base 0x10000, 4 KiB), y in buffer 2 */
static struct moe_gpu_chan_desc good(void)
{
    memset(tab, 0, sizeof tab);
    tab[1] = (struct moe_gpu_reg){0x10000, 4096};
    tab[2] = (struct moe_gpu_reg){0x40000, 2 * 4 * H};
    struct moe_gpu_chan_desc d = {.layer = 2, .n_tokens = 4, .seq = 1, .key = KEY};
    d.x = (struct moe_gpu_chan_ref){1, 0, 0};
    d.ids = (struct moe_gpu_chan_ref){1, 0, 2 * 4 * H};
    d.w = (struct moe_gpu_chan_ref){1, 0, 2 * 4 * H + 4 * 4 * K};
    d.y = (struct moe_gpu_chan_ref){2, 0, 0};
    return d;
}

static uint32_t check(const struct moe_gpu_chan_desc *d, uint64_t ptr[4], int32_t *slot)
{
    return moe_gpu_chan_check(d, KEY, tab, H, K, MAXT, slot_of, 4, ptr, slot);
}

START_TEST(test_good_descriptor_resolves)
{
    struct moe_gpu_chan_desc d = good();
    uint64_t p[4] = {0};
    int32_t slot = -1;
    ck_assert_uint_eq(check(&d, p, &slot), MOE_GPU_CHAN_OK);
    ck_assert_uint_eq(p[0], 0x10000);
    ck_assert_uint_eq(p[1], 0x10000 + 2 * 4 * H);
    ck_assert_uint_eq(p[2], 0x10000 + 2 * 4 * H + 4 * 4 * K);
    ck_assert_uint_eq(p[3], 0x40000);
    ck_assert_int_eq(slot, 1);
    d.n_tokens = MAXT; /* x + ids + w of T = 8 still fit in buffer 1; y does not fit in 2 */
    ck_assert_uint_eq(check(&d, p, &slot), MOE_GPU_CHAN_E_RANGE);
}
END_TEST

START_TEST(test_malformed_descriptors_get_their_status)
{
    uint64_t p[4];
    int32_t slot;
    struct moe_gpu_chan_desc d;
#define EXPECT(edit, status)                                                                      \
    do {                                                                                          \
        d = good();                                                                               \
        edit;                                                                                     \
        ck_assert_uint_eq(check(&d, p, &slot), status);                                           \
    } while (0)
    EXPECT(d.key = KEY + 1, MOE_GPU_CHAN_E_KEY);
    EXPECT(d.key = 0, MOE_GPU_CHAN_E_KEY);
    EXPECT(d.flags = 0x4, MOE_GPU_CHAN_E_FLAGS);
    EXPECT(d.flags = 0x80000000u, MOE_GPU_CHAN_E_FLAGS);
    EXPECT(d.flags = MOE_GPU_CHAN_ROUTED_ONLY | MOE_GPU_CHAN_EMPTY_SLOTS, MOE_GPU_CHAN_OK);
    EXPECT(d.n_tokens = 0, MOE_GPU_CHAN_E_TOKENS);
    EXPECT(d.n_tokens = MAXT + 1, MOE_GPU_CHAN_E_TOKENS);
    EXPECT(d.n_tokens = UINT32_MAX, MOE_GPU_CHAN_E_TOKENS);
    EXPECT(d.layer = 0, MOE_GPU_CHAN_E_LAYER);
    EXPECT(d.layer = 4, MOE_GPU_CHAN_E_LAYER);
    EXPECT(d.layer = UINT32_MAX, MOE_GPU_CHAN_E_LAYER);
    EXPECT(d.x.buf = 0, MOE_GPU_CHAN_E_BUF);                 /* empty entry */
    EXPECT(d.w.buf = MOE_GPU_CHAN_BUFS, MOE_GPU_CHAN_E_BUF);  /* outside the table */
    EXPECT(d.ids.buf = UINT32_MAX, MOE_GPU_CHAN_E_BUF);
    EXPECT(d.x.off = 4096 - 16, MOE_GPU_CHAN_E_RANGE);
    EXPECT(d.y.off = 16, MOE_GPU_CHAN_E_RANGE);
    EXPECT(d.w.off = UINT64_MAX - 8, MOE_GPU_CHAN_E_RANGE);   /* off + len overflows */
    EXPECT(d.x.off = UINT64_MAX, MOE_GPU_CHAN_E_RANGE);
    EXPECT(d.x.off = 8, MOE_GPU_CHAN_E_ALIGN);
    EXPECT(d.ids.off += 2, MOE_GPU_CHAN_E_ALIGN);
    EXPECT((d.y = (struct moe_gpu_chan_ref){1, 0, 0}), MOE_GPU_CHAN_E_OVERLAP);
    EXPECT((d.y = (struct moe_gpu_chan_ref){1, 0, 2 * 4 * H}), MOE_GPU_CHAN_E_OVERLAP);
    EXPECT((d.y = (struct moe_gpu_chan_ref){1, 0, 1024}), MOE_GPU_CHAN_OK);
#undef EXPECT
}
END_TEST

START_TEST(test_expert_ids)
{
    const int32_t good[] = {0, 1, 5};
    for (unsigned i = 0; i < 3; i++) {
        ck_assert(moe_gpu_id_ok(good[i], E, 0));
        ck_assert(moe_gpu_id_ok(good[i], E, MOE_GPU_CHAN_EMPTY_SLOTS));
    }
    const int32_t bad[] = {E, E + 1, -2, INT32_MIN, INT32_MAX};
    for (unsigned i = 0; i < 5; i++) {
        ck_assert(!moe_gpu_id_ok(bad[i], E, 0));
        ck_assert(!moe_gpu_id_ok(bad[i], E, MOE_GPU_CHAN_EMPTY_SLOTS | MOE_GPU_CHAN_ROUTED_ONLY));
    }
    /* -1 is an empty slot only when the descriptor says so */
    ck_assert(!moe_gpu_id_ok(-1, E, 0));
    ck_assert(!moe_gpu_id_ok(-1, E, MOE_GPU_CHAN_ROUTED_ONLY));
    ck_assert(moe_gpu_id_ok(-1, E, MOE_GPU_CHAN_EMPTY_SLOTS));
    ck_assert_uint_eq(moe_gpu_chan_word(5, MOE_GPU_CHAN_E_EXPERT), (5u << 8) | 7u);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("chan_check");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_good_descriptor_resolves);
    tcase_add_test(tc, test_malformed_descriptors_get_their_status);
    tcase_add_test(tc, test_expert_ids);
    suite_add_tcase(s, tc);
    return moed_check_run(s);
}
