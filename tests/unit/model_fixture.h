/* model_fixture.h - the checkpoint fixtures of test_model.c and
 * test_model_bad.c: a temporary directory per test, tiny NVFP4-shaped
 * checkpoints written with st_writer from deterministic bytes (struct fx
 * says what to write and what to break), and the checks that recompute
 * those bytes. */
#ifndef MOED_MODEL_FIXTURE_H
#define MOED_MODEL_FIXTURE_H

#include <check.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "model.h"
#include "moed_err.h"
#include "moed_log.h"
#include "safetensors.h"
#include "check_main.h"

static char dir[64];
static char err[MOED_ERRLEN];

static inline int rm_one(const char *p, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    return remove(p);
}

static inline void setup(void)
{
    strcpy(dir, "/tmp/moed-model-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    err[0] = '\0';
    moed_log_set_level(MOED_LOG_ERROR); /* keep the Check output readable */
}

static inline void teardown(void)
{
    nftw(dir, rm_one, 8, FTW_DEPTH | FTW_PHYS);
}

static inline void write_text(const char *name, const char *text)
{
    char p[256];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
}

/* ------------------------------------------------------------- fixtures */

/* Deterministic bytes from the tensor name, so checks recompute them. */
static inline uint64_t fnv(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static inline void fill(const char *name, uint8_t *buf, uint64_t n)
{
    uint64_t x = fnv(name) | 1;
    for (uint64_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf[i] = (uint8_t)(x >> 24);
    }
}

/* Block scales: fill's bytes with the two NaN codes (0x7f, 0xff) turned
 * into 0x7e / 0xfe, since the loader refuses NaN scales. */
static inline void fill_scales(const char *name, uint8_t *buf, uint64_t n)
{
    fill(name, buf, n);
    for (uint64_t i = 0; i < n; i++)
        if ((buf[i] & 0x7f) == 0x7f)
            buf[i] ^= 1;
}

static inline float scale2_of(const char *name)
{
    return 0.001f * (float)(1 + fnv(name) % 97);
}

struct fx {
    const char *config;      /* NULL: DeepSeek-style config from the dims below */
    const char *hfq;         /* NULL: NVFP4/16; "": no hf_quant_config.json */
    uint32_t H, I, E, S, k, layers;
    uint64_t moe_mask;       /* layers that get tensors; 0 = all */
    int n_shards;            /* 0: one model.safetensors, else shards + index */
    const char *prefix;      /* NULL: "model." */
    const char *skip;        /* tensor (plain name) left out */
    const char *bad_scale;   /* weight_scale (plain name) written as [N, K/32] */
    const char *bad_dtype;   /* weight (plain name) written as I8 */
    const char *zero_s2;     /* weight_scale_2 (plain name) written as 0 */
    const char *nan_scale;   /* weight_scale (plain name) with nan_code at [nan_row, nan_block] */
    uint32_t nan_row, nan_block;
    uint8_t nan_code;
    const char *shard0;      /* name the index gives the first shard */
    int no_input_scale;
    int scale2_vec;          /* weight_scale_2 as [1] instead of [] */
    int mixtral;             /* Mixtral names (block_sparse_moe, w1/w3/w2) and config */
};

static const struct fx tiny = {.H = 64, .I = 32, .E = 4, .S = 1, .k = 2, .layers = 2};

static const char *const projs[3] = {"gate_proj", "up_proj", "down_proj"};
static const char *const mixtral_projs[3] = {"w1", "w3", "w2"};

/* "model.layers.L.mlp.experts.e.gate_proj" (no trailing dot); Mixtral:
 * "model.layers.L.block_sparse_moe.experts.e.w1". */
static inline void base_name(char *buf, size_t len, const char *prefix, const struct fx *f, uint32_t l,
                      uint32_t e, int p)
{
    if (f->mixtral)
        snprintf(buf, len, "%slayers.%u.block_sparse_moe.experts.%u.%s", prefix, l, e,
                 mixtral_projs[p]);
    else if (e < f->E)
        snprintf(buf, len, "%slayers.%u.mlp.experts.%u.%s", prefix, l, e, projs[p]);
    else if (f->S == 1)
        snprintf(buf, len, "%slayers.%u.mlp.shared_experts.%s", prefix, l, projs[p]);
    else
        snprintf(buf, len, "%slayers.%u.mlp.shared_experts.%u.%s", prefix, l, e - f->E,
                 projs[p]);
}

struct pool {
    void *p[4096];
    int n;
};

static inline void *pool_alloc(struct pool *pl, size_t n)
{
    ck_assert_int_lt(pl->n, 4096);
    void *p = calloc(1, n ? n : 1);
    ck_assert_ptr_nonnull(p);
    return pl->p[pl->n++] = p;
}

static inline uint8_t *add(struct st_writer *w, cJSON *wm, const char *shard, struct pool *pl,
                    const char *name, enum st_dtype dt, uint32_t nd, uint64_t d0, uint64_t d1,
                    float scalar)
{
    uint64_t shape[2] = {d0, d1};
    uint64_t nb = st_dtype_size(dt) * (nd > 0 ? d0 : 1) * (nd > 1 ? d1 : 1);
    uint8_t *buf = pool_alloc(pl, nb);
    char plain[256]; /* bytes depend on the plain name: checks recompute them */
    if (strncmp(name, "model.language_model.", 21) == 0)
        snprintf(plain, sizeof plain, "model.%s", name + 21);
    else
        snprintf(plain, sizeof plain, "%s", name);
    if (dt == ST_F32)
        memcpy(buf, &scalar, 4);
    else if (dt == ST_F8_E4M3)
        fill_scales(plain, buf, nb);
    else
        fill(plain, buf, nb);
    ck_assert_int_eq(st_writer_add(w, name, dt, nd, shape, buf, nb), 0);
    if (wm)
        ck_assert_ptr_nonnull(cJSON_AddStringToObject(wm, name, shard));
    return buf;
}

static inline int match(const char *a, const char *b)
{
    return a && strcmp(a, b) == 0;
}

static inline void write_model(const struct fx *f)
{
    char cfg[1024], shard[64], path[256], full[256], plain[256], base[200], pbase[200];
    const char *prefix = f->prefix ? f->prefix : "model.";
    int ns = f->n_shards ? f->n_shards : 1;
    struct st_writer *w[8];
    struct pool *pl = calloc(1, sizeof *pl);
    cJSON *index = NULL, *wm = NULL;
    ck_assert_int_le(ns, 8);

    if (!f->config && f->mixtral) { /* the keys transformers 5 writes (no layer key) */
        snprintf(cfg, sizeof cfg,
                 "{\"architectures\": [\"MixtralForCausalLM\"], \"model_type\": \"mixtral\", "
                 "\"hidden_size\": %u, \"intermediate_size\": %u, \"num_local_experts\": %u, "
                 "\"num_experts_per_tok\": %u, \"num_hidden_layers\": %u, "
                 "\"sliding_window\": null, \"transformers_version\": \"5.24.0\"}",
                 f->H, f->I, f->E, f->k, f->layers);
        write_text("config.json", cfg);
    } else if (!f->config) {
        snprintf(cfg, sizeof cfg,
                 "{\"model_type\": \"deepseek_v3\", \"hidden_size\": %u, "
                 "\"moe_intermediate_size\": %u, \"n_routed_experts\": %u, "
                 "\"num_experts_per_tok\": %u, \"n_shared_experts\": %u, "
                 "\"num_hidden_layers\": %u, \"first_k_dense_replace\": 0}",
                 f->H, f->I, f->E, f->k, f->S, f->layers);
        write_text("config.json", cfg);
    } else {
        write_text("config.json", f->config);
    }
    if (!f->hfq)
        write_text("hf_quant_config.json",
                   "{\"producer\": {\"name\": \"modelopt\"}, \"quantization\": "
                   "{\"quant_algo\": \"NVFP4\", \"group_size\": 16, "
                   "\"exclude_modules\": [\"lm_head\"]}}");
    else if (*f->hfq)
        write_text("hf_quant_config.json", f->hfq);
    if (f->n_shards) {
        index = cJSON_CreateObject();
        cJSON *md = cJSON_AddObjectToObject(index, "metadata");
        cJSON_AddNumberToObject(md, "total_size", 0);
        wm = cJSON_AddObjectToObject(index, "weight_map");
    }
    for (int s = 0; s < ns; s++)
        ck_assert_int_eq(st_writer_new(&w[s]), 0);
    for (uint32_t l = 0; l < f->layers; l++) {
        if (f->moe_mask && !(f->moe_mask >> l & 1))
            continue;
        int s = (int)(l % (uint32_t)ns);
        if (f->n_shards)
            snprintf(shard, sizeof shard, "model-%05d-of-%05d.safetensors", s + 1, ns);
        else
            snprintf(shard, sizeof shard, "model.safetensors");
        const char *iname = (s == 0 && f->shard0) ? f->shard0 : shard;
        for (uint32_t e = 0; e < f->E + f->S; e++) {
            for (int p = 0; p < 3; p++) {
                uint64_t n = p < 2 ? f->I : f->H, k = p < 2 ? f->H : f->I;
                base_name(base, sizeof base, prefix, f, l, e, p);
                base_name(pbase, sizeof pbase, "model.", f, l, e, p);
                /* weight */
                snprintf(full, sizeof full, "%s.weight", base);
                snprintf(plain, sizeof plain, "%s.weight", pbase);
                if (!match(f->skip, plain))
                    add(w[s], wm, iname, pl, full, match(f->bad_dtype, plain) ? ST_I8 : ST_U8,
                        2, n, k / 2, 0);
                snprintf(full, sizeof full, "%s.weight_scale", base);
                snprintf(plain, sizeof plain, "%s.weight_scale", pbase);
                if (!match(f->skip, plain)) {
                    uint8_t *sc = add(w[s], wm, iname, pl, full, ST_F8_E4M3, 2, n,
                                      match(f->bad_scale, plain) ? k / 32 : k / 16, 0);
                    if (match(f->nan_scale, plain))
                        sc[(uint64_t)f->nan_row * (k / 16) + f->nan_block] = f->nan_code;
                }
                snprintf(full, sizeof full, "%s.weight_scale_2", base);
                snprintf(plain, sizeof plain, "%s.weight_scale_2", pbase);
                if (!match(f->skip, plain))
                    add(w[s], wm, iname, pl, full, ST_F32, f->scale2_vec ? 1 : 0, 1, 0,
                        match(f->zero_s2, plain) ? 0.0f : scale2_of(plain));
                snprintf(full, sizeof full, "%s.input_scale", base);
                snprintf(plain, sizeof plain, "%s.input_scale", pbase);
                if (!f->no_input_scale && !match(f->skip, plain))
                    add(w[s], wm, iname, pl, full, ST_F32, 0, 0, 0, 0.5f);
            }
        }
    }
    /* A non-expert tensor in another dtype, as real checkpoints have. */
    if (f->n_shards)
        snprintf(shard, sizeof shard, "model-%05d-of-%05d.safetensors", 1, ns);
    add(w[0], wm, shard, pl, "model.embed_tokens.weight", ST_BF16, 2, 8, f->H, 0);
    for (int s = 0; s < ns; s++) {
        if (f->n_shards)
            snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", dir, s + 1, ns);
        else
            snprintf(path, sizeof path, "%s/model.safetensors", dir);
        ck_assert_msg(st_writer_write(w[s], path, err, sizeof err) == 0, "%s", err);
        st_writer_free(w[s]);
    }
    if (index) {
        char *txt = cJSON_Print(index);
        write_text("model.safetensors.index.json", txt);
        cJSON_free(txt);
        cJSON_Delete(index);
    }
    for (int i = 0; i < pl->n; i++)
        free(pl->p[i]);
    free(pl);
}

/* Open must fail with `code` and a message containing `want`. */
static inline void expect_open_fail(uint64_t budget, int code, const char *want)
{
    struct moed_model *m = (struct moed_model *)0x1;
    int rc = moed_model_open(dir, budget, NULL, NULL, &m, err, sizeof err);
    ck_assert_msg(rc == code, "rc %d, expected %d (%s)", rc, code, err);
    ck_assert_ptr_null(m);
    ck_assert_msg(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
}

/* Every expert matrix of every MoE layer points at the bytes written. */
static inline void check_bytes(const struct moed_model *m, const struct fx *f)
{
    char pbase[200], name[256];
    for (uint32_t l = 0; l < f->layers; l++) {
        const struct moe_layer *ly = moed_model_layer(m, l);
        if (f->moe_mask && !(f->moe_mask >> l & 1)) {
            ck_assert_ptr_null(ly);
            continue;
        }
        ck_assert_ptr_nonnull(ly);
        ck_assert_uint_eq(ly->hidden, f->H);
        ck_assert_uint_eq(ly->inter, f->I);
        ck_assert_uint_eq(ly->n_experts, f->E);
        ck_assert_uint_eq(ly->n_shared, f->S);
        ck_assert_uint_eq(ly->top_k, f->k);
        for (uint32_t e = 0; e < f->E + f->S; e++) {
            const struct nvfp4_mat *mats[3] = {&ly->experts[e].gate, &ly->experts[e].up,
                                               &ly->experts[e].down};
            for (int p = 0; p < 3; p++) {
                const struct nvfp4_mat *mt = mats[p];
                uint32_t n = p < 2 ? f->I : f->H, k = p < 2 ? f->H : f->I;
                ck_assert_uint_eq(mt->n, n);
                ck_assert_uint_eq(mt->k, k);
                base_name(pbase, sizeof pbase, "model.", f, l, e, p);
                uint8_t *want = malloc((size_t)n * k / 2);
                snprintf(name, sizeof name, "%s.weight", pbase);
                fill(name, want, (uint64_t)n * k / 2);
                ck_assert_msg(memcmp(mt->w, want, (size_t)n * k / 2) == 0, "%s", name);
                snprintf(name, sizeof name, "%s.weight_scale", pbase);
                fill_scales(name, want, (uint64_t)n * k / 16);
                ck_assert_msg(memcmp(mt->scale, want, (size_t)n * k / 16) == 0, "%s", name);
                free(want);
                snprintf(name, sizeof name, "%s.weight_scale_2", pbase);
                ck_assert_float_eq(mt->scale_2, scale2_of(name));
                ck_assert_float_eq(mt->input_scale, f->no_input_scale ? 1.0f : 0.5f);
            }
        }
    }
}

struct prog {
    int calls;
    uint64_t last, total;
    int monotonic;
};

static inline void on_progress(void *ctx, uint64_t done, uint64_t total)
{
    struct prog *p = ctx;
    if (done < p->last)
        p->monotonic = 0;
    p->calls++;
    p->last = done;
    p->total = total;
}


#endif
