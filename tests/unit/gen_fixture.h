/* gen_fixture.h - a genmodel synthetic checkpoint (the "tiny" preset: H 256,
 * I 128, E 8, k 2, S 1) written to a temporary directory and opened, and
 * random batches for it: the fixture of the tests that compare whole-layer
 * results (test_moe_ref.c, test_ep.c). */
#ifndef MOED_GEN_FIXTURE_H
#define MOED_GEN_FIXTURE_H

#include <check.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "genmodel.h"
#include "model.h"
#include "moe_ref.h"
#include "moed_err.h"
#include "moed_log.h"

#define GEN_LAYERS 2u

struct gen_fx {
    char dir[64];
    struct moed_model *m;
};

static inline int gen_rm_one(const char *p, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    return remove(p);
}

static inline void gen_fx_open(struct gen_fx *fx, uint64_t seed)
{
    char err[MOED_ERRLEN] = "";
    moed_log_set_level(MOED_LOG_ERROR); /* keep the Check output readable */
    strcpy(fx->dir, "/tmp/moed-gen-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(fx->dir));
    struct moed_gen_opts o = {.preset = "tiny", .layers = GEN_LAYERS, .seed = seed, .threads = 1};
    ck_assert_msg(moed_gen_model(&o, fx->dir, err, sizeof err) == 0, "%s", err);
    ck_assert_msg(moed_model_open(fx->dir, 0, NULL, NULL, &fx->m, err, sizeof err) == 0, "%s",
                  err);
}

static inline void gen_fx_close(struct gen_fx *fx)
{
    moed_model_close(fx->m);
    fx->m = NULL;
    nftw(fx->dir, gen_rm_one, 8, FTW_DEPTH | FTW_PHYS);
}

static inline uint64_t gen_rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* A random batch of T tokens for layer L: x bf16 in [-2, 2), ids in [0, E)
 * (with empty_every > 0: about one slot in empty_every is -1, its weight 0),
 * weights in (0, 1). A token's ids may repeat an expert: the engine passes
 * what the router chose. */
static inline void gen_batch(const struct moe_layer *L, uint32_t T, uint64_t *s,
                             uint32_t empty_every, uint16_t *x, int32_t *ids, float *w)
{
    for (size_t i = 0; i < (size_t)T * L->hidden; i++)
        x[i] = bf16_from_float((float)((double)(gen_rnd(s) >> 11) * 0x1p-53 * 4.0 - 2.0));
    for (size_t i = 0; i < (size_t)T * L->top_k; i++) {
        uint64_t r = gen_rnd(s);
        if (empty_every && r % empty_every == 0) {
            ids[i] = -1;
            w[i] = 0.0f;
            continue;
        }
        ids[i] = (int32_t)((r >> 8) % L->n_experts);
        w[i] = (float)((double)((r >> 20) % 65535 + 1) / 65536.0);
    }
}

/* FNV-1a over bytes, chained through h. */
static inline uint64_t gen_hash(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

#endif
