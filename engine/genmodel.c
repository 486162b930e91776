/* genmodel.c - deterministic synthetic NVFP4 checkpoints (contract in
 * genmodel.h).
 *
 * Layout written (ModelOpt unified HF export, as vLLM/SGLang read it):
 *   config.json            family's own key names (DeepSeek-V3 or Qwen3-MoE)
 *   hf_quant_config.json   producer modelopt, NVFP4, group_size 16
 *   model.safetensors      (1 layer) or model-0000L-of-0000N.safetensors, one
 *                          shard per layer, + model.safetensors.index.json
 * Per expert e of layer L, for p in gate/up/down:
 *   model.layers.L.mlp.experts.e.p_proj.{weight U8 [N,K/2], weight_scale
 *   F8_E4M3 [N,K/16], weight_scale_2 F32 [], input_scale F32 []}
 * and the same under mlp.shared_experts.p_proj (one shared expert).
 *
 * Values: w ~ N(0, std = 1/sqrt(K)) so x of O(1) gives activations of O(1).
 * Element pair m of matrix (layer, expert, matrix) comes from a counter-based
 * generator: 64 hashed bits of (key(seed, layer, expert, matrix), m) ->
 * Box-Muller -> two normals. No sequential state, so any thread may produce
 * any expert and the bytes never depend on the thread count.
 *
 * gate and up of an expert are quantized as ONE [2I, H] matrix, so they share
 * weight_scale_2 (ModelOpt's preprocess_linear_fusion unifies the amax of
 * linears that read the same input; SGLang/vLLM expect the two to match for
 * their fused w13). Block scales are per row, so this changes nothing else.
 *
 * Memory: one layer's quantized bytes (st_writer borrows them until the
 * shard is written) + per thread one float copy of an expert's gate+up.
 */
#include "genmodel.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model.h"
#include "moed_err.h"
#include "moed_log.h"
#include "nvfp4.h"
#include "safetensors.h"

#define GEN_MAX_THREADS 256
#define GEN_PATH_MAX 4096
/* Activation amax assumed for input_scale: |x| of a unit normal over a few
 * thousand samples rarely passes 4. Unused by W4A16, carried for W4A4 users. */
#define GEN_INPUT_AMAX 4.0f

struct gen_preset {
    const char *name;
    const char *family;   /* config.json model_type */
    const char *arch;     /* config.json architectures[0] */
    uint32_t hidden, inter, n_experts, top_k, n_shared;
};

static const struct gen_preset presets[] = {
    {"tiny", "moed_tiny", "MoedTinyForCausalLM", 256, 128, 8, 2, 1},
    {"qwen3-30b-a3b", "qwen3_moe", "Qwen3MoeForCausalLM", 2048, 768, 128, 8, 0},
    {"deepseek-v3", "deepseek_v3", "DeepseekV3ForCausalLM", 7168, 2048, 256, 8, 1},
};
#define N_PRESETS (sizeof presets / sizeof presets[0])

static const char *const proj_names[3] = {"gate_proj", "up_proj", "down_proj"};

static const struct gen_preset *find_preset(const char *name)
{
    for (size_t i = 0; name && i < N_PRESETS; i++)
        if (strcmp(presets[i].name, name) == 0)
            return &presets[i];
    return NULL;
}

int moed_gen_preset(const char *preset, struct moed_dims *dims, char *err, size_t errlen)
{
    const struct gen_preset *p = find_preset(preset);
    if (!p)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "unknown preset '%.64s' (allowed: tiny, qwen3-30b-a3b, deepseek-v3)",
                           preset ? preset : "(null)");
    memset(dims, 0, sizeof *dims);
    dims->hidden = p->hidden;
    dims->inter = p->inter;
    dims->n_experts = p->n_experts;
    dims->top_k = p->top_k;
    dims->n_shared = p->n_shared;
    snprintf(dims->family, sizeof dims->family, "%s", p->family);
    return 0;
}

/* ------------------------------------------------------------------ PRNG */

/* splitmix64's finalizer: a bijective 64-bit mixer with full avalanche. */
static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t stream_key(uint64_t seed, uint32_t layer, uint32_t expert, uint32_t matrix)
{
    uint64_t k = mix64(seed + 0x9e3779b97f4a7c15ull);
    k = mix64(k ^ ((uint64_t)layer + 0x632be59bd9b4e019ull));
    k = mix64(k ^ ((uint64_t)expert + 0x8cb92ba72f3d8dd7ull));
    return mix64(k ^ ((uint64_t)matrix + 0x5851f42d4c957f2dull));
}

/* Fill out[count] (count even) with N(0, std^2) samples of stream `key`. */
static void gen_normal(uint64_t key, float std, float *out, size_t count)
{
    const float two_pi = 6.28318530717958647692f;
    for (size_t m = 0; m < count / 2; m++) {
        uint64_t b = mix64(key + (uint64_t)m * 0x9e3779b97f4a7c15ull);
        /* u1 in (0, 1] so the log is finite; u2 in [0, 1). 24 bits each: the
         * float significand. */
        float u1 = (float)((b >> 40) + 1) * 0x1p-24f;
        float u2 = (float)(b & 0xffffffu) * 0x1p-24f;
        float r = sqrtf(-2.0f * logf(u1)) * std;
        out[2 * m] = r * cosf(two_pi * u2);
        out[2 * m + 1] = r * sinf(two_pi * u2);
    }
}

/* ------------------------------------------------------------ layer data */

/* One layer's quantized tensors, laid out per expert:
 *   [gate w | up w | gate scales | up scales | down w | down scales]
 * so gate+up come out of a single [2I, H] nvfp4_quantize call. */
struct gen_layer {
    const struct gen_preset *p;
    uint32_t n_exp;        /* E + S */
    uint64_t exp_bytes;    /* per expert */
    uint8_t *data;         /* n_exp * exp_bytes */
    float *scalars;        /* [n_exp][3][2]: weight_scale_2, input_scale */
};

static uint8_t *exp_gu_w(const struct gen_layer *g, uint32_t e)
{
    return g->data + (uint64_t)e * g->exp_bytes;
}
static uint8_t *exp_gu_s(const struct gen_layer *g, uint32_t e)
{
    return exp_gu_w(g, e) + (uint64_t)g->p->inter * g->p->hidden;
}
static uint8_t *exp_d_w(const struct gen_layer *g, uint32_t e)
{
    return exp_gu_s(g, e) + (uint64_t)g->p->inter * g->p->hidden / 8;
}
static uint8_t *exp_d_s(const struct gen_layer *g, uint32_t e)
{
    return exp_d_w(g, e) + (uint64_t)g->p->hidden * g->p->inter / 2;
}

struct gen_job {
    struct gen_layer *g;
    uint64_t seed;
    uint32_t layer;
    atomic_uint next;        /* next expert of this layer */
    atomic_ulong *done;      /* experts finished over the whole run */
    uint64_t total;          /* experts over the whole run */
};

struct gen_worker {
    struct gen_job *job;
    float *buf; /* 2 * I * H floats */
};

static void gen_expert(struct gen_job *j, uint32_t e, float *buf)
{
    const struct gen_preset *p = j->g->p;
    const uint32_t H = p->hidden, I = p->inter;
    const size_t ih = (size_t)I * H;
    float s2;
    /* gate and up: rows 0..I-1 gate, I..2I-1 up; std 1/sqrt(K = H). */
    gen_normal(stream_key(j->seed, j->layer, e, 0), 1.0f / sqrtf((float)H), buf, ih);
    gen_normal(stream_key(j->seed, j->layer, e, 1), 1.0f / sqrtf((float)H), buf + ih, ih);
    nvfp4_quantize(buf, 2 * I, H, exp_gu_w(j->g, e), exp_gu_s(j->g, e), &s2);
    float *sc = j->g->scalars + (size_t)e * 6;
    sc[0] = s2;
    sc[2] = s2;
    /* down: [H, I], K = I. */
    gen_normal(stream_key(j->seed, j->layer, e, 2), 1.0f / sqrtf((float)I), buf, ih);
    nvfp4_quantize(buf, H, I, exp_d_w(j->g, e), exp_d_s(j->g, e), &s2);
    sc[4] = s2;
    sc[1] = sc[3] = sc[5] = GEN_INPUT_AMAX / (NVFP4_E2M1_MAX * NVFP4_E4M3_MAX);
}

static void *gen_worker_main(void *arg)
{
    struct gen_worker *wk = arg;
    struct gen_job *j = wk->job;
    for (;;) {
        uint32_t e = atomic_fetch_add(&j->next, 1);
        if (e >= j->g->n_exp)
            break;
        gen_expert(j, e, wk->buf);
        unsigned long d = atomic_fetch_add(j->done, 1) + 1;
        /* Log when the done count crosses a 10% step. */
        if (d * 10 / j->total != (d - 1) * 10 / j->total)
            LOG_I("gen-model: %llu%% (%lu/%llu experts)",
                  (unsigned long long)(d * 100 / j->total), d, (unsigned long long)j->total);
    }
    return NULL;
}

/* ----------------------------------------------------------------- files */

static int mkdir_p(const char *dir, char *err, size_t errlen)
{
    char path[GEN_PATH_MAX];
    size_t n = strlen(dir);
    if (n == 0 || n >= sizeof path - 64)
        return moed_seterr(err, errlen, MOED_E_INVAL, "output directory '%.64s' is %s", dir,
                           n ? "too long" : "empty");
    memcpy(path, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (path[i] != '/' && path[i] != '\0')
            continue;
        char c = path[i];
        path[i] = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST)
            return moed_seterr(err, errlen, MOED_E_IO, "cannot create directory %s: %s", path,
                               strerror(errno));
        path[i] = c;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return moed_seterr(err, errlen, MOED_E_IO, "%s exists and is not a directory", dir);
    return 0;
}

static FILE *open_out(const char *dir, const char *name, char *path, size_t plen, char *err,
                      size_t errlen)
{
    snprintf(path, plen, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f)
        moed_seterr(err, errlen, MOED_E_IO, "cannot create %s: %s", path, strerror(errno));
    return f;
}

static int close_out(FILE *f, const char *path, char *err, size_t errlen)
{
    int bad = ferror(f);
    if (fclose(f) != 0 || bad)
        return moed_seterr(err, errlen, MOED_E_IO, "write to %s failed: %s", path,
                           strerror(errno));
    return 0;
}

static int write_configs(const struct gen_preset *p, uint32_t layers, const char *dir, char *err,
                         size_t errlen)
{
    char path[GEN_PATH_MAX + 64];
    FILE *f = open_out(dir, "config.json", path, sizeof path, err, errlen);
    if (!f)
        return MOED_E_IO;
    int qwen = strcmp(p->family, "qwen3_moe") == 0;
    fprintf(f, "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n", p->arch,
            p->family);
    fprintf(f, "  \"hidden_size\": %u,\n  \"moe_intermediate_size\": %u,\n", p->hidden, p->inter);
    /* Each family's own key names: Qwen3-MoE says num_experts and marks MoE
     * layers with decoder_sparse_step/mlp_only_layers; DeepSeek-V3 (and the
     * tiny preset, modelled on it) n_routed_experts/first_k_dense_replace. */
    if (qwen)
        fprintf(f, "  \"num_experts\": %u,\n  \"num_experts_per_tok\": %u,\n"
                   "  \"decoder_sparse_step\": 1,\n  \"mlp_only_layers\": [],\n"
                   "  \"norm_topk_prob\": true,\n",
                p->n_experts, p->top_k);
    else
        fprintf(f, "  \"n_routed_experts\": %u,\n  \"num_experts_per_tok\": %u,\n"
                   "  \"n_shared_experts\": %u,\n  \"first_k_dense_replace\": 0,\n",
                p->n_experts, p->top_k, p->n_shared);
    fprintf(f, "  \"num_hidden_layers\": %u,\n  \"torch_dtype\": \"bfloat16\",\n", layers);
    fprintf(f, "  \"quantization_config\": {\n"
               "    \"quant_method\": \"modelopt\",\n    \"quant_algo\": \"NVFP4\",\n"
               "    \"config_groups\": {\"group_0\": {\n"
               "      \"weights\": {\"num_bits\": 4, \"type\": \"float\", \"group_size\": 16, "
               "\"dynamic\": false},\n"
               "      \"input_activations\": {\"num_bits\": 4, \"type\": \"float\", "
               "\"group_size\": 16, \"dynamic\": false},\n"
               "      \"targets\": [\"Linear\"]}},\n"
               "    \"ignore\": [\"lm_head\"],\n"
               "    \"producer\": {\"name\": \"modelopt\", \"version\": \"moed-gen-%s\"}\n"
               "  }\n}\n",
            MOED_VERSION);
    int rc = close_out(f, path, err, errlen);
    if (rc)
        return rc;

    f = open_out(dir, "hf_quant_config.json", path, sizeof path, err, errlen);
    if (!f)
        return MOED_E_IO;
    fprintf(f, "{\n  \"producer\": {\"name\": \"modelopt\", \"version\": \"moed-gen-%s\"},\n"
               "  \"quantization\": {\n    \"quant_algo\": \"NVFP4\",\n"
               "    \"kv_cache_quant_algo\": null,\n    \"group_size\": 16,\n"
               "    \"exclude_modules\": [\"lm_head\"]\n  }\n}\n",
            MOED_VERSION);
    return close_out(f, path, err, errlen);
}

static void shard_name(uint32_t layer, uint32_t layers, char *out, size_t n)
{
    if (layers == 1)
        snprintf(out, n, "model.safetensors");
    else
        snprintf(out, n, "model-%05u-of-%05u.safetensors", layer + 1, layers);
}

static void tensor_base(const struct gen_preset *p, uint32_t layer, uint32_t e, int proj,
                        char *out, size_t n)
{
    if (e < p->n_experts)
        snprintf(out, n, "model.layers.%u.mlp.experts.%u.%s", layer, e, proj_names[proj]);
    else if (p->n_shared == 1)
        snprintf(out, n, "model.layers.%u.mlp.shared_experts.%s", layer, proj_names[proj]);
    else
        snprintf(out, n, "model.layers.%u.mlp.shared_experts.%u.%s", layer, e - p->n_experts,
                 proj_names[proj]);
}

static const char *const suffixes[4] = {"weight", "weight_scale", "weight_scale_2",
                                        "input_scale"};

/* Add every tensor of the layer to a writer (data borrowed from g). */
static int add_layer_tensors(struct st_writer *w, const struct gen_layer *g, uint32_t layer,
                             uint64_t *bytes)
{
    const struct gen_preset *p = g->p;
    const uint64_t H = p->hidden, I = p->inter;
    char name[256], base[192];
    for (uint32_t e = 0; e < g->n_exp; e++) {
        for (int pr = 0; pr < 3; pr++) {
            uint64_t n = pr < 2 ? I : H, k = pr < 2 ? H : I;
            const uint8_t *wp = pr == 0 ? exp_gu_w(g, e)
                              : pr == 1 ? exp_gu_w(g, e) + I * H / 2
                                        : exp_d_w(g, e);
            const uint8_t *sp = pr == 0 ? exp_gu_s(g, e)
                              : pr == 1 ? exp_gu_s(g, e) + I * H / 16
                                        : exp_d_s(g, e);
            const float *sc = g->scalars + (size_t)e * 6 + pr * 2;
            uint64_t shw[2] = {n, k / 2}, shs[2] = {n, k / NVFP4_GROUP};
            tensor_base(p, layer, e, pr, base, sizeof base);
            const struct {
                enum st_dtype dt;
                uint32_t ndim;
                const uint64_t *shape;
                const void *data;
                uint64_t nbytes;
            } t[4] = {
                {ST_U8, 2, shw, wp, n * k / 2},
                {ST_F8_E4M3, 2, shs, sp, n * k / NVFP4_GROUP},
                {ST_F32, 0, NULL, &sc[0], 4},
                {ST_F32, 0, NULL, &sc[1], 4},
            };
            for (int s = 0; s < 4; s++) {
                snprintf(name, sizeof name, "%s.%s", base, suffixes[s]);
                int rc = st_writer_add(w, name, t[s].dt, t[s].ndim, t[s].shape, t[s].data,
                                       t[s].nbytes);
                if (rc)
                    return rc;
                *bytes += t[s].nbytes;
            }
        }
    }
    return 0;
}

static int write_index(const struct gen_preset *p, uint32_t layers, uint64_t total_bytes,
                       const char *dir, char *err, size_t errlen)
{
    char path[GEN_PATH_MAX + 64], base[192], shard[64];
    FILE *f = open_out(dir, "model.safetensors.index.json", path, sizeof path, err, errlen);
    if (!f)
        return MOED_E_IO;
    fprintf(f, "{\n  \"metadata\": {\"total_size\": %llu},\n  \"weight_map\": {",
            (unsigned long long)total_bytes);
    const char *sep = "\n";
    for (uint32_t l = 0; l < layers; l++) {
        shard_name(l, layers, shard, sizeof shard);
        for (uint32_t e = 0; e < p->n_experts + p->n_shared; e++)
            for (int pr = 0; pr < 3; pr++) {
                tensor_base(p, l, e, pr, base, sizeof base);
                for (int s = 0; s < 4; s++) {
                    fprintf(f, "%s    \"%s.%s\": \"%s\"", sep, base, suffixes[s], shard);
                    sep = ",\n";
                }
            }
    }
    fprintf(f, "\n  }\n}\n");
    return close_out(f, path, err, errlen);
}

/* ------------------------------------------------------------------ main */

int moed_gen_model(const struct moed_gen_opts *opts, const char *out_dir, char *err,
                   size_t errlen)
{
    if (!opts || !out_dir)
        return moed_seterr(err, errlen, MOED_E_INVAL, "gen-model: missing options or --out");
    const struct gen_preset *p = find_preset(opts->preset);
    if (!p)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "unknown preset '%.64s' (allowed: tiny, qwen3-30b-a3b, deepseek-v3)",
                           opts->preset ? opts->preset : "(null)");
    if (opts->layers < 1 || opts->layers > MOED_MAX_LAYERS)
        return moed_seterr(err, errlen, MOED_E_INVAL, "layers %u not in 1..%u", opts->layers,
                           MOED_MAX_LAYERS);

    int rc = mkdir_p(out_dir, err, errlen);
    if (rc)
        return rc;
    rc = write_configs(p, opts->layers, out_dir, err, errlen);
    if (rc)
        return rc;

    const uint32_t n_exp = p->n_experts + p->n_shared;
    long nt = opts->threads ? (long)opts->threads : sysconf(_SC_NPROCESSORS_ONLN);
    if (nt < 1)
        nt = 1;
    if (nt > GEN_MAX_THREADS)
        nt = GEN_MAX_THREADS;
    if ((uint32_t)nt > n_exp)
        nt = n_exp;

    struct gen_layer g = {.p = p, .n_exp = n_exp};
    g.exp_bytes = 2 * nvfp4_mat_bytes(p->inter, p->hidden) + nvfp4_mat_bytes(p->hidden, p->inter);
    const size_t buf_floats = 2 * (size_t)p->inter * p->hidden;
    struct gen_worker *workers = NULL;
    pthread_t *tids = NULL;
    float *bufs = NULL;
    struct st_writer *w = NULL;
    atomic_ulong done;
    uint64_t total_bytes = 0;
    char path[GEN_PATH_MAX + 64], shard[64];

    atomic_init(&done, 0);
    g.data = malloc(n_exp * g.exp_bytes);
    g.scalars = calloc((size_t)n_exp * 6, sizeof *g.scalars);
    workers = calloc((size_t)nt, sizeof *workers);
    tids = calloc((size_t)nt, sizeof *tids);
    bufs = malloc((size_t)nt * buf_floats * sizeof *bufs);
    if (!g.data || !g.scalars || !workers || !tids || !bufs) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM,
                         "out of memory: one layer of %s needs %.2f GB + %ld x %.0f MB scratch",
                         p->name, (double)(n_exp * g.exp_bytes) / 1e9, nt,
                         (double)(buf_floats * sizeof(float)) / 1e6);
        goto out;
    }
    LOG_I("gen-model: preset %s, %u layer(s), seed %llu, %ld thread(s), %.2f GB per layer -> %s",
          p->name, opts->layers, (unsigned long long)opts->seed, nt,
          (double)(n_exp * g.exp_bytes) / 1e9, out_dir);

    for (uint32_t l = 0; l < opts->layers; l++) {
        struct gen_job job = {.g = &g, .seed = opts->seed, .layer = l, .done = &done,
                              .total = (uint64_t)n_exp * opts->layers};
        atomic_init(&job.next, 0);
        for (long i = 0; i < nt; i++) {
            workers[i].job = &job;
            workers[i].buf = bufs + (size_t)i * buf_floats;
        }
        /* This thread is worker 0; work goes by an atomic counter, so a
         * failed pthread_create only leaves fewer helpers. */
        long started = 1;
        for (long i = 1; i < nt; i++) {
            if (pthread_create(&tids[i], NULL, gen_worker_main, &workers[i]) != 0) {
                LOG_W("gen-model: pthread_create failed; continuing with %ld threads", started);
                break;
            }
            started++;
        }
        gen_worker_main(&workers[0]);
        for (long i = 1; i < started; i++)
            pthread_join(tids[i], NULL);

        rc = st_writer_new(&w);
        if (rc) {
            moed_seterr(err, errlen, rc, "out of memory for the safetensors writer");
            goto out;
        }
        rc = add_layer_tensors(w, &g, l, &total_bytes);
        if (rc) {
            moed_seterr(err, errlen, rc, "layer %u: cannot add tensors to the writer (%s)", l,
                        moed_strerror(rc));
            goto out;
        }
        shard_name(l, opts->layers, shard, sizeof shard);
        snprintf(path, sizeof path, "%s/%s", out_dir, shard);
        rc = st_writer_write(w, path, err, errlen);
        if (rc)
            goto out;
        st_writer_free(w);
        w = NULL;
        LOG_I("gen-model: wrote %s (layer %u/%u)", path, l + 1, opts->layers);
    }
    if (opts->layers > 1) {
        rc = write_index(p, opts->layers, total_bytes, out_dir, err, errlen);
        if (rc)
            goto out;
    } else {
        /* An index left by an earlier multi-layer run in the same directory
         * would point loaders at stale shards instead of model.safetensors. */
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", out_dir);
        if (unlink(path) == 0)
            LOG_W("gen-model: removed stale %s", path);
    }
    LOG_I("gen-model: done, %.2f GB of tensors in %s", (double)total_bytes / 1e9, out_dir);

out:
    st_writer_free(w);
    free(bufs);
    free(tids);
    free(workers);
    free(g.scalars);
    free(g.data);
    return rc;
}
