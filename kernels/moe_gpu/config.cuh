/* config.cuh - the kernel's configuration: tuning values, derived sizes,
 * the device counter block. Part of the one translation unit moe_gpu.cu.
 *
 * Tuning values are constants, each with the GPU and the measurement that
 * chose it (bench/NOTES.md has every figure; a losing variant is recorded
 * there, not kept as a switch). The compile-time switches left are
 * MOE_GPU_PHASES (instrumentation for the benchmark, off in a serving
 * build), and MOE_GPU_TAKE_STAMPS (the same for the doorbell's take). Layout
 * constants shared with the host (MOE_GPU_MR, unit sizes, the ring) are in
 * kernels/moe_gpu_abi.h.
 */
#ifndef MOE_GPU_PHASES /* 1: gate_up / down end timestamps (costs an atomic per tile) */
#define MOE_GPU_PHASES 0
#endif
#ifndef MOE_GPU_TASK_LOG /* 1: each CTA's task timeline of its last batch (moe_gpu_task_log) */
#define MOE_GPU_TASK_LOG 0
#endif
#ifndef MOE_GPU_TAKE_STAMPS /* 1: the doorbell take's own stamps (moe_gpu_take_stamps) */
#define MOE_GPU_TAKE_STAMPS 0
#endif

/* warps per CTA. H200 2026-11-29: 4 CTAs/SM of 4 warps beat 2 of 8 by 13-35%,
 * and 2-warp CTAs lost at T = 1 (bench/NOTES.md v7) */
constexpr int NWARPS = 4;
constexpr int THREADS = NWARPS * 32;
static_assert(MOE_GPU_ROW_TAIL_BYTES >= NWARPS * MOE_GPU_UNIT_K * 2,
              "a warp may load its first unit past a short row: MOE_GPU_ROW_TAIL_BYTES");
/* CTAs per SM the register budget must allow (__launch_bounds__: 3 gives
 * 168 registers). H200: 24-32 warps per SM (6-8 CTAs, 80-64 registers) gained
 * nothing on DeepSeek-V3 and lost at T = 1 (v9e). H100 2026-12-06: the wide
 * split-K chunks of 16 pairs (before split-M tasks) needed 3: at 4 (128
 * registers) they spilled 220 bytes, 3.5-9
 * % slower at T <= 64 and -5 / -13 % at T = 256 (DeepSeek-V3 / Qwen3)
 * against 4 without them; 3 with them: T = 256 -8 / -15 %, T <= 64 +0.4 to
 * +7 % on that H100 and -1 to -4 % on another (bench/NOTES.md; not yet
 * measured on an H200) */
constexpr int MINB = 3;
/* cp.async stages per warp (one weight unit + its activation rows each).
 * H200 2026-11-29: 4 is 1-2% faster than 3 at every point (v15), 5 no better
 * (v9b), 8 no better (v2) */
constexpr int STAGES = 4;
/* (token, slot) pairs per task chunk of an expert with at most this many:
 * one n-tile of 8 tokens. H200 2026-11-30: 16-pair chunks for every expert
 * (at 128 registers, spilling) were 11-14% faster at T = 256 and 3-17%
 * slower at T <= 64, Qwen3 slower everywhere (v14, v18) */
constexpr int CHUNK_TOKENS = 8;
/* an expert with more pairs than CHUNK_TOKENS is cut into chunks of up to
 * SPLITM_TOKENS, each a split-M task per tile group (task_splitm: every warp
 * one tile over the whole K, split-K's sums; each weight unit dequantized
 * once for all the chunk's pairs) where its tile group has all NTILE_MAX
 * tiles and its K units divide among the warps. H100 2026-12-06 against the
 * wide split-K chunks of 16 pairs before it: Qwen3 T = 256 -6 %, DeepSeek-V3
 * and T <= 128 within 1 % (bench/NOTES.md stop 38) */
constexpr int SPLITM_NT = 4;
constexpr int SPLITM_TOKENS = SPLITM_NT * CHUNK_TOKENS;
/* a batch of at least SPLIT_T tokens has its routing built once, by CTA 0
 * while the others stage x, and runs its down tasks in two parts, the first
 * of at most SPLIT_EIGHTHS eighths of the tile groups, the combine of its
 * columns beside the second (sched). H200 2026-12-06: Qwen3 T = 256 -5.4 %,
 * T = 128 -2.8 % (routing and parts for every T: +1 to +3 % at T <= 64, so
 * smaller batches keep the per-CTA routing and one part); H100: Qwen3 T = 256
 * -4.9 %, T <= 64 within 1 %; first part 5 / 8 against 4 / 8 a further -0.8
 * % at T = 128 and 256, 6 / 8 +1 % (bench/NOTES.md stop 39) */
constexpr unsigned SPLIT_T = 128;
constexpr unsigned SPLIT_EIGHTHS = 5;
/* row tiles per gate_up / down task, at most (task_mma_full's steady state).
 * H200: 4 against 1, +1-4% (DeepSeek-V3), Qwen3 T = 64 +8%, T = 256 +18% (v9d);
 * 2 at most: worse (v15) */
constexpr int NTILE_MAX = 4;
/* a batch uses NTILE_MAX tiles per task only while every CTA still gets this
 * many tasks (v9d, v15: 1 wave per CTA for multi-tile tasks was worse) */
constexpr int NTILE_WAVES = 2;
/* task_mma_full keeps unit (v, j) of a task's NTILE_MAX tiles in weight slot
 * j: its weight ring has NTILE_MAX slots and its activation ring as many,
 * which fill exactly the warp's STAGES stages. */
static_assert(NTILE_MAX == STAGES, "task_mma_full: one stage per tile of a full task");

#if MOE_GPU_TASK_LOG
/* The task log (moe_gpu.h): the current task's stamps, staged in shared
 * memory by thread 0 and written once the task is done (a global store per
 * stamp waited behind the SM's weight streams, H200 2026-12-04) */
__shared__ unsigned long long tlog_st[7];
__device__ __forceinline__ void tlog_stamp(int i)
{
    if (threadIdx.x == 0)
        tlog_st[i] = clock64();
}
#define TLOG_STAMP(i) tlog_stamp(i)
#else
#define TLOG_STAMP(i) ((void)0)
#endif

/* chunks whose expert a task finds in the routing's table (shared memory,
 * 2 bytes each); later chunks of a larger batch search the chunk offsets */
constexpr int CTAB = 1024;

/* (int, as the macros they replace: the index arithmetic keeps its types) */
constexpr int MR = MOE_GPU_MR;
constexpr int X_ROW_BYTES = 144; /* 128 + 16: conflict-free 16-byte fragment reads */
/* a stage of the one-n-tile pipeline: one weight unit + 8 activation rows */
constexpr int STAGE_BYTES = MOE_GPU_UNIT_BYTES + CHUNK_TOKENS * X_ROW_BYTES;
/* each warp's shared-memory stage region */
constexpr int cmax(int a, int b) { return a > b ? a : b; }
/* (a split-M task: the CTA's STAGES stages of NWARPS weight units and
 * SPLITM_TOKENS activation rows, over its warps' regions) */
constexpr int WARP_SMEM =
    cmax(STAGES * STAGE_BYTES,
         STAGES * (NWARPS * MOE_GPU_UNIT_BYTES + SPLITM_TOKENS * X_ROW_BYTES) / NWARPS);
static_assert((size_t)THREADS * 16 >= sizeof(struct moe_gpu_slot), "one load per thread reads a ring slot");
static_assert(sizeof(struct moe_gpu_desc) / 16 <= THREADS, "one load per thread reads the desc");
static_assert(sizeof(struct moe_gpu_chan_desc) / 16 + MOE_GPU_CHAN_BUFS + 1 <= THREADS,
              "one load per thread reads a doorbell descriptor, its table and key");

/* 16-byte chunks of a weight unit, and how many lanes copy them (the largest
 * divisor of UC that is at most 32: 72 -> 24 lanes x 3). */
constexpr unsigned UC = MOE_GPU_UNIT_BYTES / 16;
constexpr unsigned ul_for(unsigned c, unsigned l) { return c % l == 0 ? l : ul_for(c, l - 1); }
constexpr unsigned UL = ul_for(UC, 32);

/* Device counters; zeroed once at allocation, reset per batch by the last CTA. */
struct moe_state {
    unsigned long long dev_head; /* seq released to all CTAs by the dispatcher */
    unsigned long long done_dev; /* last completed seq */
    unsigned int stop_dev;
    unsigned int task_ctr;
    unsigned int cta_done;
    unsigned int dn_part[2]; /* down tiles done, of each part (sched) */
    unsigned int exit_ctr;
    unsigned int x_done; /* CTAs that finished their slice of the x staging */
    unsigned int route_done; /* 1: CTA 0 has published the batch's routing */
    unsigned int gu_all, dn_all; /* tiles done in this batch (phase timestamps) */
    unsigned long long src_seq;  /* the current batch's seq in its source */
    unsigned long long t0;       /* %globaltimer when the dispatcher took it */
    unsigned int src;            /* its source: 0 the host ring, 1 + c channel c */
    unsigned int pad_;
    struct moe_gpu_desc desc; /* current batch */
    unsigned int gu_done[1];  /* [E+S], allocated larger */
};
