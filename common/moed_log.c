/* moed_log.c - leveled stderr log, one write(2) per line. */
#include "moed_log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int moed_log_threshold = MOED_LOG_INFO;

static const char *const level_names[] = {"error", "warn", "info", "debug"};
static const char *const level_tags[] = {"ERROR", "WARN ", "INFO ", "DEBUG"};
/* sd-daemon(3) priority prefixes (SD_ERR, SD_WARNING, SD_INFO, SD_DEBUG) */
static const char *const level_prio[] = {"<3>", "<4>", "<6>", "<7>"};

/* -1 not decided yet, 0 plain lines, 1 journal lines (see moed_log.h). */
static atomic_int journal_mode = -1;

/* stderr is the journal when $JOURNAL_STREAM names its device and inode
 * (systemd.exec(5)); MOED_LOG_PRIORITY=1 asks for the prefixes anyway. */
static int journal_decide(void)
{
    const char *force = getenv("MOED_LOG_PRIORITY");
    if (force && *force)
        return strcmp(force, "0") != 0;
    const char *js = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    if (!js || sscanf(js, "%llu:%llu", &dev, &ino) != 2 || fstat(STDERR_FILENO, &st) != 0)
        return 0;
    return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

int moed_log_to_journal(void)
{
    int m = atomic_load_explicit(&journal_mode, memory_order_relaxed);
    if (m < 0) {
        m = journal_decide();
        atomic_store_explicit(&journal_mode, m, memory_order_relaxed);
    }
    return m;
}

void moed_log_set_level(enum moed_log_level level) { moed_log_threshold = (int)level; }

int moed_log_level_parse(const char *name)
{
    for (int i = 0; i < 4; i++)
        if (strcmp(name, level_names[i]) == 0)
            return i;
    return -1;
}

const char *moed_log_level_name(enum moed_log_level level)
{
    return ((unsigned)level < 4) ? level_names[level] : "?";
}

void moed_log_write(enum moed_log_level level, const char *fmt, ...)
{
    char line[2048];
    unsigned lv = (unsigned)level < 4 ? (unsigned)level : 0;
    int n;
    if (moed_log_to_journal()) {
        /* the journal stamps time and pid itself: priority, level, message */
        n = snprintf(line, sizeof line, "%s%s ", level_prio[lv], level_tags[lv]);
    } else {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ moed[%d] %s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, (int)getpid(), level_tags[lv]);
    }
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}
