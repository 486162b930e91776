/* test_nccl_host.c - the NCCL group's host-side parts (engine/nccl_group.h).
 * The id file: written as 256 hex digits and a newline with mode 0600 and
 * read back byte for byte; a reader started before the writer waits for it
 * (another process writes it later); a file that never appears times out
 * naming the path and the timeout; malformed files are refused naming what
 * is wrong; no temporary file is left behind; an unwritable directory is
 * MOED_E_IO. The header check: every field a worker acts on, each refusal
 * by its reason. The entries of a ROWS batch: over 1..4 devices and random
 * batches (empty slots, routed only), each device's list is exactly the
 * entries moed_ep_assign gives it, and the lists together cover every entry
 * the combine reads once.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "gen_fixture.h"
#include "moed_err.h"
#include "nccl_group.h"
#include "placement.h"

static char dir[64];
static char path[128];

static void setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/moed-nccl-id-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/nccl.id", dir);
}

static void teardown(void)
{
    unlink(path);
    rmdir(dir);
}

static void fill(uint8_t *id, unsigned seed)
{
    for (int i = 0; i < MOED_NCCL_ID_BYTES; i++)
        id[i] = (uint8_t)(seed * 131u + (unsigned)i * 7u);
}

static void put(const char *text, size_t n)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(text, 1, n, f), n);
    fclose(f);
}

START_TEST(round_trip_mode_and_no_temporary)
{
    uint8_t id[MOED_NCCL_ID_BYTES], got[MOED_NCCL_ID_BYTES];
    char err[512] = "";
    fill(id, 3);
    ck_assert_int_eq(moed_nccl_id_write(path, id, err, sizeof err), 0);
    struct stat st;
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(st.st_mode & 0777, 0600);
    ck_assert_int_eq(st.st_size, 2 * MOED_NCCL_ID_BYTES + 1);
    ck_assert_int_eq(moed_nccl_id_read(path, 0, got, err, sizeof err), 0);
    ck_assert_mem_eq(got, id, sizeof id);
    /* a second write replaces it whole */
    fill(id, 4);
    ck_assert_int_eq(moed_nccl_id_write(path, id, err, sizeof err), 0);
    ck_assert_int_eq(moed_nccl_id_read(path, 0, got, err, sizeof err), 0);
    ck_assert_mem_eq(got, id, sizeof id);
    char tmp[200];
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    ck_assert_int_ne(access(tmp, F_OK), 0);
}
END_TEST

START_TEST(reader_waits_for_a_later_writer)
{
    uint8_t id[MOED_NCCL_ID_BYTES], got[MOED_NCCL_ID_BYTES];
    char err[512] = "";
    fill(id, 9);
    const pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        usleep(200 * 1000);
        char e2[512];
        _exit(moed_nccl_id_write(path, id, e2, sizeof e2) ? 1 : 0);
    }
    /* generous: the writer is a process of its own on a loaded machine */
    const int rc = moed_nccl_id_read(path, 60000, got, err, sizeof err);
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_int_eq(WEXITSTATUS(status), 0);
    ck_assert_msg(rc == 0, "%d %s", rc, err);
    ck_assert_mem_eq(got, id, sizeof id);
}
END_TEST

START_TEST(missing_file_times_out_naming_it)
{
    uint8_t got[MOED_NCCL_ID_BYTES];
    char err[512] = "", want[300];
    ck_assert_int_eq(moed_nccl_id_read(path, 50, got, err, sizeof err), MOED_E_TIMEOUT);
    snprintf(want, sizeof want,
             "engine.nccl_id_file %s: rank 0 did not write it within engine.nccl_timeout_ms "
             "(50 ms)", path);
    ck_assert_str_eq(err, want);
}
END_TEST

START_TEST(malformed_files_refused)
{
    uint8_t got[MOED_NCCL_ID_BYTES];
    char err[512] = "", want[300], text[2 * MOED_NCCL_ID_BYTES + 8];
    memset(text, 'a', sizeof text);
    /* one digit short */
    put(text, 2 * MOED_NCCL_ID_BYTES - 1);
    ck_assert_int_eq(moed_nccl_id_read(path, 0, got, err, sizeof err), MOED_E_CONFIG);
    snprintf(want, sizeof want,
             "engine.nccl_id_file %s: 255 bytes, not an NCCL id (256 hex digits and a newline, "
             "as rank 0 writes it)", path);
    ck_assert_str_eq(err, want);
    /* empty */
    put(text, 0);
    ck_assert_int_eq(moed_nccl_id_read(path, 0, got, err, sizeof err), MOED_E_CONFIG);
    ck_assert_ptr_nonnull(strstr(err, ": 0 bytes, not an NCCL id"));
    /* two newlines */
    text[2 * MOED_NCCL_ID_BYTES] = '\n';
    text[2 * MOED_NCCL_ID_BYTES + 1] = '\n';
    put(text, 2 * MOED_NCCL_ID_BYTES + 2);
    ck_assert_int_eq(moed_nccl_id_read(path, 0, got, err, sizeof err), MOED_E_CONFIG);
    ck_assert_ptr_nonnull(strstr(err, ": 258 bytes, not an NCCL id"));
    /* a non-hex digit at byte 77 */
    memset(text, '0', sizeof text);
    text[77] = 'g';
    text[2 * MOED_NCCL_ID_BYTES] = '\n';
    put(text, 2 * MOED_NCCL_ID_BYTES + 1);
    ck_assert_int_eq(moed_nccl_id_read(path, 0, got, err, sizeof err), MOED_E_CONFIG);
    snprintf(want, sizeof want,
             "engine.nccl_id_file %s: byte 77 is not a hex digit; not an NCCL id", path);
    ck_assert_str_eq(err, want);
    /* without the newline, upper case: accepted */
    memset(text, 'F', sizeof text);
    put(text, 2 * MOED_NCCL_ID_BYTES);
    ck_assert_int_eq(moed_nccl_id_read(path, 0, got, err, sizeof err), 0);
    for (int i = 0; i < MOED_NCCL_ID_BYTES; i++)
        ck_assert_uint_eq(got[i], 0xff);
}
END_TEST

START_TEST(unwritable_directory_is_io)
{
    uint8_t id[MOED_NCCL_ID_BYTES];
    char err[512] = "", p[200];
    fill(id, 1);
    snprintf(p, sizeof p, "%s/no/such/dir/nccl.id", dir);
    ck_assert_int_eq(moed_nccl_id_write(p, id, err, sizeof err), MOED_E_IO);
    ck_assert_ptr_nonnull(strstr(err, p));
    ck_assert_ptr_nonnull(strstr(err, "No such file or directory"));
}
END_TEST

START_TEST(header_check_names_each_refusal)
{
    struct gen_fx fx;
    gen_fx_open(&fx, 11);
    const struct moed_model *m = fx.m;
    const struct moed_nccl_hdr ok = {.magic = MOED_NCCL_MAGIC, .kind = MOED_NCCL_BATCH,
                                     .seq = 7, .layer = 0, .n_tokens = 64,
                                     .flags = MOED_BATCH_ROWS, .ep_n = 3, .ep_shard = 2};
    ck_assert_ptr_null(moed_nccl_hdr_check(&ok, m, 3, 2, 64));
    struct moed_nccl_hdr h = ok;
    h.flags |= MOED_BATCH_ROUTED_ONLY;
    ck_assert_ptr_null(moed_nccl_hdr_check(&h, m, 3, 2, 64));
    h = (struct moed_nccl_hdr){.magic = MOED_NCCL_MAGIC, .kind = MOED_NCCL_PING};
    ck_assert_ptr_null(moed_nccl_hdr_check(&h, m, 3, 2, 64));
    h.kind = MOED_NCCL_STOP;
    ck_assert_ptr_null(moed_nccl_hdr_check(&h, m, 3, 2, 64));
    static const struct {
        int field;
        uint32_t value;
        const char *why;
    } bad[] = {
        {0, 0x4e43454eu, "bad magic"},
        {1, MOED_NCCL_REPLY, "unknown kind"},
        {1, 99, "unknown kind"},
        {2, 0, "n_tokens out of range"},
        {2, 65, "n_tokens out of range"},
        {3, GEN_LAYERS, "not a MoE layer"},
        {3, 0xffffffffu, "not a MoE layer"},
        {4, 0, "flags"},
        {4, MOED_BATCH_ROWS | MOED_BATCH_COMBINE, "flags"},
        {4, MOED_BATCH_ROWS | 0x80u, "flags"},
        {4, MOED_BATCH_ROUTED_ONLY, "flags"},
        {5, 2, "ep_n / ep_shard are not this group's"},
        {6, 1, "ep_n / ep_shard are not this group's"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        h = ok;
        uint32_t *f[] = {&h.magic, &h.kind, &h.n_tokens, &h.layer, &h.flags, &h.ep_n,
                         &h.ep_shard};
        *f[bad[i].field] = bad[i].value;
        const char *why = moed_nccl_hdr_check(&h, m, 3, 2, 64);
        ck_assert_msg(why && strcmp(why, bad[i].why) == 0, "case %zu: %s", i,
                      why ? why : "(accepted)");
    }
    gen_fx_close(&fx);
}
END_TEST

START_TEST(rows_entries_are_the_assigned_ones)
{
    enum { E = 8, k = 2, S = 1, KS = k + S, TMAX = 40 };
    uint64_t rnd = 2026;
    for (uint32_t n_dev = 1; n_dev <= 4; n_dev++) {
        struct moed_placement p;
        char err[MOED_ERRLEN] = "";
        uint64_t load[E];
        for (uint32_t e = 0; e < E; e++)
            load[e] = 1 + gen_rnd(&rnd) % 50;
        ck_assert_msg(moed_placement_balanced(E, S, n_dev, load, n_dev, 0.5, &p, err,
                                              sizeof err) == 0, "%s", err);
        for (int round = 0; round < 40; round++) {
            const uint32_t T = 1 + (uint32_t)(gen_rnd(&rnd) % TMAX);
            const int routed_only = round % 3 == 1;
            int32_t ids[TMAX * 2], sub[TMAX * 2];
            uint8_t dev_of[TMAX * 3];
            uint32_t count[MOED_PLACE_MAX_DEVS], seen[E], got[TMAX * 3];
            int covered[TMAX * 3];
            memset(covered, 0, sizeof covered);
            for (uint32_t i = 0; i < T * k; i++)
                ids[i] = gen_rnd(&rnd) % 5 == 0 ? -1 : (int32_t)(gen_rnd(&rnd) % E);
            ck_assert_int_eq(moed_ep_assign(&p, T, k, ids, dev_of, count, seen), 0);
            for (uint32_t c = 0; c < n_dev; c++) {
                for (uint32_t t = 0; t < T; t++)
                    for (uint32_t j = 0; j < k; j++)
                        sub[t * k + j] = dev_of[t * KS + j] == c ? ids[t * k + j] : -1;
                struct moed_batch b = {.n_tokens = T, .top_k = k,
                                       .ids = {MOED_BUF_HOST, 0, sub, (uint64_t)T * k * 4},
                                       .flags = MOED_BATCH_ROWS |
                                                (routed_only ? MOED_BATCH_ROUTED_ONLY : 0),
                                       .ep_n = n_dev, .ep_shard = c};
                const uint32_t n = moed_nccl_rows_entries(&b, k, S, got);
                uint32_t want = 0;
                for (uint32_t e = 0; e < T * KS; e++) {
                    const int is_shared = e % KS >= k;
                    if (dev_of[e] != c || (is_shared && routed_only))
                        continue;
                    ck_assert_uint_lt(want, n);
                    ck_assert_uint_eq(got[want], e);
                    covered[e]++;
                    want++;
                }
                ck_assert_uint_eq(n, want);
            }
            for (uint32_t e = 0; e < T * KS; e++) {
                const int is_shared = e % KS >= k;
                const int read = is_shared ? !routed_only : ids[e / KS * k + e % KS] >= 0;
                ck_assert_int_eq(covered[e], read);
            }
        }
        moed_placement_free(&p);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("nccl_host");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, round_trip_mode_and_no_temporary);
    tcase_add_test(tc, reader_waits_for_a_later_writer);
    tcase_add_test(tc, missing_file_times_out_naming_it);
    tcase_add_test(tc, malformed_files_refused);
    tcase_add_test(tc, unwritable_directory_is_io);
    tcase_add_test(tc, header_check_names_each_refusal);
    tcase_add_test(tc, rows_entries_are_the_assigned_ones);
    suite_add_tcase(s, tc);
    return moed_check_run(s);
}
