/* genmodel.h - deterministic synthetic NVFP4 checkpoints.
 *
 * Writes a real ModelOpt-layout checkpoint (config.json, hf_quant_config.json,
 * model.safetensors or shards + model.safetensors.index.json) whose expert
 * weights are Gaussian N(0, 1/sqrt(K)) drawn from a seeded PRNG and quantized
 * with nvfp4_quantize. Same preset + layers + seed -> byte-identical files.
 */
#ifndef MOED_GENMODEL_H
#define MOED_GENMODEL_H

#include <stdint.h>
#include <stddef.h>

struct moed_gen_opts {
    const char *preset;   /* "tiny", "qwen3-30b-a3b", "deepseek-v3" */
    uint32_t layers;      /* MoE layers to write (>= 1) */
    uint64_t seed;
    uint32_t threads;     /* 0 = all cores */
};

/* Preset dims: fills hidden/inter/n_experts/top_k/n_shared, returns
 * MOED_E_INVAL for an unknown name (message lists the presets). */
struct moed_dims;
int moed_gen_preset(const char *preset, struct moed_dims *dims, char *err, size_t errlen);

/* Create `out_dir` (and parents) and write the checkpoint; logs progress. */
int moed_gen_model(const struct moed_gen_opts *opts, const char *out_dir, char *err,
                   size_t errlen);

#endif
