/* bench_moe.c - latency and effective bandwidth of the CUDA backend.
 *
 *   bench_moe [--preset deepseek-v3|qwen3-30b-a3b|...] [--layers N] [--iters N]
 *             [--tokens 1,4,16,64,256] (at most BENCH_MAX_POINTS values)
 *
 * Shapes (--preset) come from the GPU op-test table, tests/gpu/moe_cases.h
 * (with their default layer counts); any served shape there can be timed.
 *
 * Weights: random NVFP4 generated on the device (moed_cuda_src.random_weights)
 * for N layers, so consecutive batches rotate across layers and stream from
 * HBM, not L2 (deepseek-v3: 6.4 GB per layer; L2 is 60 MB). Routing: uniform
 * random top-k with distinct experts per token, new ids every batch.
 * Each batch is submitted alone and waited for (a decode step's layers are
 * sequential), so the latency is end to end through the backend: host ring,
 * x read over PCIe from pinned host memory (the backend's host_alloc, as the
 * daemon's read buffers), kernel, y written back in place, completion thread.
 * Bytes = distinct experts touched (routed + shared) x bytes per expert
 * (E2M1 codes + E4M3 scales of gate, up, down); TB/s = bytes / median time.
 * A streaming-read kernel over 4 GB in the same run gives the ceiling.
 *
 * Baselines in the same run (bench_baseline.h): (a) the same NVFP4 math as
 * one kernel launch per stage in a CUDA graph, (b) bf16 weights + cuBLAS
 * GEMMs per touched expert in a CUDA graph; each checked against moed's
 * output (relative L2) on the same batch. The persistent kernel exits when
 * idle (engine.idle_exit_ms) before they run, so they have the GPU to
 * themselves.
 * Dispatch latency: host CLOCK_REALTIME stamps of the head store and of the
 * completion thread's first sight of done_seq, against the kernel's
 * %globaltimer phases, with the clock offset from a mapped-memory ping-pong.
 * BENCH_CSV=path appends one row per (model, T). BENCH_PROFILE_RANGE=1 makes
 * each T's timed batches one profiler range (cudaProfilerStart/Stop, the
 * kernel idle at both ends) and prints their distinct experts' bytes, for
 * the DRAM-bytes-per-batch report (scripts/device-profile.sh dram);
 * BENCH_PROFILE_RANGE=busy makes a range of BENCH_PROFILE_MS (500) of
 * batches back to back after them instead, for the stall and pipe figures
 * of the busy kernel (scripts/device-profile.sh range).
 * Energy (bench/lib/power.h, NVML): per T, BENCH_ENERGY_MS (default 300; 0:
 * none) of the same batches back to back, the board's energy counter read
 * at both ends: joules per GB of distinct expert bytes, the mean power, and
 * the SM clock sampled every 10 ms (the clock the power cap leaves); the
 * sustained streaming read gets the same window, for the floor.
 * BENCH_TASKLOG=dir (a kernel built with -DMOE_GPU_TASK_LOG=1): after each
 * T's timed batches, the last batch's task log (moe_gpu_task_log) to
 * dir/PRESET-TT.bin, the header array then the entries, little-endian u64
 * (scripts/tasklog.py reads it).
 */
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "backend_cuda.h"
#include "backend_cuda_hooks.h"
#include "moed_util.h"
#include "bench_baseline.h"
#include "gpu/moe_cases.h"
#include "moed_err.h"
#include "moed_log.h"
#include "nvfp4.h"
#include "power.h"

/* batch sizes one run may time (--tokens: the make bench table, or the
 * 1..512 sweep of scripts/run-bench.sh) */
#define BENCH_MAX_POINTS 32

static volatile int g_done;

static void on_done(void *ctx, struct moed_batch *b)
{
    (void)ctx;
    (void)b;
    __atomic_store_n(&g_done, 1, __ATOMIC_RELEASE);
}

static uint64_t rng(uint64_t *s) { return moed_splitmix64(s); }

static double now_us(void) { return (double)moed_mono_ns() * 1e-3; }

/* v printed with fmt, or "n/a" where v < 0 (not measured); four slots, so
 * that one printf can hold four of them */
static const char *fmt_opt(double v, const char *fmt, int slot)
{
    static char buf[4][32];
    if (v < 0)
        return "n/a";
    snprintf(buf[slot & 3], sizeof buf[0], fmt, v);
    return buf[slot & 3];
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Uniform random top-k with distinct experts per token, weights 1/k;
 * returns the number of distinct experts (shared included). */
static uint32_t gen_routing(const struct moe_gpu_dims *d, uint32_t T, uint64_t *s, int32_t *ids,
                            float *w, uint8_t *seen)
{
    memset(seen, 0, d->n_experts);
    uint32_t distinct = d->n_shared;
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t j = 0; j < d->top_k; j++) {
            int32_t e;
            uint32_t q;
            do {
                e = (int32_t)(rng(s) % d->n_experts);
                for (q = 0; q < j && ids[t * d->top_k + q] != e; q++)
                    ;
            } while (q < j);
            ids[t * d->top_k + j] = e;
            w[t * d->top_k + j] = 1.0f / d->top_k;
            if (!seen[e]) {
                seen[e] = 1;
                distinct++;
            }
        }
    return distinct;
}

static double median(double *v, uint32_t n)
{
    qsort(v, n, sizeof *v, cmp_d);
    return v[n / 2];
}

/* One batch through moed, waited for by spinning on the done callback. */
static int moed_one(struct moed_backend *be, uint32_t layer, uint32_t T, uint32_t k, uint32_t H,
                    uint16_t *x, int32_t *ids, float *w, uint16_t *y, int xy_kind)
{
    struct moed_batch b = {0};
    b.layer = layer;
    b.n_tokens = T;
    b.top_k = k;
    b.x = (struct moed_buf){xy_kind, 0, x, (uint64_t)T * H * 2};
    b.ids = (struct moed_buf){MOED_BUF_HOST, 0, ids, (uint64_t)T * k * 4};
    b.w = (struct moed_buf){MOED_BUF_HOST, 0, w, (uint64_t)T * k * 4};
    b.y = (struct moed_buf){xy_kind, 0, y, (uint64_t)T * H * 2};
    g_done = 0;
    if (moed_backend_submit(be, &b))
        return -1;
    while (!__atomic_load_n(&g_done, __ATOMIC_ACQUIRE))
        ;
    return b.status ? -1 : 0;
}

/* Batches back to back for ms (one at least), fresh routing for each: 0, or
 * 1 (said on stderr, naming what) when one fails; *nb batches were run and
 * *dsum is their distinct experts */
static int back_to_back(struct moed_backend *be, const struct moe_gpu_dims *d, uint32_t T,
                        uint32_t layers, uint64_t *s, int32_t *ids, float *w, uint8_t *seen,
                        uint16_t *x, uint16_t *y, int xy_kind, double ms, const char *what,
                        uint32_t *nb, double *dsum)
{
    *nb = 0;
    *dsum = 0;
    for (const double t_end = now_us() + ms * 1e3; *nb == 0 || now_us() < t_end; ++*nb) {
        *dsum += gen_routing(d, T, s, ids, w, seen);
        if (moed_one(be, *nb % layers, T, d->top_k, d->hidden, x, ids, w, y, xy_kind)) {
            fprintf(stderr, "batch (%s) failed\n", what);
            return 1;
        }
    }
    return 0;
}

/* *out = the environment's name as ms in [lo, 60000], or def when unset;
 * -1 (said on stderr) when it is not such a number */
static int env_ms(const char *name, double def, double lo, double *out)
{
    const char *v = getenv(name);
    char *end;
    *out = def;
    if (!v || !*v)
        return 0;
    *out = strtod(v, &end);
    if (*end || !(*out >= lo && *out <= 60000)) {
        fprintf(stderr, "%s=%s: not a number of ms in [%.0f, 60000]\n", name, v, lo);
        return -1;
    }
    return 0;
}

/* Wait (up to 3 s) for the persistent kernel's idle exit: the clock ping-pong
 * and the baselines need SMs it would otherwise hold (its grid takes every
 * register of every SM). Returns 1 if it is still resident. */
static int wait_idle(struct moed_backend *be)
{
    for (int q = 0; q < 3000 && moed_backend_cuda_running(be); q++)
        usleep(1000);
    return moed_backend_cuda_running(be);
}

/* BENCH_TASKLOG: the last batch's task log to dir/PRESET-TT.bin, with the
 * kernel gone (idle exit) so that nothing rewrites it meanwhile */
static int tasklog_write(struct moed_backend *be, const char *dir, const char *preset, uint32_t T)
{
    const size_t nh = (size_t)MOE_GPU_TLOG_CTAS * 8, ne = (size_t)MOE_GPU_TLOG_CTAS * MOE_GPU_TLOG_N * 8;
    uint64_t *h = malloc(nh * sizeof *h), *e = malloc(ne * sizeof *e);
    char err[MOED_ERRLEN] = "", path[4096];
    int rc = 1;
    FILE *f = NULL;
    if ((size_t)snprintf(path, sizeof path, "%s/%s-T%u.bin", dir, preset, T) >= sizeof path)
        fprintf(stderr, "BENCH_TASKLOG: directory name over %zu bytes\n", sizeof path - 32);
    else if (!h || !e)
        fprintf(stderr, "BENCH_TASKLOG: out of memory\n");
    else if (wait_idle(be))
        fprintf(stderr, "BENCH_TASKLOG: the kernel did not idle out\n");
    else if (moe_gpu_task_log(h, e, err, sizeof err))
        fprintf(stderr, "BENCH_TASKLOG: %s\n", err);
    else if (!(f = fopen(path, "wb")) || fwrite(h, sizeof *h, nh, f) != nh ||
             fwrite(e, sizeof *e, ne, f) != ne)
        fprintf(stderr, "BENCH_TASKLOG: cannot write %s\n", path);
    else
        rc = 0;
    if (f && fclose(f) && !rc) {
        fprintf(stderr, "BENCH_TASKLOG: cannot write %s\n", path);
        rc = 1;
    }
    if (!rc)
        printf("# task log: %s\n", path);
    free(h);
    free(e);
    return rc;
}

static double rt_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

int main(int argc, char **argv)
{
    const char *preset = "deepseek-v3";
    uint32_t layers = 0, iters = 0, bf16_layers = 0;
    int baselines = 1;
    uint32_t toks[BENCH_MAX_POINTS] = {0};
    int n_toks = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--preset") && i + 1 < argc)
            preset = argv[++i];
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc)
            layers = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bf16-layers") && i + 1 < argc)
            bf16_layers = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-baselines"))
            baselines = 0;
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
            for (char *t = strtok(argv[++i], ","); t && n_toks < BENCH_MAX_POINTS; t = strtok(NULL, ","))
                toks[n_toks++] = (uint32_t)atoi(t);
        } else {
            fprintf(stderr, "usage: %s [--preset SHAPE (tests/gpu/moe_cases.h)] [--layers N] "
                            "[--bf16-layers N] [--iters N] [--tokens 1,4,16] [--no-baselines]\n",
                    argv[0]);
            return 2;
        }
    }
    const struct moe_shape *sh = moe_shapes_resolve() ? NULL : moe_shape_find(preset);
    if (!sh) {
        fprintf(stderr, "unknown preset %s (the shapes of tests/gpu/moe_cases.h)\n", preset);
        return 2;
    }
    const struct moe_gpu_dims d = {sh->H, sh->I, sh->E, sh->S, sh->k, 512};
    if (!layers)
        layers = sh->bench_layers ? sh->bench_layers : 4;
    if (!bf16_layers)
        bf16_layers = sh->bench_bf16_layers ? sh->bench_bf16_layers : layers;
    if (bf16_layers > layers)
        bf16_layers = layers;
    if (!n_toks) {
        uint32_t def[] = {1, 4, 16, 64, 256};
        for (int i = 0; i < 5; i++)
            toks[n_toks++] = def[i];
    }
    for (int i = 0; i < n_toks; i++)
        if (toks[i] == 0 || toks[i] > d.max_tokens) {
            fprintf(stderr, "--tokens: %u not in [1, %u]\n", toks[i], d.max_tokens);
            return 2;
        }
    /* BENCH_PROFILE_RANGE=1: each T's timed batches are one profiler range
     * (cudaProfilerStart/Stop, with the kernel idle at both ends), for
     * Nsight Compute's range replay: scripts/device-profile.sh dram.
     * BENCH_PROFILE_RANGE=busy: after each T's timed batches, a range of
     * BENCH_PROFILE_MS (default 500) of batches back to back, so that the
     * kernel's idle polling (the idle exit's 20 ms at the range's end) is a
     * small part of it: scripts/device-profile.sh range */
    const char *tasklog = getenv("BENCH_TASKLOG");
    if (tasklog && !*tasklog)
        tasklog = NULL;
    const char *pr = getenv("BENCH_PROFILE_RANGE");
    int prof_range = 0;
    if (pr && *pr && strcmp(pr, "0")) {
        if (!strcmp(pr, "1"))
            prof_range = 1;
        else if (!strcmp(pr, "busy"))
            prof_range = 2;
        else {
            fprintf(stderr, "BENCH_PROFILE_RANGE=%s: not 0, 1 or busy\n", pr);
            return 2;
        }
    }
    double prof_ms, energy_ms;
    if (env_ms("BENCH_PROFILE_MS", 500, 1, &prof_ms) || env_ms("BENCH_ENERGY_MS", 300, 0, &energy_ms))
        return 2;
    moed_log_set_level(MOED_LOG_WARN);
    char err[MOED_ERRLEN] = "";

    /* %globaltimer - CLOCK_REALTIME, before anything else holds the GPU */
    int64_t clk_off = 0, clk_half = 0;
    if (bl_clock_offset(200, &clk_off, &clk_half, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }

    /* streaming-read ceiling */
    void *probe = NULL;
    float ms = 0;
    const uint64_t pb = 4ull << 30;
    int reps = 20;
    if (cudaMalloc(&probe, pb) != cudaSuccess || cudaMemset(probe, 0x5a, pb) != cudaSuccess ||
        moe_gpu_read_bw(probe, pb, reps, &ms, err, sizeof err) != 0) {
        fprintf(stderr, "read probe failed: %s\n", err);
        return 1;
    }
    double stream_tbs = (double)pb * reps / (ms * 1e-3) / 1e12;
    /* the same read sustained for ~0.5 s, as long as a batch stream runs: HBM
     * streams slower once warm (H200: tile_probe 4.27 TB/s over 20 passes,
     * 3.84 over 2000). Printed for reference; the fractions use the short one. */
    float ms_s = 0;
    const int reps_s = 500;
    /* the board's energy over that read: the joules per GB of the stream */
    struct bench_power *pw = NULL;
    char pci[32], perr[MOED_ERRLEN] = "";
    if (energy_ms > 0) {
        if (cudaDeviceGetPCIBusId(pci, sizeof pci, 0) != cudaSuccess)
            snprintf(perr, sizeof perr, "power: no PCI bus id for GPU 0");
        else
            pw = bench_power_open(pci, NULL, perr, sizeof perr);
    }
    struct bench_power_window swin = {0};
    if (pw && bench_power_start(pw, perr, sizeof perr)) {
        bench_power_close(pw);
        pw = NULL;
    }
    if (moe_gpu_read_bw(probe, pb, reps_s, &ms_s, err, sizeof err) != 0) {
        fprintf(stderr, "read probe failed: %s\n", err);
        return 1;
    }
    if (pw && bench_power_stop(pw, &swin, perr, sizeof perr)) {
        bench_power_close(pw);
        pw = NULL;
    }
    const double stream_jpgb = pw ? swin.joules / ((double)pb * reps_s / 1e9) : 0;
    cudaFree(probe);
    const double stream_sus = (double)pb * reps_s / (ms_s * 1e-3) / 1e12;

    static const int gpu0[1] = {0};
    struct moed_backend_cfg cfg = {0};
    cfg.gpus = gpu0;
    cfg.n_gpus = 1;
    cfg.max_tokens = 512;
    cfg.batch_deadline_ms = 60000;
    cfg.idle_exit_ms = 20; /* the baselines run on a GPU the persistent kernel has left */
    struct moed_cuda_src src = {0};
    src.n_layers = layers;
    src.dims = d;
    src.random_weights = 1;
    src.seed = 42;
    struct moed_backend *be = NULL;
    if (moed_backend_cuda_open_src(&src, &cfg, on_done, NULL, &be, err, sizeof err)) {
        fprintf(stderr, "open: %s\n", err);
        return 1;
    }
    struct bl_ctx *bl = NULL;
    if (baselines) {
        struct moe_gpu_layer *lp = calloc(layers, sizeof *lp);
        struct moe_gpu_dims dd;
        for (uint32_t l = 0; lp && l < layers; l++)
            if (moed_backend_cuda_layer_ptrs(be, l, &lp[l], &dd)) {
                fprintf(stderr, "layer %u: no pointers\n", l);
                return 1;
            }
        if (!lp || bl_open(&d, lp, layers, bf16_layers, &bl, err, sizeof err)) {
            fprintf(stderr, "baselines: %s\n", lp ? err : "out of memory");
            return 1;
        }
        free(lp);
    }
    char desc[512];
    be->ops->describe(be, desc, sizeof desc);
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("# %s, %s, %u layers of random NVFP4 in device memory%s\n# %s\n", prop.name, preset,
           layers, baselines ? "" : " (no baselines)", desc);
    printf("# streaming read (4 GB x %d): %.3f TB/s; sustained (4 GB x %d): %.3f TB/s\n", reps,
           stream_tbs, reps_s, stream_sus);
    if (pw)
        printf("# energy: sustained read %.0f W (sampled draw p50 %.0f W, limit %.0f W), %.3f J/GB, "
               "SM clock p50 %.0f MHz (%.0f-%.0f over %u samples); per T below: BENCH_ENERGY_MS "
               "%.0f of batches back to back, J/GB of distinct expert bytes\n", swin.watts,
               swin.draw_w_p50, swin.limit_w, stream_jpgb, swin.sm_mhz_p50, swin.sm_mhz_min,
               swin.sm_mhz_max, swin.samples, energy_ms);
    else if (energy_ms > 0)
        printf("# energy: not measured (%s)\n", perr);
    printf("# clock: globaltimer - CLOCK_REALTIME = %lld ns, +- %lld ns (half the best of 200 "
           "mapped-memory round trips)\n", (long long)clk_off, (long long)clk_half);
    if (baselines)
        printf("# baselines: (a) staged = NVFP4, one launch per stage (route, gate_up, act, down, "
               "combine) in a CUDA graph; (b) cublas = bf16 weights (%u layers), cublasGemmEx per "
               "touched expert in a CUDA graph; inputs already on the device\n", bf16_layers);

    const uint64_t per_expert = moe_gpu_gu_bytes(d.hidden, d.inter) + moe_gpu_dn_bytes(d.hidden, d.inter);
    printf("# bytes per expert (codes + scales, gate+up+down): %llu\n",
           (unsigned long long)per_expert);
    printf("# TB/s, frac: over the end-to-end p50 (host staging, PCIe, kernel, completion);\n"
           "# TB/s_k, frac_k: over kernel time (phase stamps: head seen -> batch complete)\n");
    printf("%-14s %5s %8s %10s %10s %10s %10s %8s %8s %10s %8s %8s\n", "model", "T", "experts", "MB",
           "p50_us", "p10_us", "p90_us", "TB/s", "frac", "kernel_us", "TB/s_k", "frac_k");
    FILE *csv = NULL;
    const char *csv_path = getenv("BENCH_CSV");
    if (csv_path && *csv_path) {
        csv = fopen(csv_path, "a");
        if (!csv) {
            fprintf(stderr, "BENCH_CSV %s: cannot open\n", csv_path);
            return 1;
        }
        fseek(csv, 0, SEEK_END);
        if (ftell(csv) == 0)
            fprintf(csv, "model,T,experts,MB,moed_p50_us,moed_p10_us,moed_p90_us,moed_TBps,frac,"
                         "staged_p50_us,cublas_p50_us,staged_relL2,cublas_relL2,kernel_us,"
                         "dispatch_us,complete_us,payload_copy_us,moed_dev_p50_us,frac_kernel,"
                         "energy_J_per_GB,power_W,sm_MHz,timed_sm_MHz,timed_draw_W,temp_C,"
                         "capped_share,thermal_share\n");
    }
    struct row {
        uint32_t T;
        double dist, mb, p50, p50d, a50, b50, arel, brel, disp, comp, kern, tbs;
    } rows[BENCH_MAX_POINTS];
    uint64_t s = 7;
    for (int ti = 0; ti < n_toks; ti++) {
        uint32_t T = toks[ti];
        uint32_t n_it = iters ? iters : (T <= 16 ? 400 : T <= 64 ? 200 : 100);
        /* x and y where the daemon has them: pinned host memory from the
         * backend's host_alloc (its read buffers and reply frames), which the
         * kernel reads and writes in place; plain memory (staged) without it */
        const size_t xy_bytes = (size_t)T * d.hidden * 2;
        uint16_t *x = be->ops->host_alloc ? be->ops->host_alloc(be, xy_bytes) : NULL;
        uint16_t *y = be->ops->host_alloc ? be->ops->host_alloc(be, xy_bytes) : NULL;
        const int xy_kind = x && y ? MOED_BUF_PINNED : MOED_BUF_HOST;
        if (xy_kind == MOED_BUF_HOST) {
            if (x)
                be->ops->host_free(be, x);
            if (y)
                be->ops->host_free(be, y);
            x = malloc(xy_bytes);
            y = malloc(xy_bytes);
        }
        uint16_t *ym = malloc((size_t)T * d.hidden * 2), *yb = malloc((size_t)T * d.hidden * 2);
        int32_t *ids = malloc((size_t)T * d.top_k * 4);
        float *w = malloc((size_t)T * d.top_k * 4);
        double *lat = malloc(n_it * sizeof *lat);
        double *phs[9];
        for (int k = 0; k < 9; k++)
            phs[k] = malloc(n_it * sizeof *phs[k]);
        double distinct_sum = 0;
        uint8_t *seen = calloc(d.n_experts, 1);
        if (!x || !y || !ym || !yb || !ids || !w || !lat || !seen || !phs[8]) {
            fprintf(stderr, "out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < (size_t)T * d.hidden; i++)
            x[i] = bf16_from_float((float)((int)(rng(&s) % 2001) - 1000) / 1000.0f);
        /* clock offset before and after this T's batches, interpolated per
         * batch: the offset drifts (78 us over one deepseek-v3 run, H200
         * 2026-11-29), so one calibration at the start is not enough */
        int64_t off_a = clk_off, off_b, half_a = clk_half, half_b = 0;
        double ta, tb;
        if (wait_idle(be) || bl_clock_offset(100, &off_a, &half_a, err, sizeof err))
            off_a = clk_off, half_a = clk_half; /* fall back to the start-up offset */
        ta = rt_us();
        uint64_t *raw = malloc(n_it * 4 * sizeof *raw);
        if (!raw) {
            fprintf(stderr, "out of memory\n");
            return 1;
        }
        /* the clock, draw, temperature and clock event reasons while these
         * very batches run (the energy window below is another run of them) */
        struct bench_power_window twin;
        int twin_ok = pw && bench_power_start(pw, perr, sizeof perr) == 0;
        for (uint32_t it = 0; it < n_it + 10; it++) {
            if (it == 10 && prof_range == 1 &&
                (wait_idle(be) || cudaProfilerStart() != cudaSuccess)) {
                fprintf(stderr, "BENCH_PROFILE_RANGE: could not start the range\n");
                return 1;
            }
            uint32_t distinct = gen_routing(&d, T, &s, ids, w, seen);
            double t0 = now_us();
            if (moed_one(be, it % layers, T, d.top_k, d.hidden, x, ids, w, y, xy_kind)) {
                fprintf(stderr, "batch failed\n");
                return 1;
            }
            double t1 = now_us();
            if (it >= 10) {
                uint64_t ph[6], hs[2];
                moed_backend_cuda_phases(be, ph);
                moed_backend_cuda_host_stamps(be, hs);
                lat[it - 10] = t1 - t0;
                /* [3], [4] (per-tile ends) exist only with MOE_GPU_PHASES=1 */
                int have34 = ph[3] > ph[2] && ph[4] > ph[3] && ph[5] > ph[4];
                for (int k = 0; k < 5; k++)
                    phs[k][it - 10] = (double)(ph[k + 1] - ph[k]) * 1e-3;
                if (!have34) {
                    phs[2][it - 10] = (double)(ph[5] - ph[2]) * 1e-3;
                    phs[3][it - 10] = phs[4][it - 10] = 0;
                }
                phs[5][it - 10] = (t1 - t0) - (double)(ph[5] - ph[0]) * 1e-3;
                /* host head store -> kernel sees head; kernel done -> host sees
                 * it: computed below with the interpolated offset */
                raw[(it - 10) * 4 + 0] = ph[0];
                raw[(it - 10) * 4 + 1] = ph[5];
                raw[(it - 10) * 4 + 2] = hs[0];
                raw[(it - 10) * 4 + 3] = hs[1];
                phs[8][it - 10] = (double)(ph[5] - ph[0]) * 1e-3;
                distinct_sum += distinct;
            }
        }
        if (twin_ok && bench_power_stop(pw, &twin, perr, sizeof perr))
            twin_ok = 0;
        if (prof_range == 1) {
            /* the range ends with the kernel gone (idle exit): every batch of
             * it, and nothing else, is counted */
            if (wait_idle(be) || cudaProfilerStop() != cudaSuccess) {
                fprintf(stderr, "BENCH_PROFILE_RANGE: could not end the range\n");
                return 1;
            }
            printf("# profile-range T=%u batches=%u distinct_bytes=%.0f\n", T, n_it,
                   distinct_sum * (double)per_expert);
        }
        if (prof_range == 2) { /* busy: batches back to back, the same routing draw */
            uint32_t nb;
            double dsum;
            if (wait_idle(be) || cudaProfilerStart() != cudaSuccess) {
                fprintf(stderr, "BENCH_PROFILE_RANGE: could not start the range\n");
                return 1;
            }
            if (back_to_back(be, &d, T, layers, &s, ids, w, seen, x, y, xy_kind, prof_ms,
                             "profile range", &nb, &dsum))
                return 1;
            if (wait_idle(be) || cudaProfilerStop() != cudaSuccess) {
                fprintf(stderr, "BENCH_PROFILE_RANGE: could not end the range\n");
                return 1;
            }
            printf("# profile-range T=%u batches=%u distinct_bytes=%.0f busy_ms=%.0f\n", T, nb,
                   dsum * (double)per_expert, prof_ms);
        }
        if (tasklog && tasklog_write(be, tasklog, preset, T))
            return 1;
        /* the kernel exits when idle; then the second calibration */
        off_b = off_a;
        half_b = half_a;
        if (wait_idle(be) || bl_clock_offset(100, &off_b, &half_b, err, sizeof err))
            off_b = off_a, half_b = half_a;
        tb = rt_us();
        for (uint32_t i = 0; i < n_it; i++) {
            double th = (double)raw[i * 4 + 2] * 1e-3;
            double f = tb > ta ? (th - ta) / (tb - ta) : 0;
            double off = (double)off_a + f * (double)(off_b - off_a);
            phs[6][i] = ((double)(int64_t)(raw[i * 4 + 0] - raw[i * 4 + 2]) - off) * 1e-3;
            phs[7][i] = ((double)(int64_t)(raw[i * 4 + 3] - raw[i * 4 + 1]) + off) * 1e-3;
        }
        free(raw);
        /* the same batches with x and y in device memory (the CUDA IPC
         * deployment: no host staging, no PCIe for x; the baselines' inputs
         * are on the device too) */
        double p50_dev = -1;
        {
            void *xd = NULL, *yd = NULL;
            double *ld = malloc(n_it * sizeof *ld);
            if (!ld || cudaMalloc(&xd, (size_t)T * d.hidden * 2) != cudaSuccess ||
                cudaMalloc(&yd, (size_t)T * d.hidden * 2) != cudaSuccess ||
                cudaMemcpy(xd, x, (size_t)T * d.hidden * 2, cudaMemcpyHostToDevice) != cudaSuccess) {
                fprintf(stderr, "device buffers: allocation failed\n");
                return 1;
            }
            for (uint32_t it = 0; it < n_it + 10; it++) {
                gen_routing(&d, T, &s, ids, w, seen);
                double t0 = now_us();
                if (moed_one(be, it % layers, T, d.top_k, d.hidden, xd, ids, w, yd, MOED_BUF_DEVICE)) {
                    fprintf(stderr, "batch (device buffers) failed\n");
                    return 1;
                }
                if (it >= 10)
                    ld[it - 10] = now_us() - t0;
            }
            p50_dev = median(ld, n_it);
            free(ld);
            cudaFree(xd);
            cudaFree(yd);
        }
        double clk_unc = (double)(half_a > half_b ? half_a : half_b) * 1e-3;
        qsort(lat, n_it, sizeof *lat, cmp_d);
        double dist = distinct_sum / n_it, bytes = dist * (double)per_expert;
        double p50 = lat[n_it / 2], tbs = bytes / (p50 * 1e-6) / 1e12;
        double p10 = lat[n_it / 10], p90 = lat[n_it * 9 / 10];
        /* phase medians: where the time goes inside one batch */
        double med[9];
        for (int k = 0; k < 9; k++)
            med[k] = median(phs[k], n_it);
        /* the figure: bytes over kernel time (head seen -> batch complete) */
        const double tbs_k = med[8] > 0 ? bytes / (med[8] * 1e-6) / 1e12 : 0;
        printf("%-14s %5u %8.1f %10.1f %10.1f %10.1f %10.1f %8.3f %8.3f %10.1f %8.3f %8.3f\n", preset,
               T, dist, bytes / 1e6, p50, p10, p90, tbs, tbs / stream_tbs, med[8], tbs_k,
               tbs_k / stream_tbs);
        printf("%-14s %5s   phases p50 us: release %.1f  x-stage %.1f  tiles %.1f  down-tail %.1f"
               "  combine %.1f  host+pcie %.1f\n", "", "", med[0], med[1], med[2], med[3], med[4],
               med[5]);
        if (twin_ok)
            printf("%-14s %5s   while timed: SM clock p50 %.0f MHz (%.0f-%.0f), draw p50 %.0f W, "
                   "GPU %s C (max %s), clock held by the power cap in %s of samples, by a thermal "
                   "slowdown in %s (%u samples, every 10 ms; clock event reasons seen: 0x%llx)\n",
                   "", "", twin.sm_mhz_p50, twin.sm_mhz_min, twin.sm_mhz_max, twin.draw_w_p50,
                   fmt_opt(twin.temp_c_p50, "%.0f", 0), fmt_opt(twin.temp_c_max, "%.0f", 1),
                   fmt_opt(twin.capped_share * 100, "%.0f%%", 2),
                   fmt_opt(twin.thermal_share * 100, "%.0f%%", 3), twin.samples, twin.reasons_any);
        printf("%-14s %5s   x, y in device memory: p50 %.1f us (%.3f TB/s)\n", "", "", p50_dev,
               bytes / (p50_dev * 1e-6) / 1e12);
        /* payload copy: x in and y out through the pinned staging (host memcpy) */
        double cp[21];
        for (int r = 0; r < 21; r++) {
            double c0 = now_us();
            memcpy(ym, x, (size_t)T * d.hidden * 2);
            memcpy(yb, ym, (size_t)T * d.hidden * 2);
            cp[r] = now_us() - c0;
        }
        double cpy = median(cp, 21);
        printf("%-14s %5s   dispatch p50 us: head store -> kernel sees it %.2f, kernel done -> "
               "host sees it %.2f (clock +- %.2f, offset drift %.1f); kernel %.1f; payload memcpy "
               "in+out %.1f\n", "", "", med[6], med[7], clk_unc, (double)(off_b - off_a) * 1e-3,
               med[8], cpy);

        /* energy: the same batches (x, y in pinned host memory) back to back
         * for energy_ms, the board's counter at both ends */
        double jpgb = -1, watts = -1, mhz = -1;
        if (pw) {
            struct bench_power_window win;
            uint32_t nb = 0;
            double bsum = 0;
            int ok = bench_power_start(pw, perr, sizeof perr) == 0;
            if (ok && back_to_back(be, &d, T, layers, &s, ids, w, seen, x, y, xy_kind, energy_ms,
                                   "energy", &nb, &bsum))
                return 1;
            if (ok && bench_power_stop(pw, &win, perr, sizeof perr) == 0 && bsum > 0) {
                jpgb = win.joules / (bsum * (double)per_expert / 1e9);
                watts = win.watts;
                mhz = win.sm_mhz_p50;
                /* the sampled draw beside the counter's mean: a cross-check of
                 * the counter's resolution over a short window */
                printf("%-14s %5s   energy: %u batches back to back in %.0f ms: %.0f W (sampled "
                       "draw p50 %.0f W), %.3f J/GB (%.2fx the sustained read's), SM clock p50 "
                       "%.0f MHz (%.0f-%.0f)\n", "", "", nb, win.seconds * 1e3, watts,
                       win.draw_w_p50, jpgb,
                       stream_jpgb > 0 ? jpgb / stream_jpgb : 0,
                       mhz, win.sm_mhz_min, win.sm_mhz_max);
            } else {
                printf("%-14s %5s   energy: not measured (%s)\n", "", "", perr);
            }
        }

        struct row *rw = &rows[ti];
        memset(rw, 0, sizeof *rw);
        rw->T = T;
        rw->dist = dist;
        rw->mb = bytes / 1e6;
        rw->p50 = p50;
        rw->p50d = p50_dev;
        rw->tbs = tbs;
        rw->disp = med[6];
        rw->comp = med[7];
        rw->kern = med[8];
        rw->a50 = rw->b50 = rw->arel = rw->brel = -1;
        if (bl) {
            /* BL_SLOTS batches; slot 0 also through moed (layer 0) for the check */
            uint16_t *xs[BL_SLOTS];
            int32_t *is[BL_SLOTS];
            float *ws[BL_SLOTS];
            for (int q = 0; q < BL_SLOTS; q++) {
                xs[q] = malloc((size_t)T * d.hidden * 2);
                is[q] = malloc((size_t)T * d.top_k * 4);
                ws[q] = malloc((size_t)T * d.top_k * 4);
                if (!xs[q] || !is[q] || !ws[q]) {
                    fprintf(stderr, "out of memory\n");
                    return 1;
                }
                for (size_t i = 0; i < (size_t)T * d.hidden; i++)
                    xs[q][i] = bf16_from_float((float)((int)(rng(&s) % 2001) - 1000) / 1000.0f);
                gen_routing(&d, T, &s, is[q], ws[q], seen);
            }
            if (moed_one(be, 0, T, d.top_k, d.hidden, xs[0], is[0], ws[0], ym, MOED_BUF_HOST)) {
                fprintf(stderr, "check batch failed\n");
                return 1;
            }
            /* wait for the idle exit: the baselines get the whole GPU */
            if (wait_idle(be))
                printf("# warning: persistent kernel still resident during the baselines\n");
            for (int q = 0; q < BL_SLOTS; q++)
                if (bl_set_batch(bl, (uint32_t)q, T, xs[q], is[q], ws[q], err, sizeof err)) {
                    fprintf(stderr, "%s\n", err);
                    return 1;
                }
            double res[2] = {0, 0}, rel[2] = {0, 0};
            for (int which = 0; which < 2; which++) {
                double us;
                if (bl_run(bl, which, 0, yb, &us, err, sizeof err)) {
                    fprintf(stderr, "%s\n", err);
                    return 1;
                }
                rel[which] = bf16_rel_l2(yb, ym, (size_t)T * d.hidden);
                uint32_t nb = n_it < 100 ? n_it : 100;
                for (uint32_t it = 0; it < nb + 2 * BL_SLOTS; it++) {
                    if (bl_run(bl, which, it % BL_SLOTS, NULL, &us, err, sizeof err)) {
                        fprintf(stderr, "%s\n", err);
                        return 1;
                    }
                    if (it >= 2 * BL_SLOTS)
                        lat[it - 2 * BL_SLOTS] = us;
                }
                res[which] = median(lat, nb);
            }
            rw->a50 = res[0];
            rw->b50 = res[1];
            rw->arel = rel[0];
            rw->brel = rel[1];
            printf("%-14s %5s   baselines p50 us: staged %.1f (%.2fx moed, rel L2 %.1e), cublas "
                   "%.1f (%.2fx moed, rel L2 %.1e)%s\n", "", "", res[0], res[0] / p50, rel[0],
                   res[1], res[1] / p50, rel[1],
                   (rel[0] < 1e-2 && rel[1] < 1e-2) ? "" : "  CHECK FAILED (rel L2 >= 1e-2)");
            for (int q = 0; q < BL_SLOTS; q++) {
                free(xs[q]);
                free(is[q]);
                free(ws[q]);
            }
        }
        if (csv)
            fprintf(csv, "%s,%u,%.1f,%.1f,%.1f,%.1f,%.1f,%.3f,%.3f,%.1f,%.1f,%.2e,%.2e,%.1f,%.2f,%.2f,%.1f,%.1f,%.3f,"
                         "%.4f,%.1f,%.0f,%.0f,%.0f,%.0f,%.2f,%.2f\n",
                    preset, T, dist, bytes / 1e6, p50, p10, p90, tbs,
                    tbs / stream_tbs, rw->a50, rw->b50, rw->arel, rw->brel, med[8], med[6], med[7],
                    cpy, p50_dev, tbs_k / stream_tbs, jpgb, watts, mhz,
                    twin_ok ? twin.sm_mhz_p50 : -1, twin_ok ? twin.draw_w_p50 : -1,
                    twin_ok ? twin.temp_c_p50 : -1, twin_ok ? twin.capped_share : -1,
                    twin_ok ? twin.thermal_share : -1);
        fflush(stdout);
        if (xy_kind == MOED_BUF_PINNED) { /* queued; freed when the backend closes */
            be->ops->host_free(be, x);
            be->ops->host_free(be, y);
        } else {
            free(x);
            free(y);
        }
        free(ym);
        free(yb);
        free(ids);
        free(w);
        free(lat);
        free(seen);
        for (int k = 0; k < 9; k++)
            free(phs[k]);
    }
    if (bl) {
        printf("\n# side by side (p50 us; speedup = baseline / moed; moed = x, y in pinned host "
               "memory read and written by the kernel in place, as the daemon's buffers; moed-dev = "
               "x, y in device memory like the baselines')\n");
        printf("%-14s %5s %10s %10s %10s %10s %8s %8s %10s %10s %10s\n", "model", "T", "moed",
               "moed-dev", "staged", "cublas", "x(a)", "x(b)", "x(b)dev", "disp_us", "compl_us");
        for (int ti = 0; ti < n_toks; ti++) {
            struct row *rw = &rows[ti];
            printf("%-14s %5u %10.1f %10.1f %10.1f %10.1f %8.2f %8.2f %10.2f %10.2f %10.2f\n",
                   preset, rw->T, rw->p50, rw->p50d, rw->a50, rw->b50, rw->a50 / rw->p50,
                   rw->b50 / rw->p50, rw->b50 / rw->p50d, rw->disp, rw->comp);
        }
    }
    int64_t off2 = 0, half2 = 0;
    moed_backend_close(be);
    bl_close(bl);
    bench_power_close(pw);
    if (bl_clock_offset(200, &off2, &half2, err, sizeof err) == 0)
        printf("# clock offset at the end: %lld ns (drift %lld ns)\n", (long long)off2,
               (long long)(off2 - clk_off));
    if (csv)
        fclose(csv);
    return 0;
}
