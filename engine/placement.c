/* placement.c - expert placement across the GPUs of a host and the
 * assignment of a batch's pairs to them (placement.h). */
#include "placement.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed_err.h"
#include "moed_file.h"

#define NO_DEV 0xFFu

static int alloc_placement(struct moed_placement *p, uint32_t n_experts, uint32_t n_shared,
                           uint32_t n_dev, char *err, size_t errlen)
{
    memset(p, 0, sizeof *p);
    if (n_dev < 1 || n_dev > MOED_PLACE_MAX_DEVS)
        return moed_seterr(err, errlen, MOED_E_INVAL, "placement: %u devices (1..%d)", n_dev,
                           MOED_PLACE_MAX_DEVS);
    if (n_experts < 1)
        return moed_seterr(err, errlen, MOED_E_INVAL, "placement: no routed experts");
    p->n_rep = calloc(n_experts, 1);
    p->dev = malloc((size_t)n_experts * MOED_PLACE_MAX_REPLICAS);
    if (!p->n_rep || !p->dev) {
        moed_placement_free(p);
        return moed_seterr(err, errlen, MOED_E_NOMEM, "placement: out of memory");
    }
    memset(p->dev, NO_DEV, (size_t)n_experts * MOED_PLACE_MAX_REPLICAS);
    p->n_dev = n_dev;
    p->n_experts = n_experts;
    p->n_shared = n_shared;
    return 0;
}

void moed_placement_free(struct moed_placement *p)
{
    free(p->n_rep);
    free(p->dev);
    memset(p, 0, sizeof *p);
}

/* One replica to place: its expert and its share of the expert's load. */
struct item {
    uint32_t e;
    double load;
};

static int by_load_desc(const void *a, const void *b)
{
    const struct item *x = a, *y = b;
    if (x->load != y->load)
        return x->load > y->load ? -1 : 1;
    return x->e < y->e ? -1 : x->e > y->e; /* the lower expert first */
}

int moed_placement_balanced(uint32_t n_experts, uint32_t n_shared, uint32_t n_dev,
                            const uint64_t *load, uint32_t max_replicas, double hot,
                            struct moed_placement *out, char *err, size_t errlen)
{
    int rc = alloc_placement(out, n_experts, n_shared, n_dev, err, errlen);
    if (rc)
        return rc;
    if (max_replicas < 1 || max_replicas > n_dev) {
        moed_placement_free(out);
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "placement: max_replicas %u is out of range [1, %u] (one copy per "
                           "device at most)",
                           max_replicas, n_dev);
    }
    if (!(hot > 0 && hot <= 1e6)) {
        moed_placement_free(out);
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "placement: hot %g is out of range (0, 1e6]", hot);
    }
    double total = 0;
    for (uint32_t e = 0; e < n_experts; e++)
        total += (double)load[e];
    const double fair = total / n_dev; /* one device's share of the traffic */
    uint32_t n_items = 0;
    for (uint32_t e = 0; e < n_experts; e++) {
        uint32_t r = 1;
        if (fair > 0 && (double)load[e] > hot * fair) {
            double want = ceil((double)load[e] / (hot * fair));
            r = want >= max_replicas ? max_replicas : (uint32_t)want;
        }
        out->n_rep[e] = (uint8_t)r;
        n_items += r;
    }
    struct item *it = malloc((size_t)n_items * sizeof *it);
    if (!it) {
        moed_placement_free(out);
        return moed_seterr(err, errlen, MOED_E_NOMEM, "placement: out of memory");
    }
    uint32_t k = 0;
    for (uint32_t e = 0; e < n_experts; e++)
        for (uint32_t r = 0; r < out->n_rep[e]; r++)
            it[k++] = (struct item){e, (double)load[e] / out->n_rep[e]};
    qsort(it, n_items, sizeof *it, by_load_desc);
    /* every device holds floor or ceil of n_items / n_dev replicas */
    const uint32_t cap = (n_items + n_dev - 1) / n_dev;
    double dload[MOED_PLACE_MAX_DEVS] = {0};
    uint32_t dcount[MOED_PLACE_MAX_DEVS] = {0};
    uint8_t placed[MOED_PLACE_MAX_DEVS];
    for (uint32_t i = 0; i < n_items; i++) {
        const uint32_t e = it[i].e;
        uint8_t *devs = out->dev + (size_t)e * MOED_PLACE_MAX_REPLICAS;
        uint32_t have = 0;
        while (have < MOED_PLACE_MAX_REPLICAS && devs[have] != NO_DEV)
            have++;
        memset(placed, 0, sizeof placed);
        for (uint32_t r = 0; r < have; r++)
            placed[devs[r]] = 1;
        int best = -1;
        for (uint32_t d = 0; d < n_dev; d++) {
            if (placed[d] || dcount[d] >= cap)
                continue;
            if (best < 0 || dload[d] < dload[best] ||
                (dload[d] == dload[best] && dcount[d] < dcount[best]))
                best = (int)d;
        }
        /* a free device always exists: have < n_rep <= n_dev, and the
         * devices' room (n_dev * cap >= n_items) is not all taken while an
         * item is left; only the ones holding e may be full */
        if (best < 0) {
            for (uint32_t d = 0; d < n_dev; d++)
                if (!placed[d] && (best < 0 || dcount[d] < dcount[best]))
                    best = (int)d;
        }
        devs[have] = (uint8_t)best;
        dload[best] += it[i].load;
        dcount[best]++;
    }
    free(it);
    return 0;
}

int moed_placement_from_lists(uint32_t n_experts, uint32_t n_shared, uint32_t n_dev,
                              const int64_t *const *lists, const uint32_t *lens,
                              struct moed_placement *out, char *err, size_t errlen)
{
    int rc = alloc_placement(out, n_experts, n_shared, n_dev, err, errlen);
    if (rc)
        return rc;
    for (uint32_t e = 0; e < n_experts; e++) {
        if (lens[e] < 1 || lens[e] > MOED_PLACE_MAX_REPLICAS || lens[e] > n_dev) {
            moed_placement_free(out);
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "placement: expert %u has %u devices (1..%u: each device at "
                               "most once)",
                               e, lens[e], n_dev < MOED_PLACE_MAX_REPLICAS ? n_dev
                                                                          : MOED_PLACE_MAX_REPLICAS);
        }
        uint8_t *devs = out->dev + (size_t)e * MOED_PLACE_MAX_REPLICAS;
        for (uint32_t r = 0; r < lens[e]; r++) {
            const int64_t d = lists[e][r];
            if (d < 0 || d >= (int64_t)n_dev) {
                moed_placement_free(out);
                return moed_seterr(err, errlen, MOED_E_INVAL,
                                   "placement: expert %u, entry %u: device %lld is out of "
                                   "range [0, %u)",
                                   e, r, (long long)d, n_dev);
            }
            for (uint32_t q = 0; q < r; q++)
                if (devs[q] == (uint8_t)d) {
                    moed_placement_free(out);
                    return moed_seterr(err, errlen, MOED_E_INVAL,
                                       "placement: expert %u names device %lld twice", e,
                                       (long long)d);
                }
            devs[r] = (uint8_t)d;
        }
        out->n_rep[e] = (uint8_t)lens[e];
    }
    return 0;
}

int moed_ep_assign(const struct moed_placement *p, uint32_t T, uint32_t top_k,
                   const int32_t *ids, uint8_t *dev_of, uint32_t *count, uint32_t *seen)
{
    const uint32_t KS = top_k + p->n_shared;
    memset(seen, 0, p->n_experts * sizeof *seen); /* pairs of e so far, token order */
    memset(count, 0, p->n_dev * sizeof *count);
    int rc = 0;
    for (uint32_t t = 0; t < T && !rc; t++) {
        for (uint32_t j = 0; j < KS; j++) {
            uint8_t d;
            if (j < top_k) {
                const int32_t e = ids[(size_t)t * top_k + j];
                if (e < 0) {
                    dev_of[(size_t)t * KS + j] = NO_DEV;
                    continue;
                }
                if ((uint32_t)e >= p->n_experts) {
                    rc = MOED_E_INVAL;
                    break;
                }
                const uint32_t r = seen[e]++ % p->n_rep[e];
                d = p->dev[(size_t)e * MOED_PLACE_MAX_REPLICAS + r];
            } else {
                d = (uint8_t)(t % p->n_dev);
            }
            dev_of[(size_t)t * KS + j] = d;
            count[d]++;
        }
    }
    return rc;
}

void moed_placement_loads(const struct moed_placement *p, const uint64_t *load,
                          double *dev_load, uint32_t *dev_experts)
{
    for (uint32_t d = 0; d < p->n_dev; d++) {
        if (dev_load)
            dev_load[d] = 0;
        if (dev_experts)
            dev_experts[d] = 0;
    }
    for (uint32_t e = 0; e < p->n_experts; e++)
        for (uint32_t r = 0; r < p->n_rep[e]; r++) {
            const uint8_t d = p->dev[(size_t)e * MOED_PLACE_MAX_REPLICAS + r];
            if (dev_load && load)
                dev_load[d] += (double)load[e] / p->n_rep[e];
            if (dev_experts)
                dev_experts[d]++;
        }
}

/* ---- a placement map file (moectl placement --json) ---- */

/* v as an integer in [lo, hi]: 1, else 0 */
static int json_int(const cJSON *v, int64_t lo, int64_t hi, int64_t *out)
{
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) ||
        v->valuedouble < (double)lo || v->valuedouble > (double)hi)
        return 0;
    *out = (int64_t)v->valuedouble;
    return 1;
}

/* The top-level number `key` of the map: it must be `want`. */
static int map_expect(const cJSON *root, const char *name, const char *key, uint32_t want,
                      const char *what, char *err, size_t errlen)
{
    int64_t v;
    if (!json_int(cJSON_GetObjectItemCaseSensitive(root, key), 0, UINT32_MAX, &v))
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "%s: \"%s\" is missing or not an integer", name, key);
    if (v != (int64_t)want)
        return moed_seterr(err, errlen, MOED_E_CONFIG, "%s: \"%s\" is %lld but %s %u", name, key,
                           (long long)v, what, want);
    return 0;
}

/* Layer object li of the map into out[layer] (its "experts" lists). */
static int map_layer(const cJSON *l, uint32_t li, const char *name, uint32_t n_layers,
                     const uint8_t *is_moe, uint32_t E, uint32_t S, uint32_t n_dev,
                     struct moed_placement *out, char *err, size_t errlen)
{
    int64_t id;
    if (!cJSON_IsObject(l) ||
        !json_int(cJSON_GetObjectItemCaseSensitive(l, "layer"), 0, UINT32_MAX, &id))
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "%s: layers[%u] is not an object with an integer \"layer\"", name, li);
    if (id >= (int64_t)n_layers || !is_moe[id])
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "%s: layers[%u]: layer %lld is not an MoE layer of the model (%u "
                           "layers)", name, li, (long long)id, n_layers);
    if (out[id].n_rep)
        return moed_seterr(err, errlen, MOED_E_CONFIG, "%s: layer %lld is listed twice", name,
                           (long long)id);
    const cJSON *ex = cJSON_GetObjectItemCaseSensitive(l, "experts");
    if (!cJSON_IsArray(ex) || cJSON_GetArraySize(ex) != (int)E)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "%s: layer %lld: \"experts\" must be an array of %u device lists "
                           "(one per routed expert)", name, (long long)id, E);
    int64_t *vals = malloc(sizeof *vals * (size_t)E * MOED_PLACE_MAX_REPLICAS);
    const int64_t **lists = malloc(sizeof *lists * E);
    uint32_t *lens = malloc(sizeof *lens * E);
    int rc = 0;
    char why[256];
    if (!vals || !lists || !lens) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory", name);
        goto out;
    }
    uint32_t e = 0;
    for (const cJSON *d = ex->child; d; d = d->next, e++) {
        int n = cJSON_GetArraySize(d);
        if (!cJSON_IsArray(d) || n < 1 || n > MOED_PLACE_MAX_REPLICAS) {
            rc = moed_seterr(err, errlen, MOED_E_CONFIG,
                             "%s: layer %lld, expert %u: not a list of 1..%d device indices",
                             name, (long long)id, e, MOED_PLACE_MAX_REPLICAS);
            goto out;
        }
        lists[e] = vals + (size_t)e * MOED_PLACE_MAX_REPLICAS;
        lens[e] = 0;
        for (const cJSON *v = d->child; v; v = v->next) {
            int64_t x;
            if (!json_int(v, 0, INT32_MAX, &x)) {
                rc = moed_seterr(err, errlen, MOED_E_CONFIG,
                                 "%s: layer %lld, expert %u, entry %u: not a device index", name,
                                 (long long)id, e, lens[e]);
                goto out;
            }
            vals[(size_t)e * MOED_PLACE_MAX_REPLICAS + lens[e]++] = x;
        }
    }
    rc = moed_placement_from_lists(E, S, n_dev, lists, lens, &out[id], why, sizeof why);
    if (rc) /* "placement: expert E, entry R: ..." */
        rc = moed_seterr(err, errlen, MOED_E_CONFIG, "%s: layer %lld: %s", name, (long long)id,
                         strncmp(why, "placement: ", 11) ? why : why + 11);
out:
    free(vals);
    free(lists);
    free(lens);
    return rc;
}

int moed_placement_parse_json(const char *text, size_t len, const char *name, uint32_t n_layers,
                              const uint8_t *is_moe, uint32_t n_experts, uint32_t n_shared,
                              uint32_t n_dev, struct moed_placement *out, char *err,
                              size_t errlen)
{
    int rc = 0;
    memset(out, 0, sizeof *out * n_layers);
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (!cJSON_IsObject(root)) {
        rc = moed_seterr(err, errlen, MOED_E_CONFIG, "%s: not a JSON object (moectl placement "
                         "--json writes the map)", name);
        goto out;
    }
    if ((rc = map_expect(root, name, "gpus", n_dev, "engine.gpus lists", err, errlen)) ||
        (rc = map_expect(root, name, "n_experts", n_experts, "the model's routed experts are",
                         err, errlen)) ||
        (rc = map_expect(root, name, "n_shared", n_shared, "the model's shared experts are", err,
                         errlen)))
        goto out;
    const cJSON *layers = cJSON_GetObjectItemCaseSensitive(root, "layers");
    if (!cJSON_IsArray(layers)) {
        rc = moed_seterr(err, errlen, MOED_E_CONFIG, "%s: \"layers\" is missing or not an array",
                         name);
        goto out;
    }
    uint32_t li = 0;
    for (const cJSON *l = layers->child; l; l = l->next, li++)
        if ((rc = map_layer(l, li, name, n_layers, is_moe, n_experts, n_shared, n_dev, out, err,
                            errlen)))
            goto out;
    for (uint32_t l = 0; l < n_layers; l++)
        if (is_moe[l] && !out[l].n_rep) {
            rc = moed_seterr(err, errlen, MOED_E_CONFIG,
                             "%s: MoE layer %u is not in the map (every MoE layer must be)", name,
                             l);
            goto out;
        }
out:
    cJSON_Delete(root);
    if (rc)
        for (uint32_t l = 0; l < n_layers; l++)
            moed_placement_free(&out[l]);
    return rc;
}

int moed_placement_load_json(const char *path, uint32_t n_layers, const uint8_t *is_moe,
                             uint32_t n_experts, uint32_t n_shared, uint32_t n_dev,
                             struct moed_placement *out, char *err, size_t errlen)
{
    char *text = NULL;
    size_t n = 0;
    memset(out, 0, sizeof *out * n_layers);
    /* "engine.placement: cannot open PATH: ...", "engine.placement: N bytes, over ..." */
    int rc = moed_file_read_small(path, "engine.placement", MOED_PLACE_MAX_JSON_BYTES,
                                  MOED_E_CONFIG, &text, &n, NULL, err, errlen);
    if (rc) /* a map that cannot be read is a config error, as one that does not parse */
        return rc == MOED_E_NOMEM ? rc : MOED_E_CONFIG;
    rc = moed_placement_parse_json(text, n, path, n_layers, is_moe, n_experts, n_shared, n_dev,
                                   out, err, errlen);
    free(text);
    return rc;
}
