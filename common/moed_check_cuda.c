/* moed_check_cuda.c - failure reporting of the CUDA check macros
 * (moed_check_cuda.h). */
#include <cuda_runtime.h>

#include "moed_check_cuda.h"
#include "moed_err.h"
#include "moed_log.h"

int moed_cuda_fail(char *err, size_t errlen, int e, const char *call, const char *file, int line)
{
    const cudaError_t ce = (cudaError_t)e;
    LOG_E("CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(ce), cudaGetErrorString(ce), call,
          file, line);
    return moed_seterr(err, errlen, MOED_E_BACKEND, "CUDA error %s (%s) in %s at %s:%d",
                       cudaGetErrorName(ce), cudaGetErrorString(ce), call, file, line);
}

int moed_lib_fail(char *err, size_t errlen, const char *lib, int code, const char *what,
                  const char *call, const char *file, int line)
{
    LOG_E("%s error %d (%s) in %s at %s:%d", lib, code, what ? what : "?", call, file, line);
    return moed_seterr(err, errlen, MOED_E_BACKEND, "%s error %d (%s) in %s at %s:%d", lib, code,
                       what ? what : "?", call, file, line);
}
