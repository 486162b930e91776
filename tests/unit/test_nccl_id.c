/* test_nccl_id.c - the NCCL group's id file (engine/nccl_group.h): written as
 * 256 hex digits and a newline with mode 0600 and read back byte for byte;
 * a reader started before the writer waits for it (another process writes it
 * later); a file that never appears times out naming the path and the
 * timeout; malformed files are refused naming what is wrong; no temporary
 * file is left behind; an unwritable directory is MOED_E_IO.
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
#include "moed_err.h"
#include "nccl_group.h"

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

int main(void)
{
    Suite *s = suite_create("nccl_id");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, round_trip_mode_and_no_temporary);
    tcase_add_test(tc, reader_waits_for_a_later_writer);
    tcase_add_test(tc, missing_file_times_out_naming_it);
    tcase_add_test(tc, malformed_files_refused);
    tcase_add_test(tc, unwritable_directory_is_io);
    suite_add_tcase(s, tc);
    return moed_check_run(s);
}
