/* desc.h - registered client buffers and the descriptor request source
 * (prefix moed_desc_; protocol version 2, ipc/PROTOCOL.md section 9).
 *
 * A client registers a range of one of its GPU allocations (CUDA IPC handle,
 * offset, size, device UUID: this daemon's GPU, or a GPU it reaches by peer
 * access, backend peer_gpu); the registry checks it, maps the allocation
 * through the backend (ipc_open) once per handle, caches the mapping and
 * hands out a buffer id that names the range on that connection only. A
 * FORWARD_DESC names x, ids, w and y as (id, offset) ranges: each is checked
 * against its registration (known id, inside the range, no overflow, aligned,
 * y overlapping no input) before the request is queued, and the request then
 * holds a reference on each registration until it is answered. A
 * registration goes when it is unregistered or its connection closes and the
 * last request holding it has completed; a mapping when its last registration
 * has gone (backend ipc_close). A request whose batch failed while the device
 * may still touch its buffers keeps its references forever (the mapping is
 * left to process exit, as pinned buffers are).
 *
 * Doorbell channels (PROTOCOL.md section 10) belong here too: CHAN_OPEN
 * names up to MOED_PROTO_CHAN_BUFS registrations of its connection, or an
 * arena (memory the backend allocates next to the channel's ring, so that a
 * client's death frees nothing the kernel touches) and up to one fewer;
 * once the checks pass (registration on when ids are named, channels on, a
 * backend with chan ops, the arena within moed_desc_arena_limit, every id
 * registered here, the client's GPU this daemon's GPU under MPS, or a GPU
 * the backend reaches by peer access, backend peer_gpu, without MPS) the
 * backend's chan_open takes a table entry and the channel holds a reference
 * on each registration, which then cannot be unregistered (MOED_E_BUSY)
 * while the channel is open. CHAN_CLOSE, or the connection's close, closes
 * the channel at the backend (chan_close, not waiting) and moves it to the
 * draining list; moed_desc_chan_reap, polled by the engine from a timer
 * while anything drains, frees each channel the backend reports quiet and
 * drops its references (the registrations and mappings then go as usual).
 *
 * Loop thread only.
 */
#ifndef MOED_DESC_H
#define MOED_DESC_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "reqio.h"
#include "server.h"

struct moed_desc;

struct moed_desc_stats {
    uint64_t registered;     /* registrations alive (all connections) */
    uint64_t mappings;       /* allocations mapped now */
    uint64_t mapped_bytes;   /* their bytes */
    uint64_t peer_mappings;  /* those of memory on a peer GPU (backend peer_gpu) */
    uint64_t registers;      /* REGISTER_BUF accepted since start */
    uint64_t refused;        /* REGISTER_BUF / FORWARD_DESC refused */
    uint64_t requests;       /* FORWARD_DESC taken */
    /* doorbell channels */
    uint64_t chans_open, chans_draining; /* now */
    uint64_t arena_bytes;                /* the arenas of those, now */
    uint64_t chan_opens, chan_refused;   /* CHAN_OPEN accepted / refused since start */
    /* descriptors served / refused and their kernel ns, every channel since
     * start (the backend's counters; those of reaped channels kept) */
    uint64_t db_served, db_refused, db_kernel_ns;
};

/* One live channel (moed_desc_chan_rows). */
struct moed_desc_chan_row {
    uint32_t id, index, n_bufs;
    int draining;                /* closed, the backend not yet quiet */
    int gpu;                     /* the client's GPU: -1 the daemon's, else its peer ordinal */
    uint64_t arena_bytes;        /* its arena (0: none) */
    struct moed_chan_stats st;   /* the backend's counters (zero without chan_stats) */
};

/* max_per_conn: server.max_registered_buffers (0: registration off);
 * max_chans: engine.max_channels (0: channels off); max_chans_per_conn:
 * server.max_channels_per_client (channels one connection may have open). */
int moed_desc_open(struct moed_backend *be, uint32_t max_per_conn, uint32_t max_chans,
                   uint32_t max_chans_per_conn, uint32_t hidden, uint32_t top_k,
                   uint32_t max_tokens, struct moed_desc **out);
/* The backend is about to close: what is still mapped (abandoned batches
 * only, after a drain) is left to process exit from here on. */
void moed_desc_detach(struct moed_desc *d);
/* Free the registry (after every request was answered). NULL is fine. */
void moed_desc_close(struct moed_desc *d);

/* REGISTER_BUF, UNREGISTER_BUF of connection c (its table lives in
 * moed_server_conn_user(c)). 0 or a negative code with a message. */
int moed_desc_register(struct moed_desc *d, struct moed_conn *c,
                       const struct moed_register_req *rq, uint32_t *buf_id, char *err,
                       size_t errlen);
int moed_desc_unregister(struct moed_desc *d, struct moed_conn *c, uint32_t buf_id, char *err,
                         size_t errlen);
/* Connection c closed: all it registered goes (as its requests complete). */
void moed_desc_conn_closed(struct moed_desc *d, struct moed_conn *c);

/* Check a decoded FORWARD_DESC against c's registrations and fill *io (the
 * descriptor source: never merged, y written in place, the reply a head).
 * 0, or a negative code with a message (nothing taken). */
int moed_desc_request(struct moed_desc *d, struct moed_conn *c, uint64_t request_id,
                      const struct moed_forward_desc_req *rq, struct moed_reqio *io, char *err,
                      size_t errlen);

void moed_desc_get_stats(const struct moed_desc *d, struct moed_desc_stats *out);

/* CHAN_OPEN of connection c (decoded): 0 with the reply head in *rep and
 * *kernel at its rep->kernel_bytes bytes of fatbin (static), or a negative
 * code with a message (nothing taken). */
int moed_desc_chan_open(struct moed_desc *d, struct moed_conn *c,
                        const struct moed_chan_open_req *rq, struct moed_chan_open_rep *rep,
                        const void **kernel, char *err, size_t errlen);
/* CHAN_CLOSE: channel chan_id of connection c starts draining; 0, or
 * MOED_E_INVAL for a channel that is not open on c. */
int moed_desc_chan_close(struct moed_desc *d, struct moed_conn *c, uint32_t chan_id, char *err,
                         size_t errlen);
/* The largest CHAN_OPEN arena_bytes: max_tokens rows of x (bf16 [T, H]),
 * ids (int32 [T, k]), w (fp32 [T, k]) and y (bf16 [T, H]), + 64 for each
 * part's 16-byte alignment. */
uint64_t moed_desc_arena_limit(uint32_t max_tokens, uint32_t hidden, uint32_t top_k);
/* Poll the draining channels (backend chan_quiet, never waiting): free the
 * quiet ones. Returns how many still drain (0: the caller stops polling). */
uint32_t moed_desc_chan_reap(struct moed_desc *d);
/* The live channels, open then draining, into out[0..max); returns how many
 * were written. */
uint32_t moed_desc_chan_rows(const struct moed_desc *d, struct moed_desc_chan_row *out,
                             uint32_t max);

#endif
