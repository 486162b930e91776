/* moed_check_uv.h - the check macros for libuv calls, in the convention of
 * moed_check_cuda.h (the enclosing function has `int rc`, `char *err,
 * size_t errlen` and one cleanup tail labelled `cleanup:`). A failing call
 * logs (LOG_E) libuv's error name and text, the call as written, the file
 * and the line; then
 *   MOED_UV_TRY(call)    writes the same into err, sets rc to MOED_E_IO and
 *                        jumps to cleanup;
 *   MOED_UV_CHECK(call)  (an expression) gives the call's result: for a call
 *                        where nothing unwinds (a callback re-arming a timer)
 *                        or the caller has its own answer to a failure.
 *
 *   MOED_UV_TRY(uv_listen((uv_stream_t *)&s, 128, on_conn));
 *   if (MOED_UV_CHECK(uv_read_start(st, on_alloc, on_read)) < 0) ...
 */
#ifndef MOED_CHECK_UV_H
#define MOED_CHECK_UV_H

#include <stddef.h>

/* Log a failed libuv call (uvrc < 0); returns uvrc. */
int moed_uv_log_fail(int uvrc, const char *call, const char *file, int line);
/* Log and record it into err; returns MOED_E_IO. */
int moed_uv_fail(char *err, size_t errlen, int uvrc, const char *call, const char *file, int line);

static inline int moed_uv_check(int uvrc, const char *call, const char *file, int line)
{
    return uvrc < 0 ? moed_uv_log_fail(uvrc, call, file, line) : uvrc;
}

#define MOED_UV_CHECK(call) moed_uv_check((call), #call, __FILE__, __LINE__)

#define MOED_UV_TRY(call)                                                                      \
    do {                                                                                       \
        const int moed_u_ = (call);                                                            \
        if (moed_u_ < 0) {                                                                     \
            rc = moed_uv_fail(err, errlen, moed_u_, #call, __FILE__, __LINE__);               \
            goto cleanup;                                                                      \
        }                                                                                      \
    } while (0)

#endif
