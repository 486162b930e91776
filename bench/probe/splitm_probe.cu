/* splitm_probe.cu - would split-M tasks stream a weight byte as fast as
 * moed's split-K tasks, with up to 32 tokens per weight pass? (issue 12, T =
 * 256: bench/NOTES.md 2026-12-06 stop 37, "the next structural step").
 *
 * moed's task splits K over its 4 warps, so every warp holds the
 * accumulators of every tile and token of the task (tiles x n-tiles <= 8 at
 * 168 registers: a crowded expert streams its weights once per 16 tokens)
 * and the task ends in a partials exchange and a reduction. Here a CTA takes
 * 4-tile tasks of E experts, every task with N = 8 NT activation rows, and
 * warp w streams tile w of the task over the whole K (one MMA chain per
 * output: MR x NT x 4 accumulators, 32 floats at N = 32), its weights
 * through its own WS-stage cp.async ring; the task's rows of a K unit are
 * copied once by the whole CTA into a WS-stage shared ring, and one CTA
 * barrier per K unit makes unit v visible to every warp and frees the slot
 * of unit v - 1. The dequant and MMAs are moed's (unit_mma, load_b).
 *
 * Timed, its sums go to a sink; `check` runs one pass that writes the first
 * tasks' outputs and compares them with the same chains computed without a
 * pipeline (one warp per tile, one unit at a time): a test of the rings.
 * moed's own task on the same shapes: tile_probe gu|dn N REPS 4 [SHAPE]
 * (N <= 16).
 *
 * Build (repository root):
 *   nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Icommon -Ikernels \
 *     -DMOED_HAVE_CUDA=1 -o build-var/splitm_probe bench/probe/splitm_probe.cu \
 *     kernels/moe_gpu_pack.c common/moed_err.c common/moed_log.c common/moed_check_cuda.c
 * Run:   splitm_probe [gu|dn] [N: 8|16|32] [reps] [deepseek-v3|qwen3-30b-a3b]
 *        splitm_probe check [gu|dn] [N] [SHAPE]   (exit 0: the outputs agree)
 * N as rN (r32): the same sums as moed's split-K task (warp r's chain over
 * units r, r + 4, ..., the four chains added in task_splitk's order), so a
 * split-M task could serve a crowded expert beside split-K tasks without
 * changing any token's result: each warp streams its tile residue by
 * residue (units 0, 4, 8, ..., then 1, 5, 9, ...) and adds each residue's
 * chain to its sums as the reduction does.
 */
#include "../../kernels/moe_gpu.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "probe_rows.h"

constexpr int SM_WS = STAGES; /* stages of both rings */

/* This warp's tile of task t: the out rows of tile `tile` (32), N columns */
template <int NT>
__device__ __forceinline__ void sm_out(const float (&acc)[MR][NT][4], size_t row0, float *out)
{
    const unsigned lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int m = 0; m < MR; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                out[(row0 + m * 16 + g + (c >> 1) * 8) * (NT * 8) + n * 8 + 2 * q + (c & 1)] =
                    acc[m][n][c];
}

template <int NT, bool RES>
__global__ void __launch_bounds__(THREADS, MINB)
    splitm_probe(const uint8_t *__restrict__ w, unsigned n_exp, unsigned rt, unsigned units,
                 size_t exp_bytes, const uint16_t *__restrict__ x, unsigned ld, float *sink,
                 float *out, unsigned n_out)
{
    extern __shared__ __align__(128) uint8_t smem[];
    constexpr unsigned UB = MOE_GPU_UNIT_BYTES, N = NT * 8, XB = N * X_ROW_BYTES;
    constexpr unsigned WS = SM_WS;
    const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint8_t *const xring = smem;                               /* WS x XB, the CTA's */
    uint8_t *const wring = smem + WS * XB + warp * WS * UB;    /* WS x UB, this warp's */
    const unsigned lw = (lane < UL ? lane : lane - (32 - UL)) * 16; /* lanes >= UL repeat */
    const unsigned TPE = rt / NWARPS;
    float sum = 0.f;
    for (unsigned t = blockIdx.x; t < n_exp * TPE; t += gridDim.x) {
        const unsigned e = t / TPE, tile = (t - e * TPE) * NWARPS + warp;
        const uint8_t *wt = w + e * exp_bytes + (size_t)tile * units * UB + lw;
        float acc[MR][NT][4], cur[MR][NT][4];
        zero_acc<NT>(acc);
        zero_acc<NT>(cur);
        /* the v-th unit streamed: v itself, or (RES) split-K's order, residue
         * r = v / (units / 4) first: units r, r + 4, ... (units % 4 == 0) */
        const unsigned q4 = units / NWARPS;
        auto unit_of = [&](unsigned v) { return RES ? (v % q4) * NWARPS + v / q4 : v; };
        auto issue = [&](unsigned v) {
            if (v < units) {
                const unsigned s = v % WS, u = unit_of(v);
#pragma unroll
                for (unsigned k = 0; k < UC / UL; k++)
                    cp_async16(wring + s * UB + lw + k * UL * 16, wt + (size_t)u * UB + k * UL * 16);
                for (unsigned c = tid; c < N * 8; c += THREADS)
                    cp_async16(xring + s * XB + (c >> 3) * X_ROW_BYTES + (c & 7) * 16,
                               x + (size_t)(c >> 3) * ld + u * MOE_GPU_UNIT_K + (c & 7) * 8);
            }
            cp_async_commit();
        };
#pragma unroll
        for (unsigned s = 0; s + 1 < WS; s++)
            issue(s);
        for (unsigned v = 0; v < units; v++) {
            cp_async_wait<WS - 2>();
            __syncthreads(); /* unit v in, for every warp; every warp past unit v - 1 */
            issue(v + WS - 1);
            const unsigned s = v % WS;
            uint4 xb[NT][2];
            load_b<NT>(xring + s * XB, xb);
            if (RES) {
                unit_mma<NT>(wring + s * UB, xb, cur);
                if (v % q4 == q4 - 1) /* residue done: acc += its chain, as the reduction */
                    acc_fold<NT>(acc, cur);
            } else {
                unit_mma<NT>(wring + s * UB, xb, acc);
            }
        }
        cp_async_wait<0>();
        __syncthreads(); /* the next task's prologue rewrites both rings */
        if (out && t < n_out)
            sm_out<NT>(acc, ((size_t)t * NWARPS + warp) * 32, out);
#pragma unroll
        for (int m = 0; m < MR; m++)
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    sum += acc[m][n][c];
    }
    if (sum == 1234.5f) /* never: keeps the sums live */
        *sink = sum;
}

/* The reference: one warp per (task, tile), one unit at a time through its
 * own shared memory, the same chain (unit_mma over K units 0, 1, ...). */
template <int NT, bool RES>
__global__ void splitm_ref(const uint8_t *__restrict__ w, unsigned rt, unsigned units,
                           size_t exp_bytes, const uint16_t *__restrict__ x, unsigned ld,
                           float *out)
{
    __shared__ __align__(128) uint8_t st[MOE_GPU_UNIT_BYTES + NT * 8 * X_ROW_BYTES];
    constexpr unsigned N = NT * 8;
    const unsigned t = blockIdx.x / NWARPS, wt_ = blockIdx.x % NWARPS, lane = threadIdx.x;
    const unsigned TPE = rt / NWARPS, e = t / TPE, tile = (t - e * TPE) * NWARPS + wt_;
    const uint8_t *wt = w + e * exp_bytes + (size_t)tile * units * MOE_GPU_UNIT_BYTES;
    float acc[MR][NT][4];
    zero_acc<NT>(acc);
    /* RES: split-K's sums, warp r's chain over units r, r + 4, ... added in
     * the order r = 0, 1, 2, 3 (task_splitk's reduction) */
    for (unsigned r = 0; r < (RES ? NWARPS : 1u); r++) {
        float cur[MR][NT][4];
        zero_acc<NT>(cur);
        for (unsigned u = r; u < units; u += RES ? NWARPS : 1u) {
            for (unsigned c = lane; c < UC; c += 32)
                cp_async16(st + c * 16, wt + (size_t)u * MOE_GPU_UNIT_BYTES + c * 16);
            for (unsigned c = lane; c < N * 8; c += 32)
                cp_async16(st + MOE_GPU_UNIT_BYTES + (c >> 3) * X_ROW_BYTES + (c & 7) * 16,
                           x + (size_t)(c >> 3) * ld + u * MOE_GPU_UNIT_K + (c & 7) * 8);
            cp_async_commit();
            cp_async_wait<0>();
            __syncwarp();
            uint4 xb[NT][2];
            load_b<NT>(st + MOE_GPU_UNIT_BYTES, xb);
            unit_mma<NT>(st, xb, cur);
            __syncwarp();
        }
        acc_fold<NT>(acc, cur);
    }
    sm_out<NT>(acc, ((size_t)t * NWARPS + wt_) * 32, out);
}

template <int NT, bool RES>
static int run(bool chk, const uint8_t *w, unsigned n_exp, unsigned rt, unsigned units, size_t eb,
               const uint16_t *x, unsigned ld, float *sink, int reps, double bytes,
               const char *name, char *err, size_t errlen)
{
    int rc = 0;
    constexpr unsigned N = NT * 8;
    const int smem = SM_WS * (N * X_ROW_BYTES + NWARPS * MOE_GPU_UNIT_BYTES);
    float *out = nullptr, *ref = nullptr, *ho = nullptr, *hr = nullptr;
    cudaEvent_t a = nullptr, b = nullptr;
    int per = 0, sms = 0;
    const unsigned n_out = 64; /* tasks checked */
    const size_t no = (size_t)n_out * NWARPS * 32 * N;
    MOED_CUDA_TRY(cudaFuncSetAttribute(splitm_probe<NT, RES>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    MOED_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, splitm_probe<NT, RES>, THREADS, smem));
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    if (chk) {
        MOED_CUDA_TRY(cudaMalloc(&out, no * 4));
        MOED_CUDA_TRY(cudaMalloc(&ref, no * 4));
        MOED_CUDA_TRY(cudaMemset(out, 0xff, no * 4)); /* NaN: an unwritten output fails */
        splitm_probe<NT, RES><<<per * sms, THREADS, smem>>>(w, n_exp, rt, units, eb, x, ld, sink, out, n_out);
        splitm_ref<NT, RES><<<n_out * NWARPS, 32>>>(w, rt, units, eb, x, ld, ref);
        MOED_CUDA_TRY(cudaDeviceSynchronize());
        ho = (float *)malloc(no * 4);
        hr = (float *)malloc(no * 4);
        if (!ho || !hr) {
            rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
            goto cleanup;
        }
        MOED_CUDA_TRY(cudaMemcpy(ho, out, no * 4, cudaMemcpyDeviceToHost));
        MOED_CUDA_TRY(cudaMemcpy(hr, ref, no * 4, cudaMemcpyDeviceToHost));
        size_t differ = 0;
        float mref = 0.f;
        for (size_t i = 0; i < no; i++) {
            if (memcmp(&ho[i], &hr[i], 4) != 0)
                differ++;
            mref = fmaxf(mref, fabsf(hr[i]));
        }
        printf("splitm_probe check %s N=%u%s: %u tasks, %zu outputs, %zu differ, max |ref| %.3g: %s\n",
               name, N, RES ? " split-K order" : "", n_out, no, differ, mref, differ ? "FAIL" : "PASS");
        if (differ)
            rc = moed_seterr(err, errlen, MOED_E_BACKEND, "%zu outputs differ", differ);
        goto cleanup;
    }
    splitm_probe<NT, RES><<<per * sms, THREADS, smem>>>(w, n_exp, rt, units, eb, x, ld, sink, nullptr, 0);
    MOED_CUDA_TRY(cudaDeviceSynchronize());
    MOED_CUDA_TRY(cudaEventCreate(&a));
    MOED_CUDA_TRY(cudaEventCreate(&b));
    MOED_CUDA_TRY(cudaEventRecord(a));
    for (int i = 0; i < reps; i++)
        splitm_probe<NT, RES><<<per * sms, THREADS, smem>>>(w, n_exp, rt, units, eb, x, ld, sink, nullptr, 0);
    MOED_CUDA_TRY(cudaEventRecord(b));
    MOED_CUDA_TRY(cudaEventSynchronize(b));
    {
        float ms;
        MOED_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
        printf("splitm_probe %s N=%u%s grid=%d (%d/SM): %.1f us per pass, %.3f TB/s\n", name, N,
               RES ? " split-K order" : "", per * sms, per, ms * 1e3 / reps, bytes * reps / (ms * 1e-3) / 1e12);
    }
cleanup:
    if (a)
        cudaEventDestroy(a);
    if (b)
        cudaEventDestroy(b);
    cudaFree(out);
    cudaFree(ref);
    free(ho);
    free(hr);
    return rc;
}

int main(int argc, char **argv)
{
    int rc = 0;
    char err[MOED_ERRLEN] = "";
    const size_t errlen = sizeof err;
    uint8_t *w = nullptr;
    uint16_t *x = nullptr, *hx = nullptr;
    float *sink = nullptr;
    const bool chk = argc > 1 && strcmp(argv[1], "check") == 0;
    const char *ph = argc > 1 + chk ? argv[1 + chk] : "gu";
    const char *na = argc > 2 + chk ? argv[2 + chk] : "32";
    const bool res = na[0] == 'r'; /* rN: split-K's order of sums */
    const int n = atoi(na + res);
    const int reps = chk ? 1 : argc > 3 ? atoi(argv[3]) : 20;
    const char *shape = argc > 4 ? argv[4] : nullptr; /* PHASE N REPS SHAPE, check PHASE N SHAPE */
    const bool gu = strcmp(ph, "gu") == 0, qwen = shape && strcmp(shape, "qwen3-30b-a3b") == 0;
    if ((!gu && strcmp(ph, "dn") != 0) || (n != 8 && n != 16 && n != 32) || reps < 1 ||
        (shape && !qwen && strcmp(shape, "deepseek-v3") != 0)) {
        fprintf(stderr, "usage: splitm_probe [gu|dn] [[r]8|[r]16|[r]32] [reps >= 1] [deepseek-v3|qwen3-30b-a3b]\n"
                        "       splitm_probe check [gu|dn] [[r]8|[r]16|[r]32] [deepseek-v3|qwen3-30b-a3b]\n");
        return 2;
    }
    struct moe_gpu_dims d = {7168, 2048, 256, 1, 8, 512};
    if (qwen)
        d = {2048, 768, 128, 0, 8, 512};
    const unsigned n_exp = 240; /* as tile_probe: several times the L2 */
    const size_t gub = moe_gpu_gu_bytes(d.hidden, d.inter), eb = gub + moe_gpu_dn_bytes(d.hidden, d.inter);
    /* gate_up: 2 I / 16 / MR tiles of H / 64 units; down: H / 16 / MR tiles of I / 64 */
    const unsigned rt = gu ? 2 * d.inter / 16 / MR : d.hidden / 16 / MR;
    const unsigned units = (gu ? d.hidden : d.inter) / MOE_GPU_UNIT_K, ld = gu ? d.hidden : d.inter;
    char name[64];
    snprintf(name, sizeof name, "%s %s", qwen ? "qwen3-30b-a3b" : "deepseek-v3", gu ? "gate_up" : "down");
    { /* (a block: the gotos to cleanup leave it) */
        MOED_CUDA_TRY(cudaMalloc(&w, eb * n_exp));
        MOED_TRY(moe_gpu_fill_random(w, eb * n_exp, 7, err, errlen));
        /* 32 rows of bf16 values in [-1, 1] in steps of 1/64 (exact) */
        const size_t nx = 32 * (size_t)ld;
        hx = (uint16_t *)malloc(nx * 2);
        if (!hx) {
            rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
            goto cleanup;
        }
        probe_exact_rows(hx, nx);
        MOED_CUDA_TRY(cudaMalloc(&x, nx * 2));
        MOED_CUDA_TRY(cudaMemcpy(x, hx, nx * 2, cudaMemcpyHostToDevice));
        MOED_CUDA_TRY(cudaMalloc(&sink, sizeof(float)));
        const uint8_t *wp = gu ? w : w + gub; /* an expert's down weights follow its gate_up */
        const double bytes = (double)n_exp * (gu ? gub : eb - gub);
#define SM_RUN(NT, R) run<NT, R>(chk, wp, n_exp, rt, units, eb, x, ld, sink, reps, bytes, name, err, errlen)
        rc = res ? (n == 8 ? SM_RUN(1, true) : n == 16 ? SM_RUN(2, true) : SM_RUN(4, true))
                 : (n == 8 ? SM_RUN(1, false) : n == 16 ? SM_RUN(2, false) : SM_RUN(4, false));
#undef SM_RUN
    }
cleanup:
    if (rc)
        fprintf(stderr, "splitm_probe: %s\n", err);
    free(hx);
    cudaFree(w);
    cudaFree(x);
    cudaFree(sink);
    return rc ? 1 : 0;
}
