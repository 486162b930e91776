/* model.c - open an NVFP4 MoE checkpoint directory.
 *
 * Order of work (validate first, acquire second):
 *   1. config.json -> moed_dims + the set of MoE layers (alias table below);
 *   2. quantization: hf_quant_config.json, else config.json:quantization_config;
 *   3. shards: model.safetensors.index.json (weight_map) or model.safetensors,
 *      each shard opened once (headers parsed, data only mapped, not read);
 *   4. every expert tensor looked up and its dtype/shape checked, and the bytes
 *      of all weights + block scales summed from the headers alone;
 *   5. budget check (MOED_E_NOFIT) before any tensor byte is read;
 *   6. scalars read and checked, every block scale checked (no NaN), then
 *      every page of every expert matrix touched so the load cost is paid at
 *      start, not on the first request.
 */
#include "model_int.h"

/* ------------------------------------------------------------ small files */

static int path_join(char *buf, size_t len, const char *dir, const char *name, char *err,
                     size_t errlen)
{
    int n = snprintf(buf, len, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= len)
        return moed_seterr(err, errlen, MOED_E_RANGE, "path '%s/%s' is too long", dir, name);
    return 0;
}

/* JSON text[0..len) that must be one object; `name` labels messages. */
static int parse_json(const char *name, const char *text, size_t len, cJSON **out, char *err,
                      size_t errlen)
{
    *out = cJSON_ParseWithLength(text, len);
    if (!*out) {
        const char *at = cJSON_GetErrorPtr();
        size_t pos = (at && at >= text && at <= text + len) ? (size_t)(at - text) : 0;
        return moed_seterr(err, errlen, MOED_E_MODEL, "%s: malformed JSON near byte %zu", name,
                           pos);
    }
    if (!cJSON_IsObject(*out)) {
        cJSON_Delete(*out);
        *out = NULL;
        return moed_seterr(err, errlen, MOED_E_MODEL, "%s: not a JSON object", name);
    }
    return 0;
}

int model_read_json(const char *dir, const char *name, size_t cap, cJSON **out, int *missing,
                     char *err, size_t errlen)
{
    char path[PATH_MAX];
    char *text = NULL;
    *out = NULL;
    int rc = path_join(path, sizeof path, dir, name, err, errlen);
    if (rc)
        return rc;
    rc = moed_file_read_small(path, name, cap, MOED_E_MODEL, &text, NULL, missing, err, errlen);
    if (rc || !text)
        return rc;
    rc = parse_json(name, text, strlen(text), out, err, errlen);
    free(text);
    return rc;
}

/* ------------------------------------------------------------ quantization */

static int quant_check_fields(const char *label, const cJSON *algo, const cJSON *gs, char *err,
                              size_t errlen)
{
    uint64_t g;
    if (!cJSON_IsString(algo))
        return moed_seterr(err, errlen, MOED_E_MODEL, "%s: missing 'quant_algo' (need NVFP4)",
                           label);
    if (strcmp(algo->valuestring, "NVFP4") != 0)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "%s: quant_algo '%.64s' not supported (need NVFP4)", label,
                           algo->valuestring);
    if (!gs || cJSON_IsNull(gs))
        return 0; /* NVFP4 implies 16 */
    if (model_json_uint(gs, UINT32_MAX, &g) != 0)
        return moed_seterr(err, errlen, MOED_E_MODEL, "%s: group_size is not an integer",
                           label);
    if (g != 16)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "%s: group_size %llu not supported (NVFP4 needs 16)", label,
                           (unsigned long long)g);
    return 0;
}

/* hq: hf_quant_config.json, or NULL when the checkpoint has none (then
 * config.json's quantization_config must say NVFP4). */
static int quant_check(const cJSON *hq, const cJSON *config, char *err, size_t errlen)
{
    if (hq) {
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(hq, "quantization");
        if (!cJSON_IsObject(q))
            return moed_seterr(err, errlen, MOED_E_MODEL,
                               "hf_quant_config.json: missing 'quantization' object");
        return quant_check_fields("hf_quant_config.json",
                                  cJSON_GetObjectItemCaseSensitive(q, "quant_algo"),
                                  cJSON_GetObjectItemCaseSensitive(q, "group_size"), err, errlen);
    }
    const cJSON *qc = model_cfg_get(config, "quantization_config");
    if (!cJSON_IsObject(qc))
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "no quantization info: hf_quant_config.json is absent and "
                           "config.json has no 'quantization_config' (need ModelOpt NVFP4)");
    const cJSON *meth = cJSON_GetObjectItemCaseSensitive(qc, "quant_method");
    if (meth && !(cJSON_IsString(meth) && strcmp(meth->valuestring, "modelopt") == 0))
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "config.json: quantization_config.quant_method '%.64s' not "
                           "supported (need modelopt)",
                           cJSON_IsString(meth) ? meth->valuestring : "?");
    const cJSON *gs = cJSON_GetObjectItemCaseSensitive(qc, "config_groups");
    gs = cJSON_GetObjectItemCaseSensitive(gs, "group_0");
    gs = cJSON_GetObjectItemCaseSensitive(gs, "weights");
    gs = cJSON_GetObjectItemCaseSensitive(gs, "group_size");
    if (!gs)
        gs = cJSON_GetObjectItemCaseSensitive(qc, "group_size");
    return quant_check_fields("config.json: quantization_config",
                              cJSON_GetObjectItemCaseSensitive(qc, "quant_algo"), gs, err,
                              errlen);
}

/* config.json and hf_quant_config.json (NULL if absent) of `dir`. */
static int read_configs(const char *dir, cJSON **config, cJSON **hq, char *err, size_t errlen)
{
    int missing = 0;
    int rc = model_read_json(dir, "config.json", MODEL_MAX_CONFIG_BYTES, config, NULL, err, errlen);
    if (rc == 0)
        rc = model_read_json(dir, "hf_quant_config.json", MODEL_MAX_CONFIG_BYTES, hq, &missing, err,
                       errlen);
    return rc;
}

int moed_model_parse_config(const char *config_json, size_t config_len, const char *quant_json,
                            size_t quant_len, struct moed_dims *dims, char *err, size_t errlen)
{
    cJSON *config = NULL, *hq = NULL;
    uint8_t *is_moe = malloc(MOED_MAX_LAYERS);
    int rc;
    if (!is_moe)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
    if (config_len > MODEL_MAX_CONFIG_BYTES || quant_len > MODEL_MAX_CONFIG_BYTES) {
        rc = moed_seterr(err, errlen, MOED_E_MODEL, "%s: %zu bytes, over the %u-byte cap",
                         config_len > MODEL_MAX_CONFIG_BYTES ? "config.json"
                                                             : "hf_quant_config.json",
                         config_len > MODEL_MAX_CONFIG_BYTES ? config_len : quant_len,
                         MODEL_MAX_CONFIG_BYTES);
        goto out;
    }
    rc = parse_json("config.json", config_json, config_len, &config, err, errlen);
    if (rc == 0 && quant_json)
        rc = parse_json("hf_quant_config.json", quant_json, quant_len, &hq, err, errlen);
    if (rc == 0)
        rc = model_cfg_parse(config, dims, is_moe, err, errlen);
    if (rc == 0)
        rc = quant_check(hq, config, err, errlen);
out:
    cJSON_Delete(config);
    cJSON_Delete(hq);
    free(is_moe);
    return rc;
}

/* ------------------------------------------------------------------ shards */

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int cmp_wmap(const void *a, const void *b)
{
    return strcmp(((const struct wmap_entry *)a)->tensor, ((const struct wmap_entry *)b)->tensor);
}

static int shard_name_ok(const char *s)
{
    return s[0] != '\0' && s[0] != '/' && !strchr(s, '/') && !strstr(s, "..");
}

static int open_shard(struct moed_model *m, size_t i, char *err, size_t errlen)
{
    char path[PATH_MAX];
    int rc = path_join(path, sizeof path, m->dir, m->shards[i].file, err, errlen);
    if (rc == 0)
        rc = st_open(path, &m->shards[i].st, err, errlen);
    return rc;
}

static int shards_open(struct moed_model *m, char *err, size_t errlen)
{
    int missing = 0, rc;
    const char **files = NULL;
    rc = model_read_json(m->dir, "model.safetensors.index.json", MODEL_MAX_INDEX_BYTES, &m->index,
                   &missing, err, errlen);
    if (rc)
        return rc;
    if (missing) {
        m->shards = calloc(1, sizeof *m->shards);
        if (!m->shards)
            return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
        m->n_shards = 1;
        m->shards[0].file = "model.safetensors";
        return open_shard(m, 0, err, errlen);
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(m->index, "weight_map");
    if (!cJSON_IsObject(wm))
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "model.safetensors.index.json: missing 'weight_map' object");
    size_t n = (size_t)cJSON_GetArraySize(wm);
    m->wmap = calloc(n ? n : 1, sizeof *m->wmap);
    files = calloc(n ? n : 1, sizeof *files);
    if (!m->wmap || !files) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for %zu index entries", n);
        goto out;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        if (!cJSON_IsString(e) || !e->string) {
            rc = moed_seterr(err, errlen, MOED_E_MODEL,
                             "model.safetensors.index.json: weight_map['%.200s'] is not a "
                             "file name",
                             e->string ? e->string : "");
            goto out;
        }
        if (!shard_name_ok(e->valuestring)) {
            rc = moed_seterr(err, errlen, MOED_E_MODEL,
                             "model.safetensors.index.json: shard path '%.200s' escapes the "
                             "checkpoint directory",
                             e->valuestring);
            goto out;
        }
        m->wmap[m->n_wmap].tensor = e->string;
        files[m->n_wmap] = e->valuestring;
        m->n_wmap++;
    }
    /* Unique shard names, each opened once. */
    qsort(files, n, sizeof *files, cmp_str);
    size_t u = 0;
    for (size_t i = 0; i < n; i++)
        if (u == 0 || strcmp(files[i], files[u - 1]) != 0)
            files[u++] = files[i];
    m->shards = calloc(u ? u : 1, sizeof *m->shards);
    if (!m->shards) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < u; i++)
        m->shards[i].file = files[i];
    m->n_shards = u;
    size_t k = 0;
    cJSON_ArrayForEach(e, wm) {
        const char **hit = bsearch(&e->valuestring, files, u, sizeof *files, cmp_str);
        m->wmap[k++].shard = (uint32_t)(hit - files);
    }
    qsort(m->wmap, m->n_wmap, sizeof *m->wmap, cmp_wmap);
    for (size_t i = 1; i < m->n_wmap; i++) {
        if (strcmp(m->wmap[i].tensor, m->wmap[i - 1].tensor) == 0) {
            rc = moed_seterr(err, errlen, MOED_E_MODEL,
                             "model.safetensors.index.json: tensor '%.200s' listed twice in "
                             "weight_map",
                             m->wmap[i].tensor);
            goto out;
        }
    }
    for (size_t i = 0; i < u && rc == 0; i++)
        rc = open_shard(m, i, err, errlen);
out:
    free(files);
    return rc;
}

/* Find `name` in the checkpoint; *mapped_to names the shard the index
 * promised when the index lists it but that shard lacks it. */
static const struct st_tensor *find_exact(const struct moed_model *m, const char *name,
                                          const char **mapped_to)
{
    if (!m->index)
        return st_find(m->shards[0].st, name);
    struct wmap_entry key = {.tensor = name};
    const struct wmap_entry *w = bsearch(&key, m->wmap, m->n_wmap, sizeof *m->wmap, cmp_wmap);
    if (!w)
        return NULL;
    const struct st_tensor *t = st_find(m->shards[w->shard].st, name);
    if (!t && !*mapped_to)
        *mapped_to = m->shards[w->shard].file;
    return t;
}

/* `suffix` is the name after "model."; multimodal wrappers insert
 * "language_model." there. Writes the plain name into `name` for messages. */
static const struct st_tensor *find_tensor(const struct moed_model *m, const char *suffix,
                                           char *name, size_t len, const char **mapped_to)
{
    char alt[512];
    *mapped_to = NULL;
    snprintf(name, len, "model.%s", suffix);
    const struct st_tensor *t = find_exact(m, name, mapped_to);
    if (!t) {
        snprintf(alt, sizeof alt, "model.language_model.%s", suffix);
        t = find_exact(m, alt, mapped_to);
    }
    return t;
}

/* ----------------------------------------------------------- expert tensors */

static const char *shp(char *buf, size_t len, const struct st_tensor *t)
{
    size_t o = (size_t)snprintf(buf, len, "[");
    for (uint32_t i = 0; i < t->ndim && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%llu", i ? ", " : "",
                              (unsigned long long)t->shape[i]);
    if (o < len)
        snprintf(buf + o, len - o, "]");
    return buf;
}

static int is_scalar_f32(const struct st_tensor *t)
{
    return t->dtype == ST_F32 && (t->ndim == 0 || (t->ndim == 1 && t->shape[0] == 1));
}

/* Scalars found in pass 1 and read in pass 2 (after the budget check). A
 * down_proj cut out of a merged shared MLP (split_k != 0) is copied in pass 2
 * too: its columns split_col .. split_col + I of rows split_k weights long. */
struct mat_scalars {
    const struct st_tensor *s2, *in;
    char s2_name[256];
    const uint8_t *split_w, *split_s;
    uint32_t split_k, split_col;
};

static int missing_msg(const char *name, const char *mapped_to, char *err, size_t errlen)
{
    if (mapped_to)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "missing tensor '%s' (the index maps it to '%s', which does not "
                           "hold it)",
                           name, mapped_to);
    return moed_seterr(err, errlen, MOED_E_MODEL, "missing tensor '%s'", name);
}

/* Pass 1 for one matrix: look up, check dtypes and shapes, set pointers. */
static int mat_lookup(const struct moed_model *m, const char *base, uint32_t n, uint32_t k,
                      struct nvfp4_mat *mat, struct mat_scalars *sc, uint64_t *bytes, char *err,
                      size_t errlen)
{
    char suffix[192], name[256], s1[96], s2[96];
    const char *mapped;
    const struct st_tensor *w, *s, *t;

    snprintf(suffix, sizeof suffix, "%s.weight", base);
    w = find_tensor(m, suffix, name, sizeof name, &mapped);
    if (!w)
        return missing_msg(name, mapped, err, errlen);
    if (w->dtype != ST_U8)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "tensor '%s': dtype %s, expected U8 (packed E2M1 pairs)", name,
                           st_dtype_name(w->dtype));
    if (w->ndim != 2 || w->shape[0] != n || w->shape[1] != k / 2)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "tensor '%s': shape %s, expected [%u, %u] (N, K/2)", name,
                           shp(s1, sizeof s1, w), n, k / 2);

    snprintf(suffix, sizeof suffix, "%s.weight_scale", base);
    s = find_tensor(m, suffix, name, sizeof name, &mapped);
    if (!s)
        return missing_msg(name, mapped, err, errlen);
    if (s->dtype != ST_F8_E4M3)
        return moed_seterr(err, errlen, MOED_E_MODEL, "tensor '%s': dtype %s, expected F8_E4M3",
                           name, st_dtype_name(s->dtype));
    if (s->ndim != 2 || s->shape[0] != n || s->shape[1] != k / 16)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "tensor '%s': weight_scale shape %s does not match weight %s "
                           "(expected [%u, %u])",
                           name, shp(s1, sizeof s1, s), shp(s2, sizeof s2, w), n, k / 16);

    snprintf(suffix, sizeof suffix, "%s.weight_scale_2", base);
    t = find_tensor(m, suffix, sc->s2_name, sizeof sc->s2_name, &mapped);
    if (!t)
        return missing_msg(sc->s2_name, mapped, err, errlen);
    if (!is_scalar_f32(t))
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "tensor '%s': %s %s, expected an F32 scalar ([] or [1])",
                           sc->s2_name, st_dtype_name(t->dtype), shp(s1, sizeof s1, t));
    sc->s2 = t;

    snprintf(suffix, sizeof suffix, "%s.input_scale", base);
    t = find_tensor(m, suffix, name, sizeof name, &mapped);
    if (!t && mapped)
        return missing_msg(name, mapped, err, errlen);
    if (t && !is_scalar_f32(t))
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "tensor '%s': %s %s, expected an F32 scalar ([] or [1])", name,
                           st_dtype_name(t->dtype), shp(s1, sizeof s1, t));
    sc->in = t;

    mat->n = n;
    mat->k = k;
    mat->w = w->data;
    mat->scale = s->data;
    mat->scale_2 = 0.0f;
    mat->input_scale = 1.0f;
    *bytes += w->nbytes + s->nbytes;
    return 0;
}

static float read_f32(const void *p)
{
    float f;
    memcpy(&f, p, sizeof f); /* mmap data carries no alignment promise */
    return f;
}

/* Read one byte per page of [p, p + n) so the page cache holds it now. */
static uint64_t touch(const uint8_t *p, uint64_t n, long page)
{
    uint64_t sum = 0;
    if (n == 0)
        return 0;
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(page - 1);
    (void)madvise((void *)a, (size_t)((uintptr_t)p + n - a), MADV_WILLNEED); /* advice only */
    for (uint64_t o = 0; o < n; o += MODEL_TOUCH_STRIDE)
        sum += ((const volatile uint8_t *)p)[o];
    sum += ((const volatile uint8_t *)p)[n - 1];
    return sum;
}

/* Every E4M3 block scale of `mat` must be a number: a NaN scale (0x7f or
 * 0xff) would make every output that its 16 weights reach NaN. s2_name is
 * the matrix's weight_scale_2 tensor name, so the scale tensor's name is it
 * without the "_2". */
static int check_scales(const struct nvfp4_mat *mat, const char *s2_name, char *err,
                        size_t errlen)
{
    size_t blocks = mat->k / NVFP4_GROUP, n = (size_t)mat->n * blocks;
    size_t at = nvfp4_e4m3_find_nan(mat->scale, n);
    if (at == n)
        return 0;
    size_t row = at / blocks, blk = at % blocks;
    size_t nl = strlen(s2_name);
    int base = nl > 2 && !strcmp(s2_name + nl - 2, "_2") ? (int)(nl - 2) : (int)nl;
    return moed_seterr(err, errlen, MOED_E_MODEL,
                       "tensor '%.*s': block scale at row %zu, block %zu (weights %zu..%zu of "
                       "the row) is NaN (E4M3 byte 0x%02x); a block scale must be a number",
                       base, s2_name, row, blk, blk * NVFP4_GROUP, blk * NVFP4_GROUP + 15,
                       mat->scale[at]);
}

/* Matrix i of the flat order (expert i / 3, projection i % 3). */
static struct nvfp4_mat *mat_at(struct moe_expert *experts, size_t i)
{
    struct moe_expert *x = &experts[i / 3];
    return i % 3 == 0 ? &x->gate : i % 3 == 1 ? &x->up : &x->down;
}

static const char *const proj_names[3] = {"gate_proj", "up_proj", "down_proj"};

/* Hugging Face stores S > 1 shared experts as one MLP of intermediate size
 * S*I (layers.L.mlp.shared_experts.{gate,up,down}_proj, as DeepSeek-V2/V3 and
 * GLM-4.5 build it: moe_intermediate_size * n_shared_experts). SiLU(gate)*up
 * is elementwise along the intermediate dimension and down is linear in it,
 * so that MLP is exactly the sum of S experts cut at multiples of I: gate/up
 * rows s*I .. (s+1)*I (whole rows with their block scales) and down columns
 * s*I .. (s+1)*I (I is a multiple of 16: no 16-weight scale block is cut).
 * Every piece keeps the tensor's one weight_scale_2 and input_scale, so each
 * dequantized weight is the same number as in the merged tensor; the only
 * difference from computing the merged MLP is the fp32 order of the down
 * sums (S partial sums added in the combine). A checkpoint whose shared
 * experts were quantized one by one uses the per-index names instead
 * (shared_experts.{s}.*, each with its own scales).
 *
 * Returns 1 and fills the S experts' matrices (sc entries of mats
 * [mi, mi + 3S)) when the merged layout is there, 0 when the layer uses the
 * per-index layout, or a negative code. *split_bytes grows by the bytes the
 * down pieces need (copied in pass 2). */
static int shared_merged(const struct moed_model *m, uint32_t l, struct moe_expert *x,
                         struct mat_scalars *sc, uint64_t *need, uint64_t *split_bytes,
                         char *err, size_t errlen)
{
    const struct moed_dims *d = &m->dims;
    const uint32_t S = d->n_shared, I = d->inter, H = d->hidden;
    char suffix[192], name[256];
    const char *mapped;
    snprintf(suffix, sizeof suffix, "layers.%u.mlp.shared_experts.gate_proj.weight", l);
    if (!find_tensor(m, suffix, name, sizeof name, &mapped))
        return 0;
    for (int p = 0; p < 3; p++) {
        char base[160];
        struct nvfp4_mat whole;
        struct mat_scalars wsc = {0};
        snprintf(base, sizeof base, "layers.%u.mlp.shared_experts.%s", l, proj_names[p]);
        uint32_t n = p < 2 ? S * I : H, k = p < 2 ? H : S * I;
        int rc = mat_lookup(m, base, n, k, &whole, &wsc, need, err, errlen);
        if (rc)
            return rc;
        for (uint32_t s = 0; s < S; s++) {
            struct nvfp4_mat *mat = p == 0 ? &x[s].gate : p == 1 ? &x[s].up : &x[s].down;
            struct mat_scalars *ms = &sc[3 * s + (uint32_t)p];
            *mat = whole;
            *ms = wsc;
            if (p < 2) { /* rows s*I .. (s+1)*I */
                mat->n = I;
                mat->w = whole.w + (size_t)s * I * (H / 2);
                mat->scale = whole.scale + (size_t)s * I * (H / NVFP4_GROUP);
            } else { /* columns s*I .. (s+1)*I: copied after the budget check */
                mat->k = I;
                ms->split_w = whole.w;
                ms->split_s = whole.scale;
                ms->split_k = S * I;
                ms->split_col = s * I;
                *split_bytes += nvfp4_mat_bytes(H, I);
            }
        }
    }
    return 1;
}

/* Pass 2 for a down piece of a merged shared MLP: copy its columns into
 * dst (weights then block scales, nvfp4_mat_bytes(n, k) bytes). */
static void split_copy(struct nvfp4_mat *mat, const struct mat_scalars *sc, uint8_t *dst)
{
    const size_t wrow = mat->k / 2, srow = mat->k / NVFP4_GROUP;
    uint8_t *w = dst, *sd = dst + (size_t)mat->n * wrow;
    for (uint32_t r = 0; r < mat->n; r++) {
        memcpy(w + r * wrow, sc->split_w + (size_t)r * (sc->split_k / 2) + sc->split_col / 2,
               wrow);
        memcpy(sd + r * srow,
               sc->split_s + (size_t)r * (sc->split_k / NVFP4_GROUP) +
                   sc->split_col / NVFP4_GROUP,
               srow);
    }
    mat->w = w;
    mat->scale = sd;
}

int moed_model_open(const char *dir, uint64_t budget_bytes, moed_progress_fn progress,
                    void *progress_ctx, struct moed_model **out, char *err, size_t errlen)
{
    int rc;
    cJSON *config = NULL, *hq = NULL;
    struct mat_scalars *sc = NULL;
    struct moed_model *m = calloc(1, sizeof *m);
    *out = NULL;
    if (!m || !(m->dir = strdup(dir))) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
        goto fail;
    }
    rc = read_configs(dir, &config, &hq, err, errlen);
    if (rc)
        goto fail;
    rc = model_cfg_parse(config, &m->dims, m->is_moe, err, errlen);
    if (rc)
        goto fail;
    m->names = model_naming_for(m->dims.family);
    rc = quant_check(hq, config, err, errlen);
    if (rc)
        goto fail;
    rc = shards_open(m, err, errlen);
    if (rc)
        goto fail;

    const struct moed_dims *d = &m->dims;
    uint32_t per_layer = d->n_experts + d->n_shared;
    size_t n_mats = (size_t)d->n_moe_layers * per_layer * 3;
    m->experts = calloc((size_t)d->n_moe_layers * per_layer, sizeof *m->experts);
    m->layers = calloc(d->n_layers, sizeof *m->layers);
    sc = calloc(n_mats, sizeof *sc);
    if (!m->experts || !m->layers || !sc) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory for %zu expert matrices",
                         n_mats);
        goto fail;
    }

    /* Pass 1: headers only. */
    size_t mi = 0, ei = 0;
    uint64_t need = 0, split_bytes = 0;
    for (uint32_t l = 0; l < d->n_layers; l++) {
        struct moe_layer *ly = &m->layers[l];
        if (!m->is_moe[l])
            continue;
        ly->hidden = d->hidden;
        ly->inter = d->inter;
        ly->n_experts = d->n_experts;
        ly->n_shared = d->n_shared;
        ly->top_k = d->top_k;
        ly->experts = &m->experts[ei];
        for (uint32_t e = 0; e < per_layer; e++, ei++) {
            if (e == d->n_experts && d->n_shared > 1) {
                rc = shared_merged(m, l, &m->experts[ei], &sc[mi], &need, &split_bytes, err,
                                   errlen);
                if (rc < 0)
                    goto fail;
                if (rc == 1) {
                    ei += d->n_shared;
                    mi += 3 * (size_t)d->n_shared;
                    break;
                }
            }
            struct moe_expert *x = &m->experts[ei];
            struct nvfp4_mat *mats[3] = {&x->gate, &x->up, &x->down};
            for (int p = 0; p < 3; p++, mi++) {
                char base[160];
                if (e < d->n_experts)
                    snprintf(base, sizeof base, "layers.%u.%s.experts.%u.%s", l,
                             m->names->block, e, m->names->proj[p]);
                else if (d->n_shared == 1)
                    snprintf(base, sizeof base, "layers.%u.mlp.shared_experts.%s", l,
                             proj_names[p]);
                else
                    snprintf(base, sizeof base, "layers.%u.mlp.shared_experts.%u.%s", l,
                             e - d->n_experts, proj_names[p]);
                uint32_t n = p < 2 ? d->inter : d->hidden, k = p < 2 ? d->hidden : d->inter;
                rc = mat_lookup(m, base, n, k, mats[p], &sc[mi], &need, err, errlen);
                if (rc)
                    goto fail;
            }
        }
    }
    m->weight_bytes = need;
    m->expert_bytes = 2 * nvfp4_mat_bytes(d->inter, d->hidden) +
                      nvfp4_mat_bytes(d->hidden, d->inter);
    if (budget_bytes != 0 && need > budget_bytes) {
        rc = moed_seterr(err, errlen, MOED_E_NOFIT,
                         "model needs %.1f GiB (%llu bytes) of expert weights but only %.1f GiB "
                         "(%llu bytes) are available",
                         (double)need / GIB, (unsigned long long)need,
                         (double)budget_bytes / GIB, (unsigned long long)budget_bytes);
        goto fail;
    }

    /* Pass 2: the merged shared MLPs' down pieces, the scalars, then the block
     * scales and pages of every matrix. */
    if (split_bytes && !(m->split_mem = malloc((size_t)split_bytes))) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM,
                         "out of memory for %llu bytes of shared-expert pieces",
                         (unsigned long long)split_bytes);
        goto fail;
    }
    for (size_t i = 0, off = 0; i < n_mats; i++) {
        struct nvfp4_mat *mat = mat_at(m->experts, i);
        if (sc[i].split_k) {
            split_copy(mat, &sc[i], m->split_mem + off);
            off += nvfp4_mat_bytes(mat->n, mat->k);
        }
    }
    for (size_t i = 0; i < n_mats; i++) {
        struct nvfp4_mat *mat = mat_at(m->experts, i);
        float s2 = read_f32(sc[i].s2->data);
        if (!isfinite(s2) || !(s2 > 0.0f)) {
            rc = moed_seterr(err, errlen, MOED_E_MODEL,
                             "tensor '%s': weight_scale_2 is %g, must be finite and > 0",
                             sc[i].s2_name, (double)s2);
            goto fail;
        }
        mat->scale_2 = s2;
        if (sc[i].in)
            mat->input_scale = read_f32(sc[i].in->data);
    }
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        page = 4096;
    uint64_t done = 0, sink = 0;
    unsigned next_cb = 1, next_log = 10;
    LOG_I("loading %s: %u MoE layers x %u experts, %.1f GiB of expert weights", dir,
          d->n_moe_layers, per_layer, (double)need / GIB);
    for (size_t i = 0; i < n_mats; i++) {
        const struct nvfp4_mat *mat = mat_at(m->experts, i);
        uint64_t wb = (uint64_t)mat->n * (mat->k / 2), sb = (uint64_t)mat->n * (mat->k / 16);
        rc = check_scales(mat, sc[i].s2_name, err, errlen);
        if (rc)
            goto fail;
        sink += touch(mat->w, wb, page) + touch(mat->scale, sb, page);
        done += wb + sb;
        unsigned pct = need ? (unsigned)(done * 100 / need) : 100;
        if (progress && pct >= next_cb) {
            progress(progress_ctx, done, need);
            next_cb = pct + 1;
        }
        if (pct >= next_log && pct < 100) {
            LOG_I("loading: %u%% (%.1f of %.1f GiB)", pct, (double)done / GIB,
                  (double)need / GIB);
            next_log = pct / 10 * 10 + 10;
        }
    }
    if (progress && next_cb <= 100)
        progress(progress_ctx, done, need);
    LOG_I("loaded %s: %.1f GiB of expert weights (checksum %llu)", dir, (double)need / GIB,
          (unsigned long long)(sink & 0xffff));
    free(sc);
    cJSON_Delete(config);
    cJSON_Delete(hq);
    *out = m;
    return 0;
fail:
    free(sc);
    cJSON_Delete(config);
    cJSON_Delete(hq);
    moed_model_close(m);
    return rc;
}

void moed_model_close(struct moed_model *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->n_shards; i++)
        st_close(m->shards[i].st);
    free(m->shards);
    free(m->wmap);
    cJSON_Delete(m->index);
    free(m->experts);
    free(m->layers);
    free(m->split_mem);
    free(m->dir);
    free(m);
}

const struct moed_dims *moed_model_dims(const struct moed_model *m)
{
    return &m->dims;
}

int moed_model_is_moe_layer(const struct moed_model *m, uint32_t layer)
{
    return layer < m->dims.n_layers && m->is_moe[layer];
}

const struct moe_layer *moed_model_layer(const struct moed_model *m, uint32_t layer)
{
    return moed_model_is_moe_layer(m, layer) ? &m->layers[layer] : NULL;
}

uint64_t moed_model_weight_bytes(const struct moed_model *m)
{
    return m->weight_bytes;
}

uint64_t moed_model_expert_bytes(const struct moed_model *m)
{
    return m->expert_bytes;
}

const char *moed_model_dir(const struct moed_model *m)
{
    return m->dir;
}

