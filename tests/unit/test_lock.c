/* test_lock.c - lock files (common/moed_lock.h) between real processes: a
 * second process is refused with MOED_E_BUSY naming the holder's pid and the
 * file, takes within one process are counted, the lock goes with the last
 * drop and with the holder's death (SIGKILL), an unusable path is an
 * MOED_E_IO naming it, a path too long MOED_E_RANGE, a 65th lock
 * MOED_E_NOMEM. The other process is a fork made before the parent takes
 * anything (a fork inherits its parent's open lock), driven over pipes.
 */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "moed_err.h"
#include "moed_lock.h"
#include "check_main.h"

/* A child process that, for each byte read from its command pipe, tries the
 * lock: 't' take (answers the rc and the error text), 'd' drop (answers 0). */
struct child {
    pid_t pid;
    int cmd, ans;
};

static struct child child_start(const char *path)
{
    int c[2], a[2];
    ck_assert_int_eq(pipe(c), 0);
    ck_assert_int_eq(pipe(a), 0);
    const pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(c[1]);
        close(a[0]);
        char op;
        while (read(c[0], &op, 1) == 1) {
            char err[512] = "";
            int rc = 0;
            if (op == 't')
                rc = moed_lock_take(path, "test resource", err, sizeof err);
            else
                moed_lock_drop(path);
            if (write(a[1], &rc, sizeof rc) != sizeof rc ||
                write(a[1], err, sizeof err) != sizeof err)
                _exit(3);
        }
        _exit(0);
    }
    close(c[0]);
    close(a[1]);
    return (struct child){pid, c[1], a[0]};
}

static int child_do(struct child *ch, char op, char err[512])
{
    int rc = 1;
    ck_assert_int_eq(write(ch->cmd, &op, 1), 1);
    ck_assert_int_eq(read(ch->ans, &rc, sizeof rc), (ssize_t)sizeof rc);
    ck_assert_int_eq(read(ch->ans, err, 512), 512);
    return rc;
}

static void child_end(struct child *ch)
{
    close(ch->cmd);
    close(ch->ans);
    int st = 0;
    ck_assert_int_eq(waitpid(ch->pid, &st, 0), ch->pid);
}

static void lock_path(char *buf, size_t n, const char *tag)
{
    snprintf(buf, n, "/tmp/moed-test-lock-%s-%ld", tag, (long)getpid());
    unlink(buf);
}

START_TEST(second_process_refused_with_holder_pid)
{
    char path[128], err[512];
    lock_path(path, sizeof path, "busy");
    struct child ch = child_start(path);
    ck_assert_int_eq(moed_lock_take(path, "GPU 0", err, sizeof err), 0);
    ck_assert_int_eq(child_do(&ch, 't', err), MOED_E_BUSY);
    char want[256];
    snprintf(want, sizeof want,
             "test resource is held by another process, pid %ld (lock file %s)", (long)getpid(),
             path);
    ck_assert_str_eq(err, want);
    /* counted within the process: one drop of two takes keeps it */
    ck_assert_int_eq(moed_lock_take(path, "GPU 0", err, sizeof err), 0);
    moed_lock_drop(path);
    ck_assert_int_eq(child_do(&ch, 't', err), MOED_E_BUSY);
    moed_lock_drop(path);
    ck_assert_int_eq(child_do(&ch, 't', err), 0);
    /* and now the parent is the one refused, with the child's pid */
    ck_assert_int_eq(moed_lock_take(path, "GPU 0", err, sizeof err), MOED_E_BUSY);
    snprintf(want, sizeof want, "GPU 0 is held by another process, pid %ld (lock file %s)",
             (long)ch.pid, path);
    ck_assert_str_eq(err, want);
    ck_assert_int_eq(child_do(&ch, 'd', err), 0);
    ck_assert_int_eq(moed_lock_take(path, "GPU 0", err, sizeof err), 0);
    moed_lock_drop(path);
    child_end(&ch);
    unlink(path);
}
END_TEST

START_TEST(killed_holder_releases)
{
    char path[128], err[512];
    lock_path(path, sizeof path, "kill");
    struct child ch = child_start(path);
    ck_assert_int_eq(child_do(&ch, 't', err), 0);
    ck_assert_int_eq(moed_lock_take(path, "GPU 0", err, sizeof err), MOED_E_BUSY);
    ck_assert_int_eq(kill(ch.pid, SIGKILL), 0);
    int st = 0;
    ck_assert_int_eq(waitpid(ch.pid, &st, 0), ch.pid);
    ck_assert(WIFSIGNALED(st));
    close(ch.cmd);
    close(ch.ans);
    ck_assert_int_eq(moed_lock_take(path, "GPU 0", err, sizeof err), 0);
    moed_lock_drop(path);
    unlink(path);
}
END_TEST

START_TEST(unusable_path_is_io_error)
{
    char err[512];
    const char *path = "/nonexistent-moed-dir/gpu.lock";
    ck_assert_int_eq(moed_lock_take(path, "GPU 3", err, sizeof err), MOED_E_IO);
    ck_assert_str_eq(err, "GPU 3: cannot open lock file /nonexistent-moed-dir/gpu.lock: "
                          "No such file or directory");
    moed_lock_drop(path); /* not taken: nothing */
}
END_TEST

START_TEST(path_too_long_and_too_many_locks)
{
    char err[512], path[400];
    memset(path, 'a', sizeof path - 1);
    path[0] = '/';
    path[sizeof path - 1] = '\0';
    ck_assert_int_eq(moed_lock_take(path, "GPU 1", err, sizeof err), MOED_E_RANGE);
    ck_assert_msg(strncmp(err, "GPU 1: lock file path over 255 bytes: /aaa", 42) == 0, "%s", err);
    /* 64 locks held at once, the 65th refused; each drop frees a place */
    char paths[65][128];
    for (int i = 0; i < 65; i++) {
        snprintf(paths[i], sizeof paths[i], "/tmp/moed-test-lock-many-%ld-%d", (long)getpid(), i);
        unlink(paths[i]);
    }
    for (int i = 0; i < 64; i++)
        ck_assert_int_eq(moed_lock_take(paths[i], "GPU 0", err, sizeof err), 0);
    ck_assert_int_eq(moed_lock_take(paths[64], "GPU 9", err, sizeof err), MOED_E_NOMEM);
    ck_assert_str_eq(err, "GPU 9: over 64 lock files held");
    moed_lock_drop(paths[0]);
    ck_assert_int_eq(moed_lock_take(paths[64], "GPU 9", err, sizeof err), 0);
    for (int i = 1; i < 65; i++)
        moed_lock_drop(paths[i]);
    for (int i = 0; i < 65; i++)
        unlink(paths[i]);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("lock");
    TCase *tc = tcase_create("lock");
    tcase_add_test(tc, second_process_refused_with_holder_pid);
    tcase_add_test(tc, killed_holder_releases);
    tcase_add_test(tc, unusable_path_is_io_error);
    tcase_add_test(tc, path_too_long_and_too_many_locks);
    suite_add_tcase(s, tc);
    return moed_check_run(s);
}
