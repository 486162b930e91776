/* l2_probe.cu - how many bytes per second can the SMs take in through
 * cp.async when some of them come from L2, not HBM? (issue 12, T = 256:
 * a crowded expert's chunks stream the same weight lines on several CTAs at
 * once, so HBM reads them once and L2 delivers them once per chunk.)
 *
 * A standalone probe (not part of moed) for bench/NOTES.md. Every CTA (4 per
 * SM, 4 warps) streams 1152-byte units of C-byte chunks through a 4-stage
 * cp.async ring per warp, as moed's kernel does, and the figure is the bytes
 * delivered to shared memory per second:
 *
 *   hbm      chunks of a 4 GB buffer, each read once (the HBM ceiling of the
 *            pattern)
 *   ws=M     a working set of M MB read over and over (L2 alone when it
 *            fits)
 *   share=R  each chunk of the 4 GB buffer read by R CTAs at about the same
 *            time (consecutive chunk numbers: HBM reads it once, L2
 *            delivers it R times), as the chunks of one tile group do
 *
 * Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
 *          -o build-var/l2_probe bench/probe/l2_probe.cu
 * Run:   ./l2_probe   (one line per configuration)
 */
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

#define UNIT 1152
#define STAGES 4

__device__ __forceinline__ void cpa16(void *s, const void *g)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(g) : "memory");
}

/* chunk c (c = blockIdx.x, + gridDim.x, ... < nvirt) reads physical chunk
 * (c / share) % nphys */
__global__ void k_stream(const uint8_t *__restrict__ b, size_t nvirt, size_t nphys, unsigned share,
                         size_t chunk, unsigned *sink)
{
    extern __shared__ __align__(16) uint8_t sm[];
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    uint8_t *ring = sm + warp * STAGES * UNIT;
    unsigned x = 0;
    const unsigned units = (unsigned)(chunk / UNIT);
    for (size_t c = blockIdx.x; c < nvirt; c += gridDim.x) {
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

static int check(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "l2_probe: %s: %s\n", what, cudaGetErrorString(e));
        return 1;
    }
    return 0;
}

int main()
{
    const size_t big = 4ull << 30, C = 147456; /* Qwen3's 4-tile gate_up task */
    uint8_t *buf;
    unsigned *sink;
    int sms = 0;
    cudaEvent_t a, b;
    if (check(cudaMalloc(&buf, big), "cudaMalloc") || check(cudaMalloc(&sink, 4), "cudaMalloc") ||
        check(cudaMemset(buf, 1, big), "cudaMemset") ||
        check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute") ||
        check(cudaEventCreate(&a), "event") || check(cudaEventCreate(&b), "event"))
        return 1;
    const int smem = 4 * STAGES * UNIT;
    struct cfg {
        const char *name;
        size_t ws;      /* working set bytes */
        unsigned share; /* CTAs per chunk */
    } cfgs[] = {{"hbm", big, 1},          {"ws=16MB", 16u << 20, 1}, {"ws=32MB", 32u << 20, 1},
                {"ws=48MB", 48u << 20, 1}, {"share=2", big, 2},      {"share=3", big, 3},
                {"share=4", big, 4},       {"hbm", big, 1}};
    for (const cfg &g : cfgs) {
        const size_t nphys = g.ws / C, nvirt = (big / C) * (g.share > 1 ? g.share : 1);
        float ms = 0;
        k_stream<<<sms * 4, 128, smem>>>(buf, nvirt, nphys, g.share, C, sink);
        if (check(cudaDeviceSynchronize(), "warm-up") || check(cudaEventRecord(a), "record"))
            return 1;
        const int reps = 3;
        for (int r = 0; r < reps; r++)
            k_stream<<<sms * 4, 128, smem>>>(buf, nvirt, nphys, g.share, C, sink);
        if (check(cudaEventRecord(b), "record") || check(cudaEventSynchronize(b), "sync") ||
            check(cudaGetLastError(), "launch") || check(cudaEventElapsedTime(&ms, a, b), "time"))
            return 1;
        const double bytes = (double)nvirt * C * reps;
        printf("%-10s chunk %zu B  %7.3f TB/s delivered to shared memory (%.0f MB read per launch)\n",
               g.name, C, bytes / (ms * 1e-3) / 1e12, bytes / reps / 1e6);
        fflush(stdout);
    }
    return 0;
}
