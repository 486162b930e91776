/* backend.h - the interface every compute backend implements (CPU, CUDA).
 *
 * The engine's host loop builds batches (requests for one layer merged, up to
 * max tokens) and submits them; the backend computes them asynchronously and
 * calls `done` from its own thread, exactly once per submitted batch. The
 * engine then wakes its loop (uv_async_send) and replies.
 *
 * Buffers are descriptors so the CUDA backend can later read a client's
 * registered GPU buffer directly (CUDA IPC); the CPU backend accepts only
 * host buffers. A backend that can use host memory in place (CUDA: pinned,
 * device-mapped) hands it out through host_alloc; batches mark such memory
 * MOED_BUF_PINNED, and the backend then reads x and writes y where they lie
 * instead of copying them through its own staging memory.
 */
#ifndef MOED_BACKEND_H
#define MOED_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

enum moed_buf_kind {
    MOED_BUF_HOST = 0,   /* ordinary host memory */
    MOED_BUF_DEVICE = 1, /* memory of GPU `device` */
    MOED_BUF_PINNED = 2, /* host memory inside a block from this backend's host_alloc;
                            host-readable like MOED_BUF_HOST */
};

/* x and y are used in place only at this alignment (the CUDA kernel moves them
 * in 16-byte vectors); a pinned buffer less aligned is copied like host memory. */
#define MOED_BUF_ALIGN 16

struct moed_buf {
    enum moed_buf_kind kind;
    int device;     /* CUDA ordinal for MOED_BUF_DEVICE */
    void *ptr;
    uint64_t bytes;
};

/* 1 if the host can read and write the buffer (HOST or PINNED). */
static inline int moed_buf_on_host(const struct moed_buf *b)
{
    return b->kind == MOED_BUF_HOST || b->kind == MOED_BUF_PINNED;
}

struct moed_batch {
    uint64_t seq;         /* engine-assigned, increasing */
    uint32_t layer;       /* absolute layer id (validated MoE layer) */
    uint32_t n_tokens;    /* T, 1..max_tokens */
    uint32_t top_k;
    struct moed_buf x;    /* bf16 [T, H] */
    struct moed_buf ids;  /* int32 [T, k], every id in [0, E) or -1, an empty slot
                             (validated; an empty slot's w is 0) */
    struct moed_buf w;    /* fp32 [T, k] */
    struct moed_buf y;    /* bf16 [T, H] output */
    uint32_t flags;       /* MOED_BATCH_* */
    /* MOED_BATCH_ROWS / _COMBINE only: fp32 [T * (k + S), H] (S the
     * model's shared experts, also with ROUTED_ONLY), entry t * (k + S) + j
     * the expert output row d_j of token t's slot j (routed slots j < k,
     * then shared), unweighted. ROWS writes exactly the entries it computes:
     * routed slot j of token t when ids[t * k + j] >= 0 (the engine gives a
     * device only its own entries' ids, the others -1), and the shared slots
     * of token t when t % ep_n == ep_shard (none with ROUTED_ONLY); y is not
     * touched. COMBINE reads every entry the sum uses: routed slots whose
     * id (the batch's, -1 an empty slot that adds nothing) is >= 0, shared
     * slots unless ROUTED_ONLY; x is not read. */
    struct moed_buf rows;
    uint32_t ep_n, ep_shard; /* ROWS: devices, this device's index (< ep_n) */
    int status;           /* set by the backend before done(): 0 or MOED_E_* */
    uint64_t kernel_ns;   /* set by the backend before done() of a batch it completed
                             (submit it 0): the batch's kernel time in ns, 0 when not
                             known. CUDA: the persistent kernel's %globaltimer from
                             seeing the batch to completing it, when still readable
                             (backend_cuda.c, kernel_time_ns); CPU: always 0, except
                             with the test switch MOED_TEST_CPU_KERNEL_TIME */
    void *user;           /* engine's */
};

/* moed_batch.flags: the batch leaves out the shared experts (every request
 * in it asked for the routed experts only). */
#define MOED_BATCH_ROUTED_ONLY 0x1u
/* Expert parallelism (moed_backend_ep_open): the two halves of a batch split
 * over devices. ROWS: compute this device's expert output rows into
 * `rows` instead of y (see moed_batch.rows); COMBINE: compute nothing, y
 * from the rows as the contract sums them (kernels/moe_ref.h). A backend
 * that cannot do them refuses either with MOED_E_UNSUPPORTED. */
#define MOED_BATCH_ROWS 0x2u
#define MOED_BATCH_COMBINE 0x4u

/* A doorbell channel (chan_open): one registered range it may name. */
struct moed_chan_buf {
    void *ptr;      /* the range's device address in the daemon */
    uint64_t size;  /* its bytes */
};
struct moed_chan_info {
    uint32_t index;        /* the kernel's table entry */
    uint64_t key;          /* every descriptor of the channel carries it */
    uint8_t handle[64];    /* CUDA IPC handle of the channel's allocation (ring + arena) */
    uint64_t size;         /* bytes of struct moe_gpu_chan at its start */
    uint64_t arena_off;    /* the arena's offset in the allocation (0: none) */
    uint64_t arena_bytes;  /* its bytes (0: none) */
    const void *kernel;    /* the client kernel's fatbin (static; kernels/moe_chan_client.cu) */
    uint64_t kernel_bytes;
};
struct moed_chan_stats {
    uint64_t served, refused; /* descriptors run / answered with an error status */
    uint64_t kernel_ns;       /* sum of the served batches' kernel times */
    uint64_t last;            /* status word of the last answer (seq << 8 | status) */
};

struct moed_backend;
struct moed_placement; /* placement.h */
typedef void (*moed_backend_done_fn)(void *ctx, struct moed_batch *b);

struct moed_backend_ops {
    const char *name; /* "cpu", "cuda" */
    /* 1: batches come back in microseconds (a resident kernel): the engine's
     * loop polls for them without sleeping (engine.loop_spin_us) */
    int completes_in_us;
    /* Queue a batch; returns 0 or a negative code (then done is not called). */
    int (*submit)(struct moed_backend *be, struct moed_batch *b);
    /* 1 if healthy (kernel heartbeat advancing, no sticky error). */
    int (*healthy)(struct moed_backend *be);
    /* Persistent-kernel heartbeat counter (advances while the kernel is
     * resident); NULL for backends without one (CPU). */
    uint64_t (*heartbeat)(struct moed_backend *be);
    /* Fill a JSON-free description into buf (devices, memory); may be NULL. */
    void (*describe)(struct moed_backend *be, char *buf, unsigned len);
    /* Stop accepting, finish or fail everything queued (done called for each),
     * then free, host_alloc memory given back with host_free included. */
    void (*close)(struct moed_backend *be);
    /* Optional (NULL: callers use malloc): host memory the backend can use in
     * place, `bytes` long, page-aligned; NULL on failure (the reason is
     * logged; the caller then uses malloc'd memory, which still works,
     * through the staging copies). May take milliseconds: keep and reuse.
     * Loop thread. */
    void *(*host_alloc)(struct moed_backend *be, size_t bytes);
    /* Give back memory from host_alloc. The backend releases it once the
     * device can no longer touch it, at the latest in close (CUDA: freeing
     * pinned memory waits for the resident kernel to exit, so it happens in
     * close, after the kernel has stopped): buffers are meant to be kept,
     * not freed and allocated again. Must be called before close. */
    void (*host_free)(struct moed_backend *be, void *p);
    /* Optional, both or neither (the zero-copy path, engine/desc.h): the
     * 16-byte UUID of the GPU the backend computes on (*mps: 1 when its
     * contexts are shared through MPS, cudaDevAttrMpsEnabled); and map a client's
     * CUDA IPC handle (64 bytes, of a whole allocation) into *out (kind,
     * device, base pointer usable in batches, the allocation's bytes), 0 or
     * a negative code with the reason (a handle that will not open:
     * MOED_E_IO). Loop thread; may take milliseconds. ipc_close unmaps it
     * once no batch uses it any more. */
    int (*device_uuid)(struct moed_backend *be, uint8_t uuid[16], int *mps);
    int (*ipc_open)(struct moed_backend *be, const uint8_t handle[64], struct moed_buf *out,
                    char *err, size_t errlen);
    void (*ipc_close)(struct moed_backend *be, const struct moed_buf *m);
    /* Optional (NULL: a client on another GPU is refused; needs
     * device_uuid): can a client whose GPU has this UUID, not the backend's
     * own, be served by peer access (docs/ZERO_COPY.md, the dedicated expert
     * GPU)? It must be a GPU this process sees, and peer access must hold
     * both ways: the backend's kernel reads x and writes y in the client's
     * memory (REGISTER_BUF), the client's kernel writes the bell and slots
     * and reads done in the backend's (CHAN_OPEN). Returns the GPU's
     * ordinal in this process (>= 0, never the backend's own), or
     * MOED_E_INVAL with the reason in err (not visible to this process; no
     * peer access between the two, naming both ordinals). A buffer mapped
     * from such a GPU (ipc_open: the handle opens in the backend's own
     * device context, peer access enabled lazily) is MOED_BUF_DEVICE of the
     * backend's device: the address is one its kernel uses, the bytes lie
     * across NVLink. Loop thread; may take milliseconds. */
    int (*peer_gpu)(struct moed_backend *be, const uint8_t uuid[16], char *err, size_t errlen);
    /* (peer_gpu's two reasons, printf formats: the GPUs visible and
     * CUDA_VISIBLE_DEVICES or "unset"; moed's ordinal and the peer's) */
#define MOED_PEER_NOT_VISIBLE                                                                  \
    "it is not one of the %d GPUs this process sees (CUDA_VISIBLE_DEVICES %s)"
#define MOED_PEER_NO_ACCESS "there is no peer access between GPU %d (this daemon's) and GPU %d"
    /* Optional, all four or none (doorbell channels, engine/desc.h; CUDA
     * only). chan_open takes a free entry of the kernel's channel table
     * (engine.max_channels; none free: MOED_E_BUSY), fills it with bufs (the
     * registered ranges the channel's descriptors may name, by index) and a
     * fresh key, activates it and fills *out. With arena_bytes > 0 the
     * entry's allocation also holds an arena of that many bytes (daemon
     * memory the client maps with the ring, zeroed at every open, as the
     * ring is): it is the entry's range 0 and bufs follow it (1 + n_bufs
     * <= MOE_GPU_CHAN_BUFS; without an arena n_bufs >= 1). A client's
     * death can never free memory the kernel touches through it. chan_close deactivates entry
     * `index` without waiting; chan_quiet then answers 1 once the kernel can
     * no longer touch the channel or its buffers (the entry is free again
     * from then on; the caller releases the buffers then), 0 while it still
     * may. chan_stats reads an entry's counters; desc.c reads them once more
     * right after chan_quiet answered 1 (before any chan_open could reuse
     * the entry) as the channel's final counts, so they must hold until the
     * entry's next chan_open. Loop thread; none of them waits for the
     * kernel, except chan_open for an idle stop already under way (the
     * CUDA backend: microseconds, bounded). */
    int (*chan_open)(struct moed_backend *be, const struct moed_chan_buf *bufs, uint32_t n_bufs,
                     uint64_t arena_bytes, struct moed_chan_info *out, char *err,
                     size_t errlen);
    void (*chan_close)(struct moed_backend *be, uint32_t index);
    int (*chan_quiet)(struct moed_backend *be, uint32_t index);
    void (*chan_stats)(struct moed_backend *be, uint32_t index, struct moed_chan_stats *out);
};

struct moed_backend {
    const struct moed_backend_ops *ops;
    moed_backend_done_fn done;
    void *done_ctx;
};

struct moed_backend_cfg {
    int n_threads;          /* CPU: worker threads (0 = cores) */
    const int *gpus;        /* CUDA: device ordinals */
    int n_gpus;
    int sms_free;           /* CUDA: SMs to leave free per GPU */
    int mps_sms_free_percent; /* CUDA: under MPS with sms_free 0, this % of the SMs */
    uint32_t max_tokens;
    uint32_t batch_deadline_ms; /* CUDA: a batch over this fails the backend */
    uint32_t idle_exit_ms;  /* CUDA: persistent kernel exits after idle (0 = never) */
    uint32_t max_channels;  /* CUDA: doorbell channel table entries (0: none) */
    /* A child of moed_backend_ep_open (NULL: not one): the placement of
     * each MoE layer (absolute layer id, NULL for the others); the backend
     * needs only the routed experts with a replica on device ep_shard (and
     * the shared experts) and computes only those. */
    const struct moed_placement *const *ep_place;
    uint32_t ep_shard;
    /* CUDA: backends sharing this GPU's SMs (expert parallelism with one GPU
     * listed more than once): each one's grid takes 1/sm_share of the SMs
     * it would use alone, so that every persistent kernel fits beside the
     * others (0 or 1: the whole GPU). */
    uint32_t sm_share;
    /* CUDA: 0, or 1 + n to run the persistent kernel on a green context of
     * the SMs sms_free leaves (whole SMs stay free for this process's other
     * kernels: NCCL's, nccl_group.h): the device's SMs are cut into as many
     * such partitions as fit, and the kernel takes partition n modulo their
     * number, so that processes on one GPU (NCCL ranks standing in for hosts,
     * under MPS) given different n take disjoint SMs; without driver support,
     * an ordinary stream (logged). */
    int sm_partition;
    /* Optional: weight placement progress (bytes placed, bytes to place),
     * called from the opening thread during open. */
    moed_progress_fn progress;
    void *progress_ctx;
};

int moed_backend_cpu_open(struct moed_model *m, const struct moed_backend_cfg *cfg,
                          moed_backend_done_fn done, void *done_ctx,
                          struct moed_backend **out, char *err, size_t errlen);
/* Expert parallelism over n devices (backend_ep.c, docs/MULTI_GPU.md): a
 * backend that computes every batch of the engine by submitting a ROWS
 * batch to each child that holds one of its entries (moed_ep_assign over
 * the layer's placement) and, once all are done, a COMBINE batch to child
 * 0, the device the output is combined on. The result is the one-device
 * result bit for bit whatever the placement (the rows do not depend on
 * the device or the other tokens; the sum runs in slot order). Batches run
 * one at a time, in submission order. */
struct moed_ep_cfg {
    uint32_t n_dev;         /* children, 1..MOED_PLACE_MAX_DEVS */
    /* Open child i (its own device), delivering its batches to done/done_ctx
     * (the wrapper's); 0 or a negative code with err. */
    int (*open_child)(void *ctx, uint32_t i, moed_backend_done_fn done, void *done_ctx,
                      struct moed_backend **out, char *err, size_t errlen);
    void *open_ctx;
    /* The placement of each MoE layer (indexed by absolute layer id, NULL
     * for the others), n_dev devices each; the wrapper copies nothing: they
     * must outlive it. */
    const struct moed_placement *const *place;
    uint32_t n_layers;
    /* fp32 [max_tokens * (k + S) * H]: every child's ROWS write here and
     * child 0's COMBINE reads it (host memory for CPU children; device memory
     * of child 0 that the other children can write for CUDA ones). */
    struct moed_buf rows;
    uint32_t max_tokens;
};
int moed_backend_ep_open(struct moed_model *m, const struct moed_ep_cfg *cfg,
                         moed_backend_done_fn done, void *done_ctx, struct moed_backend **out,
                         char *err, size_t errlen);

/* Returns MOED_E_UNSUPPORTED in builds without CUDA. */
int moed_backend_cuda_open(struct moed_model *m, const struct moed_backend_cfg *cfg,
                           moed_backend_done_fn done, void *done_ctx,
                           struct moed_backend **out, char *err, size_t errlen);
/* 1 if this build has CUDA and at least one device is visible. */
int moed_backend_cuda_available(void);
/* CUDA devices visible to this process (0 without CUDA or without a GPU). */
int moed_backend_cuda_device_count(void);
/* Free and total memory of CUDA device `dev` (creates its primary context);
 * MOED_E_UNSUPPORTED without CUDA, MOED_E_BACKEND if the query fails. */
int moed_backend_cuda_mem(int dev, uint64_t *free_bytes, uint64_t *total_bytes);
/* Expert parallelism over CUDA children (engine_open.c): `bytes` of device
 * memory on GPU gpus[0] (*out, MOED_BUF_DEVICE) that every other GPU of
 * gpus[0..n) writes through peer access, enabled here (a GPU that cannot
 * reach gpus[0]: MOED_E_BACKEND naming both). Free it with
 * moed_backend_cuda_rows_free once no backend uses it (after close: freeing
 * device memory waits for the GPU to be idle). MOED_E_UNSUPPORTED without
 * CUDA. */
int moed_backend_cuda_rows_alloc(const int *gpus, int n, uint64_t bytes, struct moed_buf *out,
                                 char *err, size_t errlen);
void moed_backend_cuda_rows_free(struct moed_buf *b);

static inline int moed_backend_submit(struct moed_backend *be, struct moed_batch *b)
{
    return be->ops->submit(be, b);
}
static inline void moed_backend_close(struct moed_backend *be)
{
    if (be)
        be->ops->close(be);
}

#endif
