/* tile_probe.cu - moed's gate_up / down task code as a plain (non-persistent)
 * kernel, so that Nsight Compute can profile the hot loop (the persistent
 * kernel waits on host memory and cannot be replayed). For bench/NOTES.md.
 *
 * Includes kernels/moe_gpu.cu as is: the task functions are the ones moed runs.
 * Each CTA takes tasks blockIdx.x, blockIdx.x + grid, ... of one phase
 * (gate_up or down tiles of E experts, every expert with the same cnt tokens),
 * no routing, no queue, no dependencies.
 *
 * The kernel's timing variants that leave one stage out (no dequant, no MMA,
 * no activation loads: wrong results, for timing only) were switches in the
 * kernel until issue 16; their figures are in bench/NOTES.md ("variants"),
 * and they are re-made here, where they belong, by editing a copy of
 * unit_mma / x_rows (kernels/moe_gpu/dequant.cuh, pipeline.cuh).
 *
 * Build (repository root; -DMOE_GPU_PHASES=1 as for the kernel):
 *   nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Icommon -Ikernels \
 *     -DMOED_HAVE_CUDA=1 -o build-var/tile_probe bench/probe/tile_probe.cu \
 *     kernels/moe_gpu_pack.c common/moed_err.c common/moed_log.c common/moed_check_cuda.c
 * Run:   tile_probe [gu|dn] [cnt] [reps] [ntile] [deepseek-v3|qwen3-30b-a3b]
 *        (cnt 1-8: a narrow chunk; 9-32 with ntile 4: a crowded one, a split-M task;
 *        the task the persistent kernel's run_task picks)
 *        (the shape: DeepSeek-V3's by default; Qwen3's down tiles have 12 K units)
 *        ncu --clock-control none --launch-skip 1 --launch-count 1 \
 *            --section ComputeWorkloadAnalysis tile_probe gu 1 1 1
 */
#include "../../kernels/moe_gpu.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>

__device__ unsigned probe_claims;

__global__ void __launch_bounds__(THREADS, MINB)
    tile_probe(const struct moe_gpu_params p, const struct moe_gpu_layer L, route r, int is_gu,
               unsigned n_exp, unsigned cnt, unsigned ntile)
{
    extern __shared__ __align__(128) uint8_t smem[]; /* as the persistent kernel declares it */
    const unsigned warp = threadIdx.x >> 5;
    uint8_t *sw_cta = smem;
    uint8_t *sw = smem + warp * WARP_SMEM;
    const unsigned RT = is_gu ? p.d.inter / 16 / MR * 2 : p.d.hidden / 16 / MR;
    const unsigned TPE = (RT + ntile - 1) / ntile, n_tasks = n_exp * TPE;
    for (unsigned t = blockIdx.x; t < n_tasks; t += gridDim.x) {
        const unsigned e = t / TPE, rt0 = (t - e * TPE) * ntile, nt = min(ntile, RT - rt0);
        unsigned next; /* the task's claim, as in the persistent kernel (unused here) */
        run_task(p, L, r, is_gu, ntile, e, 0, cnt, rt0, nt, sw, sw_cta, &probe_claims, next);
        __syncthreads();
    }
}

int main(int argc, char **argv)
{
    int rc = 0;
    char err[MOED_ERRLEN] = "";
    const size_t errlen = sizeof err;
    uint8_t *w = nullptr;
    float *s2 = nullptr, *dout = nullptr;
    uint16_t *xs = nullptr, *hbuf = nullptr, *tok = nullptr;
    cudaEvent_t a = nullptr, b = nullptr;
    const int is_gu = argc > 1 ? strcmp(argv[1], "dn") != 0 : 1;
    const unsigned cnt = argc > 2 ? (unsigned)atoi(argv[2]) : 1;
    const int reps = argc > 3 ? atoi(argv[3]) : 5;
    const unsigned ntile = argc > 4 ? (unsigned)atoi(argv[4]) : 1;
    const bool qwen = argc > 5 && strcmp(argv[5], "qwen3-30b-a3b") == 0;
    if (cnt < 1 || cnt > SPLITM_TOKENS || (cnt > CHUNK_TOKENS && ntile != NTILE_MAX)) {
        fprintf(stderr, "tile_probe: cnt %u: 1 to %d tokens, more than %d (a crowded chunk) "
                        "only with ntile %d\n", cnt, SPLITM_TOKENS, CHUNK_TOKENS, NTILE_MAX);
        return 2;
    }
    if (argc > 5 && !qwen && strcmp(argv[5], "deepseek-v3") != 0) {
        fprintf(stderr, "tile_probe: shape %s: not deepseek-v3 or qwen3-30b-a3b\n", argv[5]);
        return 2;
    }
    struct moe_gpu_dims d = {7168, 2048, 256, 1, 8, 512};
    if (qwen)
        d = {2048, 768, 128, 0, 8, 512};
    const unsigned n_exp = 240; /* 5.9 GB (Qwen3: 0.64 GB): several times the L2 */
    const size_t eb = (size_t)moe_gpu_gu_bytes(d.hidden, d.inter) + moe_gpu_dn_bytes(d.hidden, d.inter);
    { /* (a block: the gotos to cleanup leave it) */
    MOED_CUDA_TRY(cudaMalloc(&w, eb * n_exp));
    MOED_TRY(moe_gpu_fill_random(w, eb * n_exp, 7, err, errlen));
    MOED_CUDA_TRY(cudaMalloc(&s2, 3 * 257 * sizeof(float)));
    {
        float h[3 * 257];
        for (int i = 0; i < 3 * 257; i++)
            h[i] = 1e-3f;
        MOED_CUDA_TRY(cudaMemcpy(s2, h, sizeof h, cudaMemcpyHostToDevice));
    }
    MOED_CUDA_TRY(cudaMalloc(&xs, SPLITM_TOKENS * d.hidden * 2));
    MOED_CUDA_TRY(cudaMemset(xs, 0x3c, SPLITM_TOKENS * d.hidden * 2));
    MOED_CUDA_TRY(cudaMalloc(&hbuf, SPLITM_TOKENS * d.inter * 2));
    MOED_CUDA_TRY(cudaMemset(hbuf, 0x3c, SPLITM_TOKENS * d.inter * 2));
    MOED_CUDA_TRY(cudaMalloc(&dout, SPLITM_TOKENS * (size_t)d.hidden * 4));
    MOED_CUDA_TRY(cudaMalloc(&tok, SPLITM_TOKENS * 2));
    {
        uint16_t h[SPLITM_TOKENS];
        for (int i = 0; i < SPLITM_TOKENS; i++)
            h[i] = (uint16_t)i;
        MOED_CUDA_TRY(cudaMemcpy(tok, h, sizeof h, cudaMemcpyHostToDevice));
    }
    struct moe_gpu_params p;
    memset(&p, 0, sizeof p);
    p.d = d;
    p.xs = xs;
    p.h = hbuf;
    p.dout = dout;
    struct moe_gpu_layer L = {w, w + moe_gpu_gu_bytes(d.hidden, d.inter), s2};
    route r;
    memset(&r, 0, sizeof r);
    r.tok = tok;
    const int smem = NWARPS * WARP_SMEM;
    MOED_CUDA_TRY(cudaFuncSetAttribute(tile_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int per = 0, sms = 0;
    MOED_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, tile_probe, THREADS, smem));
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int grid = per * sms;
    tile_probe<<<grid, THREADS, smem>>>(p, L, r, is_gu, n_exp, cnt, ntile);
    MOED_CUDA_TRY(cudaDeviceSynchronize());
    MOED_CUDA_TRY(cudaEventCreate(&a));
    MOED_CUDA_TRY(cudaEventCreate(&b));
    MOED_CUDA_TRY(cudaEventRecord(a));
    for (int i = 0; i < reps; i++)
        tile_probe<<<grid, THREADS, smem>>>(p, L, r, is_gu, n_exp, cnt, ntile);
    MOED_CUDA_TRY(cudaEventRecord(b));
    MOED_CUDA_TRY(cudaEventSynchronize(b));
    float ms;
    MOED_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
    const double bytes = (double)n_exp * (is_gu ? moe_gpu_gu_bytes(d.hidden, d.inter) : moe_gpu_dn_bytes(d.hidden, d.inter));
    printf("tile_probe %s %s cnt=%u ntile=%u grid=%d (%d/SM): %.1f us per pass, %.3f TB/s\n",
           qwen ? "qwen3-30b-a3b" : "deepseek-v3", is_gu ? "gate_up" : "down", cnt, ntile, grid,
           per, ms * 1e3 / reps,
           bytes * reps / (ms * 1e-3) / 1e12);
    }
cleanup:
    if (rc)
        fprintf(stderr, "tile_probe: %s\n", err);
    if (a)
        cudaEventDestroy(a);
    if (b)
        cudaEventDestroy(b);
    cudaFree(w);
    cudaFree(s2);
    cudaFree(xs);
    cudaFree(hbuf);
    cudaFree(dout);
    cudaFree(tok);
    return rc ? 1 : 0;
}
