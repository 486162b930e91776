/* nccl_group.h - expert parallelism across processes or hosts: an NCCL group
 * of daemons, one GPU each (docs/MULTI_GPU.md, "Across hosts").
 *
 * Rank 0 serves the clients. Its engine is the EP backend (backend.h,
 * moed_backend_ep_open) over `ranks` devices: device 0 its own GPU, device
 * r > 0 a peer (moed_nccl_peer_open) that ships each ROWS batch to rank r
 * and brings its rows back. Rank r > 0 runs a worker backend
 * (moed_nccl_worker_open): its own GPU's device r of the placement, serving
 * rank 0 from a thread; client batches are refused there.
 *
 * One exchange, rank 0 -> rank r (each message an ncclSend / ncclRecv on the
 * group's communicator, matched in order): a header (struct
 * moed_nccl_hdr), then for a batch the ids [T, k] int32 (-1 where the entry
 * is not rank r's) and x [T, H] bf16; rank r answers with a header (its
 * status and kernel time) and, for a batch, its rows [T * (k + S), H] fp32,
 * of which rank 0 keeps the entries rank r computes. Every header rank r
 * receives is checked (magic, kind, layer, T, flags, ep_n, ep_shard) before
 * anything else of it is posted.
 *
 * Liveness: rank 0 pings a peer that has had no batch for keepalive_ms;
 * every exchange must end within timeout_ms, and a worker that hears
 * nothing for timeout_ms gives up. Then the communicator is aborted
 * (ncclCommAbort: every rank's pending operations end) and the backend
 * reports itself unhealthy for good: the daemon stops being ready and exits
 * with code 4. The communicator is non-blocking (ncclConfig_t.blocking 0):
 * forming the group and every call are waited for with
 * ncclCommGetAsyncError polled against the same deadline.
 *
 * Bootstrap: NCCL's own. Rank 0 calls ncclGetUniqueId and writes the id to
 * id_file (moed_nccl_id_write), the others read it (moed_nccl_id_read);
 * with no id_file every rank takes it from NCCL_COMM_ID in the environment
 * (ncclGetUniqueId then encodes that address; rank 0 listens there).
 */
#ifndef MOED_NCCL_GROUP_H
#define MOED_NCCL_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

#define MOED_NCCL_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */

/* The id as 256 lowercase hex digits and a newline, in a file of mode 0600
 * made next to `path` and renamed over it (a reader never sees half of
 * one). 0 or MOED_E_IO naming the path and the reason. */
int moed_nccl_id_write(const char *path, const uint8_t id[MOED_NCCL_ID_BYTES], char *err,
                       size_t errlen);
/* Wait up to timeout_ms for `path` to hold an id (polled every 20 ms) and
 * read it. MOED_E_TIMEOUT when it never appeared, MOED_E_CONFIG when the
 * file holds something else than 256 hex digits (and an optional newline),
 * MOED_E_IO when it cannot be read; each naming the path. */
int moed_nccl_id_read(const char *path, uint32_t timeout_ms, uint8_t id[MOED_NCCL_ID_BYTES],
                      char *err, size_t errlen);

/* The header of every message exchange (64 bytes, host byte order: the
 * ranks of a group run the same build). */
#define MOED_NCCL_MAGIC 0x4e43454du /* "MECN" */
enum moed_nccl_kind {
    MOED_NCCL_PING = 1,  /* rank 0 -> r: answer with a REPLY */
    MOED_NCCL_BATCH = 2, /* rank 0 -> r: ids and x follow; answer REPLY + rows */
    MOED_NCCL_STOP = 3,  /* rank 0 -> r: the group ends, no answer */
    MOED_NCCL_REPLY = 4, /* r -> rank 0 */
};
struct moed_nccl_hdr {
    uint32_t magic, kind;
    uint64_t seq;
    uint32_t layer, n_tokens, flags, ep_n, ep_shard;
    int32_t status;     /* REPLY: the batch's status on rank r */
    uint64_t kernel_ns; /* REPLY: its kernel time there */
    uint32_t pad[4];
};

/* A header rank `rank` of `ranks` received from rank 0: NULL if it may act
 * on it (PING, STOP, or a BATCH of 1..max_tokens tokens for a MoE layer of
 * m, flags ROWS (and ROUTED_ONLY) only, ep_n / ep_shard its group's), else
 * what is wrong with it. */
const char *moed_nccl_hdr_check(const struct moed_nccl_hdr *h, const struct moed_model *m,
                                uint32_t ranks, uint32_t rank, uint32_t max_tokens);
/* The entries t * (k + S) + j of a ROWS batch that its device computes
 * (backend.h, moed_batch.rows: routed slots with an id >= 0, and the shared
 * slots of the tokens t with t % ep_n == ep_shard unless ROUTED_ONLY), in
 * increasing order, into out (room for T * (k + S)); their count. */
uint32_t moed_nccl_rows_entries(const struct moed_batch *b, uint32_t k, uint32_t S,
                                uint32_t *out);

struct moed_nccl_cfg {
    uint32_t ranks, rank;  /* 2..8, below ranks */
    const char *id_file;   /* "" or NULL: NCCL_COMM_ID */
    uint32_t timeout_ms, keepalive_ms;
    int gpu;               /* this rank's CUDA ordinal */
    uint32_t max_tokens;   /* the engine's: bounds every exchange */
};

struct moed_nccl_group;

/* Form the group (every rank calls it; it returns once all `ranks` have
 * joined, or fails after timeout_ms: MOED_E_TIMEOUT, MOED_E_BACKEND with
 * NCCL's reason, MOED_E_CONFIG for a bad id file or no NCCL_COMM_ID).
 * MOED_E_UNSUPPORTED without CUDA. */
int moed_nccl_open(const struct moed_model *m, const struct moed_nccl_cfg *cfg,
                   struct moed_nccl_group **out, char *err, size_t errlen);
/* Tell the workers the group ends (rank 0), destroy the communicator (or
 * abort it after a failure), remove the id file rank 0 wrote. After every
 * backend on the group is closed. */
void moed_nccl_close(struct moed_nccl_group *g);

/* Rank 0: device r (1 <= r < ranks) of the EP backend, a child that runs
 * its ROWS batches on rank r (the rows land in b->rows, device memory of
 * this rank's GPU). */
int moed_nccl_peer_open(struct moed_nccl_group *g, uint32_t r, moed_backend_done_fn done,
                        void *done_ctx, struct moed_backend **out, char *err, size_t errlen);

/* Rank r > 0: the engine's backend. It opens its local device with
 * open_local(open_ctx, r, ...) (moed_ep_cfg.open_child's contract: device r
 * of the placement), which computes the batches rank 0 sends, and serves
 * rank 0 from a thread until the group ends or fails. Its submit refuses
 * every client batch (MOED_E_UNSUPPORTED). */
int moed_nccl_worker_open(struct moed_nccl_group *g,
                          int (*open_local)(void *ctx, uint32_t i, moed_backend_done_fn done,
                                            void *done_ctx, struct moed_backend **out,
                                            char *err, size_t errlen),
                          void *open_ctx, moed_backend_done_fn done, void *done_ctx,
                          struct moed_backend **out, char *err, size_t errlen);

#endif
