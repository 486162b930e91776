/* bench_moe.c - latency and effective bandwidth of the CUDA backend.
 *
 *   bench_moe [--preset deepseek-v3|qwen3-30b-a3b] [--layers N] [--iters N]
 *             [--tokens 1,4,16,64,256]
 *
 * Weights: random NVFP4 generated on the device (moed_cuda_src.random_weights)
 * for N layers, so consecutive batches rotate across layers and stream from
 * HBM, not L2 (deepseek-v3: 6.4 GB per layer; L2 is 60 MB). Routing: uniform
 * random top-k with distinct experts per token, new ids every batch.
 * Each batch is submitted alone and waited for (a decode step's layers are
 * sequential), so the latency is end to end through the backend: host ring,
 * staging of x over PCIe, kernel, completion thread.
 * Bytes = distinct experts touched (routed + shared) x bytes per expert
 * (E2M1 codes + E4M3 scales of gate, up, down); TB/s = bytes / median time.
 * A streaming-read kernel over 4 GB in the same run gives the ceiling.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "backend_cuda.h"
#include "moed_err.h"
#include "moed_log.h"
#include "nvfp4.h"

static volatile int g_done;

static void on_done(void *ctx, struct moed_batch *b)
{
    (void)ctx;
    (void)b;
    __atomic_store_n(&g_done, 1, __ATOMIC_RELEASE);
}

static uint64_t rng(uint64_t *s)
{
    uint64_t x = (*s += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    const char *preset = "deepseek-v3";
    uint32_t layers = 0, iters = 0;
    uint32_t toks[16] = {0};
    int n_toks = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--preset") && i + 1 < argc)
            preset = argv[++i];
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc)
            layers = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
            for (char *t = strtok(argv[++i], ","); t && n_toks < 16; t = strtok(NULL, ","))
                toks[n_toks++] = (uint32_t)atoi(t);
        } else {
            fprintf(stderr, "usage: %s [--preset deepseek-v3|qwen3-30b-a3b] [--layers N] "
                            "[--iters N] [--tokens 1,4,16]\n", argv[0]);
            return 2;
        }
    }
    struct moe_gpu_dims d;
    if (!strcmp(preset, "deepseek-v3")) {
        d = (struct moe_gpu_dims){7168, 2048, 256, 1, 8, 512};
        if (!layers)
            layers = 4;
    } else if (!strcmp(preset, "qwen3-30b-a3b")) {
        d = (struct moe_gpu_dims){2048, 768, 128, 0, 8, 512};
        if (!layers)
            layers = 24;
    } else {
        fprintf(stderr, "unknown preset %s\n", preset);
        return 2;
    }
    if (!n_toks) {
        uint32_t def[] = {1, 4, 16, 64, 256};
        for (int i = 0; i < 5; i++)
            toks[n_toks++] = def[i];
    }
    moed_log_set_level(MOED_LOG_WARN);

    /* streaming-read ceiling */
    void *probe = NULL;
    float ms = 0;
    const uint64_t pb = 4ull << 30;
    int reps = 20;
    if (cudaMalloc(&probe, pb) != cudaSuccess || cudaMemset(probe, 0x5a, pb) != cudaSuccess ||
        moe_gpu_read_bw(probe, pb, reps, &ms) != 0) {
        fprintf(stderr, "read probe failed\n");
        return 1;
    }
    cudaFree(probe);
    double stream_tbs = (double)pb * reps / (ms * 1e-3) / 1e12;

    static const int gpu0[1] = {0};
    struct moed_backend_cfg cfg = {0};
    cfg.gpus = gpu0;
    cfg.n_gpus = 1;
    cfg.max_tokens = 512;
    cfg.batch_deadline_ms = 60000;
    struct moed_cuda_src src = {0};
    src.n_layers = layers;
    src.dims = d;
    src.random_weights = 1;
    src.seed = 42;
    struct moed_backend *be = NULL;
    char err[MOED_ERRLEN] = "";
    if (moed_backend_cuda_open_src(&src, &cfg, on_done, NULL, &be, err, sizeof err)) {
        fprintf(stderr, "open: %s\n", err);
        return 1;
    }
    char desc[512];
    be->ops->describe(be, desc, sizeof desc);
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("# %s, %s, %u layers of random NVFP4 in device memory\n# %s\n", prop.name, preset,
           layers, desc);
    printf("# streaming read (4 GB x %d): %.3f TB/s\n", reps, stream_tbs);

    const uint64_t per_expert = moe_gpu_gu_bytes(d.hidden, d.inter) + moe_gpu_dn_bytes(d.hidden, d.inter);
    printf("# bytes per expert (codes + scales, gate+up+down): %llu\n",
           (unsigned long long)per_expert);
    printf("%-14s %5s %8s %10s %10s %10s %10s %8s %8s\n", "model", "T", "experts", "MB", "p50_us",
           "p10_us", "p90_us", "TB/s", "frac");
    uint64_t s = 7;
    for (int ti = 0; ti < n_toks; ti++) {
        uint32_t T = toks[ti];
        uint32_t n_it = iters ? iters : (T <= 16 ? 400 : T <= 64 ? 200 : 100);
        uint16_t *x = malloc((size_t)T * d.hidden * 2), *y = malloc((size_t)T * d.hidden * 2);
        int32_t *ids = malloc((size_t)T * d.top_k * 4);
        float *w = malloc((size_t)T * d.top_k * 4);
        double *lat = malloc(n_it * sizeof *lat);
        double *phs[6];
        for (int k = 0; k < 6; k++)
            phs[k] = malloc(n_it * sizeof *phs[k]);
        double distinct_sum = 0;
        uint8_t *seen = calloc(d.n_experts, 1);
        for (size_t i = 0; i < (size_t)T * d.hidden; i++)
            x[i] = bf16_from_float((float)((int)(rng(&s) % 2001) - 1000) / 1000.0f);
        for (uint32_t it = 0; it < n_it + 10; it++) {
            memset(seen, 0, d.n_experts);
            uint32_t distinct = d.n_shared;
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t j = 0; j < d.top_k; j++) {
                    int32_t e;
                    uint32_t q;
                    do {
                        e = (int32_t)(rng(&s) % d.n_experts);
                        for (q = 0; q < j && ids[t * d.top_k + q] != e; q++)
                            ;
                    } while (q < j);
                    ids[t * d.top_k + j] = e;
                    w[t * d.top_k + j] = 1.0f / d.top_k;
                    if (!seen[e]) {
                        seen[e] = 1;
                        distinct++;
                    }
                }
            struct moed_batch b = {0};
            b.layer = it % layers;
            b.n_tokens = T;
            b.top_k = d.top_k;
            b.x = (struct moed_buf){MOED_BUF_HOST, 0, x, (uint64_t)T * d.hidden * 2};
            b.ids = (struct moed_buf){MOED_BUF_HOST, 0, ids, (uint64_t)T * d.top_k * 4};
            b.w = (struct moed_buf){MOED_BUF_HOST, 0, w, (uint64_t)T * d.top_k * 4};
            b.y = (struct moed_buf){MOED_BUF_HOST, 0, y, (uint64_t)T * d.hidden * 2};
            g_done = 0;
            double t0 = now_us();
            if (moed_backend_submit(be, &b)) {
                fprintf(stderr, "submit failed\n");
                return 1;
            }
            while (!__atomic_load_n(&g_done, __ATOMIC_ACQUIRE))
                ;
            double t1 = now_us();
            if (b.status) {
                fprintf(stderr, "batch failed: %d\n", b.status);
                return 1;
            }
            if (it >= 10) {
                uint64_t ph[6];
                moed_backend_cuda_phases(be, ph);
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
                distinct_sum += distinct;
            }
        }
        qsort(lat, n_it, sizeof *lat, cmp_d);
        double dist = distinct_sum / n_it, bytes = dist * (double)per_expert;
        double p50 = lat[n_it / 2], tbs = bytes / (p50 * 1e-6) / 1e12;
        printf("%-14s %5u %8.1f %10.1f %10.1f %10.1f %10.1f %8.3f %8.3f\n", preset, T, dist,
               bytes / 1e6, p50, lat[n_it / 10], lat[n_it * 9 / 10], tbs, tbs / stream_tbs);
        /* phase medians: where the time goes inside one batch */
        double med[6];
        for (int k = 0; k < 6; k++) {
            qsort(phs[k], n_it, sizeof(double), cmp_d);
            med[k] = phs[k][n_it / 2];
        }
        printf("%-14s %5s   phases p50 us: release %.1f  x-stage %.1f  tiles %.1f  down-tail %.1f"
               "  combine %.1f  host+pcie %.1f\n", "", "", med[0], med[1], med[2], med[3], med[4],
               med[5]);
        fflush(stdout);
        free(x);
        free(y);
        free(ids);
        free(w);
        free(lat);
        free(seen);
        for (int k = 0; k < 6; k++)
            free(phs[k]);
    }
    moed_backend_close(be);
    return 0;
}
