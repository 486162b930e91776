/* model_int.h - what the model loader's files share (private to engine/):
 * model.c (small files, quantization, shards, expert tensors, open) and
 * model_config.c (config.json: dimensions, MoE layers, model aliases). */
#ifndef MOED_MODEL_INT_H
#define MOED_MODEL_INT_H

#include "model.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "moed_err.h"
#include "moed_file.h"
#include "moed_log.h"
#include "safetensors.h"

#define MODEL_MAX_CONFIG_BYTES (16u << 20)
/* The index of a DeepSeek-V3-size NVFP4 checkpoint is ~16 MB (~180k expert
 * tensor entries), so it gets more room than the small config files. */
#define MODEL_MAX_INDEX_BYTES (256u << 20)
#define MODEL_TOUCH_STRIDE 4096u
#define GIB (1024.0 * 1024.0 * 1024.0)

struct model_shard {
    const char *file;       /* borrowed from the index JSON (or a literal) */
    struct st_file *st;
};

struct wmap_entry {
    const char *tensor;     /* borrowed from the index JSON */
    uint32_t shard;
};

/* How a family names its routed experts' tensors (after "model."):
 *   layers.{L}.{block}.experts.{e}.{proj[0..2]}.{weight,weight_scale,...}
 * proj is gate, up, down in that order. Shared experts, where a family has
 * them, are layers.{L}.mlp.shared_experts[.{s}].{gate,up,down}_proj. */
struct model_naming {
    const char *family;   /* config.json model_type; the last entry (NULL) is the default */
    const char *block;    /* the MoE block's module name */
    const char *proj[3];  /* gate, up, down */
    int shared;           /* may the family have shared experts? */
    int all_moe;          /* every layer is MoE when the config names none */
};

struct moed_model {
    char *dir;
    struct moed_dims dims;
    const struct model_naming *names; /* for dims.family */
    uint8_t is_moe[MOED_MAX_LAYERS];
    cJSON *index;                    /* kept alive: wmap and shard names point into it */
    struct model_shard *shards;
    size_t n_shards;
    struct wmap_entry *wmap;         /* sorted by tensor name; empty without an index */
    size_t n_wmap;
    struct moe_expert *experts;      /* [n_moe_layers * (E + S)] */
    struct moe_layer *layers;        /* [n_layers]; experts == NULL for dense layers */
    uint64_t weight_bytes, expert_bytes;
    uint8_t *split_mem;              /* down pieces of merged shared MLPs (model.c) */
};

/* The naming of config.json's model_type `family` (the default one when
 * the table has no row for it); never NULL. */
const struct model_naming *model_naming_for(const char *family);
const cJSON *model_cfg_get(const cJSON *root, const char *key);
int model_cfg_parse(const cJSON *root, struct moed_dims *d, uint8_t *is_moe, char *err,
                     size_t errlen);
int model_json_uint(const cJSON *v, uint64_t max, uint64_t *out);
int model_read_json(const char *dir, const char *name, size_t cap, cJSON **out, int *missing,
                     char *err, size_t errlen);

#endif
