/* moed_check_uv.c - failure reporting of the libuv check macros
 * (moed_check_uv.h). */
#include <uv.h>

#include "moed_check_uv.h"
#include "moed_err.h"
#include "moed_log.h"

int moed_uv_log_fail(int uvrc, const char *call, const char *file, int line)
{
    LOG_E("libuv error %s (%s) in %s at %s:%d", uv_err_name(uvrc), uv_strerror(uvrc), call, file,
          line);
    return uvrc;
}

int moed_uv_fail(char *err, size_t errlen, int uvrc, const char *call, const char *file, int line)
{
    moed_uv_log_fail(uvrc, call, file, line);
    return moed_seterr(err, errlen, MOED_E_IO, "libuv error %s (%s) in %s at %s:%d",
                       uv_err_name(uvrc), uv_strerror(uvrc), call, file, line);
}
