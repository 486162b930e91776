/* moe_cases.h - the GPU op-test table: MoE shapes and the cases run on them.
 *
 * One table drives both the GPU tests (tests/gpu/test_moe_gpu.c: every case)
 * and the benchmark (bench/bench_moe.c --preset NAME: the shapes). A case
 * names its shape, T, routing, seed, tolerance, where x and y live, and the
 * status it must end with (0, or the MOED_E_* code an unsupported shape or
 * batch is refused with). Its name, for --case, is "shape/T=N/routing".
 *
 * Kernel and packer constraints the shapes probe (moe_gpu_check_dims):
 * hidden and intermediate multiples of 64 (one pipeline unit of K), at most
 * 1024 experts + shared, top_k <= experts, max_tokens * (top_k + shared)
 * <= 65535. Expert counts that are not powers of two (6, 60), hidden 320 (a
 * combine block of 64 columns, 5 K units: warps with 1 or 2 units) and
 * intermediate 192 (3 K units in down: one warp without any) are served,
 * and 12 slots per token (two rounds of the combine's copies);
 * hidden 200 and intermediate 96 are refused at open.
 */
#ifndef MOED_TESTS_GPU_MOE_CASES_H
#define MOED_TESTS_GPU_MOE_CASES_H

#include <stdint.h>
#include <stdio.h>

#include "genmodel.h"
#include "model.h"
#include "moed_err.h"

/* A shape named after a generator preset (tiny, qwen3-30b-a3b, deepseek-v3)
 * takes H, I, E, k and S from engine/genmodel.c's preset table, the one place
 * those dimensions are written down: moe_shapes_resolve() fills them in. */
#define MOE_PRESET 0, 0, 0, 0, 0

struct moe_shape {
    const char *name;
    uint32_t H, I, E, k, S; /* MOE_PRESET: from moed_gen_preset(name) */
    uint32_t test_layers;  /* layers the GPU test builds in memory (1 or 2) */
    uint32_t ref_sample;   /* tokens per batch checked against the CPU reference
                              (a token's output depends on that token alone) */
    int quick;             /* also under --quick (compute-sanitizer) */
    uint32_t bench_layers; /* bench_moe defaults (0: not a bench preset) */
    uint32_t bench_bf16_layers;
    uint32_t max_tokens;   /* the backend's max_tokens in the GPU test (0: 512) */
    const char *preset;    /* MOE_PRESET dimensions of this preset (NULL: name) */
};

static struct moe_shape moe_shapes[] = {
    {"tiny", MOE_PRESET, 2, 512, 1, 0, 0, 0, NULL},
    {"qwen3-30b-a3b", MOE_PRESET, 1, 48, 0, 24, 8, 0, NULL /* 1.2 GB each */},
    {"deepseek-v3", MOE_PRESET, 2, 6, 0, 4, 2, 0, NULL /* 22.6 GB each */},
    {"e6-h320-i192", 320, 192, 6, 2, 1, 2, 512, 1, 0, 0, 0, NULL},
    {"e60-h320-i192", 320, 192, 60, 4, 2, 1, 512, 0, 0, 0, 0, NULL},
    {"e60-h1024-i320", 1024, 320, 60, 6, 0, 1, 512, 0, 0, 0, 0, NULL},
    /* 10 routed + 2 shared slots: more than a combine round's 9 (task.cuh) */
    {"e60-k10-s2", 320, 192, 60, 10, 2, 1, 512, 0, 0, 0, 0, NULL},
    {"h200-refused", 200, 128, 8, 2, 0, 1, 512, 1, 0, 0, 0, NULL},
    {"i96-refused", 256, 96, 8, 2, 0, 1, 512, 1, 0, 0, 0, NULL},
    /* the CUDA backend's largest batches (its max_tokens limit) and past them */
    {"tiny-t16k", MOE_PRESET, 1, 256, 0, 0, 0, 16384, "tiny"},
};
#define MOE_N_SHAPES (sizeof moe_shapes / sizeof moe_shapes[0])

/* Fill the preset shapes' dimensions; 0, or -1 with a message on stderr when
 * a preset name is unknown to the generator. Call once before using the table. */
static inline int moe_shapes_resolve(void)
{
    for (unsigned i = 0; i < MOE_N_SHAPES; i++) {
        struct moe_shape *s = &moe_shapes[i];
        if (s->H)
            continue;
        struct moed_dims d;
        char err[256];
        if (moed_gen_preset(s->preset ? s->preset : s->name, &d, err, sizeof err)) {
            fprintf(stderr, "moe_cases: shape %s: %s\n", s->name, err);
            return -1;
        }
        s->H = d.hidden, s->I = d.inter, s->E = d.n_experts, s->k = d.top_k, s->S = d.n_shared;
    }
    return 0;
}

static inline const struct moe_shape *moe_shape_find(const char *name)
{
    for (unsigned i = 0; i < MOE_N_SHAPES; i++) {
        const char *a = moe_shapes[i].name, *b = name;
        while (*a && *a == *b)
            a++, b++;
        if (!*a && !*b)
            return &moe_shapes[i];
    }
    return 0;
}

/* uniform: distinct random experts per token; skewed: every token on experts
 * 0..k-1 (one crowded expert group); all: token t slot j on (t k + j) % E
 * (every expert used, evenly); empty-slots: uniform with slot j of token t
 * empty (id -1, its weight left nonzero: it must be ignored) where
 * (t + j) % 3 == 1 and every slot of every 5th token empty (FORWARD flag
 * 0x2); routed-only: uniform, the batch without its shared experts (flag
 * 0x1); empty-routed: both, so every 5th token's output is exactly 0 */
enum moe_routing { R_UNIFORM, R_SKEW, R_ALL, R_EMPTY, R_ROUTED, R_EMPTY_ROUTED };
static const char *const moe_routing_name[] = {"uniform",     "skewed",      "all-experts",
                                               "empty-slots", "routed-only", "empty-routed"};
static inline int moe_routing_empty(enum moe_routing r) { return r == R_EMPTY || r == R_EMPTY_ROUTED; }
static inline int moe_routing_routed_only(enum moe_routing r)
{
    return r == R_ROUTED || r == R_EMPTY_ROUTED;
}

/* x and y in ordinary host memory (staged through the ring slot) or in the
 * backend's pinned, device-mapped memory (the kernel reads x and writes y
 * where they lie, as the daemon's buffers) */
enum moe_buf { B_HOST, B_PINNED };

struct moe_case {
    const char *shape;
    uint32_t T;
    enum moe_routing routing;
    uint64_t seed;
    double tol;      /* relative L2 against moe_ref_forward */
    enum moe_buf buf;
    int expect;      /* 0, or the MOED_E_* status (of open or of the batch) */
};

#define MOE_TOL 5e-3 /* bf16 h between the two matmuls, fp32 accumulation */
/* the three routings of one (shape, T); seed 1000 T + routing */
#define MOE_CASES3(shape, T)                                                                   \
    {shape, T, R_UNIFORM, 1000ull * (T) + 0, MOE_TOL, B_HOST, 0},                              \
        {shape, T, R_SKEW, 1000ull * (T) + 1, MOE_TOL, B_PINNED, 0},                           \
        {shape, T, R_ALL, 1000ull * (T) + 2, MOE_TOL, B_HOST, 0}

/* the FORWARD-flag routings of one (shape, T); seed 1000 T + routing */
#define MOE_CASES_FLAGS(shape, T)                                                              \
    {shape, T, R_EMPTY, 1000ull * (T) + 3, MOE_TOL, B_HOST, 0},                                \
        {shape, T, R_ROUTED, 1000ull * (T) + 4, MOE_TOL, B_PINNED, 0},                         \
        {shape, T, R_EMPTY_ROUTED, 1000ull * (T) + 5, MOE_TOL, B_HOST, 0}

static const struct moe_case moe_cases[] = {
    MOE_CASES_FLAGS("tiny", 1), MOE_CASES_FLAGS("tiny", 5), MOE_CASES_FLAGS("tiny", 64),
    MOE_CASES_FLAGS("tiny", 512), MOE_CASES_FLAGS("e60-h320-i192", 3),
    MOE_CASES_FLAGS("e60-h320-i192", 257), MOE_CASES_FLAGS("qwen3-30b-a3b", 13),
    MOE_CASES_FLAGS("deepseek-v3", 7), MOE_CASES_FLAGS("deepseek-v3", 64),

    MOE_CASES3("tiny", 1), MOE_CASES3("tiny", 2), MOE_CASES3("tiny", 3), MOE_CASES3("tiny", 5),
    MOE_CASES3("tiny", 7), MOE_CASES3("tiny", 13), MOE_CASES3("tiny", 16), MOE_CASES3("tiny", 64),
    MOE_CASES3("tiny", 256), MOE_CASES3("tiny", 257), MOE_CASES3("tiny", 512),
    {"tiny", 513, R_UNIFORM, 513000, MOE_TOL, B_HOST, MOED_E_INVAL}, /* over max_tokens */

    MOE_CASES3("e6-h320-i192", 1), MOE_CASES3("e6-h320-i192", 3), MOE_CASES3("e6-h320-i192", 5),
    MOE_CASES3("e6-h320-i192", 7), MOE_CASES3("e6-h320-i192", 13),
    MOE_CASES3("e6-h320-i192", 64), MOE_CASES3("e6-h320-i192", 257),
    MOE_CASES3("e6-h320-i192", 512),

    MOE_CASES3("e60-h320-i192", 1), MOE_CASES3("e60-h320-i192", 3),
    MOE_CASES3("e60-h320-i192", 5), MOE_CASES3("e60-h320-i192", 7),
    MOE_CASES3("e60-h320-i192", 13), MOE_CASES3("e60-h320-i192", 64),
    MOE_CASES3("e60-h320-i192", 257), MOE_CASES3("e60-h320-i192", 512),

    MOE_CASES3("e60-h1024-i320", 1), MOE_CASES3("e60-h1024-i320", 5),
    MOE_CASES3("e60-h1024-i320", 13), MOE_CASES3("e60-h1024-i320", 64),
    MOE_CASES3("e60-h1024-i320", 257),

    MOE_CASES3("e60-k10-s2", 1), MOE_CASES3("e60-k10-s2", 13), MOE_CASES3("e60-k10-s2", 257),
    MOE_CASES_FLAGS("e60-k10-s2", 5),

    {"h200-refused", 1, R_UNIFORM, 1, MOE_TOL, B_HOST, MOED_E_MODEL},
    {"i96-refused", 1, R_UNIFORM, 1, MOE_TOL, B_HOST, MOED_E_MODEL},

    MOE_CASES3("qwen3-30b-a3b", 1), MOE_CASES3("qwen3-30b-a3b", 3),
    MOE_CASES3("qwen3-30b-a3b", 5), MOE_CASES3("qwen3-30b-a3b", 7),
    MOE_CASES3("qwen3-30b-a3b", 13), MOE_CASES3("qwen3-30b-a3b", 64),
    MOE_CASES3("qwen3-30b-a3b", 257), MOE_CASES3("qwen3-30b-a3b", 512),

    MOE_CASES3("deepseek-v3", 1), MOE_CASES3("deepseek-v3", 3), MOE_CASES3("deepseek-v3", 5),
    MOE_CASES3("deepseek-v3", 7), MOE_CASES3("deepseek-v3", 13),
    MOE_CASES3("deepseek-v3", 64), MOE_CASES3("deepseek-v3", 257),
    MOE_CASES3("deepseek-v3", 512),

    MOE_CASES3("tiny-t16k", 4096), MOE_CASES3("tiny-t16k", 16384),
    {"tiny-t16k", 16385, R_UNIFORM, 16385000, MOE_TOL, B_HOST, MOED_E_INVAL},
};
#define MOE_N_CASES (sizeof moe_cases / sizeof moe_cases[0])

#endif
