/* wgmma_probe.cu - does a gate_up task stream its weights as fast with the
 * dequant done once for N tokens by wgmma (sm_90a) as moed's task does for 8
 * tokens with mma.sync? (issue 12, T = 256: bench/NOTES.md 2026-12-04, "a
 * structural option"). A timing probe: its sums are not moed's (the
 * activation rows are not permuted to the weights' K order, and the output
 * is summed into a sink), so only the time is meaningful.
 *
 * Each CTA (moed's 4 warps = one warpgroup, 4 CTAs per SM) takes 4-tile
 * gate_up tasks (128 rows) of E experts from HBM, every task with N
 * activation rows. A K unit of the 4 tiles and of the N rows is copied by the
 * whole CTA (cp.async) into one of 4 stages; then each warp dequantizes its
 * 16 rows of each 64-row half (moed's unit_mma code) into the A registers of
 * 8 wgmma.mma_async m64nNk16 (2 halves x 4 K steps), B the N rows from shared
 * memory (no swizzle: 8 x 16-byte core matrices, K-adjacent 128 bytes apart,
 * N-adjacent 256), and waits for them before the stage is refilled. The
 * same task through moed's own code: tile_probe gu 8 REPS 4 [SHAPE].
 *
 * Build (repository root):
 *   nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Icommon -Ikernels \
 *     -DMOED_HAVE_CUDA=1 -o build-var/wgmma_probe bench/probe/wgmma_probe.cu \
 *     kernels/moe_gpu_pack.c common/moed_err.c common/moed_log.c common/moed_check_cuda.c
 * Run:   wgmma_probe [N: 8|16|32] [reps] [deepseek-v3|qwen3-30b-a3b]
 */
#include "../../kernels/moe_gpu.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ != 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define WG_NONE 1 /* wgmma is sm_90a's: other targets compile an empty probe */
#endif

__device__ __forceinline__ uint64_t wg_desc(const void *s)
{
    const uint64_t a = ((uint32_t)__cvta_generic_to_shared(s) & 0x3ffffu) >> 4;
    /* LBO (K-adjacent core matrices) 128 bytes, SBO (N-adjacent) 256, no swizzle */
    return a | (uint64_t)(128 >> 4) << 16 | (uint64_t)(256 >> 4) << 32;
}

template <int N> struct wg_mma;
#define WG_ASM(n, dlist, alist, desc)                                                            \
    "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n" #n               \
    "k16.f32.bf16.bf16 {" dlist "}, {" alist "}, " desc ", p, 1, 1, 0;\n}\n"
template <> struct wg_mma<8> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint64_t b)
    {
#ifndef WG_NONE
        asm volatile(WG_ASM(8, "%0,%1,%2,%3", "%4,%5,%6,%7", "%8")
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#endif
    }
};
template <> struct wg_mma<16> {
    static __device__ __forceinline__ void run(float (&d)[8], const uint32_t (&a)[4], uint64_t b)
    {
#ifndef WG_NONE
        asm volatile(WG_ASM(16, "%0,%1,%2,%3,%4,%5,%6,%7", "%8,%9,%10,%11", "%12")
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                       "+f"(d[6]), "+f"(d[7])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#endif
    }
};
template <> struct wg_mma<32> {
    static __device__ __forceinline__ void run(float (&d)[16], const uint32_t (&a)[4], uint64_t b)
    {
#ifndef WG_NONE
        asm volatile(WG_ASM(32, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15",
                            "%16,%17,%18,%19", "%20")
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                       "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#endif
    }
};
#undef WG_ASM

__device__ __forceinline__ void wg_fence()
{
#ifndef WG_NONE
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit_wait0()
{
#ifndef WG_NONE
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}

template <int N>
__global__ void __launch_bounds__(THREADS, MINB)
    wgmma_probe(const uint8_t *__restrict__ w, unsigned n_exp, unsigned rt, unsigned units,
                size_t exp_bytes, const uint16_t *__restrict__ xs, unsigned ld, float *sink)
{
    extern __shared__ __align__(128) uint8_t smem[];
    constexpr unsigned UB = MOE_GPU_UNIT_BYTES, WB = 4 * UB, XB = N * 128, SB = WB + XB;
    constexpr unsigned WS = 4; /* stages */
    static_assert(WS * SB <= NWARPS * WARP_SMEM, "the stages fit moed's stage buffers");
    static_assert(NWARPS == 4, "a CTA is one warpgroup");
    const unsigned tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned TPE = rt / 4;
    float sum = 0.f;
    for (unsigned t = blockIdx.x; t < n_exp * TPE; t += gridDim.x) {
        const unsigned e = t / TPE, rt0 = (t - e * TPE) * 4;
        const uint8_t *wt = w + e * exp_bytes + (size_t)rt0 * units * UB;
        float acc[2][N / 2];
#pragma unroll
        for (int b = 0; b < 2; b++)
#pragma unroll
            for (int i = 0; i < N / 2; i++)
                acc[b][i] = 0.f;
        auto issue = [&](unsigned v) {
            if (v < units) {
                uint8_t *st = smem + (v % WS) * SB;
                for (unsigned c = tid; c < 4 * (UB / 16); c += THREADS) {
                    const unsigned j = c / (UB / 16), k = c - j * (UB / 16);
                    cp_async16(st + j * UB + k * 16, wt + ((size_t)j * units + v) * UB + k * 16);
                }
                for (unsigned c = tid; c < 8 * N; c += THREADS) {
                    const unsigned n = c >> 3, q = c & 7; /* 16-byte part q: K step q / 2 */
                    cp_async16(st + WB + (q >> 1) * (N * 32) + ((n >> 3) * 2 + (q & 1)) * 128 +
                                   (n & 7) * 16,
                               xs + (size_t)n * ld + v * MOE_GPU_UNIT_K + q * 8);
                }
            }
            cp_async_commit();
        };
#pragma unroll
        for (unsigned s = 0; s + 1 < WS; s++)
            issue(s);
        for (unsigned v = 0; v < units; v++) {
            cp_async_wait<WS - 2>();
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* for wgmma's reads */
            __syncthreads(); /* stage v in; every warp's wgmma of step v - 1 done */
            issue(v + WS - 1);
            const uint8_t *st = smem + (v % WS) * SB;
            uint32_t a[2][4][4];
#pragma unroll
            for (int b = 0; b < 2; b++) { /* rows 64 b + 16 warp: tile 2 b + warp / 2 */
                const uint8_t *sub = st + (2 * b + (warp >> 1)) * UB + (warp & 1) * MOE_GPU_SUB_BYTES;
                const uint4 wq = *reinterpret_cast<const uint4 *>(sub + lane * 16);
                const uint32_t s2 = *reinterpret_cast<const uint16_t *>(sub + 512 + lane * 2);
                uint32_t sg, sg8;
                scales_to_bf16(s2, sg, sg8);
                const uint32_t words[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
                for (int s = 0; s < 4; s++) {
                    a[b][s][0] = bf16x2_mul(e2m1x2_bits<0>(words[s]), sg);
                    a[b][s][1] = bf16x2_mul(e2m1x2_bits<1>(words[s]), sg8);
                    a[b][s][2] = bf16x2_mul(e2m1x2_bits<2>(words[s]), sg);
                    a[b][s][3] = bf16x2_mul(e2m1x2_bits<3>(words[s]), sg8);
                }
            }
            wg_fence();
#pragma unroll
            for (int b = 0; b < 2; b++)
#pragma unroll
                for (int s = 0; s < 4; s++)
                    wg_mma<N>::run(acc[b], a[b][s], wg_desc(st + WB + s * (N * 32)));
            wg_commit_wait0();
        }
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int b = 0; b < 2; b++)
#pragma unroll
            for (int i = 0; i < N / 2; i++)
                sum += acc[b][i];
    }
    if (sum == 1234.5f) /* never: keeps the sums live */
        *sink = sum;
}

template <int N>
static int run(const uint8_t *w, unsigned n_exp, const struct moe_gpu_dims &d, const uint16_t *xs,
               float *sink, int reps, bool qwen, char *err, size_t errlen)
{
    int rc = 0, per = 0, sms = 0;
    float ms = 0;
    cudaEvent_t a = nullptr, b = nullptr;
    const int smem = NWARPS * WARP_SMEM;
    const unsigned rt = d.inter / 16 / MR * 2, units = d.hidden / MOE_GPU_UNIT_K;
    const size_t eb = (size_t)moe_gpu_gu_bytes(d.hidden, d.inter) + moe_gpu_dn_bytes(d.hidden, d.inter);
    MOED_CUDA_TRY(cudaFuncSetAttribute(wgmma_probe<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    MOED_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, wgmma_probe<N>, THREADS, smem));
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    wgmma_probe<N><<<per * sms, THREADS, smem>>>(w, n_exp, rt, units, eb, xs, d.hidden, sink);
    MOED_CUDA_TRY(cudaDeviceSynchronize());
    MOED_CUDA_TRY(cudaEventCreate(&a));
    MOED_CUDA_TRY(cudaEventCreate(&b));
    MOED_CUDA_TRY(cudaEventRecord(a));
    for (int i = 0; i < reps; i++)
        wgmma_probe<N><<<per * sms, THREADS, smem>>>(w, n_exp, rt, units, eb, xs, d.hidden, sink);
    MOED_CUDA_TRY(cudaEventRecord(b));
    MOED_CUDA_TRY(cudaEventSynchronize(b));
    MOED_CUDA_TRY(cudaGetLastError());
    MOED_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
    printf("wgmma_probe %s gate_up N=%d ntile=4 grid=%d (%d/SM): %.1f us per pass, %.3f TB/s\n",
           qwen ? "qwen3-30b-a3b" : "deepseek-v3", N, per * sms, per, ms * 1e3 / reps,
           (double)n_exp * moe_gpu_gu_bytes(d.hidden, d.inter) * reps / (ms * 1e-3) / 1e12);
cleanup:
    if (a)
        cudaEventDestroy(a);
    if (b)
        cudaEventDestroy(b);
    return rc;
}

int main(int argc, char **argv)
{
    int rc = 0;
    char err[MOED_ERRLEN] = "";
    const size_t errlen = sizeof err;
    uint8_t *w = nullptr;
    uint16_t *xs = nullptr;
    float *sink = nullptr;
    const int n = argc > 1 ? atoi(argv[1]) : 32;
    const int reps = argc > 2 ? atoi(argv[2]) : 20;
    const bool qwen = argc > 3 && strcmp(argv[3], "qwen3-30b-a3b") == 0;
    if ((n != 8 && n != 16 && n != 32) || reps < 1 ||
        (argc > 3 && !qwen && strcmp(argv[3], "deepseek-v3") != 0)) {
        fprintf(stderr, "usage: wgmma_probe [8|16|32] [reps >= 1] [deepseek-v3|qwen3-30b-a3b]\n");
        return 2;
    }
    struct moe_gpu_dims d = {7168, 2048, 256, 1, 8, 512};
    if (qwen)
        d = {2048, 768, 128, 0, 8, 512};
    const unsigned n_exp = 240; /* as tile_probe: several times the L2 */
    const size_t eb = (size_t)moe_gpu_gu_bytes(d.hidden, d.inter) + moe_gpu_dn_bytes(d.hidden, d.inter);
    { /* (a block: the gotos to cleanup leave it) */
        MOED_CUDA_TRY(cudaMalloc(&w, eb * n_exp));
        MOED_TRY(moe_gpu_fill_random(w, eb * n_exp, 7, err, errlen));
        MOED_CUDA_TRY(cudaMalloc(&xs, 32 * (size_t)d.hidden * 2));
        MOED_CUDA_TRY(cudaMemset(xs, 0x3c, 32 * (size_t)d.hidden * 2));
        MOED_CUDA_TRY(cudaMalloc(&sink, sizeof(float)));
        if (n == 8)
            rc = run<8>(w, n_exp, d, xs, sink, reps, qwen, err, errlen);
        else if (n == 16)
            rc = run<16>(w, n_exp, d, xs, sink, reps, qwen, err, errlen);
        else
            rc = run<32>(w, n_exp, d, xs, sink, reps, qwen, err, errlen);
    }
cleanup:
    if (rc)
        fprintf(stderr, "wgmma_probe: %s\n", err);
    cudaFree(w);
    cudaFree(xs);
    cudaFree(sink);
    return rc ? 1 : 0;
}
