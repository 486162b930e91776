/* moectl_place.c - `moectl placement`: a balanced placement of every MoE
 * layer's routed experts on --gpus GPUs (engine/placement.h) from the token
 * counts the daemon has seen since it started (STATUS
 * experts.logical_count [layers][experts], by absolute layer id; a layer
 * with no tokens yet is placed by expert count). Prints per layer the
 * tokens, the busiest GPU's share against the mean and the replicas per
 * GPU; --json the map (docs/MULTI_GPU.md): for each layer, one device list
 * per expert.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

#include "model.h"
#include "moectl_int.h"
#include "placement.h"

/* One layer's row of counts into load[] (n entries, each 0..1e18: a
 * count, cast to an integer); -1 if malformed. */
static int row_loads(const cJSON *row, uint64_t *load, uint32_t n)
{
    uint32_t i = 0;
    for (const cJSON *v = row ? row->child : NULL; v; v = v->next, i++)
        if (i >= n || !cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble <= 1e18))
            return -1;
        else
            load[i] = (uint64_t)v->valuedouble;
    return i == n ? 0 : -1;
}

static cJSON *layer_json(uint32_t layer, const struct moed_placement *p, const uint64_t *load,
                         const double *dl, const uint32_t *dx)
{
    cJSON *l = cJSON_CreateObject();
    cJSON *ex = l ? cJSON_AddArrayToObject(l, "experts") : NULL;
    if (!ex || !cJSON_AddNumberToObject(l, "layer", layer))
        goto fail;
    double tokens = 0;
    for (uint32_t e = 0; e < p->n_experts; e++) {
        tokens += (double)load[e];
        cJSON *devs = cJSON_CreateArray();
        if (!devs)
            goto fail;
        cJSON_AddItemToArray(ex, devs);
        for (uint32_t r = 0; r < p->n_rep[e]; r++) {
            cJSON *d = cJSON_CreateNumber(p->dev[(size_t)e * MOED_PLACE_MAX_REPLICAS + r]);
            if (!d)
                goto fail;
            cJSON_AddItemToArray(devs, d);
        }
    }
    cJSON *tok = cJSON_AddArrayToObject(l, "device_tokens");
    cJSON *rep = cJSON_AddArrayToObject(l, "device_experts");
    if (!tok || !rep || !cJSON_AddNumberToObject(l, "tokens", tokens))
        goto fail;
    for (uint32_t d = 0; d < p->n_dev; d++) {
        cJSON *a = cJSON_CreateNumber(dl[d]), *b = cJSON_CreateNumber(dx[d]);
        if (!a || !b) {
            cJSON_Delete(a);
            cJSON_Delete(b);
            goto fail;
        }
        cJSON_AddItemToArray(tok, a);
        cJSON_AddItemToArray(rep, b);
    }
    return l;
fail:
    cJSON_Delete(l);
    return NULL;
}

int cmd_placement(const struct opts *o)
{
    const uint32_t nd = (uint32_t)o->gpus;
    const uint32_t max_rep = o->max_replicas ? (uint32_t)o->max_replicas : nd;
    if (max_rep > nd) {
        fprintf(stderr, "moectl placement: --max-replicas %u is over --gpus %u (one copy per "
                        "GPU at most)\n",
                max_rep, nd);
        return 2;
    }
    struct moedc *c;
    struct moed_hello_rep h;
    if (connect_hello(o, &c, &h))
        return 1;
    uint32_t *moe = malloc(MOED_MAX_LAYERS * sizeof *moe);
    const uint32_t n_moe = moe ? moedc_moe_layers(c, moe, MOED_MAX_LAYERS) : 0;
    cJSON *root = moe ? fetch_status(o, c, NULL) : NULL;
    moedc_close(c);
    if (!root) {
        if (!moe)
            fprintf(stderr, "moectl placement: out of memory\n");
        free(moe);
        return 1;
    }
    int ret = 1;
    uint64_t *load = NULL;
    cJSON *out = NULL;
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(root, "experts");
    const cJSON *lc = cJSON_GetObjectItemCaseSensitive(x, "logical_count");
    const cJSON *ne = cJSON_GetObjectItemCaseSensitive(x, "num_logical_experts");
    if (!cJSON_IsArray(lc) || !cJSON_IsNumber(ne) || ne->valuedouble != h.n_experts) {
        fprintf(stderr, "moectl placement: the daemon's status has no experts.logical_count "
                        "of its %u experts (an older moed)\n", h.n_experts);
        goto out;
    }
    const uint32_t E = h.n_experts, S = h.n_shared;
    load = calloc(E, sizeof *load);
    out = cJSON_CreateObject();
    cJSON *layers = out ? cJSON_AddArrayToObject(out, "layers") : NULL;
    if (!load || !layers || !cJSON_AddNumberToObject(out, "gpus", nd) ||
        !cJSON_AddNumberToObject(out, "max_replicas", max_rep) ||
        !cJSON_AddNumberToObject(out, "hot", (double)o->hot_percent / 100.0) ||
        !cJSON_AddNumberToObject(out, "n_experts", E) ||
        !cJSON_AddNumberToObject(out, "n_shared", S)) {
        fprintf(stderr, "moectl placement: out of memory\n");
        goto out;
    }
    if (!o->json)
        printf("%6s %12s %14s %s   (%u GPUs; shared experts on every GPU)\n", "layer",
               "tokens", "busiest/mean", "experts per GPU", nd);
    /* every MoE layer the daemon serves, its counts by absolute layer id */
    for (uint32_t li = 0; li < n_moe && li < MOED_MAX_LAYERS; li++) {
        const uint32_t layer = moe[li];
        const cJSON *row = cJSON_GetArrayItem(lc, (int)layer);
        if (!row)
            for (uint32_t e = 0; e < E; e++)
                load[e] = 0;
        else if (row_loads(row, load, E)) {
            fprintf(stderr, "moectl placement: experts.logical_count[%u] is not %u counts\n",
                    layer, E);
            goto out;
        }
        struct moed_placement p;
        char err[256];
        if (moed_placement_balanced(E, S, nd, load, max_rep, (double)o->hot_percent / 100.0, &p,
                                    err, sizeof err)) {
            fprintf(stderr, "moectl placement: layer %u: %s\n", layer, err);
            goto out;
        }
        double dl[MOED_PLACE_MAX_DEVS], tokens = 0, mx = 0;
        uint32_t dx[MOED_PLACE_MAX_DEVS];
        moed_placement_loads(&p, load, dl, dx);
        for (uint32_t d = 0; d < nd; d++) {
            tokens += dl[d];
            mx = dl[d] > mx ? dl[d] : mx;
        }
        cJSON *l = layer_json(layer, &p, load, dl, dx);
        moed_placement_free(&p);
        if (!l) {
            fprintf(stderr, "moectl placement: out of memory\n");
            goto out;
        }
        cJSON_AddItemToArray(layers, l);
        if (!o->json) {
            printf("%6u %12.0f %14.2f ", layer, tokens, tokens > 0 ? mx / (tokens / nd) : 1.0);
            for (uint32_t d = 0; d < nd; d++)
                printf("%s%u", d ? "/" : "", dx[d]);
            printf("\n");
        }
    }
    if (o->json) {
        char *s = cJSON_PrintUnformatted(out);
        if (!s)
            goto out;
        printf("%s\n", s);
        free(s);
    }
    ret = 0;
out:
    free(moe);
    free(load);
    cJSON_Delete(out);
    cJSON_Delete(root);
    return ret;
}
