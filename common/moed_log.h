/* moed_log.h - one leveled log to stderr.
 *
 * Lines look like "2026-11-29T20:48:14.123Z moed[pid] INFO  message"; when
 * stderr is the systemd journal ($JOURNAL_STREAM matches it) or
 * MOED_LOG_PRIORITY=1, like "<6>INFO  message": the sd-daemon(3) syslog
 * priority prefix (<3> error, <4> warn, <6> info, <7> debug), which journald
 * files the line under, and no time stamp (the journal keeps its own).
 * The level is checked before any formatting (the macro), so disabled debug
 * lines cost one compare. Thread-safe (one write(2) per line).
 */
#ifndef MOED_LOG_H
#define MOED_LOG_H

enum moed_log_level {
    MOED_LOG_ERROR = 0,
    MOED_LOG_WARN = 1,
    MOED_LOG_INFO = 2,
    MOED_LOG_DEBUG = 3,
};

extern int moed_log_threshold; /* lines above this level are dropped; default INFO */

void moed_log_set_level(enum moed_log_level level);
/* "error", "warn", "info", "debug" -> level; returns -1 if unknown. */
int moed_log_level_parse(const char *name);
const char *moed_log_level_name(enum moed_log_level level);
/* 1 if lines carry the journal's priority prefix (decided on first use). */
int moed_log_to_journal(void);

void moed_log_write(enum moed_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define moed_log(level, ...)                                   \
    do {                                                       \
        if ((int)(level) <= moed_log_threshold)                \
            moed_log_write((level), __VA_ARGS__);              \
    } while (0)
#define LOG_E(...) moed_log(MOED_LOG_ERROR, __VA_ARGS__)
#define LOG_W(...) moed_log(MOED_LOG_WARN, __VA_ARGS__)
#define LOG_I(...) moed_log(MOED_LOG_INFO, __VA_ARGS__)
#define LOG_D(...) moed_log(MOED_LOG_DEBUG, __VA_ARGS__)

#endif
