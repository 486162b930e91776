/* placement.h - where each expert of an MoE layer lives across the GPUs of
 * one host, and which GPU computes which (token, slot) pair of a batch
 * (expert parallelism, docs/MULTI_GPU.md).
 *
 * A placement gives every routed expert one or more replicas, each on its
 * own device; shared experts live on every device. It is made balanced from
 * measured per-expert load (tokens routed to each expert, /status
 * experts.logical_count) or read from a map a user wrote (one device list per
 * expert). Balanced: an expert whose load is over `hot` of a device's fair
 * share is replicated (at most max_replicas copies, one per device) and its
 * tokens split evenly between the copies; then the replicas go, heaviest
 * first, to the least loaded device that has room, every device holding about
 * the same number of replicas (within 2): memory stays balanced as well as
 * traffic.
 * Ties go to the lower expert id and the lower device: the same input gives
 * the same placement.
 *
 * The assignment of a batch (moed_ep_assign) names the device of every entry
 * t * (k + S) + j, routed slots j < k and shared slots after: a routed
 * expert's pairs in token order go to its replicas in turn, a shared slot of
 * token t to device t % n_dev. Which device computes a pair does not change
 * its expert output row (the rows are batch-invariant, kernels/moe_ref.h);
 * the rows are combined on one device in slot order, so the output is the
 * one-device output bit for bit whatever the placement.
 */
#ifndef MOED_PLACEMENT_H
#define MOED_PLACEMENT_H

#include <stddef.h>
#include <stdint.h>

#define MOED_PLACE_MAX_DEVS 8     /* GPUs of one host */
#define MOED_PLACE_MAX_REPLICAS 8 /* copies of one expert (one per device) */

struct moed_placement {
    uint32_t n_dev, n_experts, n_shared;
    uint8_t *n_rep; /* [n_experts] replicas of routed expert e, >= 1 */
    uint8_t *dev;   /* [n_experts * MOED_PLACE_MAX_REPLICAS]: replica r of e on dev[e * MAX + r] */
};

/* Balanced placement from load[n_experts] (tokens per routed expert; all 0:
 * an even split by expert count). n_dev 1..MOED_PLACE_MAX_DEVS, max_replicas
 * 1..n_dev (1: no replication), hot in (0, 1e6]. 0 or MOED_E_INVAL /
 * MOED_E_NOMEM with err. */
int moed_placement_balanced(uint32_t n_experts, uint32_t n_shared, uint32_t n_dev,
                            const uint64_t *load, uint32_t max_replicas, double hot,
                            struct moed_placement *out, char *err, size_t errlen);

/* A placement from a map: lists[e] (lens[e] entries) the devices of routed
 * expert e's replicas. Every expert placed at least once, each device index
 * below n_dev, no device twice in one list, at most MOED_PLACE_MAX_REPLICAS;
 * else MOED_E_INVAL naming the expert and the entry. */
int moed_placement_from_lists(uint32_t n_experts, uint32_t n_shared, uint32_t n_dev,
                              const int64_t *const *lists, const uint32_t *lens,
                              struct moed_placement *out, char *err, size_t errlen);

void moed_placement_free(struct moed_placement *p);

/* A placement map (docs/MULTI_GPU.md; `moectl placement --json` writes
 * one): an object with gpus (= n_dev), n_experts, n_shared (the model's)
 * and layers, one object per MoE layer, each with layer (its absolute id)
 * and experts (one device list per routed expert, as
 * moed_placement_from_lists checks them); other keys are ignored. out[l]
 * for every l < n_layers: filled for each MoE layer (is_moe[l]; every one
 * must be listed, once), zeroed for the others. 0, or MOED_E_CONFIG /
 * MOED_E_NOMEM with err naming `name` (the file), the layer and the entry
 * (nothing left allocated). load_json reads the file at `path` (at most
 * MOED_PLACE_MAX_JSON_BYTES). */
#define MOED_PLACE_MAX_JSON_BYTES (16 << 20)
int moed_placement_parse_json(const char *text, size_t len, const char *name, uint32_t n_layers,
                              const uint8_t *is_moe, uint32_t n_experts, uint32_t n_shared,
                              uint32_t n_dev, struct moed_placement *out, char *err,
                              size_t errlen);
int moed_placement_load_json(const char *path, uint32_t n_layers, const uint8_t *is_moe,
                             uint32_t n_experts, uint32_t n_shared, uint32_t n_dev,
                             struct moed_placement *out, char *err, size_t errlen);

/* The device of every entry of a batch of T tokens: dev_of[T * (k + S)]
 * (ids [T, k]; an id < 0 is an empty slot, its entry gets device 0xFF and
 * no device computes it), count[n_dev] the entries per device; seen
 * [n_experts] is the caller's scratch (per batch: no allocation here). ids
 * must be in [-1, n_experts) (the engine validated them): else
 * MOED_E_INVAL. */
int moed_ep_assign(const struct moed_placement *p, uint32_t T, uint32_t top_k,
                   const int32_t *ids, uint8_t *dev_of, uint32_t *count, uint32_t *seen);

/* The placement's load per device for load[] (replica shares summed, shared
 * experts not counted) into dev_load[n_dev]; replicas per device into
 * dev_experts[n_dev] (either may be NULL). */
void moed_placement_loads(const struct moed_placement *p, const uint64_t *load,
                          double *dev_load, uint32_t *dev_experts);

#endif
