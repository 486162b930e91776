/* moed_proto.h - the moed wire protocol, versions 1 and 2. ipc/PROTOCOL.md is
 * the byte-level specification; this header defines it for C. Version 2 keeps
 * the frame (header `version` is 1 in both: it names the framing) and adds
 * the MoE layer list to the HELLO reply and FORWARD flags; HELLO negotiates
 * it.
 *
 * Every message is one frame: a 32-byte little-endian header followed by
 * `payload_len` bytes. Requests may be pipelined; every reply carries the
 * request id of its request (replies may come back in any order).
 *
 *   off size field
 *     0   4  magic        "MOED" (0x4445'4F4D as a LE u32)
 *     4   2  version      1
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
#define MOED_PROTO_VERSION 1     /* the frame header's `version` (the framing) */
#define MOED_PROTO_MAX_VERSION 2 /* highest protocol version HELLO negotiates */
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
    /* 16..31 reserved for buffer registration (CUDA IPC), a later version */
    MOED_MSG_REGISTER_BUF = 16,
    MOED_MSG_UNREGISTER_BUF = 17,
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
 * once 32 bytes are there and validates it (magic, version, known request
 * type, flags/reserved zero, payload_len <= max_payload). Returns
 * MOED_PARSE_COMPLETE when header + payload are all in buf (the frame is
 * 32 + hdr->payload_len bytes), MOED_PARSE_NEED_MORE, or a negative code. *hdr
 * is filled whenever 32 bytes were available, even on error (for the request
 * id of the error reply). */
int moed_frame_parse(const uint8_t *buf, size_t len, uint64_t max_payload,
                     struct moed_frame_hdr *hdr);

/* Encode a header into out[32]. */
void moed_frame_encode(uint8_t out[MOED_PROTO_HDR_SIZE], uint16_t type, uint64_t request_id,
                       uint64_t payload_len);

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
