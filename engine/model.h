/* model.h - an NVFP4 MoE checkpoint: config, tensors, memory budget.
 *
 * A checkpoint directory holds config.json, hf_quant_config.json (or
 * quantization_config inside config.json) and model.safetensors or sharded
 * files named by model.safetensors.index.json. moed reads only the MoE expert
 * tensors:
 *
 *   model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.{weight,weight_scale,
 *       weight_scale_2,input_scale}
 *   model.layers.{L}.mlp.shared_experts.{gate,up,down}_proj.{...}   (if any)
 *
 * or, for model_type "mixtral" (no shared experts):
 *
 *   model.layers.{L}.block_sparse_moe.experts.{e}.{w1,w3,w2}.{...}
 *       (w1 gate, w3 up, w2 down)
 *
 * Layers: every L in [first_dense, n_layers) is an MoE layer (DeepSeek-V3/GLM
 * first_k_dense_replace, GLM-5 mlp_layer_types, Qwen3 decoder_sparse_step +
 * mlp_only_layers; Mixtral: every layer). The wire protocol names layers by this absolute L.
 */
#ifndef MOED_MODEL_H
#define MOED_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "moe_ref.h"

#define MOED_MAX_LAYERS 1024
#define MOED_MAX_EXPERTS 1024
#define MOED_MAX_SHARED 8
#define MOED_MAX_TOPK 32
#define MOED_MAX_HIDDEN 65536
#define MOED_MAX_INTER 65536

struct moed_dims {
    uint32_t hidden;      /* H */
    uint32_t inter;       /* I (moe_intermediate_size) */
    uint32_t n_experts;   /* E routed */
    uint32_t top_k;       /* k (num_experts_per_tok) */
    uint32_t n_shared;    /* S (n_shared_experts; 0 if absent) */
    uint32_t n_layers;    /* num_hidden_layers */
    uint32_t n_moe_layers;/* how many of them are MoE layers */
    char family[32];      /* model_type from config.json, e.g. "deepseek_v3" */
};

struct moed_model; /* opaque: owns the mmaps of every shard */

/* Progress callback for long loads: done/total bytes; may be NULL. */
typedef void (*moed_progress_fn)(void *ctx, uint64_t done, uint64_t total);

/* Parse config.json (alias table for DeepSeek-V3, GLM-4.5/GLM-5, Qwen3-MoE,
 * Mixtral)
 * from `dir`; no tensors touched. */
int moed_model_read_config(const char *dir, struct moed_dims *dims, char *err, size_t errlen);

/* The checks moed_model_open makes on the two small files, on their text in
 * memory: config.json (config_json[0..config_len)) and hf_quant_config.json
 * (NULL when the checkpoint has none: config.json's quantization_config must
 * then say NVFP4). Fills dims; MOED_E_MODEL with a message on any error. For
 * tests and the fuzz target. */
int moed_model_parse_config(const char *config_json, size_t config_len, const char *quant_json,
                            size_t quant_len, struct moed_dims *dims, char *err, size_t errlen);

/* Open a checkpoint directory: parse configs, open shards (headers only
 * first), check every needed tensor's dtype and shape, compute the bytes the
 * expert weights need, refuse with MOED_E_NOFIT naming both numbers if that is
 * over `budget_bytes` (0 = no limit), then map the data (progress logged and
 * reported through `progress`). The model owns every mapping. */
int moed_model_open(const char *dir, uint64_t budget_bytes, moed_progress_fn progress,
                    void *progress_ctx, struct moed_model **out, char *err, size_t errlen);
void moed_model_close(struct moed_model *m);

const struct moed_dims *moed_model_dims(const struct moed_model *m);
/* Is absolute layer L an MoE layer held by this model? */
int moed_model_is_moe_layer(const struct moed_model *m, uint32_t layer);
/* The layer's experts (E routed then S shared) as a moe_layer, or NULL if L is
 * not an MoE layer. Pointers valid until moed_model_close. */
const struct moe_layer *moed_model_layer(const struct moed_model *m, uint32_t layer);
/* Bytes of all expert weights + block scales the model holds. */
uint64_t moed_model_weight_bytes(const struct moed_model *m);
/* Bytes of one expert (gate+up+down, weights + block scales). */
uint64_t moed_model_expert_bytes(const struct moed_model *m);
const char *moed_model_dir(const struct moed_model *m);

#endif
