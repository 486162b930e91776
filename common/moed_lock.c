/* moed_lock.c - lock files held for a process's life (moed_lock.h). */
#include "moed_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "moed_err.h"

#define MAX_LOCKS 64
#define MAX_PATH 256

static struct held {
    char path[MAX_PATH];
    int fd, refs;
} g_held[MAX_LOCKS];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static struct held *find(const char *path)
{
    for (int i = 0; i < MAX_LOCKS; i++)
        if (g_held[i].refs > 0 && strcmp(g_held[i].path, path) == 0)
            return &g_held[i];
    return NULL;
}

/* The holder's pid as it wrote it, or 0 (not written yet, or unreadable). */
static long holder_pid(int fd)
{
    char buf[32];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *end = NULL;
    long pid = strtol(buf, &end, 10);
    return end != buf && pid > 0 ? pid : 0;
}

int moed_lock_take(const char *path, const char *what, char *err, size_t errlen)
{
    if (strlen(path) >= MAX_PATH)
        return moed_seterr(err, errlen, MOED_E_RANGE, "%s: lock file path over %d bytes: %s",
                           what, MAX_PATH - 1, path);
    int rc = 0;
    pthread_mutex_lock(&g_mu);
    struct held *h = find(path);
    if (h) {
        h->refs++;
        goto out;
    }
    for (int i = 0; i < MAX_LOCKS && !h; i++)
        h = g_held[i].refs == 0 ? &g_held[i] : NULL;
    if (!h) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: over %d lock files held", what,
                         MAX_LOCKS);
        goto out;
    }
    /* read-write to record the pid; a file another user made is locked
     * read-only (flock needs no write access) */
    int writable = 1, fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0 && errno == EACCES) {
        writable = 0;
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    }
    if (fd < 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "%s: cannot open lock file %s: %s", what, path,
                         strerror(errno));
        goto out;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        const int e = errno;
        if (e == EWOULDBLOCK) {
            const long pid = holder_pid(fd);
            if (pid)
                rc = moed_seterr(err, errlen, MOED_E_BUSY,
                                 "%s is held by another process, pid %ld (lock file %s)", what,
                                 pid, path);
            else
                rc = moed_seterr(err, errlen, MOED_E_BUSY,
                                 "%s is held by another process (lock file %s)", what, path);
        } else {
            rc = moed_seterr(err, errlen, MOED_E_IO, "%s: cannot lock %s: %s", what, path,
                             strerror(e));
        }
        close(fd);
        goto out;
    }
    if (writable) {
        char buf[32];
        const int n = snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
        /* the lock holds whatever these do: a failure only leaves the next
         * taker's message without the pid */
        if (ftruncate(fd, 0) == 0)
            (void)!pwrite(fd, buf, (size_t)n, 0);
    }
    snprintf(h->path, sizeof h->path, "%s", path);
    h->fd = fd;
    h->refs = 1;
out:
    pthread_mutex_unlock(&g_mu);
    return rc;
}

void moed_lock_drop(const char *path)
{
    pthread_mutex_lock(&g_mu);
    struct held *h = find(path);
    if (h && --h->refs == 0) {
        close(h->fd); /* releases the flock */
        h->path[0] = '\0';
    }
    pthread_mutex_unlock(&g_mu);
}
