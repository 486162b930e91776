/* stream_probe.cu - what access pattern can stream weights at the HBM roofline?
 *
 * A standalone probe (not part of moed) for bench/NOTES.md: reads a buffer
 * several times the L2 once per repetition with different patterns and
 * prints TB/s. No math, so the figure is the ceiling of the pattern alone.
 *
 *   grid      grid-stride 16-byte loads (the benchmark's streaming read)
 *   chunk-ld  CTAs claim contiguous chunks of C bytes (static round robin);
 *             the CTA's threads read a chunk with 16-byte loads, UNROLL
 *             independent loads in flight per thread
 *   cpasync   like moed's kernel: each warp streams 1152-byte units (units
 *             w, w+NW, ... of the chunk) through an S-stage cp.async ring;
 *             the ring drains at the end of every chunk; ws=M re-reads an
 *             M MB working set (L2), share=R has R CTAs read each chunk at
 *             about the same time (HBM once, L2 R times): the bytes
 *             delivered to shared memory per second
 *   bulk      each warp streams its share of the chunk with 1-D bulk copies
 *             (cp.async.bulk ... mbarrier::complete_tx) of B bytes into an
 *             S-stage ring; lane 0 issues, the warp waits on the mbarrier
 *
 * Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icommon \
 *          -o build-var/stream_probe bench/probe/stream_probe.cu \
 *          common/moed_err.c common/moed_log.c common/moed_check_cuda.c
 * Run:   ./stream_probe [GiB]   (prints one line per configuration)
 */
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cuda_runtime.h>

extern "C" {
#include "moed_check_cuda.h"
#include "moed_err.h"
}

__global__ void k_grid(const uint4 *__restrict__ b, size_t n, unsigned *sink)
{
    unsigned x = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(b + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x12345u)
        *sink = x;
}

template <int UNROLL>
__global__ void k_chunk_ld(const uint4 *__restrict__ b, size_t nchunks, size_t chunk16, unsigned *sink)
{
    unsigned x = 0;
    for (size_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const uint4 *p = b + c * chunk16;
        for (size_t i = threadIdx.x; i < chunk16; i += (size_t)blockDim.x * UNROLL) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                v[u] = i + u * blockDim.x < chunk16 ? __ldcs(p + i + u * blockDim.x) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    if (x == 0x12345u)
        *sink = x;
}

#define UNIT 1152
__device__ __forceinline__ void cpa16(void *s, const void *g)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(g) : "memory");
}

/* NW warps per CTA; STAGES-deep ring of 1152-byte units per warp. Chunk c
 * (c = blockIdx.x, + gridDim.x, ... < nchunks) reads physical chunk
 * (c / share) % nphys: nphys = nchunks and share = 1 read each chunk once;
 * a smaller nphys reads a working set over and over (L2 when it fits);
 * share = R makes R CTAs read each chunk at about the same time (HBM once,
 * L2 R times, as the chunks of one of moed's tile groups do) */
template <int STAGES>
__global__ void k_cpasync(const uint8_t *__restrict__ b, size_t nchunks, size_t chunk,
                          unsigned *sink, size_t nphys, unsigned share)
{
    extern __shared__ __align__(16) uint8_t sm[];
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    uint8_t *ring = sm + warp * STAGES * UNIT;
    unsigned x = 0;
    const unsigned units = (unsigned)(chunk / UNIT);
    for (size_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const uint8_t *p = b + ((c / share) % nphys) * chunk;
        const unsigned nu = units > warp ? (units - warp + nw - 1) / nw : 0;
        auto issue = [&](unsigned i) {
            if (i < nu) {
                const uint8_t *src = p + (size_t)(warp + i * nw) * UNIT;
                uint8_t *dst = ring + (i % STAGES) * UNIT;
                for (unsigned k = lane; k < UNIT / 16; k += 32)
                    cpa16(dst + k * 16, src + k * 16);
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        };
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++)
            issue(s);
        for (unsigned i = 0; i < nu; i++) {
            asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
            __syncwarp();
            issue(i + STAGES - 1);
            x ^= *reinterpret_cast<const unsigned *>(ring + (i % STAGES) * UNIT + lane * 16);
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncwarp();
    }
    if (x == 0x12345u)
        *sink = x;
}

/* 1-D bulk copies: per warp an S-stage ring of B-byte stages, one mbarrier each */
__global__ void k_bulk(const uint8_t *__restrict__ b, size_t nchunks, size_t chunk, unsigned B, unsigned S,
                       unsigned *sink)
{
    extern __shared__ __align__(16) uint8_t sm[];
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    uint64_t *bars = reinterpret_cast<uint64_t *>(sm) + warp * 16;
    uint8_t *ring = sm + 16 * 8 * nw + (size_t)warp * S * B;
    if (lane == 0)
        for (unsigned s = 0; s < S; s++) {
            unsigned a = (unsigned)__cvta_generic_to_shared(bars + s);
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a) : "memory");
        }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    unsigned x = 0, phase_bits = 0; /* parity per stage */
    const unsigned pieces = (unsigned)(chunk / B);
    for (size_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const uint8_t *p = b + c * chunk;
        const unsigned nu = pieces > warp ? (pieces - warp + nw - 1) / nw : 0;
        auto issue = [&](unsigned i) {
            if (i < nu && lane == 0) {
                unsigned s = i % S;
                unsigned bar = (unsigned)__cvta_generic_to_shared(bars + s);
                unsigned dst = (unsigned)__cvta_generic_to_shared(ring + (size_t)s * B);
                const uint8_t *src = p + (size_t)(warp + i * nw) * B;
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(B) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             ::"r"(dst), "l"(src), "r"(B), "r"(bar) : "memory");
            }
        };
        for (unsigned s = 0; s + 1 < S; s++)
            issue(s);
        for (unsigned i = 0; i < nu; i++) {
            issue(i + S - 1);
            unsigned s = i % S;
            unsigned bar = (unsigned)__cvta_generic_to_shared(bars + s);
            unsigned par = (phase_bits >> s) & 1u;
            unsigned done = 0;
            while (!done)
                asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                             : "=r"(done) : "r"(bar), "r"(par) : "memory");
            phase_bits ^= 1u << s;
            x ^= *reinterpret_cast<const unsigned *>(ring + (size_t)s * B + lane * 16);
            __syncwarp();
        }
    }
    if (x == 0x12345u)
        *sink = x;
}

/* One configuration: a warm-up launch, then reps timed with events; prints
 * the TB/s. 0 or MOED_E_BACKEND (err). */
template <class F>
static int timeit(const char *name, F launch, size_t bytes, cudaEvent_t a, cudaEvent_t b, char *err,
                  size_t errlen)
{
    int rc = 0;
    const int reps = 5;
    float ms = 0;
    launch();
    MOED_CUDA_TRY(cudaDeviceSynchronize());
    MOED_CUDA_TRY(cudaEventRecord(a));
    for (int r = 0; r < reps; r++)
        launch();
    MOED_CUDA_TRY(cudaEventRecord(b));
    MOED_CUDA_TRY(cudaEventSynchronize(b));
    MOED_CUDA_TRY(cudaGetLastError());
    MOED_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
    printf("%-48s %6.3f TB/s\n", name, (double)bytes * reps / (ms * 1e-3) / 1e12);
    fflush(stdout);
cleanup:
    return rc;
}

int main(int argc, char **argv)
{
    int rc = 0;
    char err[MOED_ERRLEN] = "";
    const size_t errlen = sizeof err;
    double gib = argc > 1 ? atof(argv[1]) : 8.0;
    size_t bytes = (size_t)(gib * (1ull << 30));
    bytes -= bytes % (1 << 20);
    uint8_t *buf = nullptr;
    unsigned *sink = nullptr;
    cudaEvent_t a = nullptr, b2 = nullptr;
    int sms = 0;
    char nm[128];
    MOED_CUDA_TRY(cudaMalloc(&buf, bytes));
    MOED_CUDA_TRY(cudaMalloc(&sink, 4));
    MOED_CUDA_TRY(cudaMemset(buf, 1, bytes));
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    MOED_CUDA_TRY(cudaEventCreate(&a));
    MOED_CUDA_TRY(cudaEventCreate(&b2));
#define TIMEIT_B(name, body, nb) MOED_TRY(timeit(name, [&] { body; }, nb, a, b2, err, errlen))
#define TIMEIT(name, body) TIMEIT_B(name, body, bytes)
    TIMEIT("grid 4x512/SM", (k_grid<<<sms * 4, 512>>>((const uint4 *)buf, bytes / 16, sink)));
    TIMEIT("grid 4x128/SM", (k_grid<<<sms * 4, 128>>>((const uint4 *)buf, bytes / 16, sink)));
    {
        const size_t chunks[] = {36864, 129024, 516096, 2064384};
        for (size_t C : chunks) {
            size_t n = bytes / C;
            for (int per : {4, 8}) {
                snprintf(nm, sizeof nm, "chunk-ld C=%zu %dx128/SM unroll4", C, per);
                TIMEIT(nm, (k_chunk_ld<4><<<sms * per, 128>>>((const uint4 *)buf, n, C / 16, sink)));
            }
            snprintf(nm, sizeof nm, "chunk-ld C=%zu 4x128/SM unroll8", C);
            TIMEIT(nm, (k_chunk_ld<8><<<sms * 4, 128>>>((const uint4 *)buf, n, C / 16, sink)));
            {
                int smem = 4 * 3 * UNIT;
                snprintf(nm, sizeof nm, "cpasync C=%zu 4x(4w x S3)/SM", C);
                TIMEIT(nm, (k_cpasync<3><<<sms * 4, 128, smem>>>(buf, n, C, sink, n, 1)));
                smem = 4 * 6 * UNIT;
                MOED_CUDA_TRY(cudaFuncSetAttribute(k_cpasync<6>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                snprintf(nm, sizeof nm, "cpasync C=%zu 4x(4w x S6)/SM", C);
                TIMEIT(nm, (k_cpasync<6><<<sms * 4, 128, smem>>>(buf, n, C, sink, n, 1)));
            }
            for (unsigned B : {2304u, 4608u}) {
                for (unsigned S : {2u, 3u, 4u, 6u}) {
                    int smem = 16 * 8 * 4 + 4 * S * B;
                    if (smem > 56 * 1024 || C % B)
                        continue;
                    MOED_CUDA_TRY(cudaFuncSetAttribute(
                        k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                    snprintf(nm, sizeof nm, "bulk C=%zu 4x(4w x %u x %u B)/SM", C, S, B);
                    TIMEIT(nm, (k_bulk<<<sms * 4, 128, smem>>>(buf, n, C, B, S, sink)));
                }
            }
        }
    }
    {
        /* L2 (issue 12, T = 256): moed's ring (4 stages) over Qwen3's 4-tile
         * gate_up task chunks, a working set re-read, then chunks read by
         * R CTAs at once; the figure is the bytes delivered to shared memory */
        const size_t C = 147456, n = bytes / C;
        const int smem = 4 * 4 * UNIT;
        for (unsigned mb : {16u, 32u, 48u}) {
            snprintf(nm, sizeof nm, "cpasync C=%zu 4x(4w x S4)/SM ws=%uMB", C, mb);
            TIMEIT_B(nm, (k_cpasync<4><<<sms * 4, 128, smem>>>(buf, n, C, sink,
                                                                ((size_t)mb << 20) / C, 1)),
                     n * C);
        }
        for (unsigned r : {1u, 2u, 3u, 4u}) {
            snprintf(nm, sizeof nm, "cpasync C=%zu 4x(4w x S4)/SM share=%u (x%u delivered)", C, r, r);
            TIMEIT_B(nm, (k_cpasync<4><<<sms * 4, 128, smem>>>(buf, n * r, C, sink, n, r)),
                     n * C * r);
        }
    }
#undef TIMEIT
#undef TIMEIT_B
cleanup:
    if (rc)
        fprintf(stderr, "stream_probe: %s\n", err);
    if (a)
        cudaEventDestroy(a);
    if (b2)
        cudaEventDestroy(b2);
    cudaFree(buf);
    cudaFree(sink);
    return rc ? 1 : 0;
}
