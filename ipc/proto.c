/* proto.c - the moed wire protocol, versions 1 and 2: frame header parse/encode and
 * FORWARD payload validation (ipc/PROTOCOL.md is the byte-level spec).
 *
 * Everything here is a pure function of its arguments so that both the server
 * and the client library use the same code and a fuzzer can drive it. Fields
 * are read and written byte by byte in little-endian order: the buffer is never
 * cast to a struct, so alignment, padding and host byte order do not matter.
 */
#include "moed_le.h"
#include "moed_proto.h"

#include <inttypes.h>
#include <string.h>

#include "moed_err.h"

/* moed_proto.h is installed with libmoedclient, so its functions are part of
 * the library's exported surface even though the library is built with
 * -fvisibility=hidden. */
#ifdef MOEDC_BUILD
#pragma GCC visibility push(default)
#endif

/* Types a version-1 peer may send: the requests, and their replies (REPLY
 * bit set) plus ERROR, which exists only as a reply. The server must still
 * refuse a reply-typed frame as a request (PROTOCOL.md, "Bad input"). */
static int type_known(uint16_t type)
{
    uint16_t base = (uint16_t)(type & ~MOED_PROTO_REPLY);
    int reply = (type & MOED_PROTO_REPLY) != 0;
    switch (base) {
    case MOED_MSG_HELLO:
    case MOED_MSG_FORWARD:
    case MOED_MSG_STATUS:
    case MOED_MSG_PING:
    case MOED_MSG_REGISTER_BUF:
    case MOED_MSG_UNREGISTER_BUF:
    case MOED_MSG_FORWARD_DESC:
    case MOED_MSG_CHAN_OPEN:
    case MOED_MSG_CHAN_CLOSE:
        return 1;
    case MOED_MSG_ERROR:
        return reply;
    default:
        return 0;
    }
}

int moed_frame_parse(const uint8_t *buf, size_t len, uint64_t max_payload,
                     struct moed_frame_hdr *hdr)
{
    if (len < MOED_PROTO_HDR_SIZE)
        return MOED_PARSE_NEED_MORE;
    struct moed_frame_hdr h = {
        .magic = le_get32(buf + 0),
        .version = le_get16(buf + 4),
        .type = le_get16(buf + 6),
        .flags = le_get32(buf + 8),
        .reserved = le_get32(buf + 12),
        .request_id = le_get64(buf + 16),
        .payload_len = le_get64(buf + 24),
    };
    if (hdr)
        *hdr = h;
    /* Order matters: MOED_E_TYPE is returned only for a header that is
     * otherwise sound (length within the limit), so the receiver may answer it
     * and skip exactly payload_len bytes; every earlier error means the stream
     * cannot be trusted any more and the connection is closed. */
    if (h.magic != MOED_PROTO_MAGIC)
        return MOED_E_PROTO;
    if (h.version < MOED_PROTO_MIN_VERSION || h.version > MOED_PROTO_VERSION)
        return MOED_E_VERSION;
    if (h.flags != 0 || h.reserved != 0)
        return MOED_E_PROTO;
    if (h.payload_len > max_payload)
        return MOED_E_TOOBIG;
    if (!type_known(h.type))
        return MOED_E_TYPE;
    if (len - MOED_PROTO_HDR_SIZE < h.payload_len)
        return MOED_PARSE_NEED_MORE;
    return MOED_PARSE_COMPLETE;
}

void moed_frame_encode(uint8_t out[MOED_PROTO_HDR_SIZE], uint16_t type, uint64_t request_id,
                       uint64_t payload_len)
{
    le_put32(out + 0, MOED_PROTO_MAGIC);
    le_put16(out + 4, moed_type_min_version(type));
    le_put16(out + 6, type);
    le_put32(out + 8, 0);
    le_put32(out + 12, 0);
    le_put64(out + 16, request_id);
    le_put64(out + 24, payload_len);
}

uint16_t moed_type_min_version(uint16_t type)
{
    uint16_t base = (uint16_t)(type & ~MOED_PROTO_REPLY);
    return base >= 16 && base <= 31 ? 2 : 1;
}

/* a*b, or 0 with *ovf set when it does not fit in 64 bits. */
static uint64_t mul_ovf(uint64_t a, uint64_t b, int *ovf)
{
    if (a != 0 && b > UINT64_MAX / a) {
        *ovf = 1;
        return 0;
    }
    return a * b;
}

static uint64_t add_ovf(uint64_t a, uint64_t b, int *ovf)
{
    if (b > UINT64_MAX - a) {
        *ovf = 1;
        return 0;
    }
    return a + b;
}

uint64_t moed_forward_payload_len(uint64_t n_tokens, uint64_t hidden, uint64_t top_k)
{
    int ovf = 0;
    /* 16 + 2*T*H + 8*T*k: bf16 x, then int32 ids and fp32 weights. */
    uint64_t x = mul_ovf(mul_ovf(n_tokens, hidden, &ovf), 2, &ovf);
    uint64_t routing = mul_ovf(mul_ovf(n_tokens, top_k, &ovf), 8, &ovf);
    uint64_t total = add_ovf(add_ovf(sizeof(struct moed_forward_req), x, &ovf), routing, &ovf);
    return ovf ? 0 : total;
}

int moed_forward_validate(const uint8_t *payload, uint64_t len, uint32_t hidden,
                          uint32_t n_experts, uint32_t top_k, uint32_t max_tokens,
                          int (*is_moe_layer)(const void *ctx, uint32_t layer),
                          const void *ctx, struct moed_forward_req *req, char *err,
                          size_t errlen)
{
    if (len < sizeof(struct moed_forward_req))
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "payload is %" PRIu64 " bytes, shorter than the %zu-byte FORWARD head",
                           len, sizeof(struct moed_forward_req));
    struct moed_forward_req r = {
        .layer = le_get32(payload + 0),
        .n_tokens = le_get32(payload + 4),
        .top_k = le_get32(payload + 8),
        .flags = le_get32(payload + 12),
    };
    if (req)
        *req = r;
    if (r.flags & ~MOED_FORWARD_FLAGS_KNOWN)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "forward flags 0x%" PRIx32 " has unknown bits 0x%" PRIx32
                           " (known: 0x1 routed-only, 0x2 empty slots)",
                           r.flags, r.flags & ~MOED_FORWARD_FLAGS_KNOWN);
    if (is_moe_layer && !is_moe_layer(ctx, r.layer))
        return moed_seterr(err, errlen, MOED_E_INVAL, "layer %" PRIu32
                           " is not an MoE layer of this model", r.layer);
    if (r.n_tokens > max_tokens)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "n_tokens %" PRIu32 " is out of range [0, %" PRIu32 "]", r.n_tokens,
                           max_tokens);
    if (r.top_k != top_k)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "top_k %" PRIu32 " does not match the model's %" PRIu32, r.top_k,
                           top_k);
    uint64_t need = moed_forward_payload_len(r.n_tokens, hidden, r.top_k);
    if (need == 0 || len != need)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "payload is %" PRIu64 " bytes but T=%" PRIu32 ", H=%" PRIu32
                           ", k=%" PRIu32 " need %" PRIu64,
                           len, r.n_tokens, hidden, r.top_k, need);
    const uint8_t *ids = payload + sizeof(struct moed_forward_req) + 2 * (uint64_t)r.n_tokens * hidden;
    const int empty_ok = (r.flags & MOED_FORWARD_EMPTY_SLOTS) != 0;
    for (uint32_t t = 0; t < r.n_tokens; t++) {
        for (uint32_t j = 0; j < r.top_k; j++) {
            int32_t id = (int32_t)le_get32(ids + 4 * ((uint64_t)t * r.top_k + j));
            if (id == MOED_EXPERT_NONE && empty_ok)
                continue;
            if (id < 0 || (uint32_t)id >= n_experts)
                return moed_seterr(err, errlen, MOED_E_INVAL,
                                   "expert id %" PRId32 " at token %" PRIu32 " slot %" PRIu32
                                   " is out of range [0, %" PRIu32 ")%s",
                                   id, t, j, n_experts,
                                   id == MOED_EXPERT_NONE
                                       ? " (-1 is an empty slot only with forward flag 0x2)"
                                       : "");
        }
    }
    return 0;
}

int moed_hello_parse(const uint8_t *b, uint64_t len, struct moed_hello_rep *rep,
                     uint32_t layers[MOED_PROTO_MAX_LAYERS], uint32_t *n_moe_layers, char *err,
                     size_t errlen)
{
    if (len < MOED_HELLO_V1_BYTES)
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "HELLO reply is %" PRIu64 " bytes, expected at least %d", len,
                           MOED_HELLO_V1_BYTES);
    struct moed_hello_rep r = {
        .version = le_get16(b),
        .reserved0 = le_get16(b + 2),
        .hidden = le_get32(b + 4),
        .inter = le_get32(b + 8),
        .n_experts = le_get32(b + 12),
        .top_k = le_get32(b + 16),
        .n_shared = le_get32(b + 20),
        .n_layers = le_get32(b + 24),
        .first_moe_layer = le_get32(b + 28),
        .max_tokens = le_get32(b + 32),
        .reserved1 = le_get32(b + 36),
        .max_frame_bytes = le_get64(b + 40),
    };
    memcpy(r.backend, b + 48, sizeof r.backend);
    r.backend[sizeof r.backend - 1] = 0;
    if (r.version < MOED_PROTO_MIN_VERSION || r.version > MOED_PROTO_VERSION)
        return moed_seterr(err, errlen, MOED_E_VERSION,
                           "daemon chose protocol version %u; this client speaks 1..%d",
                           (unsigned)r.version, MOED_PROTO_VERSION);
    /* Version 2: n_moe_layers, then the ids, ascending, each < n_layers;
     * version 1: exactly the 64 bytes, the layers first_moe_layer.. */
    uint32_t nl = r.version >= 2 && len >= MOED_HELLO_V1_BYTES + 4
                      ? le_get32(b + MOED_HELLO_V1_BYTES) : 0;
    uint64_t want = r.version >= 2 ? MOED_HELLO_V1_BYTES + 4 + 4ull * nl : MOED_HELLO_V1_BYTES;
    if ((r.version >= 2 && (len < MOED_HELLO_V1_BYTES + 4 || nl > MOED_PROTO_MAX_LAYERS)) ||
        len != want)
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "version-%u HELLO reply is %" PRIu64 " bytes; its layer list needs %"
                           PRIu64, (unsigned)r.version, len, want);
    for (uint32_t i = 0; i < nl; i++) {
        uint32_t l = le_get32(b + MOED_HELLO_V1_BYTES + 4 + 4 * i);
        if (l >= r.n_layers || (i && l <= layers[i - 1]))
            return moed_seterr(err, errlen, MOED_E_PROTO,
                               "HELLO layer list: entry %" PRIu32 " (%" PRIu32
                               ") is not ascending and below n_layers %" PRIu32,
                               i, l, r.n_layers);
        layers[i] = l;
    }
    if (r.version < 2)
        for (uint32_t l = r.first_moe_layer; l < r.n_layers && nl < MOED_PROTO_MAX_LAYERS; l++)
            layers[nl++] = l;
    *n_moe_layers = nl;
    *rep = r;
    return 0;
}

int moed_register_decode(const uint8_t *payload, uint64_t len, struct moed_register_req *out,
                         char *err, size_t errlen)
{
    if (len != sizeof(struct moed_register_req))
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "REGISTER_BUF payload is %" PRIu64 " bytes; expected %zu", len,
                           sizeof(struct moed_register_req));
    struct moed_register_req r;
    memcpy(r.handle, payload, sizeof r.handle);
    r.offset = le_get64(payload + 64);
    r.size = le_get64(payload + 72);
    memcpy(r.uuid, payload + 80, sizeof r.uuid);
    *out = r;
    if (r.size == 0)
        return moed_seterr(err, errlen, MOED_E_INVAL, "REGISTER_BUF size is 0");
    if (r.offset % MOED_PROTO_BUF_ALIGN != 0)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "REGISTER_BUF offset %" PRIu64 " is not a multiple of %d", r.offset,
                           MOED_PROTO_BUF_ALIGN);
    if (r.size > UINT64_MAX - r.offset)
        return moed_seterr(err, errlen, MOED_E_RANGE,
                           "REGISTER_BUF offset %" PRIu64 " + size %" PRIu64 " overflows",
                           r.offset, r.size);
    return 0;
}

static struct moed_bufref bufref_get(const uint8_t *p)
{
    return (struct moed_bufref){le_get32(p), le_get32(p + 4), le_get64(p + 8)};
}

int moed_forward_desc_decode(const uint8_t *payload, uint64_t len, uint32_t top_k,
                             uint32_t max_tokens,
                             int (*is_moe_layer)(const void *ctx, uint32_t layer),
                             const void *ctx, struct moed_forward_desc_req *out, char *err,
                             size_t errlen)
{
    if (len != sizeof(struct moed_forward_desc_req))
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "FORWARD_DESC payload is %" PRIu64 " bytes; expected %zu", len,
                           sizeof(struct moed_forward_desc_req));
    struct moed_forward_desc_req r = {
        .head = {le_get32(payload), le_get32(payload + 4), le_get32(payload + 8),
                 le_get32(payload + 12)},
        .x = bufref_get(payload + 16),
        .ids = bufref_get(payload + 32),
        .w = bufref_get(payload + 48),
        .y = bufref_get(payload + 64),
    };
    *out = r;
    if (r.head.flags & ~MOED_FORWARD_DESC_TIMES)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "FORWARD_DESC flags 0x%" PRIx32 " have unknown bits 0x%" PRIx32
                           " (known: 0x100 times)",
                           r.head.flags, r.head.flags & ~MOED_FORWARD_DESC_TIMES);
    if (is_moe_layer && !is_moe_layer(ctx, r.head.layer))
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "layer %" PRIu32 " is not an MoE layer of this model", r.head.layer);
    if (r.head.n_tokens < 1 || r.head.n_tokens > max_tokens)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "n_tokens %" PRIu32 " is out of range [1, %" PRIu32 "]",
                           r.head.n_tokens, max_tokens);
    if (r.head.top_k != top_k)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "top_k %" PRIu32 " does not match the model's %" PRIu32, r.head.top_k,
                           top_k);
    const struct moed_bufref *refs[4] = {&out->x, &out->ids, &out->w, &out->y};
    static const char *const names[4] = {"x", "ids", "w", "y"};
    static const unsigned align[4] = {MOED_PROTO_BUF_ALIGN, 4, 4, MOED_PROTO_BUF_ALIGN};
    for (int i = 0; i < 4; i++) {
        if (refs[i]->buf_id == 0 || refs[i]->reserved != 0)
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "%s: buffer id %" PRIu32 " / reserved %" PRIu32
                               " (the id must be non-zero, reserved 0)",
                               names[i], refs[i]->buf_id, refs[i]->reserved);
        if (refs[i]->offset % align[i] != 0)
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "%s: offset %" PRIu64 " is not a multiple of %u", names[i],
                               refs[i]->offset, align[i]);
    }
    return 0;
}

int moed_chan_open_decode(const uint8_t *payload, uint64_t len, struct moed_chan_open_req *out,
                          char *err, size_t errlen)
{
    if (len != MOED_PROTO_CHAN_OPEN_SHORT && len != sizeof(struct moed_chan_open_req))
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "CHAN_OPEN payload is %" PRIu64 " bytes; expected %d or %zu", len,
                           MOED_PROTO_CHAN_OPEN_SHORT, sizeof(struct moed_chan_open_req));
    struct moed_chan_open_req r;
    memcpy(r.uuid, payload, sizeof r.uuid);
    r.n_bufs = le_get32(payload + 16);
    r.flags = le_get32(payload + 20);
    for (uint32_t i = 0; i < MOED_PROTO_CHAN_BUFS; i++)
        r.buf_ids[i] = le_get32(payload + 24 + 4 * i);
    r.arena_bytes = len > MOED_PROTO_CHAN_OPEN_SHORT ? le_get64(payload + 88) : 0;
    *out = r;
    if (r.flags != 0)
        return moed_seterr(err, errlen, MOED_E_INVAL, "CHAN_OPEN flags 0x%" PRIx32 " are not 0",
                           r.flags);
    /* with an arena, buffer 0 is the arena and the ids are buffers 1.. */
    const uint32_t lo = r.arena_bytes ? 0 : 1, hi = MOED_PROTO_CHAN_BUFS - (r.arena_bytes != 0);
    if (r.n_bufs < lo || r.n_bufs > hi)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "CHAN_OPEN n_bufs %" PRIu32 " is out of range [%" PRIu32 ", %" PRIu32
                           "]%s",
                           r.n_bufs, lo, hi,
                           r.arena_bytes ? " (with an arena, buffer 0 is the arena)" : "");
    for (uint32_t i = 0; i < MOED_PROTO_CHAN_BUFS; i++) {
        if (i < r.n_bufs && r.buf_ids[i] == 0)
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "CHAN_OPEN buf_ids[%" PRIu32 "] is 0 (the first n_bufs %" PRIu32
                               " ids must name registered buffers)",
                               i, r.n_bufs);
        if (i >= r.n_bufs && r.buf_ids[i] != 0)
            return moed_seterr(err, errlen, MOED_E_INVAL,
                               "CHAN_OPEN buf_ids[%" PRIu32 "] is %" PRIu32 " past n_bufs %" PRIu32
                               " (unused ids must be 0)",
                               i, r.buf_ids[i], r.n_bufs);
    }
    return 0;
}

int moed_chan_close_decode(const uint8_t *payload, uint64_t len, struct moed_chan_close_req *out,
                           char *err, size_t errlen)
{
    if (len != sizeof(struct moed_chan_close_req))
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "CHAN_CLOSE payload is %" PRIu64 " bytes; expected %zu (channel id, "
                           "reserved 0)",
                           len, sizeof(struct moed_chan_close_req));
    *out = (struct moed_chan_close_req){le_get32(payload), le_get32(payload + 4)};
    if (out->reserved != 0)
        return moed_seterr(err, errlen, MOED_E_INVAL, "CHAN_CLOSE reserved is %" PRIu32 ", not 0",
                           out->reserved);
    return 0;
}

void moed_chan_open_rep_encode(uint8_t out[sizeof(struct moed_chan_open_rep)],
                               const struct moed_chan_open_rep *r)
{
    le_put32(out, r->chan_id);
    le_put32(out + 4, r->slots);
    le_put64(out + 8, r->key);
    memcpy(out + 16, r->handle, sizeof r->handle);
    le_put64(out + 80, r->size);
    le_put32(out + 88, r->abi_version);
    le_put32(out + 92, r->kernel_bytes);
    le_put64(out + 96, r->arena_off);
    le_put64(out + 104, r->arena_bytes);
}

int moed_chan_open_rep_decode(const uint8_t *payload, uint64_t len,
                              struct moed_chan_open_rep *out, char *err, size_t errlen)
{
    const uint64_t head = sizeof(struct moed_chan_open_rep);
    if (len < head)
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "CHAN_OPEN reply is %" PRIu64 " bytes, shorter than its %" PRIu64
                           "-byte head",
                           len, head);
    struct moed_chan_open_rep r = {
        .chan_id = le_get32(payload),
        .slots = le_get32(payload + 4),
        .key = le_get64(payload + 8),
        .size = le_get64(payload + 80),
        .abi_version = le_get32(payload + 88),
        .kernel_bytes = le_get32(payload + 92),
        .arena_off = le_get64(payload + 96),
        .arena_bytes = le_get64(payload + 104),
    };
    memcpy(r.handle, payload + 16, sizeof r.handle);
    *out = r;
    if (r.kernel_bytes < 1 || r.kernel_bytes > MOED_PROTO_MAX_CHAN_KERNEL ||
        len != head + r.kernel_bytes)
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "CHAN_OPEN reply is %" PRIu64 " bytes for kernel_bytes %" PRIu32
                           " (expected %" PRIu64 " + kernel_bytes, kernel_bytes in [1, %u])",
                           len, r.kernel_bytes, head, MOED_PROTO_MAX_CHAN_KERNEL);
    if (r.chan_id == 0 || r.slots == 0 || r.size == 0)
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "CHAN_OPEN reply: chan_id %" PRIu32 ", slots %" PRIu32 ", size %" PRIu64
                           " (each must be > 0)",
                           r.chan_id, r.slots, r.size);
    if (r.arena_bytes ? r.arena_off < r.size || r.arena_off % MOED_PROTO_CHAN_ARENA_OFF != 0 ||
                            r.arena_bytes > UINT64_MAX - r.arena_off
                      : r.arena_off != 0)
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "CHAN_OPEN reply: arena_off %" PRIu64 " for arena_bytes %" PRIu64
                           " (an arena lies 4096-aligned past the %" PRIu64
                           "-byte channel; none has offset 0)",
                           r.arena_off, r.arena_bytes, r.size);
    return 0;
}

#ifdef MOEDC_BUILD
#pragma GCC visibility pop
#endif
