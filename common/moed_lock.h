/* moed_lock.h - an exclusive lock file per resource (a GPU), held by one
 * process until it drops it or exits: flock(2), so the kernel releases it
 * when the holder dies, SIGKILL included. The file holds the holder's pid,
 * so that the next taker's error names it. Within one process a path may be
 * taken more than once (counted: an expert-parallel engine may place two
 * shards on one GPU); the lock goes with the last drop. Thread-safe. */
#ifndef MOED_LOCK_H
#define MOED_LOCK_H

#include <stddef.h>

/* Take the lock at path (created if missing; the file is never removed, so
 * that two takers always lock the same inode). 0, or MOED_E_BUSY when another
 * process holds it ("<what> is held by another process, pid N (lock file
 * <path>)"), or MOED_E_IO when the file cannot be opened or locked, or
 * MOED_E_NOMEM / MOED_E_RANGE (too many locks, path too long). */
int moed_lock_take(const char *path, const char *what, char *err, size_t errlen);

/* Drop one take of path (a path not taken: nothing). */
void moed_lock_drop(const char *path);

#endif
