/* test_model.c - the checkpoint loader against fixtures written here: tiny
 * NVFP4-shaped checkpoints (st_writer + deterministic bytes), hand-written
 * config.json files for DeepSeek-V3, GLM-4.5, GLM-5 and Qwen3-MoE (values from
 * notes/formats-and-interfaces.md section 2.2), and one broken fixture per
 * error the loader must name. */
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

static int rm_one(const char *p, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    return remove(p);
}

static void setup(void)
{
    strcpy(dir, "/tmp/moed-model-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    err[0] = '\0';
    moed_log_set_level(MOED_LOG_ERROR); /* keep the Check output readable */
}

static void teardown(void)
{
    nftw(dir, rm_one, 8, FTW_DEPTH | FTW_PHYS);
}

static void write_text(const char *name, const char *text)
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
static uint64_t fnv(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static void fill(const char *name, uint8_t *buf, uint64_t n)
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
static void fill_scales(const char *name, uint8_t *buf, uint64_t n)
{
    fill(name, buf, n);
    for (uint64_t i = 0; i < n; i++)
        if ((buf[i] & 0x7f) == 0x7f)
            buf[i] ^= 1;
}

static float scale2_of(const char *name)
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
};

static const struct fx tiny = {.H = 64, .I = 32, .E = 4, .S = 1, .k = 2, .layers = 2};

static const char *const projs[3] = {"gate_proj", "up_proj", "down_proj"};

/* "model.layers.L.mlp.experts.e.gate_proj" (no trailing dot). */
static void base_name(char *buf, size_t len, const char *prefix, const struct fx *f, uint32_t l,
                      uint32_t e, int p)
{
    if (e < f->E)
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

static void *pool_alloc(struct pool *pl, size_t n)
{
    ck_assert_int_lt(pl->n, 4096);
    void *p = calloc(1, n ? n : 1);
    ck_assert_ptr_nonnull(p);
    return pl->p[pl->n++] = p;
}

static uint8_t *add(struct st_writer *w, cJSON *wm, const char *shard, struct pool *pl,
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

static int match(const char *a, const char *b)
{
    return a && strcmp(a, b) == 0;
}

static void write_model(const struct fx *f)
{
    char cfg[1024], shard[64], path[256], full[256], plain[256], base[200], pbase[200];
    const char *prefix = f->prefix ? f->prefix : "model.";
    int ns = f->n_shards ? f->n_shards : 1;
    struct st_writer *w[8];
    struct pool *pl = calloc(1, sizeof *pl);
    cJSON *index = NULL, *wm = NULL;
    ck_assert_int_le(ns, 8);

    if (!f->config) {
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
static void expect_open_fail(uint64_t budget, int code, const char *want)
{
    struct moed_model *m = (struct moed_model *)0x1;
    int rc = moed_model_open(dir, budget, NULL, NULL, &m, err, sizeof err);
    ck_assert_msg(rc == code, "rc %d, expected %d (%s)", rc, code, err);
    ck_assert_ptr_null(m);
    ck_assert_msg(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
}

/* Every expert matrix of every MoE layer points at the bytes written. */
static void check_bytes(const struct moed_model *m, const struct fx *f)
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

static void on_progress(void *ctx, uint64_t done, uint64_t total)
{
    struct prog *p = ctx;
    if (done < p->last)
        p->monotonic = 0;
    p->calls++;
    p->last = done;
    p->total = total;
}

/* ------------------------------------------------------------ valid models */

/* One MoE expert of H=64, I=32: gate and up [32, 64], down [64, 32]; each
 * matrix 2048 codes -> 1024 bytes of weights + 128 bytes of block scales. */
#define TINY_EXPERT_BYTES (3u * (1024u + 128u))

START_TEST(tiny_sharded)
{
    struct fx f = tiny;
    f.n_shards = 2;
    write_model(&f);
    struct moed_model *m;
    struct prog pr = {.monotonic = 1};
    int rc = moed_model_open(dir, 0, on_progress, &pr, &m, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    const struct moed_dims *d = moed_model_dims(m);
    ck_assert_uint_eq(d->hidden, 64);
    ck_assert_uint_eq(d->inter, 32);
    ck_assert_uint_eq(d->n_experts, 4);
    ck_assert_uint_eq(d->top_k, 2);
    ck_assert_uint_eq(d->n_shared, 1);
    ck_assert_uint_eq(d->n_layers, 2);
    ck_assert_uint_eq(d->n_moe_layers, 2);
    ck_assert_str_eq(d->family, "deepseek_v3");
    ck_assert_str_eq(moed_model_dir(m), dir);
    ck_assert_uint_eq(moed_model_expert_bytes(m), TINY_EXPERT_BYTES);
    /* 2 layers x (4 routed + 1 shared) experts. */
    ck_assert_uint_eq(moed_model_weight_bytes(m), 2u * 5u * TINY_EXPERT_BYTES);
    ck_assert_int_eq(moed_model_is_moe_layer(m, 0), 1);
    ck_assert_int_eq(moed_model_is_moe_layer(m, 1), 1);
    ck_assert_int_eq(moed_model_is_moe_layer(m, 2), 0);
    ck_assert_ptr_null(moed_model_layer(m, 2));
    ck_assert_ptr_null(moed_model_layer(m, UINT32_MAX));
    check_bytes(m, &f);
    ck_assert_int_ge(pr.calls, 1);
    ck_assert_int_le(pr.calls, 101);
    ck_assert_int_eq(pr.monotonic, 1);
    ck_assert_uint_eq(pr.last, 2u * 5u * TINY_EXPERT_BYTES);
    ck_assert_uint_eq(pr.total, 2u * 5u * TINY_EXPERT_BYTES);
    moed_model_close(m);
}
END_TEST

/* Single file, multimodal prefix, scale_2 as [1], no input_scale, quant info
 * only in config.json, two shared experts, and exactly the budget. */
START_TEST(single_file_variants)
{
    struct fx f = {.H = 96, .I = 64, .E = 3, .S = 2, .k = 3, .layers = 1};
    f.prefix = "model.language_model.";
    f.scale2_vec = 1;
    f.no_input_scale = 1;
    f.hfq = "";
    f.config = "{\"model_type\": \"glm4_moe\", \"hidden_size\": 96, "
               "\"moe_intermediate_size\": 64, \"n_routed_experts\": 3, "
               "\"num_experts_per_tok\": 3, \"n_shared_experts\": 2, "
               "\"num_hidden_layers\": 1, \"first_k_dense_replace\": 0, "
               "\"quantization_config\": {\"quant_method\": \"modelopt\", "
               "\"quant_algo\": \"NVFP4\", \"config_groups\": {\"group_0\": {\"weights\": "
               "{\"num_bits\": 4, \"type\": \"float\", \"group_size\": 16}}}}}";
    write_model(&f);
    uint64_t per = 2 * (64 * 96 / 2 + 64 * 96 / 16) + (96 * 64 / 2 + 96 * 64 / 16);
    struct moed_model *m;
    int rc = moed_model_open(dir, 5 * per, NULL, NULL, &m, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(moed_model_weight_bytes(m), 5 * per);
    ck_assert_uint_eq(moed_model_expert_bytes(m), per);
    ck_assert_str_eq(moed_model_dims(m)->family, "glm4_moe");
    check_bytes(m, &f);
    moed_model_close(m);
}
END_TEST

/* ------------------------------------------------------ family aliases */

START_TEST(alias_deepseek_v3)
{
    write_text("config.json",
               "{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"model_type\": "
               "\"deepseek_v3\", \"hidden_size\": 7168, \"intermediate_size\": 18432, "
               "\"moe_intermediate_size\": 2048, \"n_routed_experts\": 256, "
               "\"n_shared_experts\": 1, \"num_experts_per_tok\": 8, \"n_group\": 8, "
               "\"topk_group\": 4, \"routed_scaling_factor\": 2.5, \"scoring_func\": "
               "\"sigmoid\", \"topk_method\": \"noaux_tc\", \"norm_topk_prob\": true, "
               "\"first_k_dense_replace\": 3, \"num_hidden_layers\": 61, "
               "\"num_nextn_predict_layers\": 1}");
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.hidden, 7168);
    ck_assert_uint_eq(d.inter, 2048);
    ck_assert_uint_eq(d.n_experts, 256);
    ck_assert_uint_eq(d.top_k, 8);
    ck_assert_uint_eq(d.n_shared, 1);
    ck_assert_uint_eq(d.n_layers, 61);
    ck_assert_uint_eq(d.n_moe_layers, 58);
    ck_assert_str_eq(d.family, "deepseek_v3");
}
END_TEST

START_TEST(alias_glm45)
{
    write_text("config.json",
               "{\"model_type\": \"glm4_moe\", \"hidden_size\": 5120, "
               "\"moe_intermediate_size\": 1536, \"n_routed_experts\": 160, "
               "\"n_shared_experts\": 1, \"num_experts_per_tok\": 8, \"n_group\": 1, "
               "\"topk_group\": 1, \"routed_scaling_factor\": 2.5, \"norm_topk_prob\": true, "
               "\"first_k_dense_replace\": 3, \"num_hidden_layers\": 92}");
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.hidden, 5120);
    ck_assert_uint_eq(d.inter, 1536);
    ck_assert_uint_eq(d.n_experts, 160);
    ck_assert_uint_eq(d.top_k, 8);
    ck_assert_uint_eq(d.n_shared, 1);
    ck_assert_uint_eq(d.n_layers, 92);
    ck_assert_uint_eq(d.n_moe_layers, 89);
    ck_assert_str_eq(d.family, "glm4_moe");
}
END_TEST

START_TEST(alias_glm5)
{
    /* 78 layers: 3 dense then 75 sparse. */
    char cfg[4096];
    size_t o = (size_t)snprintf(cfg, sizeof cfg,
                                "{\"model_type\": \"glm_moe_dsa\", \"hidden_size\": 6144, "
                                "\"moe_intermediate_size\": 2048, \"n_routed_experts\": 256, "
                                "\"n_shared_experts\": 1, \"num_experts_per_tok\": 8, "
                                "\"num_hidden_layers\": 78, \"mlp_layer_types\": [");
    for (int l = 0; l < 78; l++)
        o += (size_t)snprintf(cfg + o, sizeof cfg - o, "%s\"%s\"", l ? ", " : "",
                              l < 3 ? "dense" : "sparse");
    snprintf(cfg + o, sizeof cfg - o, "]}");
    write_text("config.json", cfg);
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.hidden, 6144);
    ck_assert_uint_eq(d.inter, 2048);
    ck_assert_uint_eq(d.n_experts, 256);
    ck_assert_uint_eq(d.n_shared, 1);
    ck_assert_uint_eq(d.n_layers, 78);
    ck_assert_uint_eq(d.n_moe_layers, 75);
    ck_assert_str_eq(d.family, "glm_moe_dsa");
}
END_TEST

START_TEST(alias_qwen3)
{
    write_text("config.json",
               "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 2048, "
               "\"moe_intermediate_size\": 768, \"num_experts\": 128, "
               "\"num_experts_per_tok\": 8, \"norm_topk_prob\": true, "
               "\"decoder_sparse_step\": 1, \"mlp_only_layers\": [], "
               "\"num_hidden_layers\": 48}");
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.hidden, 2048);
    ck_assert_uint_eq(d.inter, 768);
    ck_assert_uint_eq(d.n_experts, 128);
    ck_assert_uint_eq(d.top_k, 8);
    ck_assert_uint_eq(d.n_shared, 0); /* absent -> 0 */
    ck_assert_uint_eq(d.n_layers, 48);
    ck_assert_uint_eq(d.n_moe_layers, 48);
    ck_assert_str_eq(d.family, "qwen3_moe");
}
END_TEST

/* Which layers are MoE, checked through a loaded model holding exactly
 * those layers' tensors. */
static void check_layers(const char *config, uint32_t layers, uint32_t S, uint64_t mask)
{
    struct fx f = tiny;
    f.config = config;
    f.layers = layers;
    f.S = S;
    f.moe_mask = mask;
    write_model(&f);
    struct moed_model *m;
    int rc = moed_model_open(dir, 0, NULL, NULL, &m, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    uint32_t n = 0;
    for (uint32_t l = 0; l < layers; l++) {
        ck_assert_int_eq(moed_model_is_moe_layer(m, l), (int)(mask >> l & 1));
        n += (uint32_t)(mask >> l & 1);
    }
    ck_assert_uint_eq(moed_model_dims(m)->n_moe_layers, n);
    ck_assert_uint_eq(moed_model_weight_bytes(m), (uint64_t)n * (4 + S) * TINY_EXPERT_BYTES);
    check_bytes(m, &f);
    moed_model_close(m);
}

START_TEST(layers_first_k_dense)
{
    check_layers("{\"model_type\": \"deepseek_v3\", \"hidden_size\": 64, "
                 "\"moe_intermediate_size\": 32, \"n_routed_experts\": 4, "
                 "\"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
                 "\"num_hidden_layers\": 4, \"first_k_dense_replace\": 2}",
                 4, 1, 0xc);
}
END_TEST

START_TEST(layers_mlp_layer_types)
{
    check_layers("{\"model_type\": \"glm_moe_dsa\", \"hidden_size\": 64, "
                 "\"moe_intermediate_size\": 32, \"n_routed_experts\": 4, "
                 "\"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
                 "\"num_hidden_layers\": 4, "
                 "\"mlp_layer_types\": [\"dense\", \"sparse\", \"dense\", \"sparse\"]}",
                 4, 1, 0xa);
}
END_TEST

START_TEST(layers_qwen3_sparse_step)
{
    /* step 2: layers 1, 3, 5 are MoE; mlp_only_layers removes 3. */
    check_layers("{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64, "
                 "\"moe_intermediate_size\": 32, \"num_experts\": 4, "
                 "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 6, "
                 "\"decoder_sparse_step\": 2, \"mlp_only_layers\": [3]}",
                 6, 0, 0x22);
}
END_TEST

START_TEST(alias_text_config)
{
    write_text("config.json",
               "{\"model_type\": \"qwen3_vl_moe\", \"text_config\": {\"model_type\": "
               "\"qwen3_vl_moe_text\", \"hidden_size\": 2048, \"moe_intermediate_size\": 768, "
               "\"num_experts\": 128, \"num_experts_per_tok\": 8, \"decoder_sparse_step\": 1, "
               "\"num_hidden_layers\": 48}}");
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(d.n_experts, 128);
    ck_assert_uint_eq(d.n_moe_layers, 48);
    ck_assert_str_eq(d.family, "qwen3_vl_moe");
}
END_TEST

/* ------------------------------------------------------------ bad inputs */

static void expect_config_fail(const char *cfg, const char *want)
{
    struct moed_dims d;
    write_text("config.json", cfg);
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_msg(rc == MOED_E_MODEL, "rc %d (%s)", rc, err);
    ck_assert_msg(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
}

START_TEST(config_missing_key)
{
    expect_config_fail("{\"hidden_size\": 64, \"n_routed_experts\": 4, "
                       "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 2, "
                       "\"first_k_dense_replace\": 0}",
                       "config.json: missing 'moe_intermediate_size'");
}
END_TEST

START_TEST(config_missing_experts)
{
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 2, "
                       "\"first_k_dense_replace\": 0}",
                       "config.json: missing 'n_routed_experts' (or alias 'num_experts')");
}
END_TEST

START_TEST(config_missing_dense_rule)
{
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2}",
                       "config.json: missing 'first_k_dense_replace' (or alias "
                       "'mlp_layer_types', 'decoder_sparse_step')");
}
END_TEST

START_TEST(config_bad_values)
{
    expect_config_fail("{\"hidden_size\": 280, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "config.json: hidden_size 280 is not a multiple of 16 (an NVFP4 row is "
                       "whole 16-weight scale blocks: one E4M3 scale per 16 weights)");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 40, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "moe_intermediate_size 40 is not a multiple of 16");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 5, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "num_experts_per_tok 5 is over the 4 routed experts");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"num_experts\": 2000, \"num_experts_per_tok\": 5, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "'num_experts' is 2000, allowed 1..1024");
    expect_config_fail("{\"hidden_size\": 131072, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "'hidden_size' is 131072, allowed 16..65536");
    expect_config_fail("{\"hidden_size\": \"64\", \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "'hidden_size' must be a non-negative integer");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"n_shared_experts\": 9, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}",
                       "'n_shared_experts' is 9, allowed 0..8");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"mlp_layer_types\": [\"dense\"]}",
                       "'mlp_layer_types' must be an array of 2 strings");
    expect_config_fail("{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
                       "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                       "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 2}",
                       "none of the 2 layers is an MoE layer");
    expect_config_fail("{\"hidden_size\": 64,", "config.json: malformed JSON");
}
END_TEST

START_TEST(config_missing_file)
{
    struct moed_dims d;
    int rc = moed_model_read_config(dir, &d, err, sizeof err);
    ck_assert_int_eq(rc, MOED_E_IO);
    ck_assert_ptr_nonnull(strstr(err, "config.json: cannot open"));
}
END_TEST

START_TEST(group_size_32)
{
    struct fx f = tiny;
    f.hfq = "{\"quantization\": {\"quant_algo\": \"NVFP4\", \"group_size\": 32}}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "hf_quant_config.json: group_size 32 not supported (NVFP4 needs 16)");
}
END_TEST

START_TEST(group_size_32_in_config)
{
    struct fx f = tiny;
    f.hfq = "";
    f.config = "{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
               "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
               "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0, "
               "\"quantization_config\": {\"quant_method\": \"modelopt\", "
               "\"quant_algo\": \"NVFP4\", \"config_groups\": {\"group_0\": {\"weights\": "
               "{\"group_size\": 32}}}}}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL, "group_size 32 not supported (NVFP4 needs 16)");
}
END_TEST

START_TEST(quant_algo_fp8)
{
    struct fx f = tiny;
    f.hfq = "{\"quantization\": {\"quant_algo\": \"FP8\", \"group_size\": 16}}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "hf_quant_config.json: quant_algo 'FP8' not supported (need NVFP4)");
}
END_TEST

START_TEST(no_quant_info)
{
    struct fx f = tiny;
    f.hfq = "";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL, "no quantization info");
}
END_TEST

START_TEST(shard_escape)
{
    struct fx f = tiny;
    f.n_shards = 2;
    f.shard0 = "../x";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL, "shard path '../x' escapes the checkpoint directory");
}
END_TEST

START_TEST(shard_absolute)
{
    struct fx f = tiny;
    f.n_shards = 2;
    f.shard0 = "/etc/passwd";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "shard path '/etc/passwd' escapes the checkpoint directory");
}
END_TEST

START_TEST(shard_missing_file)
{
    struct fx f = tiny;
    f.n_shards = 2;
    f.shard0 = "model-00009-of-00002.safetensors";
    write_model(&f);
    expect_open_fail(0, MOED_E_IO, "model-00009-of-00002.safetensors: cannot open");
}
END_TEST

START_TEST(missing_tensor)
{
    struct fx f = tiny;
    f.skip = "model.layers.0.mlp.experts.3.up_proj.weight_scale";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "missing tensor 'model.layers.0.mlp.experts.3.up_proj.weight_scale'");
}
END_TEST

START_TEST(missing_shared_tensor)
{
    struct fx f = tiny;
    f.n_shards = 2;
    f.skip = "model.layers.1.mlp.shared_experts.down_proj.weight";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "missing tensor 'model.layers.1.mlp.shared_experts.down_proj.weight'");
}
END_TEST

START_TEST(missing_moe_layer)
{
    /* config says 3 MoE layers, the checkpoint holds layers 0 and 1 only. */
    struct fx f = tiny;
    f.config = "{\"hidden_size\": 64, \"moe_intermediate_size\": 32, "
               "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
               "\"num_hidden_layers\": 3, \"first_k_dense_replace\": 0}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "missing tensor 'model.layers.2.mlp.experts.0.gate_proj.weight'");
}
END_TEST

START_TEST(scale_shape_mismatch)
{
    struct fx f = {.H = 256, .I = 64, .E = 2, .S = 0, .k = 1, .layers = 1};
    f.bad_scale = "model.layers.0.mlp.experts.1.gate_proj.weight_scale";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "tensor 'model.layers.0.mlp.experts.1.gate_proj.weight_scale': "
                     "weight_scale shape [64, 8] does not match weight [64, 128] "
                     "(expected [64, 16])");
}
END_TEST

START_TEST(weight_dtype_mismatch)
{
    struct fx f = tiny;
    f.bad_dtype = "model.layers.1.mlp.experts.2.down_proj.weight";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "tensor 'model.layers.1.mlp.experts.2.down_proj.weight': dtype I8, "
                     "expected U8");
}
END_TEST

START_TEST(weight_shape_mismatch)
{
    /* Tensors for H=64, I=32, config claims I=64. */
    struct fx f = tiny;
    f.config = "{\"hidden_size\": 64, \"moe_intermediate_size\": 64, "
               "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"n_shared_experts\": 1, "
               "\"num_hidden_layers\": 2, \"first_k_dense_replace\": 0}";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight': shape [32, 32], "
                     "expected [64, 32] (N, K/2)");
}
END_TEST

START_TEST(scale2_zero)
{
    struct fx f = tiny;
    f.zero_s2 = "model.layers.1.mlp.experts.0.up_proj.weight_scale_2";
    write_model(&f);
    expect_open_fail(0, MOED_E_MODEL,
                     "tensor 'model.layers.1.mlp.experts.0.up_proj.weight_scale_2': "
                     "weight_scale_2 is 0, must be finite and > 0");
}
END_TEST

/* A NaN block scale (either code, first / middle / last block of a matrix) is
 * refused at load, naming the tensor, the row and the block; the same
 * checkpoint with the byte a number again loads. */
START_TEST(scale_nan)
{
    static const struct {
        const char *t;
        uint32_t row, block;
        uint8_t code;
    } cases[] = {
        {"model.layers.0.mlp.experts.0.gate_proj.weight_scale", 0, 0, 0x7f},
        {"model.layers.1.mlp.experts.2.up_proj.weight_scale", 17, 3, 0xff},
        {"model.layers.1.mlp.shared_experts.down_proj.weight_scale", 63, 1, 0x7f},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct fx f = tiny;
        f.nan_scale = cases[i].t;
        f.nan_row = cases[i].row;
        f.nan_block = cases[i].block;
        f.nan_code = cases[i].code;
        write_model(&f);
        char want[512];
        uint32_t b = cases[i].block;
        snprintf(want, sizeof want,
                 "tensor '%s': block scale at row %u, block %u (weights %u..%u of the row) is "
                 "NaN (E4M3 byte 0x%02x)",
                 cases[i].t, cases[i].row, b, b * 16, b * 16 + 15, cases[i].code);
        expect_open_fail(0, MOED_E_MODEL, want);
    }
    struct fx f = tiny;
    f.nan_scale = cases[0].t;
    f.nan_code = 0x7e; /* 448: the largest finite scale */
    write_model(&f);
    struct moed_model *m;
    ck_assert_msg(moed_model_open(dir, 0, NULL, NULL, &m, err, sizeof err) == 0, "%s", err);
    moed_model_close(m);
}
END_TEST

/* hidden_size and moe_intermediate_size need only be whole 16-weight scale
 * blocks: 272 and 48 (multiples of 16, not of 32) load and every matrix has
 * the right shape. */
START_TEST(dims_multiple_of_16)
{
    struct fx f = tiny;
    f.H = 272;
    f.I = 48;
    write_model(&f);
    struct moed_model *m;
    ck_assert_msg(moed_model_open(dir, 0, NULL, NULL, &m, err, sizeof err) == 0, "%s", err);
    check_bytes(m, &f);
    moed_model_close(m);
}
END_TEST

/* moed_model_parse_config: the same checks on text in memory (the fuzz
 * target's entry point), with and without hf_quant_config.json. */
START_TEST(parse_config_mem)
{
    static const char cfg[] = "{\"hidden_size\": 272, \"moe_intermediate_size\": 48, "
                              "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, "
                              "\"num_hidden_layers\": 3, \"first_k_dense_replace\": 1, "
                              "\"quantization_config\": {\"quant_method\": \"modelopt\", "
                              "\"quant_algo\": \"NVFP4\"}}";
    static const char q[] = "{\"quantization\": {\"quant_algo\": \"FP8\"}}";
    struct moed_dims d;
    ck_assert_msg(moed_model_parse_config(cfg, strlen(cfg), NULL, 0, &d, err, sizeof err) == 0,
                  "%s", err);
    ck_assert_uint_eq(d.hidden, 272);
    ck_assert_uint_eq(d.inter, 48);
    ck_assert_uint_eq(d.n_moe_layers, 2);
    /* hf_quant_config.json, when present, is what counts */
    ck_assert_int_eq(moed_model_parse_config(cfg, strlen(cfg), q, strlen(q), &d, err, sizeof err),
                     MOED_E_MODEL);
    ck_assert_str_eq(err, "hf_quant_config.json: quant_algo 'FP8' not supported (need NVFP4)");
    /* the length bounds the text: a prefix is malformed, not read past */
    ck_assert_int_eq(moed_model_parse_config(cfg, 20, NULL, 0, &d, err, sizeof err),
                     MOED_E_MODEL);
    ck_assert_msg(strncmp(err, "config.json: malformed JSON near byte ", 38) == 0, "%s", err);
    ck_assert_int_eq(moed_model_parse_config(cfg, strlen(cfg), "[]", 2, &d, err, sizeof err),
                     MOED_E_MODEL);
    ck_assert_str_eq(err, "hf_quant_config.json: not a JSON object");
}
END_TEST

START_TEST(over_budget)
{
    struct fx f = tiny;
    write_model(&f);
    /* 2 layers x 5 experts x 3456 bytes = 34560. */
    expect_open_fail(34559, MOED_E_NOFIT,
                     "model needs 0.0 GiB (34560 bytes) of expert weights but only 0.0 GiB "
                     "(34559 bytes) are available");
    struct moed_model *m;
    ck_assert_int_eq(moed_model_open(dir, 34560, NULL, NULL, &m, err, sizeof err), 0);
    moed_model_close(m);
}
END_TEST

START_TEST(bad_shard_file)
{
    struct fx f = tiny;
    write_model(&f);
    char p[256];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    ck_assert_int_eq(truncate(p, 5), 0);
    expect_open_fail(0, MOED_E_FORMAT, "model.safetensors: truncated: 5 bytes");
}
END_TEST

START_TEST(index_duplicate)
{
    struct fx f = tiny;
    f.n_shards = 1;
    write_model(&f);
    write_text("model.safetensors.index.json",
               "{\"weight_map\": {\"a\": \"model-00001-of-00001.safetensors\", "
               "\"a\": \"model-00001-of-00001.safetensors\"}}");
    expect_open_fail(0, MOED_E_MODEL, "tensor 'a' listed twice in weight_map");
}
END_TEST

START_TEST(index_points_elsewhere)
{
    /* Index maps a tensor to a shard that does not hold it. */
    struct fx f = tiny;
    f.n_shards = 2;
    write_model(&f);
    char p[256];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *fp = fopen(p, "r");
    char *txt = calloc(1, 1 << 20);
    ck_assert_uint_gt(fread(txt, 1, (1 << 20) - 1, fp), 0);
    fclose(fp);
    cJSON *root = cJSON_Parse(txt);
    cJSON *wm = cJSON_GetObjectItem(root, "weight_map");
    cJSON_ReplaceItemInObject(wm, "model.layers.0.mlp.experts.1.gate_proj.weight",
                              cJSON_CreateString("model-00002-of-00002.safetensors"));
    char *out = cJSON_Print(root);
    write_text("model.safetensors.index.json", out);
    cJSON_free(out);
    cJSON_Delete(root);
    free(txt);
    expect_open_fail(0, MOED_E_MODEL,
                     "missing tensor 'model.layers.0.mlp.experts.1.gate_proj.weight' (the "
                     "index maps it to 'model-00002-of-00002.safetensors'");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("model");
    TCase *good = tcase_create("valid");
    TCase *alias = tcase_create("aliases");
    TCase *bad = tcase_create("bad_input");
    TCase *all[3] = {good, alias, bad};
    for (int i = 0; i < 3; i++) {
        tcase_add_checked_fixture(all[i], setup, teardown);
        tcase_set_timeout(all[i], 30);
    }
    tcase_add_test(good, tiny_sharded);
    tcase_add_test(good, single_file_variants);
    tcase_add_test(alias, alias_deepseek_v3);
    tcase_add_test(alias, alias_glm45);
    tcase_add_test(alias, alias_glm5);
    tcase_add_test(alias, alias_qwen3);
    tcase_add_test(alias, alias_text_config);
    tcase_add_test(alias, layers_first_k_dense);
    tcase_add_test(alias, layers_mlp_layer_types);
    tcase_add_test(alias, layers_qwen3_sparse_step);
    tcase_add_test(bad, config_missing_key);
    tcase_add_test(bad, config_missing_experts);
    tcase_add_test(bad, config_missing_dense_rule);
    tcase_add_test(bad, config_bad_values);
    tcase_add_test(bad, config_missing_file);
    tcase_add_test(bad, group_size_32);
    tcase_add_test(bad, group_size_32_in_config);
    tcase_add_test(bad, quant_algo_fp8);
    tcase_add_test(bad, no_quant_info);
    tcase_add_test(bad, shard_escape);
    tcase_add_test(bad, shard_absolute);
    tcase_add_test(bad, shard_missing_file);
    tcase_add_test(bad, missing_tensor);
    tcase_add_test(bad, missing_shared_tensor);
    tcase_add_test(bad, missing_moe_layer);
    tcase_add_test(bad, scale_shape_mismatch);
    tcase_add_test(bad, scale_nan);
    tcase_add_test(good, dims_multiple_of_16);
    tcase_add_test(bad, parse_config_mem);
    tcase_add_test(bad, weight_dtype_mismatch);
    tcase_add_test(bad, weight_shape_mismatch);
    tcase_add_test(bad, scale2_zero);
    tcase_add_test(bad, over_budget);
    tcase_add_test(bad, bad_shard_file);
    tcase_add_test(bad, index_duplicate);
    tcase_add_test(bad, index_points_elsewhere);
    suite_add_tcase(s, good);
    suite_add_tcase(s, alias);
    suite_add_tcase(s, bad);
    return moed_check_run(s);
}
