/* moed_err.c - error strings. */
#include "moed_err.h"

/* Exported from libmoedclient.so too (built with -fvisibility=hidden). */
#define MOED_ERR_API __attribute__((visibility("default")))

#include <stdarg.h>
#include <stdio.h>

static const struct {
    const char *name;
    const char *text;
} err_table[MOED_E__COUNT] = {
    [0] = {"ok", "success"},
    [1] = {"nomem", "out of memory"},
    [2] = {"io", "I/O error"},
    [3] = {"format", "malformed file"},
    [4] = {"range", "value out of range"},
    [5] = {"config", "invalid configuration"},
    [6] = {"model", "invalid or unsupported model checkpoint"},
    [7] = {"nofit", "model does not fit in available memory"},
    [8] = {"proto", "malformed frame"},
    [9] = {"version", "unsupported protocol version"},
    [10] = {"type", "unknown message type"},
    [11] = {"toobig", "payload too large"},
    [12] = {"inval", "invalid request"},
    [13] = {"busy", "server busy (limit reached)"},
    [14] = {"timeout", "deadline exceeded"},
    [15] = {"shutdown", "server shutting down"},
    [16] = {"backend", "backend failure"},
    [17] = {"unsupported", "not supported by this build"},
    [18] = {"perm", "permission denied"},
    [19] = {"notready", "not ready"},
    [20] = {"conn", "connection failed or lost"},
};

static int err_index(int err)
{
    int i = -err;
    return (i >= 0 && i < MOED_E__COUNT) ? i : -1;
}

MOED_ERR_API const char *moed_strerror(int err)
{
    int i = err_index(err);
    return i < 0 ? "unknown error" : err_table[i].text;
}

MOED_ERR_API const char *moed_errname(int err)
{
    int i = err_index(err);
    return i < 0 ? "unknown" : err_table[i].name;
}

MOED_ERR_API int moed_seterr(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}
