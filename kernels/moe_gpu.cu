/* moe_gpu.cu - the persistent fused NVFP4 MoE kernel (one per GPU, resident).
 *
 * WHAT IT COMPUTES (contract: kernels/moe_ref.h). For each batch of T tokens
 * with top-k pairs (e_j, w_j) and S shared experts (weight 1):
 *   h   = bf16( silu(W_gate[e] x) * (W_up[e] x) )
 *   d   = W_down[e] h                     fp32, one row per (token, slot) pair
 *   y_t = bf16( sum_j w_j d_j + sum_s d_s )   slots in order: deterministic
 *
 * LAYOUT (weights, repacked once at load by moe_gpu_pack.c). Each matrix is
 * cut into warp tiles of MR*16 rows x K. A tile is K/64 units; a unit is MR
 * sub-tiles of 576 bytes: 512 bytes of E2M1 codes (lane l = 4g+q owns 16
 * bytes: rows g and g+8, k in [16q, 16q+16) of the unit, in mma A-fragment
 * order) then 64 bytes of E4M3 block scales (lane l owns 2: rows g, g+8,
 * block q). K inside a unit is permuted (the same permutation on A and B, so
 * the dot product is unchanged) such that each lane's B fragment is 32
 * contiguous bytes of the activation row and each lane needs exactly one
 * scale per row: no duplicated scale bytes, one 16-byte code load per lane per
 * sub-tile. gate_up interleaves 8 gate rows and the same 8 up rows per
 * 16-row sub-tile, so the accumulator fragment of one lane holds gate (c0,c1)
 * and up (c2,c3) of the same intermediate index: SiLU(gate)*up is formed in
 * registers and h is written once, in bf16.
 *
 * MATH PER WARP. bf16 mma.sync m16n8k16 with weights as A (16 rows, the large
 * side) and tokens as B (8 per n-tile, the small side: "swap A/B"); NT = 1
 * or, a wide chunk, 2 n-tiles (the MMAs of one n-tile never mix columns, so
 * a token's sums are the same in either); fp32 accumulation. Dequant in
 * registers: an E2M1 code (s e1 e0 m) placed as bf16 bits s|e1e0<<7|m<<6 is
 * exactly value * 2^-126 (E2M1 subnormal 0.5 lands on the bf16 subnormal
 * with the same meaning); one bf16x2 fma with the block scale * 2^118
 * (E4M3 -> f16 by the hardware cvt, exact) gives value * scale * 2^-8, every
 * product a normal bf16 and exact. The epilogue multiplies 2^8 * weight_scale_2
 * of the tile's own matrix (gate and up each their own).
 *
 * PARTITIONING AND TASKS. The CTA (NWARPS = 4 warps) is the worker.
 * Per batch, tasks are numbered
 *   [gate_up tasks][down tasks][combine units]
 * A gate_up or down task is (expert, chunk of its (token, slot) pairs,
 * NTILE consecutive 32-row tiles); an expert's chunks are CHUNK_TOKENS = 8
 * pairs (one n-tile) if it has at most 8, else SPLITM_TOKENS = 32 (a crowded
 * chunk: a split-M task, below), ordered by expert,
 * then tile group, then chunk (the chunks of a crowded expert read the same
 * tiles back to back: the second read comes from L2);
 * NTILE is chosen per batch (ntile_for: up to NTILE_MAX = 4 while every
 * CTA still gets NTILE_WAVES = 2 tasks; 1 for small batches, so every
 * SM streams at T = 1). The CTA's warps split each tile's K units (warp w
 * takes units w, w+4, ... of every tile: split-K), stream K unit v of all
 * the task's tiles before K unit v+1, without draining (bench/NOTES.md v17:
 * a K unit's activation rows are read once per task, not once per tile;
 * H200: +7-11% at T = 4-64, +22% at T = 256), and warp w sums tile w's partials in
 * warp order (fixed: deterministic, and the same sum whatever NTILE is, so a
 * token's output does not depend on its batch) and writes its epilogue. A
 * combine unit is one token x 256 columns, one per warp. Each CTA claims the
 * next number from one atomic counter (the claim for the next task is issued
 * while the current one runs). Counters count tiles: a down task waits until
 * its expert's gate_up counter reaches the expert's tile count; combine
 * waits for every down tile. Waits only point backwards in the order and
 * every CTA is resident (grid from the occupancy API), so nothing can
 * deadlock.
 *
 * EXPERT PARALLELISM (desc.flags, moe_gpu_abi.h). A ROWS batch computes
 * only its entries (ids -1 elsewhere; the shared slots of tokens t with t %
 * ep_n == ep_shard) and, after its down tasks, copies each computed entry's
 * fp32 row from dout to rows + (t * (k + S) + j) * H (another GPU's memory,
 * peer mapped) instead of combining; a COMBINE batch has no pairs: the x
 * staging copies its rows into dout rows t * (k + S) + j and its combine
 * units are the plain ones (same code, same order), so ROWS over any split
 * of the entries followed by COMBINE gives the plain batch's y bit for bit.
 *
 * ROUTING. Every CTA builds the batch's expert histogram (shared memory),
 * the (token, slot) -> pair position map and the pair -> token list (its own
 * region of device memory, leaving shared memory to the pipeline) by itself,
 * with no grid barrier: the histogram from shared-memory atomics, then each
 * warp ranks a quarter of the entries 32 at a time with __match_any_sync
 * (ids and ranks in the stage buffers, free between batches), so a pair's
 * position is its entry's rank among the earlier entries of its expert, the
 * same in every CTA (a batch of at most 128 entries: warp 0 alone).
 *
 * PIPELINE. Each warp streams its share of a task through its own
 * STAGES-deep ring of shared-memory stages filled with 16-byte cp.async
 * (.cg: L2 only). A stage holds one K unit of weights (MR sub-tiles) and the
 * same K unit of the task's activation rows (x for gate_up, h for down; only
 * the rows in use, 144-byte padded rows for conflict-free fragment reads);
 * a multi-tile task keeps weights and activation rows in two rings, so one
 * K unit's rows serve all its tiles. In the steady state (task_mma_full,
 * task_mma_full1) every ring index and offset is a constant and no copy
 * branches. Measured on the H200: loading the activations from L2 into
 * registers one unit ahead instead capped the stream at ~2 TB/s; 4-6 stages,
 * 24-32 warps per SM and longer tasks did not raise the stream: the SM's
 * issue slots and integer pipe are what bind (Nsight Compute on
 * bench/probe/tile_probe.cu), and under a sustained batch stream the board's
 * power limit lowers the SM clock (bench/NOTES.md).
 *
 * QUEUE PROTOCOL. Host: writes ring[seq % RING] (the descriptor and, for
 * small batches, ids and w inline) then st.release of head
 * (64-bit, system scope). CTA 0 thread 0 (the dispatcher) waits until the
 * previous batch is complete (done_dev), then polls head with ld.acquire.sys,
 * copies the descriptor, and CTA 0 stages ids and w into device memory;
 * then st.release.gpu of dev_head. Every CTA then stages its slice of x
 * (mapped host memory over PCIe wants many SMs' loads in flight) and counts
 * itself in x_done; gate_up tasks wait for all slices. Every CTA waits on dev_head (device
 * memory: no PCIe polling by 132+ CTAs). The last CTA to finish a batch
 * (atomic count) resets the counters, releases done_dev, and st.release.sys
 * of ctrl->done_seq, which the host completion thread watches. Batches run
 * one after another; the ring lets the host queue ahead.
 *
 * IDLE, STOP, HEARTBEAT. Waiting threads back off with __nanosleep (short
 * while recently busy, longer when idle). The dispatcher bumps ctrl->heartbeat
 * about every 100 us while idle and after every batch. The host sets
 * ctrl->stop only when nothing is queued on the host ring; the dispatcher
 * reads it every 8th idle round, and after a channel-table generation change
 * (the host bumps gen to stop a kernel that doorbell traffic keeps busy), and
 * forwards it to the other CTAs through stop_dev; the last CTA to leave sets
 * ctrl->exited. The host relaunches on the next batch or open channel (idle
 * exit, unmapping client buffers) or frees everything (shutdown).
 *
 * ARCHITECTURE. Everything here is sm_80+ PTX (cp.async, mma.sync bf16)
 * plus cvt e4m3x2 (sm_89+), so one path serves sm_90a (H200) and sm_120a
 * (RTX PRO 6000, 100 KB smem: the occupancy API picks one CTA per SM there).
 *
 * FILES. This is the one translation unit (one cubin: the split does not
 * change the machine code); the parts follow the sections above:
 *   moe_gpu_abi.h          the host-device contract (layouts, asserts, ring)
 *   moe_gpu/config.cuh     tuning constants (with their measurements), sizes
 *   moe_gpu/ptx.cuh        PTX wrappers (acquire/release, cp.async, mma)
 *   moe_gpu/dequant.cuh    MATH PER WARP: NVFP4 -> bf16 in registers, unit MMAs
 *   moe_gpu/route.cuh      ROUTING
 *   moe_gpu/pipeline.cuh   PIPELINE: a warp's stage rings and MMA chains
 *   moe_gpu/task.cuh       PARTITIONING AND TASKS: split-K, epilogues, combine
 *   moe_gpu/kernel.cuh     QUEUE PROTOCOL, IDLE/STOP: the persistent kernel
 *   this file              host side: sizes, ABI, plan, launch
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "moe_gpu.h"
#include "moed_check_cuda.h"
#include "moed_err.h"
}

// clang-format off
#include "moe_gpu/config.cuh"
#include "moe_gpu/ptx.cuh"
#include "moe_gpu/dequant.cuh"
#include "moe_gpu/route.cuh"
#include "moe_gpu/pipeline.cuh"
#include "moe_gpu/task.cuh"
#include "moe_gpu/kernel.cuh"
// clang-format on

/* ---------------- host side: sizes, ABI, plan, launch ---------------- */

/* Rows of other ranks (engine/nccl_group.h): dst row entries[i] = src row
 * entries[i], hidden floats each (hidden % 4 == 0); one CTA per entry. */
__global__ void rows_merge(float4 *dst, const float4 *src, const uint32_t *entries,
                           uint32_t n4)
{
    const size_t row = (size_t)entries[blockIdx.x] * n4;
    for (uint32_t i = threadIdx.x; i < n4; i += blockDim.x)
        dst[row + i] = __ldcs(src + row + i);
}

extern "C" int moe_gpu_rows_merge(float *dst, const float *src, const uint32_t *entries,
                                  uint32_t n, uint32_t hidden, void *stream, char *err,
                                  size_t errlen)
{
    int rc = 0;
    if (n)
        rows_merge<<<n, 256, 0, (cudaStream_t)stream>>>((float4 *)dst, (const float4 *)src,
                                                        entries, hidden / 4);
    MOED_CUDA_TRY(cudaGetLastError());
cleanup:
    return rc;
}

extern "C" int moe_gpu_fill_random(void *buf, uint64_t bytes, uint64_t seed, char *err,
                                   size_t errlen)
{
    int rc = 0;
    fill_random<<<1024, 256>>>((uint8_t *)buf, bytes / 16, seed);
    MOED_CUDA_TRY(cudaGetLastError());
cleanup:
    return rc;
}

extern "C" size_t moe_gpu_state_bytes(const struct moe_gpu_dims *d)
{
    return sizeof(struct moe_state) + sizeof(unsigned) * (d->n_experts + d->n_shared);
}

/* The routing's region of device memory per CTA (kernel.cuh,
 * moe_route_region): the CTA's pos and tok (2 bytes per (token, slot) entry
 * each; in device memory, not shared, which leaves shared memory to the
 * stages: H200 2026-11-29, v9a, v15), then room for a copy of its tables
 * (counts, offsets, chunk starts, the chunk table: moe_gpu_smem_route_bytes),
 * which CTA 0 fills when a batch shares its routing. */
extern "C" uint32_t moe_gpu_route_gmem_bytes(const struct moe_gpu_dims *d)
{
    return (uint32_t)moe_route_region(*d);
}

extern "C" uint32_t moe_gpu_smem_route_bytes(const struct moe_gpu_dims *d)
{
    return (uint32_t)moe_route_smem(*d);
}

static int smem_total(const struct moe_gpu_dims *d)
{
    return (int)moe_gpu_smem_route_bytes(d) + NWARPS * WARP_SMEM;
}

extern "C" uint32_t moe_gpu_smem_bytes(const struct moe_gpu_dims *d)
{
    return (uint32_t)smem_total(d);
}

/* The layout this translation unit was compiled with. Its device pass sees
 * the same header and checks the same asserts, which pin every size and
 * offset the fingerprint hashes, so this is the kernel's layout too; a value
 * the device computed would need a module global (or kernel) of its own,
 * which moves the module's and later allocations' addresses (H200
 * 2026-12-01: bench/NOTES.md). */
extern "C" uint64_t moe_gpu_kernel_abi(void)
{
    constexpr uint64_t fp = moe_gpu_abi_fingerprint();
    return fp;
}

extern "C" int moe_gpu_plan(int device, const struct moe_gpu_dims *d, int sms_free,
                            struct moe_gpu_launch *out, char *err, size_t errlen)
{
    int rc = 0, sms = 0, optin = 0, per_sm = 0, use;
    const int smem = smem_total(d);
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (smem > optin) {
        rc = moed_seterr(err, errlen, MOED_E_CONFIG,
                         "cuda backend: the kernel needs %d bytes of shared memory per CTA, GPU "
                         "%d allows %d", smem, device, optin);
        goto cleanup;
    }
    MOED_CUDA_TRY(cudaFuncSetAttribute(moe_persistent, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       smem));
    MOED_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_persistent, THREADS,
                                                                (size_t)smem));
    if (per_sm < 1) {
        rc = moed_seterr(err, errlen, MOED_E_BACKEND,
                         "cuda backend: no CTA of the kernel fits an SM of GPU %d (%d threads, "
                         "%d bytes of shared memory)", device, THREADS, smem);
        goto cleanup;
    }
    use = sms - sms_free;
    if (use < 1)
        use = 1;
    out->grid = per_sm * use;
    out->block = THREADS;
    out->smem_bytes = smem;
    out->ctas_per_sm = per_sm;
    out->sms = use;
cleanup:
    return rc;
}

extern "C" int moe_gpu_start(const struct moe_gpu_params *p, const struct moe_gpu_launch *l,
                             void *stream, char *err, size_t errlen)
{
    int rc = 0;
    /* Every kernel launched while the persistent one runs is loaded first:
     * under lazy loading (CUDA's default since 12.2) loading a kernel may
     * synchronize the context, which never ends while a persistent kernel
     * is resident (CUDA Programming Guide, Lazy Loading, "Potential
     * hazards"). Seen on an H200: rank 0 of an NCCL group hung for good in
     * the first rows_merge's cudaStreamSynchronize (bench/NOTES.md). */
    cudaFuncAttributes fa;
    MOED_CUDA_TRY(cudaFuncGetAttributes(&fa, rows_merge));
    moe_persistent<<<l->grid, l->block, l->smem_bytes, (cudaStream_t)stream>>>(*p);
    MOED_CUDA_TRY(cudaGetLastError());
cleanup:
    return rc;
}

extern "C" int moe_gpu_task_log(uint64_t *hdr, uint64_t *ents, char *err, size_t errlen)
{
#if MOE_GPU_TASK_LOG
    static_assert(sizeof moe_tlog_hdr == MOE_GPU_TLOG_CTAS * 8 * sizeof(uint64_t), "task log");
    static_assert(sizeof moe_tlog == (size_t)MOE_GPU_TLOG_CTAS * MOE_GPU_TLOG_N * 8 * 8, "task log");
    int rc = 0;
    MOED_CUDA_TRY(cudaMemcpyFromSymbol(hdr, moe_tlog_hdr, sizeof moe_tlog_hdr));
    MOED_CUDA_TRY(cudaMemcpyFromSymbol(ents, moe_tlog, sizeof moe_tlog));
cleanup:
    return rc;
#else
    (void)hdr;
    (void)ents;
    return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                       "the kernel was built without MOE_GPU_TASK_LOG");
#endif
}

extern "C" int moe_gpu_take_stamps(uint64_t (*out)[4], char *err, size_t errlen)
{
#if MOE_GPU_TAKE_STAMPS
    static_assert(sizeof moe_take_stamp == MOE_GPU_CHAN_SLOTS * 4 * sizeof(uint64_t), "stamps");
    int rc = 0;
    MOED_CUDA_TRY(cudaMemcpyFromSymbol(out, moe_take_stamp, sizeof moe_take_stamp));
cleanup:
    return rc;
#else
    (void)out;
    return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                       "the kernel was built without MOE_GPU_TAKE_STAMPS");
#endif
}

extern "C" int moe_gpu_read_bw(const void *buf, uint64_t bytes, int reps, float *ms, char *err,
                               size_t errlen)
{
    int rc = 0, sms = 0, dev = 0;
    cudaEvent_t a = nullptr, b = nullptr;
    unsigned *sink = nullptr;
    MOED_CUDA_TRY(cudaGetDevice(&dev));
    MOED_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    MOED_CUDA_TRY(cudaMalloc(&sink, sizeof(unsigned)));
    MOED_CUDA_TRY(cudaEventCreate(&a));
    MOED_CUDA_TRY(cudaEventCreate(&b));
    read_probe<<<sms * 4, 512>>>((const uint4 *)buf, bytes / 16, sink); /* warm-up */
    MOED_CUDA_TRY(cudaEventRecord(a));
    for (int i = 0; i < reps; i++)
        read_probe<<<sms * 4, 512>>>((const uint4 *)buf, bytes / 16, sink);
    MOED_CUDA_TRY(cudaEventRecord(b));
    MOED_CUDA_TRY(cudaEventSynchronize(b));
    MOED_CUDA_TRY(cudaEventElapsedTime(ms, a, b));
cleanup:
    if (a)
        cudaEventDestroy(a);
    if (b)
        cudaEventDestroy(b);
    cudaFree(sink);
    return rc;
}
