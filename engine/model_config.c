/* model_config.c - a checkpoint's config.json (see model.c): the model's
 * dimensions under each family's key names, and which layers are MoE. */
#include "model_int.h"

/* -------------------------------------------------------------- config.json */

/* Concepts and the config.json names each family uses for them. */
enum cfg_concept { C_HIDDEN, C_INTER, C_EXPERTS, C_TOPK, C_SHARED, C_LAYERS, C__COUNT };

static const struct cfg_alias {
    const char *concept;
    const char *keys[3];  /* first is the canonical name */
    int required;         /* else `dflt` when absent */
    uint32_t dflt, min, max;
} cfg_aliases[C__COUNT] = {
    [C_HIDDEN] = {"hidden size", {"hidden_size"}, 1, 0, NVFP4_GROUP, MOED_MAX_HIDDEN},
    /* intermediate_size: Mixtral-style configs, whose experts are the size of
     * the dense MLP (DeepSeek, GLM and Qwen3 give moe_intermediate_size too,
     * which comes first) */
    [C_INTER] = {"expert intermediate size", {"moe_intermediate_size", "intermediate_size"}, 1,
                 0, NVFP4_GROUP, MOED_MAX_INTER},
    /* DeepSeek-V2/V3, GLM-4.5/5: n_routed_experts; Qwen2/3-MoE before
     * transformers 5: num_experts; transformers 5 (Qwen3-MoE, Mixtral):
     * num_local_experts */
    [C_EXPERTS] = {"routed experts", {"n_routed_experts", "num_experts", "num_local_experts"}, 1,
                   0, 1, MOED_MAX_EXPERTS},
    [C_TOPK] = {"experts per token", {"num_experts_per_tok"}, 1, 0, 1, MOED_MAX_TOPK},
    /* n_shared_experts (DeepSeek, GLM; one merged MLP of S*I in the
     * checkpoint, model.c splits it); num_shared_experts (Ling/Bailing) */
    [C_SHARED] = {"shared experts", {"n_shared_experts", "num_shared_experts"}, 0, 0, 0,
                  MOED_MAX_SHARED},
    [C_LAYERS] = {"layers", {"num_hidden_layers"}, 1, 0, 1, MOED_MAX_LAYERS},
};

/* Expert tensor names by family. DeepSeek-V2/V3, GLM-4.5/5, Qwen2/3-MoE:
 * mlp.experts.{e}.{gate,up,down}_proj. Mixtral (MixtralForCausalLM, and
 * ModelOpt's NVFP4 exports of it): block_sparse_moe.experts.{e}.{w1,w3,w2},
 * w1 the gate, w3 the up and w2 the down projection (the names vLLM's and
 * SGLang's Mixtral loaders map and transformers 5 converts to its fused
 * gate_up_proj: w1 rows first); no shared experts, every layer MoE.
 * The same layout: PhiMoE (Phi-3.5-MoE, model_type phimoe) and MiniMax
 * (MiniMax-Text-01 as transformers writes it: minimax; its remote-code
 * config: minimax_text_01; MiniMax-M1: minimax_m1; MiniMax-M2: minimax_m2):
 * transformers' conversion_mapping.py reads all of them as Mixtral's
 * block_sparse_moe.experts.*.{w1,w3,w2} (phimoe with its own entry, the
 * minimax ones through "mixtral"); their config keys are Mixtral's too
 * (num_local_experts, intermediate_size; MiniMax's shared_intermediate_size
 * is 0: no shared expert). */
static const struct model_naming namings[] = {
    {"mixtral", "block_sparse_moe", {"w1", "w3", "w2"}, 0, 1},
    {"phimoe", "block_sparse_moe", {"w1", "w3", "w2"}, 0, 1},
    {"minimax", "block_sparse_moe", {"w1", "w3", "w2"}, 0, 1},
    {"minimax_text_01", "block_sparse_moe", {"w1", "w3", "w2"}, 0, 1},
    {"minimax_m1", "block_sparse_moe", {"w1", "w3", "w2"}, 0, 1},
    {"minimax_m2", "block_sparse_moe", {"w1", "w3", "w2"}, 0, 1},
    {NULL, "mlp", {"gate_proj", "up_proj", "down_proj"}, 1, 0},
};

const struct model_naming *model_naming_for(const char *family)
{
    const struct model_naming *n = namings;
    while (n->family && strcmp(n->family, family) != 0)
        n++;
    return n;
}

/* Multimodal wrappers (e.g. Qwen3-VL-MoE) nest the language model's keys in
 * "text_config"; look there when the top level lacks the key. */
const cJSON *model_cfg_get(const cJSON *root, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (v)
        return v;
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    return cJSON_IsObject(tc) ? cJSON_GetObjectItemCaseSensitive(tc, key) : NULL;
}

int model_json_uint(const cJSON *v, uint64_t max, uint64_t *out)
{
    if (!cJSON_IsNumber(v))
        return -1;
    double d = v->valuedouble;
    if (!isfinite(d) || d < 0 || d > (double)max || floor(d) != d)
        return -1;
    *out = (uint64_t)d;
    return 0;
}

/* *used: the key the value came from (for messages). */
static int cfg_read_concept(const cJSON *root, enum cfg_concept c, uint32_t *out,
                            const char **used, char *err, size_t errlen)
{
    const struct cfg_alias *a = &cfg_aliases[c];
    const cJSON *v = NULL;
    const char *key = a->keys[0];
    for (int i = 0; i < 3 && a->keys[i] && !v; i++) {
        v = model_cfg_get(root, a->keys[i]);
        if (v)
            key = a->keys[i];
    }
    *used = key;
    if (!v || cJSON_IsNull(v)) {
        if (a->required) {
            char alias[128] = "";
            size_t o = 0;
            for (int i = 1; i < 3 && a->keys[i] && o < sizeof alias; i++)
                o += (size_t)snprintf(alias + o, sizeof alias - o, "%s'%s'",
                                      i == 1 ? " (or alias " : ", ", a->keys[i]);
            if (o && o < sizeof alias)
                snprintf(alias + o, sizeof alias - o, ")");
            return moed_seterr(err, errlen, MOED_E_MODEL, "config.json: missing '%s'%s (%s)",
                               a->keys[0], alias, a->concept);
        }
        *out = a->dflt;
        return 0;
    }
    uint64_t x;
    if (model_json_uint(v, UINT32_MAX, &x) != 0)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "config.json: '%s' must be a non-negative integer", key);
    if (x < a->min || x > a->max)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "config.json: '%s' is %llu, allowed %u..%u", key,
                           (unsigned long long)x, a->min, a->max);
    *out = (uint32_t)x;
    return 0;
}

/* Which layers are MoE: GLM-5 mlp_layer_types, else DeepSeek/GLM-4.5
 * first_k_dense_replace, else Qwen3 decoder_sparse_step + mlp_only_layers. */
static int cfg_moe_layers(const cJSON *root, const struct model_naming *nm, uint32_t n_layers,
                          uint8_t *is_moe, char *err, size_t errlen)
{
    const cJSON *types = model_cfg_get(root, "mlp_layer_types");
    const cJSON *fk = model_cfg_get(root, "first_k_dense_replace");
    const cJSON *step = model_cfg_get(root, "decoder_sparse_step");
    uint64_t x;
    if (types && !cJSON_IsNull(types)) {
        if (!cJSON_IsArray(types) || (uint32_t)cJSON_GetArraySize(types) != n_layers)
            return moed_seterr(err, errlen, MOED_E_MODEL,
                               "config.json: 'mlp_layer_types' must be an array of %u strings "
                               "(one per layer)",
                               n_layers);
        uint32_t l = 0;
        const cJSON *t;
        cJSON_ArrayForEach(t, types) {
            if (cJSON_IsString(t) && strcmp(t->valuestring, "sparse") == 0)
                is_moe[l] = 1;
            else if (cJSON_IsString(t) && strcmp(t->valuestring, "dense") == 0)
                is_moe[l] = 0;
            else
                return moed_seterr(err, errlen, MOED_E_MODEL,
                                   "config.json: mlp_layer_types[%u] is not \"dense\" or "
                                   "\"sparse\"",
                                   l);
            l++;
        }
        return 0;
    }
    if (fk && !cJSON_IsNull(fk)) {
        if (model_json_uint(fk, n_layers, &x) != 0)
            return moed_seterr(err, errlen, MOED_E_MODEL,
                               "config.json: 'first_k_dense_replace' must be an integer in "
                               "0..%u (num_hidden_layers)",
                               n_layers);
        for (uint32_t l = 0; l < n_layers; l++)
            is_moe[l] = l >= x;
        return 0;
    }
    if (step && !cJSON_IsNull(step)) {
        if (model_json_uint(step, UINT32_MAX, &x) != 0 || x == 0)
            return moed_seterr(err, errlen, MOED_E_MODEL,
                               "config.json: 'decoder_sparse_step' must be a positive integer");
        for (uint32_t l = 0; l < n_layers; l++)
            is_moe[l] = (l + 1) % x == 0;
        const cJSON *only = model_cfg_get(root, "mlp_only_layers");
        if (only && !cJSON_IsNull(only)) {
            if (!cJSON_IsArray(only))
                return moed_seterr(err, errlen, MOED_E_MODEL,
                                   "config.json: 'mlp_only_layers' must be an array of layer "
                                   "numbers");
            const cJSON *v;
            cJSON_ArrayForEach(v, only) {
                uint64_t l;
                if (model_json_uint(v, n_layers - 1, &l) != 0)
                    return moed_seterr(err, errlen, MOED_E_MODEL,
                                       "config.json: 'mlp_only_layers' entries must be layer "
                                       "numbers in 0..%u",
                                       n_layers - 1);
                is_moe[l] = 0;
            }
        }
        return 0;
    }
    if (nm->all_moe) { /* Mixtral: no key, every decoder layer is MoE */
        memset(is_moe, 1, n_layers);
        return 0;
    }
    return moed_seterr(err, errlen, MOED_E_MODEL,
                       "config.json: missing 'first_k_dense_replace' (or alias "
                       "'mlp_layer_types', 'decoder_sparse_step') (which layers are MoE)");
}

int model_cfg_parse(const cJSON *root, struct moed_dims *d, uint8_t *is_moe, char *err,
                     size_t errlen)
{
    uint32_t v[C__COUNT];
    const char *key[C__COUNT];
    int rc;
    memset(d, 0, sizeof *d);
    for (int c = 0; c < C__COUNT; c++)
        if ((rc = cfg_read_concept(root, (enum cfg_concept)c, &v[c], &key[c], err, errlen)) != 0)
            return rc;
    /* The format's own unit: one E4M3 scale per NVFP4_GROUP (16) weights of a
     * row, two weights a byte. Backends may need more (CUDA: 64, checked when
     * it starts); the CPU backend takes any multiple of 16. */
    if (v[C_HIDDEN] % NVFP4_GROUP != 0)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "config.json: hidden_size %u is not a multiple of %d (an NVFP4 row "
                           "is whole %d-weight scale blocks: one E4M3 scale per %d weights)",
                           v[C_HIDDEN], NVFP4_GROUP, NVFP4_GROUP, NVFP4_GROUP);
    if (v[C_INTER] % NVFP4_GROUP != 0)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "config.json: %s %u is not a multiple of %d (an NVFP4 row is whole "
                           "%d-weight scale blocks: one E4M3 scale per %d weights)",
                           key[C_INTER], v[C_INTER], NVFP4_GROUP, NVFP4_GROUP, NVFP4_GROUP);
    if (v[C_TOPK] > v[C_EXPERTS])
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "config.json: num_experts_per_tok %u is over the %u routed experts",
                           v[C_TOPK], v[C_EXPERTS]);
    const cJSON *mt = model_cfg_get(root, "model_type");
    snprintf(d->family, sizeof d->family, "%s",
             cJSON_IsString(mt) ? mt->valuestring : "unknown");
    const struct model_naming *nm = model_naming_for(d->family);
    if (v[C_SHARED] > 0 && !nm->shared)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "config.json: %u shared experts, but model_type '%s' names no "
                           "shared-expert tensors",
                           v[C_SHARED], d->family);
    memset(is_moe, 0, MOED_MAX_LAYERS);
    if ((rc = cfg_moe_layers(root, nm, v[C_LAYERS], is_moe, err, errlen)) != 0)
        return rc;
    d->hidden = v[C_HIDDEN];
    d->inter = v[C_INTER];
    d->n_experts = v[C_EXPERTS];
    d->top_k = v[C_TOPK];
    d->n_shared = v[C_SHARED];
    d->n_layers = v[C_LAYERS];
    for (uint32_t l = 0; l < d->n_layers; l++)
        d->n_moe_layers += is_moe[l];
    if (d->n_moe_layers == 0)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "config.json: none of the %u layers is an MoE layer", d->n_layers);
    /* Qwen2-MoE / Qwen3-Next: one shared expert of its own size behind a
     * sigmoid gate (shared_expert_gate), which moed cannot compute: it holds
     * none, HELLO says n_shared 0, and the serving framework keeps it. The
     * MiniMax-M1 / Text-01 configs name the same thing
     * shared_intermediate_size (with shared_moe_mode "sigmoid"; 0 in the
     * released checkpoints). */
    static const char *const gated_keys[] = {"shared_expert_intermediate_size",
                                             "shared_intermediate_size"};
    for (size_t i = 0; i < sizeof gated_keys / sizeof gated_keys[0]; i++) {
        const cJSON *sei = model_cfg_get(root, gated_keys[i]);
        uint64_t sei_v = 0;
        if (d->n_shared == 0 && sei && model_json_uint(sei, UINT32_MAX, &sei_v) == 0 &&
            sei_v > 0)
            LOG_W("config.json: %s %llu (a gated shared expert): not served by moed (HELLO "
                  "n_shared 0); the serving framework must compute it",
                  gated_keys[i], (unsigned long long)sei_v);
    }
    return 0;
}

int moed_model_read_config(const char *dir, struct moed_dims *dims, char *err, size_t errlen)
{
    cJSON *root = NULL;
    uint8_t *is_moe = malloc(MOED_MAX_LAYERS);
    int rc;
    if (!is_moe)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
    rc = model_read_json(dir, "config.json", MODEL_MAX_CONFIG_BYTES, &root, NULL, err, errlen);
    if (rc == 0)
        rc = model_cfg_parse(root, dims, is_moe, err, errlen);
    cJSON_Delete(root);
    free(is_moe);
    return rc;
}

