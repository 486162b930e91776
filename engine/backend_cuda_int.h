/* backend_cuda_int.h - what the CUDA backend's files share (engine/
 * backend_cuda.c: open, queue, completion thread, close; backend_place_cuda.c:
 * weight repack and upload; backend_hooks_cuda.c: the test and bench hooks;
 * backend_ipc_cuda.c: client buffers through CUDA IPC; backend_shard_cuda.c:
 * one device of expert parallelism).
 * Internal: nothing outside these includes it.
 */
#ifndef MOED_BACKEND_CUDA_INT_H
#define MOED_BACKEND_CUDA_INT_H

#include <cuda_runtime.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "backend_cuda.h"
#include "moe_gpu.h"

/* With moed_backend_cuda_test_guards(1) (GPU tests), the scratch the kernel
 * writes lies between two guard regions of GUARD_FILL bytes (GUARD_BYTES
 * keeps the buffers 256-byte aligned), which the tests check after every
 * batch (moed_backend_cuda_check_guards). Off (served, benchmarked): plain
 * allocations at the addresses they had before the guards existed (H200
 * 2026-12-01, identical kernel code: with the guards always on, DeepSeek-V3
 * T = 1 took 1% longer in each of three runs; bench/NOTES.md). */
#define GUARD_BYTES 256
#define GUARD_FILL 0xa5
enum { G_XS, G_IDS, G_W, G_H, G_DOUT, G_ROUTE, G_COUNT };
struct guarded {
    uint8_t *base; /* the allocation: [guard], buffer, [guard] */
    size_t bytes;  /* the buffer's */
};

struct pend {
    struct pend *next;
    struct moed_batch *b;
};

struct cuda_backend {
    struct moed_backend base; /* first: ops receive &base */
    struct moe_gpu_dims d;
    int dev;
    char dev_name[256];
    uint8_t uuid[16];  /* cudaDeviceProp.uuid, read at open */
    int mps;           /* the device runs under MPS (cudaDevAttrMpsEnabled) */
    int n_sms;
    void *ctx;         /* a CUcontext limited to ctx_sms SMs (MPS execution affinity),
                          or NULL: the device's primary context (cuda_use) */
    int ctx_sms;
    void *green;       /* a CUgreenCtx of green_sms SMs the kernel's stream runs on
                          (cuda_green_stream), or NULL */
    int green_sms;
    char lock_path[64]; /* the GPU's lock file under MPS (cuda_gpu_lock), or "" */
    uint32_t deadline_ms, idle_exit_ms;
    moed_progress_fn progress; /* weight placement progress (open only) */
    void *progress_ctx;
    /* layer id -> slot */
    int32_t *slot_of;
    uint32_t n_slot_of;
    uint32_t n_layers;
    /* device memory */
    uint8_t *wbuf;
    float *s2;
    struct moe_gpu_layer *layers_d;
    void *state;
    uint16_t *xs, *h;
    int32_t *ids_s;
    uint16_t *route_g; /* per-CTA routing tables */
    struct guarded g[G_COUNT]; /* the allocations behind xs, ids_s, w_s, h, dout, route_g */
    size_t guard;              /* GUARD_BYTES, or 0 (no guard regions) */
    float *w_s, *dout;
    uint64_t weight_bytes, scratch_bytes, dev_used, dev_total;
    size_t h_l2_bytes; /* the first bytes of h kept in L2 as persisting lines (cuda_h_in_l2), or 0 */
    /* mapped host memory */
    struct moe_gpu_ctrl *ctrl, *ctrl_d;
    uint8_t *stage, *stage_d;
    size_t off_ids, off_w, off_y, slot_bytes;
    cudaStream_t stream;
    struct moe_gpu_launch launch;
    struct moe_gpu_params params;
    /* queue state (mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thr;
    int thr_started;
    int running;   /* kernel launched and not stopped */
    int closing;
    int quiesced;  /* moed_backend_cuda_quiesce ran */
    int device_ok; /* after it: the kernel is known gone (device memory may be freed) */
    int failed;    /* sticky: unhealthy */
    uint64_t next_seq;  /* last seq published */
    uint64_t delivered; /* last seq completed and handed back */
    struct moed_batch *inflight[MOE_GPU_RING];
    struct pend *ph, *pt;
    uint64_t head_start_ns, last_active_ns;
    /* bench: CLOCK_REALTIME (ns) of the last head store and of the completion
     * thread's first sight of the last completed seq (single writers) */
    uint64_t pub_rt_ns, seen_rt_ns;
    uint64_t launches;
    uint64_t stall_ns; /* test hook, consumed by the next publish */
    char fail_msg[256];
    /* host_alloc blocks given back (host_free), freed in close (mu) */
    struct host_blk *host_freed;
    /* doorbell channels (backend_chan_cuda.c): the kernel's table, its
     * control block, the layer map it checks descriptors with, the stream
     * the table is written through; host state and counts under mu */
    uint32_t n_chans;
    struct moe_gpu_chan_ent *chans_d;
    struct moe_gpu_chanctl *chanctl, *chanctl_d;
    int32_t *slot_of_d;
    cudaStream_t side;
    void *zeros;             /* MOE_GPU_CHAN_ALLOC pinned zero bytes: a channel's
                                allocation is cleared by copies from it (a copy
                                engine's work; a memset may need an SM, and under
                                an SM-limited context the kernel holds them all) */
    struct cuda_chan *chan;  /* [n_chans] */
    uint32_t chans_live;     /* open or draining: the kernel stays resident */
    int stopping;            /* an idle stop is under way (the kernel sees a bell only
                                once relaunched: a channel opens after it) */
    uint64_t chan_gen;       /* last generation released */
    /* expert parallelism (backend_shard_cuda.c): the local index of each
     * routed expert per layer slot ([n_layers * ep_experts], -1: not placed
     * here; NULL: every expert is), the model's routed experts (what batch
     * ids are checked against); dev_held: counted in the GPU's backends
     * (cuda_dev_hold), park_next: the parked list */
    int32_t *ep_loc;
    uint32_t ep_experts;
    int dev_held;
    struct cuda_backend *park_next;
    /* device memory to let go of, not yet released: client mappings given
     * back (cuda_ipc_close) and channel allocations outgrown (cuda_chan_open).
     * cudaIpcCloseMemHandle and cudaFree wait for the device to go idle, so
     * they run only with no kernel resident (the completion thread stops it
     * for them, mu) */
    struct cuda_release *rel;
    uint32_t n_rel, cap_rel;
};

/* One deferred release (cuda_release_later). */
enum { CUDA_REL_UNMAP = 0, CUDA_REL_FREE };
struct cuda_release {
    void *ptr;
    int kind; /* CUDA_REL_UNMAP: cudaIpcCloseMemHandle; CUDA_REL_FREE: cudaFree */
};

/* Host state of one channel table entry. */
struct cuda_chan {
    void *mem;            /* its allocation, kept once made (replaced by a larger one
                             when an arena needs more, the old one freed later) */
    size_t mem_bytes;     /* MOE_GPU_CHAN_ALLOC, or 4096 + an arena rounded up to it */
    uint8_t handle[64];   /* cudaIpcGetMemHandle of mem */
    int state;            /* free, open, draining */
    uint64_t close_gen;   /* draining: quiet once the kernel acknowledged this */
};

/* A host_alloc block given back, waiting for close; the link lies in it. */
struct host_blk {
    struct host_blk *next;
};

/* Repack every layer of src (or fill random weights) into one device
 * allocation, with the per-layer scale table and layer pointers
 * (backend_place_cuda.c); 0 or a MOED_E_* code with err. */
int cuda_place_weights(struct cuda_backend *cb, const struct moed_cuda_src *src, char *err,
                       size_t errlen);

/* The zero-copy path (backend_ipc_cuda.c): the backend's ops device_uuid,
 * ipc_open, ipc_close (backend.h). */
int cuda_device_uuid(struct moed_backend *be, uint8_t uuid[16], int *mps);
/* Under MPS with SMs to leave free (sms < n_sms): a context of the device that
 * may use `sms` SMs only (cuCtxCreate with CU_EXEC_AFFINITY_TYPE_SM_COUNT),
 * so that moed's CTAs leave the other SMs whole for the engine's kernels;
 * cb->ctx, cb->ctx_sms (what the driver granted, rounded up). Without MPS,
 * without driver support or on failure (logged): the primary context, as
 * before. Current on the calling thread on return. */
void cuda_ctx_open(struct cuda_backend *cb, int sms);
/* Under MPS: take the GPU's lock file (/dev/shm/moed-gpu-<uuid>.lock,
 * moed_lock.h), so that a second moed on the GPU is refused at open with
 * MOED_E_BUSY naming the first one's pid, before it makes a context or
 * launches a kernel. A file that cannot be used is logged and skipped.
 * Without MPS nothing is taken: two moeds on one GPU take turns there, each
 * kernel resident while the other's has idled out (engine.idle_exit_ms). */
int cuda_gpu_lock(struct cuda_backend *cb, char *err, size_t errlen);
void cuda_gpu_unlock(struct cuda_backend *cb);
/* Make cb's context current on this thread: every thread, before any CUDA
 * call for cb (cudaSetDevice when cb has the primary context). */
cudaError_t cuda_use(const struct cuda_backend *cb);
/* Destroy cb's own context (none: nothing); after every free of cb's. */
void cuda_ctx_close(struct cuda_backend *cb);
/* A stream whose kernels run on `sms` SMs of the device only (a green
 * context, cuGreenCtxCreate; no MPS needed), so that the other SMs stay
 * whole for this process's other kernels (NCCL's: moed_backend_cfg.
 * sm_partition); memory stays the primary context's. The device's SMs are
 * split into as many partitions of that size as fit and the stream's is
 * partition `part` modulo their number (processes on one GPU given
 * different `part` get disjoint SMs). 0 with *out, cb->green
 * and cb->green_sms (what the driver granted: a multiple of its SM
 * granularity, at most `sms`), or -1 (logged: no driver support, too few
 * SMs) and the caller makes an ordinary stream. cuda_green_close after the
 * stream is destroyed. */
int cuda_green_stream(struct cuda_backend *cb, int sms, unsigned part, cudaStream_t *out);
void cuda_green_close(struct cuda_backend *cb);
int cuda_peer_gpu(struct moed_backend *be, const uint8_t uuid[16], char *err, size_t errlen);
int cuda_ipc_open(struct moed_backend *be, const uint8_t handle[64], struct moed_buf *out,
                  char *err, size_t errlen);
void cuda_ipc_close(struct moed_backend *be, const struct moed_buf *m);
/* Queue ptr to be unmapped or freed (kind CUDA_REL_*) with no kernel
 * resident; 1 if queued, 0 if it is left to process exit (the backend has
 * failed: the kernel may still touch it; or out of memory), logged. Any
 * thread (takes mu). */
int cuda_release_later(struct cuda_backend *cb, void *ptr, int kind);
/* Release what cuda_release_later queued (no kernel resident: the
 * completion thread, or close after the kernel stopped). */
void cuda_release_queued(struct cuda_backend *cb);
/* At open: the device's UUID and MPS attribute into cb (uuid, mps). */
void cuda_sharing_probe(struct cuda_backend *cb, const struct cudaDeviceProp *prop);
/* SMs the kernel leaves free: sms_free, or under MPS with sms_free 0,
 * mps_percent of the device's SMs (logged). */
int cuda_sms_free(const struct cuda_backend *cb, int sms_free, int mps_percent);

/* Doorbell channels (backend_chan_cuda.c): the table and its control block
 * at open (fills cb->params' channel fields; max_channels 0: none), freed
 * in free_all; the backend ops; every open channel closed (before the
 * kernel is asked to stop: a ringing channel would keep it busy). */
int cuda_chan_setup(struct cuda_backend *cb, uint32_t max_channels, char *err, size_t errlen);
void cuda_chan_teardown(struct cuda_backend *cb, int device_ok);
int cuda_chan_open(struct moed_backend *be, const struct moed_chan_buf *bufs, uint32_t n_bufs,
                   uint64_t arena_bytes, struct moed_chan_info *out, char *err, size_t errlen);
void cuda_chan_close(struct moed_backend *be, uint32_t index);
int cuda_chan_quiet(struct moed_backend *be, uint32_t index);
void cuda_chan_stats(struct moed_backend *be, uint32_t index, struct moed_chan_stats *out);
void cuda_chan_deactivate_all(struct cuda_backend *cb);
/* The backend failed: every open or draining channel's client is told
 * (its `closed` word), so that no call waits out its timeout. */
void cuda_chan_failed(struct cuda_backend *cb);
/* Make a busy kernel look at its stop request (mu held): a new table
 * generation, which the dispatcher takes between batches, busy or not, and
 * then reads ctrl->stop (an idle one reads it anyway). */
void cuda_chan_wake_locked(struct cuda_backend *cb);

/* Expert parallelism (backend_shard_cuda.c). A partial placement: the
 * layer views holding only the experts placed on cfg->ep_shard (local
 * routed ones, padded to n_local, then the shared ones) and the map from
 * the model's expert ids to local ones ([n_layers * n_experts], -1: not
 * here). cuda_shard_open fills *out (src with the views and n_local routed
 * experts); the views are needed until the weights are placed, the map for
 * the backend's life. */
struct cuda_shard {
    uint32_t n_layers, n_experts, n_local;
    int32_t *local;
    struct moe_layer *views;
    const struct moe_layer **view_ptrs;
};
int cuda_shard_open(const struct moed_cuda_src *src, const struct moed_backend_cfg *cfg,
                    struct cuda_shard *sh, struct moed_cuda_src *out, char *err, size_t errlen);
void cuda_shard_free(struct cuda_shard *sh);
/* 0, or MOED_E_INVAL for a ROWS / COMBINE batch this backend cannot run
 * (logged, naming the expert when one is not placed here), or a plain batch
 * on a device with a partial placement. */
int cuda_shard_check(const struct cuda_backend *cb, const struct moed_batch *b);
/* b's ids into dst (the slot or its staging area), local indices for a
 * ROWS batch on a partial placement. */
void cuda_shard_ids(const struct cuda_backend *cb, const struct moed_batch *b, int32_t *dst);
/* Count cb in its GPU's backends (at open, once cb->dev is known), and
 * release it: its memory freed now (free_all) or, while other backends
 * hold the GPU (their kernels keep it busy: cudaFree would wait for
 * them), parked until the last one leaves. */
int cuda_dev_hold(struct cuda_backend *cb, char *err, size_t errlen);
void cuda_dev_release(struct cuda_backend *cb, int device_ok);
void cuda_free_all(struct cuda_backend *cb, int device_ok);

/* host_alloc / host_free of the backend ops (backend_place_cuda.c) */
void *cuda_host_alloc(struct moed_backend *be, size_t bytes);
void cuda_host_free(struct moed_backend *be, void *p);

#endif
