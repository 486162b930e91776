/* moed_client.h - C client library for the moed daemon (libmoedclient.so).
 *
 * The whole public surface of the library. Link with `pkg-config --libs
 * moed-client`. Wire format: moed_proto.h and ipc/PROTOCOL.md.
 *
 * Conventions (as everywhere in moed): functions return 0 or a negative
 * MOED_E_* code (moed_err.h); those that take `char *err, size_t errlen` (err
 * may be NULL) write one line saying what went wrong. When the daemon answered
 * with an ERROR frame, the return value is the daemon's code and err holds the
 * daemon's message.
 *
 * A `struct moedc` is one connection; it is not thread-safe: use one per
 * thread (the daemon serves many connections concurrently).
 *
 * After a local failure -- MOED_E_CONN (connection lost or refused),
 * MOED_E_TIMEOUT (no complete reply in time) or MOED_E_PROTO (the daemon's
 * reply was malformed or over its bound) -- the connection is unusable: every
 * later call returns MOED_E_CONN until moedc_close. An ERROR reply from the
 * daemon about one request (bad layer, token count, expert id, ...) leaves the
 * connection usable.
 *
 * Arrays are in host memory, row-major, native byte order (the library
 * converts to the little-endian wire order): bf16 values are uint16_t bit
 * patterns.
 */
#ifndef MOED_CLIENT_H
#define MOED_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "moed_err.h"
#include "moed_proto.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(MOEDC_BUILD)
#define MOEDC_API __attribute__((visibility("default")))
#else
#define MOEDC_API
#endif

/* Largest STATUS reply the client accepts (the JSON is a few KiB normally). */
#define MOEDC_MAX_STATUS_BYTES (16u << 20)

struct moedc; /* opaque: one connection */

/* Connect to the daemon's Unix socket at `path` (at most 107 bytes).
 * timeout_ms bounds the connect and, afterwards, every blocking call's wait
 * for its reply (<= 0: wait forever). No HELLO is sent here: moedc_hello, or
 * the first moedc_forward/moedc_send_forward, does that. On success *out is a
 * new connection owned by the caller (free with moedc_close). */
MOEDC_API int moedc_connect(const char *path, int timeout_ms, struct moedc **out, char *err,
                            size_t errlen);

/* How long moedc_forward_desc polls the socket for its reply without
 * sleeping (one core busy) before it waits in poll(): a layer on the GPU
 * takes microseconds, and a thread asleep through it wakes up tens of
 * microseconds late (bench/NOTES.md, 2026-12-02). Default
 * MOEDC_DEFAULT_SPIN_US, longer than a decode layer; 0: wait in poll() at
 * once. */
#define MOEDC_DEFAULT_SPIN_US 10000u
MOEDC_API void moedc_set_spin_us(struct moedc *c, uint32_t us);

/* Close the socket and free c (NULL is fine). Pending pipelined replies are
 * dropped. */
MOEDC_API void moedc_close(struct moedc *c);

/* Send HELLO (versions 1..2) and wait for the reply; fills *rep (the model's
 * dims, limits and backend name; rep->version is the version chosen) and
 * caches it in c for moedc_forward's size checks, with the MoE layer list
 * (moedc_moe_layers). */
MOEDC_API int moedc_hello(struct moedc *c, struct moed_hello_rep *rep, char *err, size_t errlen);
/* The model's MoE layer ids from the last HELLO, ascending, into
 * out[0..max); returns how many there are (0 before HELLO). A version-1
 * daemon's are first_moe_layer .. n_layers - 1. */
MOEDC_API uint32_t moedc_moe_layers(const struct moedc *c, uint32_t *out, uint32_t max);

/* One MoE layer forward, blocking:
 *   x    bf16  [n_tokens, H]   H = the model's hidden size (from HELLO)
 *   ids  int32 [n_tokens, top_k]   expert ids in [0, E) (-1 too with
 *                                   MOED_FORWARD_EMPTY_SLOTS, moedc_forward_flags)
 *   w    fp32  [n_tokens, top_k]   final routing weights
 *   y    bf16  [n_tokens, H]   output, written by the call (caller allocates)
 * Sends HELLO first if this connection has not done it yet. Returns 0, the
 * daemon's negative code with its message in err (the connection stays
 * usable), or a local failure code. Not allowed while pipelined requests are
 * outstanding (MOED_E_INVAL). */
MOEDC_API int moedc_forward(struct moedc *c, uint32_t layer, uint32_t n_tokens, uint32_t top_k,
                            const uint16_t *x, const int32_t *ids, const float *w, uint16_t *y,
                            char *err, size_t errlen);
/* moedc_forward with FORWARD flags (protocol version 2): MOED_FORWARD_ROUTED_ONLY
 * (the routed experts only, no shared-expert term) and MOED_FORWARD_EMPTY_SLOTS
 * (an id of MOED_EXPERT_NONE, -1, is an empty slot that adds nothing). A
 * version-1 daemon gets none (MOED_E_VERSION, nothing sent). n_tokens 0 is
 * valid in both calls with a version-2 daemon (a version-1 one: MOED_E_VERSION,
 * nothing sent): x, ids, w and y may then be NULL, and nothing is
 * written to y. */
MOEDC_API int moedc_forward_flags(struct moedc *c, uint32_t layer, uint32_t n_tokens,
                                  uint32_t top_k, const uint16_t *x, const int32_t *ids,
                                  const float *w, uint32_t flags, uint16_t *y, char *err,
                                  size_t errlen);

/* STATUS: on success *json_out is a NUL-terminated malloc'd copy of the
 * daemon's status JSON (at most MOEDC_MAX_STATUS_BYTES); the caller frees it. */
MOEDC_API int moedc_status(struct moedc *c, char **json_out, char *err, size_t errlen);

/* PING with an 8-byte payload; on success *rtt_ns is the round-trip time
 * (CLOCK_MONOTONIC) in nanoseconds. */
MOEDC_API int moedc_ping(struct moedc *c, uint64_t *rtt_ns, char *err, size_t errlen);

/* Static text for a code (the same as moed_strerror, exported here). */
MOEDC_API const char *moedc_strerror(int code);

/* --- Pipelined interface ------------------------------------------------
 * Several FORWARD requests may be in flight on one connection: send them with
 * moedc_send_forward, then collect the replies with moedc_recv, which returns
 * whichever reply arrives next (the daemon may answer out of order) with its
 * request id. The caller picks request ids (unique among those in flight; 0 is
 * allowed but reads as "no request" in the daemon's connection-level errors).
 * While requests are in flight, the blocking calls above return MOED_E_INVAL.
 * The arrays are read during the call only (the request is written to the
 * socket before it returns; a large batch may block until the daemon reads). */
MOEDC_API int moedc_send_forward(struct moedc *c, uint64_t request_id, uint32_t layer,
                                 uint32_t n_tokens, uint32_t top_k, const uint16_t *x,
                                 const int32_t *ids, const float *w, char *err, size_t errlen);
/* moedc_send_forward with FORWARD flags (see moedc_forward_flags). */
MOEDC_API int moedc_send_forward_flags(struct moedc *c, uint64_t request_id, uint32_t layer,
                                       uint32_t n_tokens, uint32_t top_k, const uint16_t *x,
                                       const int32_t *ids, const float *w, uint32_t flags,
                                       char *err, size_t errlen);

/* One reply, filled by moedc_recv (caller allocates). */
struct moedc_reply {
    uint64_t request_id; /* the id echoed by the daemon (0 for a local failure) */
    int32_t code;        /* 0 for a FORWARD reply, else the daemon's MOED_E_* code */
    int32_t from_daemon; /* 1: an answer from the daemon; 0: a local failure */
    uint32_t n_tokens;   /* FORWARD reply: T */
    uint32_t hidden;     /* FORWARD reply: H */
    const uint16_t *y;   /* FORWARD reply: bf16 [T, H] in native order, inside c's
                          * receive buffer: valid until the next call on c */
};

/* Wait (up to the connection's timeout) for the next reply. Returns 0 for a
 * FORWARD reply; the daemon's negative code for an ERROR reply (rep->code and
 * rep->request_id set, message in err; the connection stays usable); or a local
 * failure code with rep->from_daemon == 0. MOED_E_INVAL if nothing is in
 * flight. */
MOEDC_API int moedc_recv(struct moedc *c, struct moedc_reply *rep, char *err, size_t errlen);

/* Number of pipelined requests sent and not yet answered. */
MOEDC_API uint32_t moedc_inflight(const struct moedc *c);

/* --- Registered GPU buffers (protocol version 2, CUDA IPC) ----------------
 * Register a range of a GPU allocation once, then run layers on it by
 * descriptor: the daemon reads x, ids, w and writes y where they lie, and
 * only a 40-byte reply comes back over the socket. `handle` is the
 * cudaIpcMemHandle_t (64 bytes) of the whole allocation (cudaIpcGetMemHandle
 * on its base), `offset` (a multiple of 16) and `size` the range inside it,
 * `uuid` the 16-byte UUID of its GPU (cudaDeviceProp.uuid). The daemon checks
 * everything before it opens the handle; a buffer stays mapped until it is
 * unregistered, or the connection closes, and the last request using it has
 * completed. Each call sends HELLO first if needed and needs a daemon that
 * chose version 2 (else MOED_E_UNSUPPORTED). Blocking; not while pipelined
 * requests are out. */
MOEDC_API int moedc_register_buf(struct moedc *c, const uint8_t handle[64], uint64_t offset,
                                 uint64_t size, const uint8_t uuid[16], uint32_t *buf_id,
                                 char *err, size_t errlen);
MOEDC_API int moedc_unregister_buf(struct moedc *c, uint32_t buf_id, char *err, size_t errlen);

/* A byte range of a registered buffer. */
struct moedc_bufref {
    uint32_t buf_id;
    uint64_t offset; /* from the start of the registered range; x, y: multiple of 16;
                        ids, w: multiple of 4 */
};

/* One MoE layer by descriptor, blocking: x bf16 [T, H], ids int32 [T, k],
 * w fp32 [T, k] are read and y bf16 [T, H] written in registered buffers.
 * Returns 0 once y is written (the daemon's reply), or the daemon's code. */
MOEDC_API int moedc_forward_desc(struct moedc *c, uint32_t layer, uint32_t n_tokens,
                                 uint32_t top_k, const struct moedc_bufref *x,
                                 const struct moedc_bufref *ids, const struct moedc_bufref *w,
                                 const struct moedc_bufref *y, char *err, size_t errlen);
/* A request's times (FORWARD_DESC flag 0x100, PROTOCOL.md 9.3). */
struct moedc_desc_times {
    uint64_t kernel_ns; /* its batch's kernel time; 0: the backend measured none */
    uint64_t daemon_ns; /* its time in the daemon: first byte read -> reply queued */
    uint64_t rx_ns;     /* the daemon's CLOCK_MONOTONIC at that first byte */
    uint64_t queued_ns; /* ... and when the reply was queued */
};
/* The same, asking for the request's times (for benchmarks): on the same
 * host rx_ns and queued_ns are on the caller's CLOCK_MONOTONIC, so that the
 * wait splits into the way there, the daemon and the way back. */
MOEDC_API int moedc_forward_desc_times(struct moedc *c, uint32_t layer, uint32_t n_tokens,
                                       uint32_t top_k, const struct moedc_bufref *x,
                                       const struct moedc_bufref *ids,
                                       const struct moedc_bufref *w,
                                       const struct moedc_bufref *y,
                                       struct moedc_desc_times *times, char *err,
                                       size_t errlen);

/* --- GPU doorbell channels (protocol version 2, PROTOCOL.md section 10) ---
 * A channel lets the client's own kernels, on its CUDA stream and inside a
 * CUDA graph, submit layers over its registered buffers to moed's
 * persistent kernel through device memory, with no host round trip.
 * moedc_chan_open asks for an arena of arena_bytes (0: none; at most
 * max_tokens rows of x, ids, w and y, PROTOCOL.md 10.1) and names n buffers
 * registered on this connection: without an arena 1..16, the descriptors
 * then name them by index 0..n-1; with one 0..15, the arena is index 0 and
 * buf_ids[i] index i + 1. The arena is daemon memory next to the channel's
 * ring, in the same mapping (moedc_chan_arena): the client copies its
 * inputs in and y out on its own stream, and its death, even mid-graph,
 * can never free memory moed's kernel is touching, which a registered
 * buffer's can (docs/ZERO_COPY.md). Also the 16-byte UUID of the GPU the
 * client's kernels run on (moed's GPU, under MPS); *out gets the channel's
 * id, descriptor key, the CUDA IPC handle of its memory, the arena's place
 * in it and a malloc'd copy of the client kernel's fatbin
 * (cuModuleLoadData; entry moed_chan_call): give it back with
 * moedc_chan_info_free. The buffers it names cannot be unregistered while
 * it is open. Blocking; HELLO first if needed. The channel ends with
 * moedc_chan_close or the connection. */
struct moedc_chan_info {
    uint32_t chan_id;        /* > 0: names the channel in moedc_chan_close */
    uint32_t slots;          /* descriptors in flight at most */
    uint64_t key;            /* every descriptor carries it */
    uint8_t handle[64];      /* cudaIpcMemHandle_t of the channel's memory */
    uint64_t size;           /* bytes of the channel at the handle's offset 0 */
    uint32_t abi_version;    /* the kernel ABI the daemon speaks */
    uint64_t arena_off;      /* the arena's offset in the mapping (0: no arena) */
    uint64_t arena_bytes;    /* its bytes (0: no arena), zeroed at open */
    void *kernel;            /* the client kernel's fatbin (malloc'd) */
    size_t kernel_bytes;
};
MOEDC_API int moedc_chan_open(struct moedc *c, const uint32_t *buf_ids, uint32_t n,
                              uint64_t arena_bytes, const uint8_t uuid[16],
                              struct moedc_chan_info *out, char *err, size_t errlen);
MOEDC_API int moedc_chan_close(struct moedc *c, uint32_t chan_id, char *err, size_t errlen);
/* Free what moedc_chan_open gave (the fatbin copy); NULL is fine. */
MOEDC_API void moedc_chan_info_free(struct moedc_chan_info *info);

/* The GPU side, in the client's process: moedc_chan_attach maps the
 * channel into the CUDA context current on the calling thread (the client
 * GPU's; cuIpcOpenMemHandle with lazy peer access) and loads the client
 * kernel from info->kernel (info may be freed afterwards). The CUDA driver
 * comes from libcuda.so.1 through dlopen (this library links no CUDA):
 * without a driver, a GPU or a current context the calls answer
 * MOED_E_UNSUPPORTED saying which; a handle or kernel that will not open,
 * MOED_E_IO; a daemon of another channel ABI, MOED_E_VERSION. The
 * daemon may run on another GPU of the host than the client's, reaching it
 * by peer access (the dedicated expert GPU, docs/ZERO_COPY.md; CHAN_OPEN's
 * uuid is still the client's GPU): nothing here checks the device, the
 * lazy peer access maps moed's memory into the client's context, and the
 * arena (moedc_chan_arena) is then an address of that context on moed's GPU,
 * so copies into and out of it on the caller's stream cross NVLink. */
struct moedc_chan; /* opaque: a channel mapped on the client's GPU */
MOEDC_API int moedc_chan_attach(const struct moedc_chan_info *info, struct moedc_chan **out,
                                char *err, size_t errlen);
/* Unload the kernel and unmap the channel (after its last call completed;
 * CHAN_CLOSE is separate). NULL is fine. */
MOEDC_API void moedc_chan_detach(struct moedc_chan *ch);
/* The channel's arena as mapped here (a CUdeviceptr, in the attaching
 * context) and its bytes into *bytes (may be NULL); 0 without an arena.
 * Reads and writes of it go on the caller's stream like any device
 * memory; a moedc_chan_call names it as buffer 0. */
MOEDC_API uint64_t moedc_chan_arena(const struct moedc_chan *ch, uint64_t *bytes);

/* A range of one of the channel's buffers: buf is its index (the arena 0
 * and buf_ids[i] i + 1 with an arena, buf_ids[i] i without), offset bytes
 * from the start of the arena or of the registered range. */
struct moedc_chanref {
    uint32_t buf;
    uint64_t offset;
};
/* Enqueue one MoE layer on `stream` (a CUstream; NULL: the legacy default
 * stream) through the channel: x bf16 [T, H], ids int32 [T, k], w fp32
 * [T, k] read and y bf16 [T, H] written in place once the stream reaches
 * the launch; flags are the FORWARD flags (0x1 routed-only, 0x2 empty
 * slots). Legal inside CUDA graph capture (one kernel node). Errors on the
 * GPU side go to err_dev, 8 bytes of device memory the caller zeroed: the
 * first failing call's status word (seq << 8 | MOE_GPU_CHAN_E_*,
 * ipc/PROTOCOL.md 10.4; a wait over timeout_ns: MOE_GPU_CHAN_E_TIMEOUT) is
 * kept there. Returns 0 once enqueued, or MOED_E_INVAL / MOED_E_BACKEND
 * (the launch failed). Calls on one channel must be serialized (one
 * stream). */
MOEDC_API int moedc_chan_call(struct moedc_chan *ch, void *stream, uint32_t layer,
                              uint32_t n_tokens, uint32_t flags, const struct moedc_chanref *x,
                              const struct moedc_chanref *ids, const struct moedc_chanref *w,
                              const struct moedc_chanref *y, void *err_dev, uint64_t timeout_ns,
                              char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
