/* test_bufpool.c - the host buffer pool (ipc/bufpool.h) with a fake pinned
 * allocator that records every block: sizes and reuse, the cap on pinned
 * bytes under a stream of gets and puts, allocation failure, growth keeping
 * the bytes, spares, and the release before the allocator's owner closes.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bufpool.h"
#include "moed_err.h"
#include "moed_log.h"
#include "check_main.h"

#define MAX_BLOCKS 256

/* The fake allocator: page-aligned blocks, every one remembered so that the
 * test can tell live from given back and free what the pool leaves. */
struct fake {
    void *blk[MAX_BLOCKS];
    size_t bytes[MAX_BLOCKS];
    int live[MAX_BLOCKS];
    int n, allocs, frees;
    int fail_after; /* alloc fails once this many have succeeded (-1: never) */
};

static void *fake_alloc(void *ctx, size_t bytes)
{
    struct fake *f = ctx;
    if (f->n == MAX_BLOCKS || (f->fail_after >= 0 && f->allocs >= f->fail_after))
        return NULL;
    void *p = NULL;
    ck_assert_int_eq(posix_memalign(&p, 4096, bytes), 0);
    f->blk[f->n] = p;
    f->bytes[f->n] = bytes;
    f->live[f->n++] = 1;
    f->allocs++;
    return p;
}

static void fake_free(void *ctx, void *p)
{
    struct fake *f = ctx;
    for (int i = 0; i < f->n; i++)
        if (f->blk[i] == p) {
            ck_assert_msg(f->live[i], "block %p given back twice", p);
            f->live[i] = 0;
            f->frees++;
            free(p);
            return;
        }
    ck_abort_msg("block %p is not the allocator's", p);
}

static uint64_t fake_live_bytes(const struct fake *f)
{
    uint64_t n = 0;
    for (int i = 0; i < f->n; i++)
        n += f->live[i] ? f->bytes[i] : 0;
    return n;
}

/* Free what the pool left (blocks dropped after release): keeps ASan quiet. */
static void fake_cleanup(struct fake *f)
{
    for (int i = 0; i < f->n; i++)
        if (f->live[i])
            free(f->blk[i]);
}

static struct moed_bufpool *open_pool(struct fake *f, uint64_t limit, uint64_t keep)
{
    struct moed_bufpool_cfg cfg = {.pinned_limit = limit, .keep_bytes = keep};
    if (f) {
        memset(f, 0, sizeof *f);
        f->fail_after = -1;
        cfg.pinned = (struct moed_host_allocator){fake_alloc, fake_free, f};
    }
    struct moed_bufpool *p = NULL;
    ck_assert_int_eq(moed_bufpool_open(&cfg, &p), 0);
    ck_assert_ptr_nonnull(p);
    return p;
}

static struct moed_bufpool_stats stats(const struct moed_bufpool *p)
{
    struct moed_bufpool_stats s;
    moed_bufpool_get_stats(p, &s);
    return s;
}

START_TEST(pinned_sizes_and_reuse)
{
    struct fake f;
    struct moed_bufpool *p = open_pool(&f, 8u << 20, 1u << 20);
    struct moed_hbuf a, b;
    /* power-of-two sizes from 64 KiB, page-aligned */
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &a), 0);
    ck_assert(a.pinned);
    ck_assert_uint_eq(a.cap, 64u << 10);
    ck_assert_int_eq(moed_bufpool_get(p, (256u << 10) + 48, 1, &b), 0);
    ck_assert(b.pinned);
    ck_assert_uint_eq(b.cap, 512u << 10);
    ck_assert_uint_eq((uintptr_t)b.base % 4096, 0);
    ck_assert_int_eq(f.allocs, 2);
    uint8_t *bb = b.base;
    moed_bufpool_put(p, &b);
    ck_assert_ptr_null(b.base);
    ck_assert_uint_eq(stats(p).pinned_free_bytes, 512u << 10);
    /* the same size again: the kept buffer, no allocation */
    ck_assert_int_eq(moed_bufpool_get(p, 300000, 1, &b), 0);
    ck_assert_ptr_eq(b.base, bb);
    ck_assert_int_eq(f.allocs, 2);
    ck_assert_uint_eq(stats(p).pinned_free_bytes, 0);
    /* pinned_ok 0: plain, exactly the size asked */
    struct moed_hbuf c;
    ck_assert_int_eq(moed_bufpool_get(p, 1000, 0, &c), 0);
    ck_assert(!c.pinned);
    ck_assert_uint_eq(c.cap, 1000);
    moed_bufpool_put(p, &c);
    struct moed_bufpool_stats s = stats(p);
    ck_assert_uint_eq(s.pinned_bytes, (64u + 512u) << 10);
    ck_assert_uint_eq(s.pinned_bytes, fake_live_bytes(&f));
    ck_assert_uint_eq(s.pinned_allocs, 2);
    ck_assert_uint_eq(s.pinned_limit, 8u << 20);
    moed_bufpool_put(p, &a);
    moed_bufpool_put(p, &b);
    moed_bufpool_close(p);
    ck_assert_int_eq(f.frees, 2); /* close gave both back */
    fake_cleanup(&f);
}
END_TEST

/* Many connections' worth of gets and puts of mixed sizes: the pinned bytes
 * never pass the cap, every buffer is big enough, and once the working set is
 * allocated nothing more is. */
START_TEST(stream_stays_under_the_cap)
{
    struct fake f;
    const uint64_t limit = 3u << 20;
    struct moed_bufpool *p = open_pool(&f, limit, 1u << 20);
    enum { HELD = 12 };
    struct moed_hbuf held[HELD];
    memset(held, 0, sizeof held);
    uint64_t lcg = 1;
    int allocs_at_warm = -1;
    for (int i = 0; i < 20000; i++) {
        lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
        int slot = (int)((lcg >> 33) % HELD);
        size_t sizes[] = {48 + 2 * 64 * 2048 + 64 * 64, 40 + 2 * 8 * 2048, 1000, 600000, 70000};
        size_t want = sizes[(lcg >> 40) % 5];
        moed_bufpool_put(p, &held[slot]);
        ck_assert_int_eq(moed_bufpool_get(p, want, 1, &held[slot]), 0);
        ck_assert_uint_ge(held[slot].cap, want);
        memset(held[slot].base, 0xa5, want); /* ASan: the whole size is ours */
        struct moed_bufpool_stats s = stats(p);
        ck_assert_uint_le(s.pinned_bytes, limit);
        ck_assert_uint_eq(s.pinned_bytes, fake_live_bytes(&f));
        if (i == 10000)
            allocs_at_warm = f.allocs;
    }
    ck_assert_int_eq(f.allocs, allocs_at_warm); /* steady state: no allocation */
    ck_assert_int_eq(f.frees, 0);                /* pinned memory is never freed while serving */
    for (int i = 0; i < HELD; i++)
        moed_bufpool_put(p, &held[i]);
    ck_assert_uint_eq(stats(p).pinned_free_bytes, stats(p).pinned_bytes);
    moed_bufpool_close(p);
    ck_assert_int_eq(f.frees, f.allocs);
    fake_cleanup(&f);
}
END_TEST

START_TEST(over_the_cap_and_failure_give_plain)
{
    struct fake f;
    struct moed_bufpool *p = open_pool(&f, 1u << 20, 1u << 20);
    struct moed_hbuf a, b, c, d;
    ck_assert_int_eq(moed_bufpool_get(p, 2u << 20, 1, &a), 0); /* bigger than the cap */
    ck_assert(!a.pinned);
    ck_assert_int_eq(moed_bufpool_get(p, 1u << 20, 1, &b), 0);  /* exactly the cap */
    ck_assert(b.pinned);
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &c), 0);       /* the cap is used up */
    ck_assert(!c.pinned);
    /* a free larger buffer serves a small request once the cap is reached */
    moed_bufpool_put(p, &b);
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &d), 0);
    ck_assert(d.pinned);
    ck_assert_uint_eq(d.cap, 1u << 20);
    ck_assert_int_eq(f.allocs, 1);
    moed_bufpool_put(p, &a);
    moed_bufpool_put(p, &c);
    moed_bufpool_put(p, &d);
    moed_bufpool_close(p);
    fake_cleanup(&f);

    /* the allocator fails: the cap drops to what is held, plain from then on */
    p = open_pool(&f, 8u << 20, 1u << 20);
    f.fail_after = 1;
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &a), 0);
    ck_assert(a.pinned);
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &b), 0);
    ck_assert(!b.pinned);
    ck_assert_uint_eq(stats(p).pinned_limit, 64u << 10);
    f.fail_after = -1;
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &c), 0); /* no retry */
    ck_assert(!c.pinned);
    ck_assert_int_eq(f.allocs, 1);
    moed_bufpool_put(p, &a);
    moed_bufpool_put(p, &b);
    moed_bufpool_put(p, &c);
    moed_bufpool_close(p);
    fake_cleanup(&f);

    /* no allocator, or a cap of 0: plain only */
    p = open_pool(NULL, 8u << 20, 1u << 20);
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &a), 0);
    ck_assert(!a.pinned);
    ck_assert_uint_eq(stats(p).pinned_limit, 0);
    moed_bufpool_put(p, &a);
    moed_bufpool_close(p);
    p = open_pool(&f, 0, 1u << 20);
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &a), 0);
    ck_assert(!a.pinned);
    ck_assert_int_eq(f.allocs, 0);
    moed_bufpool_put(p, &a);
    moed_bufpool_close(p);
}
END_TEST

START_TEST(grow_keeps_the_bytes)
{
    struct fake f;
    struct moed_bufpool *p = open_pool(&f, 8u << 20, 1u << 20);
    struct moed_hbuf b = {0};
    ck_assert_int_eq(moed_bufpool_get(p, 1000, 1, &b), 0);
    for (int i = 0; i < 1000; i++)
        b.base[i] = (uint8_t)i;
    ck_assert_int_eq(moed_bufpool_grow(p, &b, 300000, 1000), 0);
    ck_assert(b.pinned);
    ck_assert_uint_eq(b.cap, 512u << 10);
    for (int i = 0; i < 1000; i++)
        ck_assert_uint_eq(b.base[i], (uint8_t)i);
    ck_assert_uint_eq(stats(p).pinned_free_bytes, 64u << 10); /* the old one came back */
    ck_assert_int_eq(moed_bufpool_grow(p, &b, 1000, 1000), 0); /* big enough: unchanged */
    ck_assert_uint_eq(b.cap, 512u << 10);
    moed_bufpool_put(p, &b);
    moed_bufpool_close(p);
    fake_cleanup(&f);

    /* without an allocator: realloc */
    p = open_pool(NULL, 0, 1u << 20);
    b = (struct moed_hbuf){0};
    ck_assert_int_eq(moed_bufpool_grow(p, &b, 100, 0), 0);
    memset(b.base, 7, 100);
    ck_assert_int_eq(moed_bufpool_grow(p, &b, 200000, 100), 0);
    ck_assert(!b.pinned);
    ck_assert_uint_eq(b.cap, 200000);
    for (int i = 0; i < 100; i++)
        ck_assert_uint_eq(b.base[i], 7);
    moed_bufpool_put(p, &b);
    moed_bufpool_close(p);
}
END_TEST

START_TEST(plain_spares)
{
    const uint64_t keep = 1u << 20;
    struct moed_bufpool *p = open_pool(NULL, 0, keep);
    struct moed_hbuf b[MOED_BUFPOOL_SPARES + 2];
    for (int i = 0; i < MOED_BUFPOOL_SPARES + 2; i++)
        ck_assert_int_eq(moed_bufpool_get(p, 100000 + (size_t)i, 1, &b[i]), 0);
    for (int i = 0; i < MOED_BUFPOOL_SPARES + 2; i++)
        moed_bufpool_put(p, &b[i]);
    /* at most MOED_BUFPOOL_SPARES kept */
    uint64_t want = 0;
    for (int i = 0; i < MOED_BUFPOOL_SPARES; i++)
        want += 100000 + (uint64_t)i;
    ck_assert_uint_eq(stats(p).spare_bytes, want);
    /* the warmest spare big enough comes back first */
    struct moed_hbuf s;
    ck_assert_int_eq(moed_bufpool_get(p, 100010, 0, &s), 0);
    ck_assert_uint_eq(s.cap, 100000 + MOED_BUFPOOL_SPARES - 1);
    ck_assert_uint_eq(stats(p).spare_bytes, want - s.cap);
    moed_bufpool_put(p, &s);
    moed_bufpool_close(p);

    /* too small (an error frame) or over keep_bytes: freed, not kept */
    p = open_pool(NULL, 0, keep);
    struct moed_hbuf small, big;
    ck_assert_int_eq(moed_bufpool_get(p, 200, 0, &small), 0);
    ck_assert_int_eq(moed_bufpool_get(p, keep + 1, 0, &big), 0);
    ck_assert_uint_eq(small.cap, 200);
    ck_assert_uint_eq(big.cap, keep + 1);
    moed_bufpool_put(p, &small);
    moed_bufpool_put(p, &big);
    ck_assert_uint_eq(stats(p).spare_bytes, 0);
    moed_bufpool_close(p);
}
END_TEST

START_TEST(release_before_the_owner_closes)
{
    struct fake f;
    struct moed_bufpool *p = open_pool(&f, 8u << 20, 1u << 20);
    struct moed_hbuf kept, out, gone;
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &kept), 0);
    ck_assert_int_eq(moed_bufpool_get(p, 100000, 1, &out), 0);
    ck_assert_int_eq(moed_bufpool_get(p, 300000, 1, &gone), 0);
    moed_bufpool_put(p, &kept);
    /* the device may still write `gone`: never reused, never freed */
    moed_bufpool_abandon(p, &gone);
    ck_assert_ptr_null(gone.base);
    ck_assert_uint_eq(stats(p).pinned_bytes, (64u + 128u + 512u) << 10);
    moed_bufpool_release_pinned(p);
    ck_assert_int_eq(f.frees, 1); /* only the free one */
    /* after the release: no more pinned buffers, and one coming back is dropped */
    struct moed_hbuf late;
    ck_assert_int_eq(moed_bufpool_get(p, 100, 1, &late), 0);
    ck_assert(!late.pinned);
    moed_bufpool_put(p, &late);
    moed_bufpool_put(p, &out);
    ck_assert_int_eq(f.frees, 1);
    moed_bufpool_close(p);
    ck_assert_int_eq(f.frees, 1);
    ck_assert_int_eq(f.allocs, 3);
    fake_cleanup(&f); /* `out` and `gone`: left to process exit in the daemon */
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("bufpool");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, pinned_sizes_and_reuse);
    tcase_add_test(tc, stream_stays_under_the_cap);
    tcase_add_test(tc, over_the_cap_and_failure_give_plain);
    tcase_add_test(tc, grow_keeps_the_bytes);
    tcase_add_test(tc, plain_spares);
    tcase_add_test(tc, release_before_the_owner_closes);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    moed_log_set_level(MOED_LOG_ERROR); /* the failure cases warn by design */
    return moed_check_run(suite());
}
