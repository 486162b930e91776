/* moed_proto.h - the moed wire protocol, versions 1 and 2. ipc/PROTOCOL.md is
 * the byte-level specification; this header defines it for C. Version 2 adds
 * the MoE layer list to the HELLO reply, FORWARD flags and T = 0 (in frames
 * of header version 1, as every version-1 type), and registered client GPU
 * buffers with FORWARD by descriptor (types 16..31, in frames of header
 * version 2: moed_type_min_version); HELLO negotiates it.
 *
 * Every message is one frame: a 32-byte little-endian header followed by
 * `payload_len` bytes. Requests may be pipelined; every reply carries the
 * request id of its request (replies may come back in any order).
 *
 *   off size field
 *     0   4  magic        "MOED" (0x4445'4F4D as a LE u32)
 *     4   2  version      1 or 2 (2: buffer registration, FORWARD_DESC)
 *     6   2  type         MOED_MSG_*; replies set bit 0x8000
 *     8   4  flags        0 (reserved; must be 0 in version 1)
 *    12   4  reserved     0
 *    16   8  request_id   chosen by the client, echoed in the reply
 *    24   8  payload_len  bytes following the header
 */
#ifndef MOED_PROTO_H
#define MOED_PROTO_H

#include <stddef.h>
#include <stdint.h>

#define MOED_PROTO_MAGIC 0x44454F4Du /* bytes 'M' 'O' 'E' 'D' */
#define MOED_PROTO_VERSION 2     /* the highest this build speaks */
#define MOED_PROTO_MIN_VERSION 1 /* the lowest it still accepts */
#define MOED_PROTO_HDR_SIZE 32
#define MOED_PROTO_REPLY 0x8000u
#define MOED_PROTO_MAX_ERRMSG 1024
#define MOED_SOCKET_PATH_MAX 107 /* a socket path: sun_path (108) minus the NUL */

enum moed_msg_type {
    MOED_MSG_HELLO = 1,
    MOED_MSG_FORWARD = 2,
    MOED_MSG_STATUS = 3,
    MOED_MSG_PING = 4,
    MOED_MSG_ERROR = 5,         /* server -> client only (with REPLY bit) */
    /* 16..31: client GPU buffers (CUDA IPC), version 2 frames only */
    MOED_MSG_REGISTER_BUF = 16,
    MOED_MSG_UNREGISTER_BUF = 17,
    MOED_MSG_FORWARD_DESC = 18, /* FORWARD by descriptor: x, ids, w, y in registered buffers */
    MOED_MSG_CHAN_OPEN = 19,    /* a GPU doorbell channel (arena, registered buffers) */
    MOED_MSG_CHAN_CLOSE = 20,
};

struct moed_frame_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    uint32_t flags;
    uint32_t reserved;
    uint64_t request_id;
    uint64_t payload_len;
};
_Static_assert(sizeof(struct moed_frame_hdr) == MOED_PROTO_HDR_SIZE, "wire header is 32 bytes");

/* HELLO request payload (8 bytes). */
struct moed_hello_req {
    uint16_t min_version, max_version;
    uint32_t reserved;
};
_Static_assert(sizeof(struct moed_hello_req) == 8, "hello request");

/* HELLO reply payload (64 bytes). Version 2 appends n_moe_layers (u32) and
 * that many u32 absolute MoE layer ids, ascending (at most
 * MOED_PROTO_MAX_LAYERS). */
#define MOED_PROTO_MAX_LAYERS 1024
#define MOED_HELLO_V1_BYTES 64
struct moed_hello_rep {
    uint16_t version;        /* chosen version */
    uint16_t reserved0;
    uint32_t hidden;         /* H */
    uint32_t inter;          /* I */
    uint32_t n_experts;      /* E */
    uint32_t top_k;          /* k */
    uint32_t n_shared;       /* S */
    uint32_t n_layers;       /* layer ids are < n_layers */
    uint32_t first_moe_layer;/* lowest MoE layer id */
    uint32_t max_tokens;     /* per FORWARD */
    uint32_t reserved1;
    uint64_t max_frame_bytes;/* max payload_len accepted */
    char backend[16];        /* "cpu" / "cuda", NUL padded */
};
_Static_assert(sizeof(struct moed_hello_rep) == 64, "hello reply");

/* FORWARD request payload: this 16-byte head, then
 *   x      bf16  [T, H]   (T*H*2 bytes)
 *   ids    int32 [T, k]   (T*k*4 bytes)
 *   w      fp32  [T, k]   (T*k*4 bytes)
 * so payload_len == 16 + 2*T*H + 8*T*k exactly. */
struct moed_forward_req {
    uint32_t layer;
    uint32_t n_tokens;
    uint32_t top_k;
    uint32_t flags;          /* MOED_FORWARD_* bits; 0: the version-1 behaviour */
};
_Static_assert(sizeof(struct moed_forward_req) == 16, "forward request head");

/* FORWARD flags. ROUTED_ONLY: only the routed experts, no shared-expert term.
 * EMPTY_SLOTS: an expert id of MOED_EXPERT_NONE (-1) is an empty slot that
 * contributes nothing (its weight is ignored); without it -1 is refused. */
#define MOED_FORWARD_ROUTED_ONLY 0x1u
#define MOED_FORWARD_EMPTY_SLOTS 0x2u
#define MOED_FORWARD_FLAGS_KNOWN (MOED_FORWARD_ROUTED_ONLY | MOED_FORWARD_EMPTY_SLOTS)
#define MOED_EXPERT_NONE (-1)

/* FORWARD reply payload: this 8-byte head then y bf16 [T, H]. */
struct moed_forward_rep {
    uint32_t n_tokens;
    uint32_t hidden;
};
_Static_assert(sizeof(struct moed_forward_rep) == 8, "forward reply head");

/* ERROR payload: this 8-byte head then msg_len bytes of UTF-8 (no NUL);
 * request_id in the frame header names the request (0 if none). */
struct moed_error_rep {
    int32_t code;            /* MOED_E_* (negative) */
    uint32_t msg_len;        /* <= MOED_PROTO_MAX_ERRMSG */
};
_Static_assert(sizeof(struct moed_error_rep) == 8, "error head");

/* ---- version 2: registered buffers (PROTOCOL.md section 9) ---- */
#define MOED_PROTO_IPC_HANDLE_BYTES 64 /* cudaIpcMemHandle_t */
#define MOED_PROTO_UUID_BYTES 16       /* cudaDeviceProp.uuid */
#define MOED_PROTO_BUF_ALIGN 16        /* offsets of x and y (ids, w: 4) */

/* REGISTER_BUF request payload (96 bytes): the CUDA IPC handle of a whole
 * allocation, the range [offset, offset + size) inside it that the client
 * lends, and the UUID of the GPU it lies on. Reply: moed_register_rep. */
struct moed_register_req {
    uint8_t handle[MOED_PROTO_IPC_HANDLE_BYTES];
    uint64_t offset;         /* multiple of MOED_PROTO_BUF_ALIGN */
    uint64_t size;           /* > 0 */
    uint8_t uuid[MOED_PROTO_UUID_BYTES];
};
_Static_assert(sizeof(struct moed_register_req) == 96, "register request");

/* REGISTER_BUF reply payload (8 bytes); UNREGISTER_BUF request payload. */
struct moed_register_rep {
    uint32_t buf_id;         /* > 0; names the buffer on this connection only */
    uint32_t reserved;
};
_Static_assert(sizeof(struct moed_register_rep) == 8, "register reply");

/* A range of a registered buffer (16 bytes). */
struct moed_bufref {
    uint32_t buf_id;
    uint32_t reserved;       /* 0 */
    uint64_t offset;         /* bytes from the start of the registered range */
};

/* FORWARD_DESC request payload (80 bytes): the FORWARD head, then where x
 * (bf16 [T, H]), ids (int32 [T, k]), w (fp32 [T, k]) and y (bf16 [T, H],
 * written) lie. Reply: moed_forward_rep alone (y is in the client's buffer). */
struct moed_forward_desc_req {
    struct moed_forward_req head;
    struct moed_bufref x, ids, w, y;
};
_Static_assert(sizeof(struct moed_forward_desc_req) == 80, "forward-by-descriptor request");

/* FORWARD_DESC head flag (its only one): the reply is
 * moed_forward_desc_times_rep, the request's own times (for benchmarks: a
 * call's time over its own kernel, PROTOCOL.md 9.3). */
#define MOED_FORWARD_DESC_TIMES 0x100u
struct moed_forward_desc_times_rep {
    uint32_t n_tokens;
    uint32_t hidden;
    uint64_t kernel_ns; /* the batch's kernel time as the backend measured it; 0: unknown */
    uint64_t daemon_ns; /* the frame's first byte read -> the reply queued */
    uint64_t rx_ns;     /* the daemon's CLOCK_MONOTONIC at that first byte */
    uint64_t queued_ns; /* ... and when the reply was queued (rx_ns + daemon_ns) */
};
_Static_assert(sizeof(struct moed_forward_desc_times_rep) == 40, "forward-by-descriptor times");

/* Decode and check a REGISTER_BUF payload (pure): length, size > 0, offset
 * aligned, offset + size without overflow. MOED_E_INVAL / MOED_E_RANGE with a
 * message. */
int moed_register_decode(const uint8_t *payload, uint64_t len, struct moed_register_req *out,
                         char *err, size_t errlen);

/* Decode and check a FORWARD_DESC payload against the model (pure): head
 * fields as moed_forward_validate checks them (T in [1, max_tokens], top_k,
 * flags, MoE layer), reserved words 0, buffer ids non-zero, x / y offsets
 * 16-aligned and ids / w offsets 4-aligned. The ranges against the
 * registrations are the daemon's to check. MOED_E_INVAL with a message. */
int moed_forward_desc_decode(const uint8_t *payload, uint64_t len, uint32_t top_k,
                             uint32_t max_tokens,
                             int (*is_moe_layer)(const void *ctx, uint32_t layer),
                             const void *ctx, struct moed_forward_desc_req *out, char *err,
                             size_t errlen);

/* ---- version 2: GPU doorbell channels (PROTOCOL.md section 10) ---- */
#define MOED_PROTO_CHAN_BUFS 16 /* buffers a channel names (MOE_GPU_CHAN_BUFS) */

/* CHAN_OPEN request payload: 88 bytes (no arena), or 96 with arena_bytes.
 * The GPU the client's kernels run on and the registered buffers
 * (REGISTER_BUF ids of this connection) its descriptors name, by index.
 * Without an arena descriptor buffer i is buf_ids[i] (n_bufs 1..16); with
 * one (arena_bytes > 0: memory the daemon allocates next to the channel's
 * ring, in the same allocation) buffer 0 is the arena and buffer i + 1 is
 * buf_ids[i] (n_bufs 0..15). */
#define MOED_PROTO_CHAN_OPEN_SHORT 88 /* the form without arena_bytes */
struct moed_chan_open_req {
    uint8_t uuid[MOED_PROTO_UUID_BYTES];
    uint32_t n_bufs;                         /* 1..16, with an arena 0..15 */
    uint32_t flags;                          /* 0 */
    uint32_t buf_ids[MOED_PROTO_CHAN_BUFS];  /* [n_bufs] non-zero, the rest 0 */
    uint64_t arena_bytes;                    /* 0: none (and the 88-byte form) */
};
_Static_assert(sizeof(struct moed_chan_open_req) == 96, "channel open request");

/* CHAN_OPEN reply payload: this head (112 bytes), then kernel_bytes bytes
 * of the client kernel's fatbin (cuModuleLoadData; kernels/moe_chan_client.cu,
 * entry moed_chan_call). */
struct moed_chan_open_rep {
    uint32_t chan_id;                        /* > 0; CHAN_CLOSE names it */
    uint32_t slots;                          /* descriptors in flight (MOE_GPU_CHAN_SLOTS) */
    uint64_t key;                            /* every descriptor carries it */
    uint8_t handle[MOED_PROTO_IPC_HANDLE_BYTES]; /* the channel's allocation: ring + arena */
    uint64_t size;                           /* bytes of struct moe_gpu_chan at offset 0 */
    uint32_t abi_version;                    /* MOE_GPU_ABI_VERSION */
    uint32_t kernel_bytes;
    uint64_t arena_off;                      /* the arena's offset in the mapping (4096-
                                                aligned, past the ring); 0 without one */
    uint64_t arena_bytes;                    /* the arena's bytes; 0 without one */
};
_Static_assert(sizeof(struct moed_chan_open_rep) == 112, "channel open reply head");
/* An arena starts this far into the channel's allocation. */
#define MOED_PROTO_CHAN_ARENA_OFF 4096

/* CHAN_CLOSE request payload (8 bytes); the reply has no payload. */
struct moed_chan_close_req {
    uint32_t chan_id;
    uint32_t reserved;                       /* 0 */
};
_Static_assert(sizeof(struct moed_chan_close_req) == 8, "channel close request");

/* The client kernel's fatbin in a CHAN_OPEN reply is at most this many
 * bytes (a client refuses a longer one). */
#define MOED_PROTO_MAX_CHAN_KERNEL (16u << 20)

/* Decode and check a CHAN_OPEN payload (pure): length 88 (arena_bytes 0)
 * or 96, flags 0, n_bufs in [1, MOED_PROTO_CHAN_BUFS] (with an arena [0,
 * MOED_PROTO_CHAN_BUFS - 1]), buf_ids[0..n_bufs) non-zero and the rest 0.
 * Whether the ids are registered and arena_bytes is within the model's
 * limit is the daemon's to check. MOED_E_INVAL with a message. */
int moed_chan_open_decode(const uint8_t *payload, uint64_t len, struct moed_chan_open_req *out,
                          char *err, size_t errlen);
/* Decode and check a CHAN_CLOSE payload (pure): length 8, reserved 0.
 * MOED_E_INVAL with a message. */
int moed_chan_close_decode(const uint8_t *payload, uint64_t len, struct moed_chan_close_req *out,
                           char *err, size_t errlen);
/* Write a CHAN_OPEN reply head (112 bytes, little-endian). */
void moed_chan_open_rep_encode(uint8_t out[sizeof(struct moed_chan_open_rep)],
                               const struct moed_chan_open_rep *r);
/* Decode a CHAN_OPEN reply payload (pure, the client's side): the head,
 * then exactly kernel_bytes (1..MOED_PROTO_MAX_CHAN_KERNEL) bytes, chan_id
 * > 0, slots > 0, size > 0; an arena (arena_bytes > 0) at a 4096-aligned
 * arena_off >= size, none with arena_off 0. MOED_E_PROTO with a message
 * otherwise. */
int moed_chan_open_rep_decode(const uint8_t *payload, uint64_t len,
                              struct moed_chan_open_rep *out, char *err, size_t errlen);

/* STATUS: empty request; reply payload is the status JSON (UTF-8).
 * PING: request payload up to 64 bytes, echoed in the reply. */
#define MOED_PROTO_MAX_PING 64

enum moed_parse_result {
    MOED_PARSE_COMPLETE = 1, /* a whole frame is in the buffer */
    MOED_PARSE_NEED_MORE = 0,/* header or payload incomplete */
    /* negative: MOED_E_PROTO (bad magic / flags / reserved), MOED_E_VERSION,
     * MOED_E_TYPE, MOED_E_TOOBIG */
};

/* Pure frame parser (fuzzable): looks at buf[0..len), decodes the header
 * once 32 bytes are there and validates it (magic, version in
 * [MOED_PROTO_MIN_VERSION, MOED_PROTO_VERSION], known request
 * type, flags/reserved zero, payload_len <= max_payload). Returns
 * MOED_PARSE_COMPLETE when header + payload are all in buf (the frame is
 * 32 + hdr->payload_len bytes), MOED_PARSE_NEED_MORE, or a negative code. *hdr
 * is filled whenever 32 bytes were available, even on error (for the request
 * id of the error reply). */
int moed_frame_parse(const uint8_t *buf, size_t len, uint64_t max_payload,
                     struct moed_frame_hdr *hdr);

/* Encode a header into out[32] (version 1, or 2 for the types only version
 * 2 has: 16..31). */
void moed_frame_encode(uint8_t out[MOED_PROTO_HDR_SIZE], uint16_t type, uint64_t request_id,
                       uint64_t payload_len);

/* The lowest frame version that may carry `type` (REPLY bit ignored). */
uint16_t moed_type_min_version(uint16_t type);

/* FORWARD payload size for T tokens, or 0 on overflow. */
uint64_t moed_forward_payload_len(uint64_t n_tokens, uint64_t hidden, uint64_t top_k);

/* Validate a FORWARD payload against the model and limits (pure): head
 * fields, flags only MOED_FORWARD_FLAGS_KNOWN, payload length ==
 * moed_forward_payload_len, T in [0, max_tokens], top_k == model's, every id
 * in [0, n_experts) (or MOED_EXPERT_NONE with MOED_FORWARD_EMPTY_SLOTS), layer
 * is an MoE layer
 * (is_moe_layer(ctx, layer)). On error returns MOED_E_INVAL and writes a
 * message naming the field and the allowed range. */
int moed_forward_validate(const uint8_t *payload, uint64_t len, uint32_t hidden,
                          uint32_t n_experts, uint32_t top_k, uint32_t max_tokens,
                          int (*is_moe_layer)(const void *ctx, uint32_t layer),
                          const void *ctx, struct moed_forward_req *req, char *err,
                          size_t errlen);

/* Decode a HELLO reply payload b[0..len) (pure): version 1 (exactly 64
 * bytes) or 2 (64 + 4 + 4 * n_moe_layers, the ids ascending and < n_layers).
 * Fills *rep, layers[0..*n_moe_layers) (version 1: first_moe_layer ..
 * n_layers - 1, at most MOED_PROTO_MAX_LAYERS). MOED_E_PROTO or
 * MOED_E_VERSION with a message on a reply that breaks those rules. */
int moed_hello_parse(const uint8_t *b, uint64_t len, struct moed_hello_rep *rep,
                     uint32_t layers[MOED_PROTO_MAX_LAYERS], uint32_t *n_moe_layers, char *err,
                     size_t errlen);

#endif
