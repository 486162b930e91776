/* wgmma_probe.cu - does a gate_up task stream its weights as fast with the
 * dequant done once for N tokens by wgmma (sm_90a) as moed's task does for 8
 * tokens with mma.sync? (issue 12, T = 256: bench/NOTES.md 2026-12-04, "a
 * structural option"). Timed, its sums go to a sink; `check` runs one pass
 * that writes the first tasks' outputs and compares them with the same sums
 * by mma.sync m16n8k16 (one warp per 16 rows, one chain over K in the same
 * order): a test of the fragment layouts the option relies on (wgmma's A
 * registers and D as mma.sync's per warp). For that the activation rows are
 * stored permuted per 64-K unit (16-byte part 2 s + kk: the pairs of elements
 * 16 q + 4 s + 2 kk, q = 0..3), the order moed's weights give the mma
 * K steps, so that wgmma's B (each 16-byte core-matrix row 8 consecutive K)
 * sees them in the weights' order; moed's kernel would write x and h so.
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
 *        wgmma_probe check [N] [SHAPE]   (exit 0: the outputs agree)
 * N as pN (p32): the pipelined loop, one wgmma group per 64-row block, each
 * block decoded while the block before's MMAs run (the plain loop waits for
 * all 8 of a K unit before the next unit's dequant: 2.8 TB/s at N = 8 where
 * moed's mma.sync task streams 4.1, H200 2026-12-04); qN: the same with
 * tasks of 8 tiles (256 rows), the activation rows copied once per 256
 * weight rows. mN / nN: pN / qN with the stages' readiness and release by
 * mbarriers and the weights by cp.async.bulk (wgmma_mbar; written 2026-12-06
 * without a GPU: run `check m32` first).
 */
#include "../../kernels/moe_gpu.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "probe_rows.h"

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
__device__ __forceinline__ void wg_commit()
{
#ifndef WG_NONE
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
/* wait until at most P of this warpgroup's committed groups are pending */
template <int P> __device__ __forceinline__ void wg_wait()
{
#ifndef WG_NONE
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(P) : "memory");
#endif
}

/* A fragments of the 4 K steps of one 16-row sub-tile (unit_mma's dequant) */
__device__ __forceinline__ void sub_frags(const uint8_t *sub, uint32_t (&a)[4][4])
{
    const unsigned lane = threadIdx.x & 31;
    const uint4 wq = *reinterpret_cast<const uint4 *>(sub + lane * 16);
    const uint32_t s2 = *reinterpret_cast<const uint16_t *>(sub + 512 + lane * 2);
    uint32_t sg, sg8;
    scales_to_bf16(s2, sg, sg8);
    const uint32_t words[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
    for (int s = 0; s < 4; s++) {
        a[s][0] = bf16x2_mul(e2m1x2_bits<0>(words[s]), sg);
        a[s][1] = bf16x2_mul(e2m1x2_bits<1>(words[s]), sg8);
        a[s][2] = bf16x2_mul(e2m1x2_bits<2>(words[s]), sg);
        a[s][3] = bf16x2_mul(e2m1x2_bits<3>(words[s]), sg8);
    }
}

/* Helpers of both kernels (wgmma_probe, wgmma_mbar). */
template <int N, int MB> __device__ __forceinline__ void acc_zero(float (&acc)[MB][N / 2])
{
#pragma unroll
    for (int b = 0; b < MB; b++)
#pragma unroll
        for (int i = 0; i < N / 2; i++)
            acc[b][i] = 0.f;
}
/* K unit v's N activation rows into a stage's B part xst, this thread's
 * 16-byte pieces: part q of row n is K step q / 2's core matrix (n / 8, q & 1) */
template <int N>
__device__ __forceinline__ void copy_rows(uint8_t *xst, const uint16_t *xs, unsigned ld, unsigned v)
{
    for (unsigned c = threadIdx.x; c < 8 * N; c += THREADS) {
        const unsigned n = c >> 3, q = c & 7;
        cp_async16(xst + (q >> 1) * (N * 32) + ((n >> 3) * 2 + (q & 1)) * 128 + (n & 7) * 16,
                   xs + (size_t)n * ld + v * MOE_GPU_UNIT_K + q * 8);
    }
}
/* 64-row block b of a stage st (weights, then the rows at st + wb) as one
 * wgmma group: this warp's 16 rows dequantized into a, the 4 K steps issued */
template <int N>
__device__ __forceinline__ void block_mma(const uint8_t *st, unsigned wb, int b, float (&acc)[N / 2],
                                          uint32_t (&a)[4][4])
{
    const unsigned warp = threadIdx.x >> 5; /* rows 64 b + 16 warp: tile 2 b + warp / 2 */
    sub_frags(st + (2 * b + (warp >> 1)) * MOE_GPU_UNIT_BYTES + (warp & 1) * MOE_GPU_SUB_BYTES, a);
    wg_fence();
#pragma unroll
    for (int k = 0; k < 4; k++)
        wg_mma<N>::run(acc, a[k], wg_desc(st + wb + k * (N * 32)));
    wg_commit();
}
/* A task's D: task t < n_out to out (row 16 warp + g (+8), column 8 j + 2 q
 * (+1)), and every sum into sum (kept live) */
template <int N, int MB>
__device__ __forceinline__ void task_out(const float (&acc)[MB][N / 2], unsigned t, float *out,
                                         unsigned n_out, float &sum)
{
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (out && t < n_out) {
        const unsigned g = lane >> 2, q = lane & 3;
#pragma unroll
        for (int b = 0; b < MB; b++)
#pragma unroll
            for (int j = 0; j < N / 8; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const unsigned row = 64 * b + 16 * warp + g + (i >> 1) * 8;
                    out[((size_t)t * 64 * MB + row) * N + 8 * j + 2 * q + (i & 1)] = acc[b][4 * j + i];
                }
    }
#pragma unroll
    for (int b = 0; b < MB; b++)
#pragma unroll
        for (int i = 0; i < N / 2; i++)
            sum += acc[b][i];
}

/* 8-tile tasks: 3 CTAs per SM (168 registers): at moed's 4 (128), ptxas
 * serializes N = 32's wgmma for want of registers (C7512) */
template <int N, bool PIPE, int MB>
__global__ void __launch_bounds__(THREADS, MB == 4 ? 3 : MINB)
    wgmma_probe(const uint8_t *__restrict__ w, unsigned n_exp, unsigned rt, unsigned units,
                size_t exp_bytes, const uint16_t *__restrict__ xs, unsigned ld, float *sink,
                float *out, unsigned n_out)
{
    extern __shared__ __align__(128) uint8_t smem[];
    constexpr unsigned UB = MOE_GPU_UNIT_BYTES, WB = 2 * MB * UB, XB = N * 128, SB = WB + XB;
    constexpr unsigned WS = 4; /* stages */
    static_assert(MB == 2 ? WS * SB <= NWARPS * WARP_SMEM : PIPE, "the stages fit moed's stage buffers");
    static_assert(NWARPS == 4, "a CTA is one warpgroup");
    const unsigned tid = threadIdx.x, warp = tid >> 5;
    const unsigned TPE = rt / (2 * MB);
    float sum = 0.f;
    for (unsigned t = blockIdx.x; t < n_exp * TPE; t += gridDim.x) {
        const unsigned e = t / TPE, rt0 = (t - e * TPE) * 2 * MB;
        const uint8_t *wt = w + e * exp_bytes + (size_t)rt0 * units * UB;
        float acc[MB][N / 2];
        acc_zero<N, MB>(acc);
        auto issue = [&](unsigned v) {
            if (v < units) {
                uint8_t *st = smem + (v % WS) * SB;
                for (unsigned c = tid; c < 2 * MB * (UB / 16); c += THREADS) {
                    const unsigned j = c / (UB / 16), k = c - j * (UB / 16);
                    cp_async16(st + j * UB + k * 16, wt + ((size_t)j * units + v) * UB + k * 16);
                }
                copy_rows<N>(st + WB, xs, ld, v);
            }
            cp_async_commit();
        };
#pragma unroll
        for (unsigned s = 0; s + 1 < WS; s++)
            issue(s);
        /* two K units per trip: with one, a unit's A registers are the
         * previous trip's, and ptxas, free to move their decode above the
         * wait for that trip's group, serializes every wgmma (C7513) */
#pragma unroll 2
        for (unsigned v = 0; v < units; v++) {
            cp_async_wait<WS - 2>();
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* for wgmma's reads */
            __syncthreads(); /* stage v in (and, in order, every warp's wgmma of v - 1 done) */
            const uint8_t *st = smem + (v % WS) * SB;
            uint32_t a[2][4][4]; /* PIPE: a ring of two blocks' */
            if constexpr (!PIPE) {
                issue(v + WS - 1);
#pragma unroll
                for (int b = 0; b < 2; b++) /* rows 64 b + 16 warp: tile 2 b + warp / 2 */
                    sub_frags(st + (2 * b + (warp >> 1)) * UB + (warp & 1) * MOE_GPU_SUB_BYTES, a[b]);
                wg_fence();
#pragma unroll
                for (int b = 0; b < 2; b++)
#pragma unroll
                    for (int s = 0; s < 4; s++)
                        wg_mma<N>::run(acc[b], a[b][s], wg_desc(st + WB + s * (N * 32)));
                wg_commit();
                wg_wait<0>();
            } else {
            /* PIPE: one group per 64-row block, each block's dequant beside
             * the block before's MMAs: A registers in a ring of two, a slot
             * rewritten once the group two back (its last user) is done */
#pragma unroll
            for (int b = 0; b < MB; b++) {
                wg_wait<1>(); /* the group before the last: a[b & 1] is free */
                if (b == 1) /* block MB - 1 of v - 1 done: every warp is past stage v - 1 */
                    issue(v + WS - 1);
                block_mma<N>(st, WB, b, acc[b], a[b & 1]);
            }
            }
        }
        wg_wait<0>();
        cp_async_wait<0>();
        __syncthreads();
        task_out<N, MB>(acc, t, out, n_out, sum);
    }
    if (sum == 1234.5f) /* never: keeps the sums live */
        *sink = sum;
}

/* mbarrier stages (the m and n forms): shared-memory addresses for PTX */
__device__ __forceinline__ unsigned sa(const void *p)
{
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mb_init(uint64_t *b, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(count) : "memory");
}
/* one arrival that also expects `bytes` of bulk copies to complete on b */
__device__ __forceinline__ void mb_arrive_tx(uint64_t *b, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mb_arrive(uint64_t *b)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory");
}
/* an arrival on b once this thread's cp.async copies so far are done */
__device__ __forceinline__ void mb_arrive_cp(uint64_t *b)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(sa(b)) : "memory");
}
__device__ __forceinline__ void mb_wait(uint64_t *b, unsigned parity)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "MB_WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra MB_WAIT_%=;\n"
                 "}\n" ::"r"(sa(b)),
                 "r"(parity)
                 : "memory");
}
/* bytes (a multiple of 16) from global to shared memory by the copy engine of
 * the SM (one instruction), completing on b */
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, unsigned bytes, uint64_t *b)
{
#ifndef WG_NONE
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(b))
                 : "memory");
#endif
}

/* The m (4-tile) and n (8-tile) forms: the pipelined loop with the stages'
 * readiness and release by mbarriers instead of a CTA barrier per K unit
 * (the plain and p forms' __syncthreads and cp.async group counts; stop 34:
 * the p form streamed at 0.66-0.75 of moed's mma.sync task at N = 8).
 * Thread 0 copies a unit's weights with one cp.async.bulk per tile (1152
 * contiguous bytes each) that completes on the stage's full barrier with its
 * byte count; every thread copies its share of the activation rows'
 * 16-byte pieces (wgmma's B layout scatters a row over 8 core matrices, so
 * a row is not one bulk copy) and arrives on the same barrier once they are
 * in (cp.async.mbarrier.arrive.noinc). The warps wait on it, fence the async
 * proxy (wgmma reads B through it), dequantize and issue one wgmma group per
 * 64-row block; once a unit's groups are done each warp arrives on its
 * stage's empty barrier, which every thread waits on before refilling the
 * stage. A CTA's units are numbered across its tasks (it): stage it % WS,
 * barrier phase (it / WS) & 1. */
template <int N, int MB>
__global__ void __launch_bounds__(THREADS, MB == 4 ? 3 : MINB)
    wgmma_mbar(const uint8_t *__restrict__ w, unsigned n_exp, unsigned rt, unsigned units,
               size_t exp_bytes, const uint16_t *__restrict__ xs, unsigned ld, float *sink,
               float *out, unsigned n_out)
{
    extern __shared__ __align__(128) uint8_t smem[];
    constexpr unsigned UB = MOE_GPU_UNIT_BYTES, WB = 2 * MB * UB, XB = N * 128, SB = WB + XB;
    constexpr unsigned WS = 4; /* stages */
    static_assert(SB % 128 == 0 && MB >= 2, "stages 128-byte aligned; a unit's release at block 1");
    __shared__ __align__(8) uint64_t full[WS], empty[WS];
    const unsigned tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) {
        for (unsigned s = 0; s < WS; s++) {
            mb_init(&full[s], THREADS + 1); /* every thread's rows + thread 0's bytes */
            mb_init(&empty[s], NWARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const unsigned TPE = rt / (2 * MB);
    float sum = 0.f;
    unsigned it0 = 0;
    for (unsigned t = blockIdx.x; t < n_exp * TPE; t += gridDim.x) {
        const unsigned e = t / TPE, rt0 = (t - e * TPE) * 2 * MB;
        const uint8_t *wt = w + e * exp_bytes + (size_t)rt0 * units * UB;
        float acc[MB][N / 2];
        acc_zero<N, MB>(acc);
        auto issue = [&](unsigned v) { /* unit v of this task */
            if (v >= units)
                return;
            const unsigned it = it0 + v, s = it % WS;
            if (it >= WS) /* its last user released it */
                mb_wait(&empty[s], (it / WS - 1) & 1);
            uint8_t *st = smem + s * SB;
            if (tid == 0) {
                mb_arrive_tx(&full[s], WB);
#pragma unroll
                for (unsigned j = 0; j < 2 * MB; j++)
                    bulk_g2s(st + j * UB, wt + ((size_t)j * units + v) * UB, UB, &full[s]);
            }
            copy_rows<N>(st + WB, xs, ld, v);
            mb_arrive_cp(&full[s]);
        };
#pragma unroll
        for (unsigned v = 0; v + 1 < WS; v++)
            issue(v);
#pragma unroll 2
        for (unsigned v = 0; v < units; v++) {
            const unsigned it = it0 + v, s = it % WS;
            mb_wait(&full[s], (it / WS) & 1);
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* for wgmma's reads */
            const uint8_t *st = smem + s * SB;
            uint32_t a[2][4][4];
#pragma unroll
            for (int b = 0; b < MB; b++) {
                wg_wait<1>(); /* the group before the last: a[b & 1] is free */
                if (b == 1) { /* unit v - 1's groups are done: release its stage, refill it */
                    if (v > 0 && lane == 0)
                        mb_arrive(&empty[(it - 1) % WS]);
                    issue(v + WS - 1);
                }
                block_mma<N>(st, WB, b, acc[b], a[b & 1]);
            }
        }
        wg_wait<0>();
        if (lane == 0) /* the task's last unit */
            mb_arrive(&empty[(it0 + units - 1) % WS]);
        it0 += units;
        task_out<N, MB>(acc, t, out, n_out, sum);
    }
    if (sum == 1234.5f) /* never: keeps the sums live */
        *sink = sum;
}

/* The reference: one warp per (task, 16 rows), mma.sync over the rows as
 * stored (not permuted: the B fragments as moed's load_b reads them), K units
 * and steps in the same order as the probe, out[task][row][column]. */
template <int N, int MB>
__global__ void wg_ref(const uint8_t *__restrict__ w, unsigned rt, unsigned units, size_t exp_bytes,
                       const uint16_t *__restrict__ x, unsigned ld, float *out)
{
    const unsigned t = blockIdx.x / (4 * MB), r16 = blockIdx.x % (4 * MB), lane = threadIdx.x;
    const unsigned TPE = rt / (2 * MB), e = t / TPE, rt0 = (t - e * TPE) * 2 * MB;
    const unsigned g = lane >> 2, q = lane & 3;
    const uint8_t *wt = w + e * exp_bytes + (size_t)(rt0 + r16 / 2) * units * MOE_GPU_UNIT_BYTES +
                        (r16 & 1) * MOE_GPU_SUB_BYTES;
    float c[N / 8][4] = {};
    for (unsigned v = 0; v < units; v++) {
        uint32_t af[4][4];
        sub_frags(wt + (size_t)v * MOE_GPU_UNIT_BYTES, af);
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const uint32_t(&a)[4] = af[s];
#pragma unroll
            for (int j = 0; j < N / 8; j++) {
                const uint32_t *xp = reinterpret_cast<const uint32_t *>(
                    x + (size_t)(8 * j + g) * ld + v * MOE_GPU_UNIT_K + q * 16 + 4 * s);
                mma_bf16(c[j], a, xp[0], xp[1]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < N / 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            out[((size_t)t * 64 * MB + 16 * r16 + g + (i >> 1) * 8) * N + 8 * j + 2 * q + (i & 1)] = c[j][i];
}

/* dynamic shared memory: moed's stage buffers for 4-tile tasks, the 4 stages
 * themselves for 8-tile ones (which do not fit moed's) */
template <int N, int MB> static int stage_smem()
{
    return MB == 2 ? NWARPS * WARP_SMEM : 4 * (2 * MB * MOE_GPU_UNIT_BYTES + N * 128);
}

/* the form's kernel: plain / p / q (wgmma_probe), m / n (wgmma_mbar) */
template <int N, bool PIPE, int MB, bool MBAR> static constexpr auto probe_kernel()
{
    if constexpr (MBAR)
        return wgmma_mbar<N, MB>;
    else
        return wgmma_probe<N, PIPE, MB>;
}
static const char *form_name(bool pipe, bool mbar)
{
    return mbar ? " mbarrier" : pipe ? " pipelined" : "";
}

template <int N, bool PIPE, int MB, bool MBAR>
static int run(const uint8_t *w, unsigned n_exp, const struct moe_gpu_dims &d, const uint16_t *xs,
               float *sink, int reps, bool qwen, char *err, size_t errlen)
{
    constexpr auto kern = probe_kernel<N, PIPE, MB, MBAR>();
    int rc = 0, per = 0, sms = 0;
    float ms = 0;
    cudaEvent_t a = nullptr, b = nullptr;
    const int smem = stage_smem<N, MB>();
    const unsigned rt = d.inter / 16 / MR * 2, units = d.hidden / MOE_GPU_UNIT_K;
    const size_t eb = (size_t)moe_gpu_gu_bytes(d.hidden, d.inter) + moe_gpu_dn_bytes(d.hidden, d.inter);
    MOED_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    MOED_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kern, THREADS, smem));
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    kern<<<per * sms, THREADS, smem>>>(w, n_exp, rt, units, eb, xs, d.hidden, sink, nullptr, 0);
    MOED_CUDA_TRY(cudaDeviceSynchronize());
    MOED_CUDA_TRY(cudaEventCreate(&a));
    MOED_CUDA_TRY(cudaEventCreate(&b));
    MOED_CUDA_TRY(cudaEventRecord(a));
    for (int i = 0; i < reps; i++)
        kern<<<per * sms, THREADS, smem>>>(w, n_exp, rt, units, eb, xs, d.hidden, sink, nullptr, 0);
    MOED_CUDA_TRY(cudaEventRecord(b));
    MOED_CUDA_TRY(cudaEventSynchronize(b));
    MOED_CUDA_TRY(cudaGetLastError());
    MOED_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
    printf("wgmma_probe %s gate_up N=%d%s ntile=%d grid=%d (%d/SM): %.1f us per pass, %.3f TB/s\n",
           qwen ? "qwen3-30b-a3b" : "deepseek-v3", N, form_name(PIPE, MBAR), 2 * MB, per * sms, per, ms * 1e3 / reps,
           (double)n_exp * moe_gpu_gu_bytes(d.hidden, d.inter) * reps / (ms * 1e-3) / 1e12);
cleanup:
    if (a)
        cudaEventDestroy(a);
    if (b)
        cudaEventDestroy(b);
    return rc;
}

/* One pass writing the first n_out tasks, the reference on the rows as stored;
 * 0 when every output agrees (bit for bit, or within 1e-5 of the largest) */
template <int N, bool PIPE, int MB, bool MBAR>
static int check(const uint8_t *w, unsigned n_exp, const struct moe_gpu_dims &d,
                 const uint16_t *xs_perm, const uint16_t *xs, float *sink, bool qwen, char *err,
                 size_t errlen)
{
    constexpr auto kern = probe_kernel<N, PIPE, MB, MBAR>();
    int rc = 0, bad = 0;
    const unsigned n_out = 64, rt = d.inter / 16 / MR * 2, units = d.hidden / MOE_GPU_UNIT_K;
    const size_t eb = (size_t)moe_gpu_gu_bytes(d.hidden, d.inter) + moe_gpu_dn_bytes(d.hidden, d.inter);
    const size_t n_f = (size_t)n_out * 64 * MB * N;
    float *o = nullptr, *r = nullptr, *ho = nullptr, *hr = nullptr;
    const int smem = stage_smem<N, MB>();
    double worst = 0, big = 0;
    size_t diff = 0;
    MOED_CUDA_TRY(cudaMalloc(&o, n_f * sizeof(float)));
    MOED_CUDA_TRY(cudaMalloc(&r, n_f * sizeof(float)));
    MOED_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kern<<<n_out, THREADS, smem>>>(w, n_exp, rt, units, eb, xs_perm, d.hidden, sink, o, n_out);
    wg_ref<N, MB><<<n_out * 4 * MB, 32>>>(w, rt, units, eb, xs, d.hidden, r);
    MOED_CUDA_TRY(cudaDeviceSynchronize());
    MOED_CUDA_TRY(cudaGetLastError());
    ho = (float *)malloc(n_f * sizeof(float));
    hr = (float *)malloc(n_f * sizeof(float));
    if (!ho || !hr) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
        goto cleanup;
    }
    MOED_CUDA_TRY(cudaMemcpy(ho, o, n_f * sizeof(float), cudaMemcpyDeviceToHost));
    MOED_CUDA_TRY(cudaMemcpy(hr, r, n_f * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n_f; i++) {
        big = fmax(big, fabs((double)hr[i]));
        worst = fmax(worst, fabs((double)ho[i] - hr[i]));
        diff += ho[i] != hr[i];
    }
    bad = !(worst <= 1e-5 * big) || big == 0;
    printf("wgmma_probe check %s N=%d%s ntile=%d: %u tasks, %zu outputs, %zu differ, max |diff| %.3g of max "
           "|ref| %.3g: %s\n", qwen ? "qwen3-30b-a3b" : "deepseek-v3", N, form_name(PIPE, MBAR), 2 * MB, n_out, n_f, diff, worst,
           big, bad ? "FAIL" : "PASS");
    if (bad)
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "the wgmma outputs differ from mma.sync's");
cleanup:
    free(ho);
    free(hr);
    cudaFree(o);
    cudaFree(r);
    return rc;
}

template <bool PIPE, int MB, bool MBAR>
static int dispatch(bool chk, int n, const uint8_t *w, unsigned n_exp, const struct moe_gpu_dims &d,
                    const uint16_t *xs, const uint16_t *xr, float *sink, int reps, bool qwen,
                    char *err, size_t errlen)
{
    if (chk)
        return n == 8    ? check<8, PIPE, MB, MBAR>(w, n_exp, d, xs, xr, sink, qwen, err, errlen)
               : n == 16 ? check<16, PIPE, MB, MBAR>(w, n_exp, d, xs, xr, sink, qwen, err, errlen)
                         : check<32, PIPE, MB, MBAR>(w, n_exp, d, xs, xr, sink, qwen, err, errlen);
    return n == 8    ? run<8, PIPE, MB, MBAR>(w, n_exp, d, xs, sink, reps, qwen, err, errlen)
           : n == 16 ? run<16, PIPE, MB, MBAR>(w, n_exp, d, xs, sink, reps, qwen, err, errlen)
                     : run<32, PIPE, MB, MBAR>(w, n_exp, d, xs, sink, reps, qwen, err, errlen);
}

int main(int argc, char **argv)
{
    int rc = 0;
    char err[MOED_ERRLEN] = "";
    const size_t errlen = sizeof err;
    uint8_t *w = nullptr;
    uint16_t *xs = nullptr;
    float *sink = nullptr;
    const bool chk = argc > 1 && strcmp(argv[1], "check") == 0;
    /* N, pN: the pipelined loop (one wgmma group per 64-row block), qN: the
     * same with 8-tile tasks (256 rows: the activation rows copied once per
     * 256 weight rows instead of 128); mN / nN: pN / qN with mbarrier stages
     * (wgmma_mbar) */
    const char *na = argc > 1 + chk ? argv[1 + chk] : "32";
    const bool mbar = na[0] == 'm' || na[0] == 'n';
    const bool pipe = na[0] == 'p' || na[0] == 'q' || mbar, wide = na[0] == 'q' || na[0] == 'n';
    const int n = atoi(na + pipe);
    const int reps = chk ? 1 : argc > 2 ? atoi(argv[2]) : 20;
    const char *shape = argc > 3 ? argv[3] : nullptr; /* N reps SHAPE, or check N SHAPE */
    const bool qwen = shape && strcmp(shape, "qwen3-30b-a3b") == 0;
    if ((n != 8 && n != 16 && n != 32) || reps < 1 ||
        (shape && !qwen && strcmp(shape, "deepseek-v3") != 0)) {
        fprintf(stderr, "usage: wgmma_probe [[p|q|m|n]8|[p|q|m|n]16|[p|q|m|n]32] [reps >= 1] "
                        "[deepseek-v3|qwen3-30b-a3b]\n"
                        "       wgmma_probe check [[p|q|m|n]8|[p|q|m|n]16|[p|q|m|n]32] "
                        "[deepseek-v3|qwen3-30b-a3b]\n");
        return 2;
    }
    uint16_t *xr = nullptr, *hx = nullptr, *hp = nullptr;
    struct moe_gpu_dims d = {7168, 2048, 256, 1, 8, 512};
    if (qwen)
        d = {2048, 768, 128, 0, 8, 512};
    const unsigned n_exp = 240; /* as tile_probe: several times the L2 */
    const size_t eb = (size_t)moe_gpu_gu_bytes(d.hidden, d.inter) + moe_gpu_dn_bytes(d.hidden, d.inter);
    { /* (a block: the gotos to cleanup leave it) */
        MOED_CUDA_TRY(cudaMalloc(&w, eb * n_exp));
        MOED_TRY(moe_gpu_fill_random(w, eb * n_exp, 7, err, errlen));
        /* 32 rows of bf16 values in [-1, 1] in steps of 1/64 (exact), as
         * stored (xr, the reference's) and permuted per 64-K unit (xs) */
        const size_t nx = 32 * (size_t)d.hidden;
        hx = (uint16_t *)malloc(nx * 2);
        hp = (uint16_t *)malloc(nx * 2);
        if (!hx || !hp) {
            rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
            goto cleanup;
        }
        probe_exact_rows(hx, nx);
        for (size_t u0 = 0; u0 < nx; u0 += MOE_GPU_UNIT_K) /* part 2 s + kk, pair q */
            for (unsigned s = 0; s < 4; s++)
                for (unsigned kk = 0; kk < 2; kk++)
                    for (unsigned q = 0; q < 4; q++)
                        for (unsigned i = 0; i < 2; i++)
                            hp[u0 + (2 * s + kk) * 8 + 2 * q + i] = hx[u0 + 16 * q + 4 * s + 2 * kk + i];
        MOED_CUDA_TRY(cudaMalloc(&xs, nx * 2));
        MOED_CUDA_TRY(cudaMalloc(&xr, nx * 2));
        MOED_CUDA_TRY(cudaMemcpy(xs, hp, nx * 2, cudaMemcpyHostToDevice));
        MOED_CUDA_TRY(cudaMemcpy(xr, hx, nx * 2, cudaMemcpyHostToDevice));
        MOED_CUDA_TRY(cudaMalloc(&sink, sizeof(float)));
        rc = mbar && wide ? dispatch<true, 4, true>(chk, n, w, n_exp, d, xs, xr, sink, reps, qwen, err, errlen)
             : mbar       ? dispatch<true, 2, true>(chk, n, w, n_exp, d, xs, xr, sink, reps, qwen, err, errlen)
             : wide       ? dispatch<true, 4, false>(chk, n, w, n_exp, d, xs, xr, sink, reps, qwen, err, errlen)
             : pipe       ? dispatch<true, 2, false>(chk, n, w, n_exp, d, xs, xr, sink, reps, qwen, err, errlen)
                          : dispatch<false, 2, false>(chk, n, w, n_exp, d, xs, xr, sink, reps, qwen, err, errlen);
    }
cleanup:
    if (rc)
        fprintf(stderr, "wgmma_probe: %s\n", err);
    free(hx);
    free(hp);
    cudaFree(w);
    cudaFree(xs);
    cudaFree(xr);
    cudaFree(sink);
    return rc ? 1 : 0;
}
