/* sm_placement.cu - where does the hardware put a persistent grid's CTAs, and
 * can another process's kernel run beside it under MPS? For bench/NOTES.md.
 *
 * moed leaves engine.sms_free SMs "free" by launching per_sm * (SMs - free)
 * CTAs; nothing makes the hardware pack them 4 to an SM. If it spreads them
 * over every SM, no SM is left whole, and under MPS another client's kernel
 * needs room beside moed's CTAs on an SM (if an SM can hold CTAs of two
 * contexts at all). This probe answers both questions with plain kernels:
 *
 *   sm_placement hold <ctas> <smem_bytes> <seconds>
 *       launches <ctas> CTAs of 128 threads with <smem_bytes> of dynamic
 *       shared memory (moed's: 36992), each records its %smid, spins until
 *       <seconds> pass; prints how many SMs hold how many CTAs
 *   sm_placement probe <ctas> <threads> <smem_bytes>
 *       (another process, while `hold` runs) launches a short kernel, waits
 *       for it and prints how long it took (beside the hold, or only after
 *       it) and on how many SMs it ran
 *
 * Build (repository root):
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
 *     -o build-cuda/sm_placement bench/probe/sm_placement.cu
 * Run under MPS (scripts/mps.sh): hold 272 36992 20 & sleep 2; probe 132 256 0
 */
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <thread>
#include <vector>

#define CK(x)                                                                       \
    do {                                                                            \
        cudaError_t e_ = (x);                                                       \
        if (e_ != cudaSuccess) {                                                    \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,             \
                    cudaGetErrorString(e_));                                        \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

__device__ __forceinline__ unsigned smid()
{
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

__device__ __forceinline__ unsigned long long gtimer()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void hold(unsigned *sm_of, unsigned long long ns)
{
    extern __shared__ unsigned char smem[];
    if (threadIdx.x == 0) {
        sm_of[blockIdx.x] = smid();
        smem[0] = 1;
    }
    const unsigned long long t0 = gtimer();
    while (gtimer() - t0 < ns)
        __nanosleep(1000);
}

__global__ void probe(unsigned *sm_of, int smem_bytes)
{
    extern __shared__ unsigned char smem[];
    if (threadIdx.x == 0) {
        sm_of[blockIdx.x] = smid();
        if (smem_bytes > 0) /* a store past a 0-byte dynamic area faults, and under MPS a
                               fault of one client is every client's (the hold's too) */
            smem[0] = 1;
    }
}

static void histogram(const std::vector<unsigned> &sm_of, int n_sms)
{
    std::vector<int> per(n_sms + 1, 0);
    for (unsigned s : sm_of)
        per[s < (unsigned)n_sms ? s : n_sms]++;
    int used = 0, most = 0;
    std::vector<int> count(65, 0);
    for (int s = 0; s < n_sms; s++) {
        used += per[s] > 0;
        most = per[s] > most ? per[s] : most;
        count[per[s] < 64 ? per[s] : 64]++;
    }
    printf("%zu CTAs on %d of %d SMs (at most %d on one SM):", sm_of.size(), used, n_sms, most);
    for (int c = 0; c <= 64; c++)
        if (count[c])
            printf(" %d SMs hold %d,", count[c], c);
    printf("\n");
}

int main(int argc, char **argv)
{
    if (argc < 5 || (std::string_view(argv[1]) != "hold" && std::string_view(argv[1]) != "probe")) {
        fprintf(stderr, "usage: %s hold <ctas> <smem_bytes> <seconds> | probe <ctas> <threads> "
                        "<smem_bytes>\n", argv[0]);
        return 2;
    }
    const bool is_hold = std::string_view(argv[1]) == "hold";
    const int ctas = atoi(argv[2]);
    const int threads = is_hold ? 128 : atoi(argv[3]);
    const int smem = atoi(is_hold ? argv[3] : argv[4]);
    int n_sms = 0;
    CK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
    unsigned *d_sm = nullptr;
    CK(cudaMalloc(&d_sm, ctas * sizeof(unsigned)));
    CK(cudaMemset(d_sm, 0xff, ctas * sizeof(unsigned)));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const auto t0 = std::chrono::steady_clock::now();
    if (is_hold) {
        CK(cudaFuncSetAttribute(hold, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        hold<<<ctas, threads, smem, s>>>(d_sm, (unsigned long long)(atof(argv[4]) * 1e9));
    } else {
        CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        probe<<<ctas, threads, smem, s>>>(d_sm, smem);
    }
    CK(cudaGetLastError());
    std::vector<unsigned> sm_of(ctas);
    if (is_hold) { /* read the placement while the grid still runs */
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        cudaStream_t r;
        CK(cudaStreamCreateWithFlags(&r, cudaStreamNonBlocking));
        CK(cudaMemcpyAsync(sm_of.data(), d_sm, ctas * sizeof(unsigned), cudaMemcpyDeviceToHost,
                           r));
        CK(cudaStreamSynchronize(r));
        printf("hold: ");
        histogram(sm_of, n_sms);
        fflush(stdout);
        CK(cudaStreamSynchronize(s));
        return 0;
    }
    /* wait for it whatever it takes (a `hold` ends by itself): under MPS a
     * process that exits with work of its own still queued or running can
     * give the other clients a fatal error (bench/NOTES.md, 2026-12-01 late) */
    while (cudaStreamQuery(s) == cudaErrorNotReady)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    CK(cudaMemcpy(sm_of.data(), d_sm, ctas * sizeof(unsigned), cudaMemcpyDeviceToHost));
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    printf("probe: %d CTAs x %d threads, %d B smem: finished in %.2f ms (%s); ", ctas, threads,
           smem, ms, ms < 1000 ? "beside the hold" : "only once the hold ended, or a second late");
    histogram(sm_of, n_sms);
    return 0;
}
