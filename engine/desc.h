/* desc.h - registered client buffers and the descriptor request source
 * (prefix moed_desc_; protocol version 2, ipc/PROTOCOL.md section 9).
 *
 * A client registers a range of one of its GPU allocations (CUDA IPC handle,
 * offset, size, device UUID); the registry checks it, maps the allocation
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
    uint64_t registers;      /* REGISTER_BUF accepted since start */
    uint64_t refused;        /* REGISTER_BUF / FORWARD_DESC refused */
    uint64_t requests;       /* FORWARD_DESC taken */
};

/* max_per_conn: server.max_registered_buffers (0: registration off). */
int moed_desc_open(struct moed_backend *be, uint32_t max_per_conn, uint32_t hidden,
                   uint32_t top_k, struct moed_desc **out);
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

#endif
