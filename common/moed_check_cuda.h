/* moed_check_cuda.h - the check macros for CUDA-side library calls (CUDA
 * runtime, cuBLAS, NCCL); CUDA builds only.
 *
 * One convention for the whole check family (the libuv macros follow it
 * too): the enclosing function has `int rc`, `char *err, size_t errlen` and
 * one cleanup tail labelled `cleanup:`. A failing call
 *   - logs (LOG_E) the library's error name and text, the call as written,
 *     the file and the line,
 *   - writes the same into err (moed_seterr),
 *   - sets rc to MOED_E_BACKEND and jumps to cleanup.
 *
 *   MOED_CUDA_TRY(cudaMalloc(&p, n));
 *   MOED_CUBLAS_TRY(cublasCreate(&h));      (cublas_v2.h at the call site)
 *   MOED_NCCL_TRY(ncclCommInitRank(...));   (nccl.h at the call site)
 */
#ifndef MOED_CHECK_CUDA_H
#define MOED_CHECK_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Log and record a failed CUDA runtime call (e: its cudaError_t); returns
 * MOED_E_BACKEND. */
int moed_cuda_fail(char *err, size_t errlen, int e, const char *call, const char *file,
                   int line);
/* The same for another library's status code `code`, described by `what`
 * (the library's own string for it, or NULL). */
int moed_lib_fail(char *err, size_t errlen, const char *lib, int code, const char *what,
                  const char *call, const char *file, int line);

#ifdef __cplusplus
}
#endif

#define MOED_CUDA_TRY(call)                                                                    \
    do {                                                                                       \
        const int moed_e_ = (int)(call);                                                       \
        if (moed_e_ != 0) {                                                                    \
            rc = moed_cuda_fail(err, errlen, moed_e_, #call, __FILE__, __LINE__);             \
            goto cleanup;                                                                      \
        }                                                                                      \
    } while (0)

#define MOED_CUBLAS_TRY(call)                                                                  \
    do {                                                                                       \
        const int moed_s_ = (int)(call);                                                       \
        if (moed_s_ != 0) {                                                                    \
            rc = moed_lib_fail(err, errlen, "cuBLAS", moed_s_,                                 \
                               cublasGetStatusString((cublasStatus_t)moed_s_), #call,          \
                               __FILE__, __LINE__);                                            \
            goto cleanup;                                                                      \
        }                                                                                      \
    } while (0)

#define MOED_NCCL_TRY(call)                                                                    \
    do {                                                                                       \
        const int moed_s_ = (int)(call);                                                       \
        if (moed_s_ != 0) {                                                                    \
            rc = moed_lib_fail(err, errlen, "NCCL", moed_s_,                                   \
                               ncclGetErrorString((ncclResult_t)moed_s_), #call, __FILE__,     \
                               __LINE__);                                                      \
            goto cleanup;                                                                      \
        }                                                                                      \
    } while (0)

/* For a MOED_E_* returning call inside the same convention: keep its code
 * and message (err is already written), jump to cleanup. */
#define MOED_TRY(call)                                                                         \
    do {                                                                                       \
        const int moed_r_ = (call);                                                            \
        if (moed_r_ != 0) {                                                                    \
            rc = moed_r_;                                                                      \
            goto cleanup;                                                                      \
        }                                                                                      \
    } while (0)

#endif
