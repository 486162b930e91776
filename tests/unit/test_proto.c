/* test_proto.c - the frame parser, encoder, FORWARD validation and the
 * channel payloads against the byte layout written out by hand from
 * ipc/PROTOCOL.md. */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moed_err.h"
#include "moed_proto.h"
#include "check_main.h"

#define MAXP (1u << 20)

/* A header written byte by byte from the spec, independent of the encoder. */
static void hand_header(uint8_t *b, uint16_t version, uint16_t type, uint32_t flags,
                        uint32_t reserved, uint64_t id, uint64_t plen)
{
    memcpy(b, "MOED", 4);
    b[4] = (uint8_t)version;
    b[5] = (uint8_t)(version >> 8);
    b[6] = (uint8_t)type;
    b[7] = (uint8_t)(type >> 8);
    for (int i = 0; i < 4; i++) {
        b[8 + i] = (uint8_t)(flags >> (8 * i));
        b[12 + i] = (uint8_t)(reserved >> (8 * i));
    }
    for (int i = 0; i < 8; i++) {
        b[16 + i] = (uint8_t)(id >> (8 * i));
        b[24 + i] = (uint8_t)(plen >> (8 * i));
    }
}

START_TEST(test_parse_byte_at_a_time)
{
    uint8_t buf[32 + 5];
    hand_header(buf, 1, MOED_MSG_PING, 0, 0, 0x0102030405060708ull, 5);
    memcpy(buf + 32, "hello", 5);
    struct moed_frame_hdr h;
    for (size_t n = 0; n < sizeof buf; n++)
        ck_assert_int_eq(moed_frame_parse(buf, n, MAXP, &h), MOED_PARSE_NEED_MORE);
    memset(&h, 0, sizeof h);
    ck_assert_int_eq(moed_frame_parse(buf, sizeof buf, MAXP, &h), MOED_PARSE_COMPLETE);
    ck_assert_uint_eq(h.magic, MOED_PROTO_MAGIC);
    ck_assert_uint_eq(h.version, 1);
    ck_assert_uint_eq(h.type, MOED_MSG_PING);
    ck_assert_uint_eq(h.request_id, 0x0102030405060708ull);
    ck_assert_uint_eq(h.payload_len, 5);
    /* Extra bytes after the frame (a pipelined next request) are fine. */
    uint8_t two[2 * sizeof buf];
    memcpy(two, buf, sizeof buf);
    memcpy(two + sizeof buf, buf, sizeof buf);
    ck_assert_int_eq(moed_frame_parse(two, sizeof two, MAXP, &h), MOED_PARSE_COMPLETE);
    ck_assert_uint_eq(h.payload_len, 5);
}
END_TEST

START_TEST(test_parse_header_errors)
{
    uint8_t b[32];
    struct moed_frame_hdr h;

    hand_header(b, 1, MOED_MSG_HELLO, 0, 0, 7, 8);
    b[0] = 'X';
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_PROTO);
    ck_assert_uint_eq(h.request_id, 7); /* filled even on error */

    hand_header(b, 0, MOED_MSG_HELLO, 0, 0, 7, 8);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_VERSION);
    hand_header(b, 3, MOED_MSG_HELLO, 0, 0, 7, 8);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_VERSION);
    hand_header(b, 2, MOED_MSG_HELLO, 0, 0, 7, 8); /* version 2 frames are accepted */
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_PARSE_NEED_MORE);

    hand_header(b, 1, 0, 0, 0, 7, 8);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_TYPE);
    hand_header(b, 1, 6, 0, 0, 7, 8);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_TYPE);
    hand_header(b, 1, 0x1234, 0, 0, 9, 8);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_TYPE);
    ck_assert_uint_eq(h.request_id, 9);
    ck_assert_uint_eq(h.payload_len, 8); /* so the receiver can skip it */
    /* ERROR exists only as a reply. */
    hand_header(b, 1, MOED_MSG_ERROR, 0, 0, 7, 8);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_TYPE);
    hand_header(b, 1, MOED_MSG_ERROR | MOED_PROTO_REPLY, 0, 0, 7, 8);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_PARSE_NEED_MORE);
    /* The reserved buffer-registration types parse (the server answers them
     * with MOED_E_UNSUPPORTED). */
    hand_header(b, 1, MOED_MSG_REGISTER_BUF, 0, 0, 7, 0);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_PARSE_COMPLETE);
    hand_header(b, 1, MOED_MSG_UNREGISTER_BUF, 0, 0, 7, 0);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_PARSE_COMPLETE);
    /* the channel types (19, 20) parse in either version; 21 is unknown */
    for (uint16_t t = MOED_MSG_CHAN_OPEN; t <= MOED_MSG_CHAN_CLOSE; t++) {
        hand_header(b, 2, t, 0, 0, 7, 0);
        ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_PARSE_COMPLETE);
        hand_header(b, 1, t | MOED_PROTO_REPLY, 0, 0, 7, 0);
        ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_PARSE_COMPLETE);
        ck_assert_uint_eq(moed_type_min_version(t), 2);
        ck_assert_uint_eq(moed_type_min_version(t | MOED_PROTO_REPLY), 2);
    }
    hand_header(b, 2, 21, 0, 0, 7, 0);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_TYPE);

    hand_header(b, 1, MOED_MSG_PING, 1, 0, 7, 0);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_PROTO);
    hand_header(b, 1, MOED_MSG_PING, 0x80000000u, 0, 7, 0);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_PROTO);
    hand_header(b, 1, MOED_MSG_PING, 0, 1, 7, 0);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_PROTO);

    hand_header(b, 1, MOED_MSG_FORWARD, 0, 0, 7, (uint64_t)MAXP + 1);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_TOOBIG);
    hand_header(b, 1, MOED_MSG_FORWARD, 0, 0, 7, UINT64_MAX);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_E_TOOBIG);
    ck_assert_int_eq(moed_frame_parse(b, 32, UINT64_MAX - 1, &h), MOED_E_TOOBIG);
    /* Exactly the maximum is allowed (and then needs its payload). */
    hand_header(b, 1, MOED_MSG_FORWARD, 0, 0, 7, MAXP);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_PARSE_NEED_MORE);
    /* A huge length within a huge limit must not overflow len arithmetic. */
    hand_header(b, 1, MOED_MSG_FORWARD, 0, 0, 7, UINT64_MAX);
    ck_assert_int_eq(moed_frame_parse(b, 32, UINT64_MAX, &h), MOED_PARSE_NEED_MORE);

    hand_header(b, 1, MOED_MSG_STATUS, 0, 0, 7, 0);
    ck_assert_int_eq(moed_frame_parse(b, 32, MAXP, &h), MOED_PARSE_COMPLETE);
    ck_assert_int_eq(moed_frame_parse(b, 32, 0, &h), MOED_PARSE_COMPLETE);
    /* NULL hdr is allowed. */
    ck_assert_int_eq(moed_frame_parse(b, 32, 0, NULL), MOED_PARSE_COMPLETE);
}
END_TEST

START_TEST(test_encode_round_trip)
{
    uint8_t enc[32], ref[32];
    moed_frame_encode(enc, MOED_MSG_FORWARD | MOED_PROTO_REPLY, 0xdeadbeefcafef00dull, 1056);
    hand_header(ref, 1, MOED_MSG_FORWARD | MOED_PROTO_REPLY, 0, 0, 0xdeadbeefcafef00dull, 1056);
    ck_assert_mem_eq(enc, ref, 32);
    /* Fixed bytes checked literally: magic "MOED", version 1 LE, type 0x8002 LE. */
    static const uint8_t head[8] = {'M', 'O', 'E', 'D', 1, 0, 0x02, 0x80};
    ck_assert_mem_eq(enc, head, 8);
    ck_assert_uint_eq(enc[24], 1056 & 0xff);
    ck_assert_uint_eq(enc[25], 1056 >> 8);

    uint16_t types[] = {MOED_MSG_HELLO, MOED_MSG_FORWARD, MOED_MSG_STATUS, MOED_MSG_PING,
                        MOED_MSG_ERROR | MOED_PROTO_REPLY, MOED_MSG_PING | MOED_PROTO_REPLY};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        uint8_t b[32];
        struct moed_frame_hdr h;
        moed_frame_encode(b, types[i], i * 0x100000001ull, 0);
        ck_assert_int_eq(moed_frame_parse(b, 32, 0, &h), MOED_PARSE_COMPLETE);
        ck_assert_uint_eq(h.type, types[i]);
        ck_assert_uint_eq(h.request_id, i * 0x100000001ull);
        ck_assert_uint_eq(h.payload_len, 0);
        ck_assert_uint_eq(h.flags, 0);
        ck_assert_uint_eq(h.reserved, 0);
    }
}
END_TEST

START_TEST(test_payload_len)
{
    ck_assert_uint_eq(moed_forward_payload_len(2, 256, 2), 16 + 2 * 2 * 256 + 8 * 2 * 2);
    ck_assert_uint_eq(moed_forward_payload_len(1, 7168, 8), 16 + 2 * 7168 + 64);
    ck_assert_uint_eq(moed_forward_payload_len(0, 7168, 8), 16);
    ck_assert_uint_eq(moed_forward_payload_len(UINT64_MAX, 2, 1), 0);
    ck_assert_uint_eq(moed_forward_payload_len(1ull << 32, 1ull << 32, 1), 0);
    ck_assert_uint_eq(moed_forward_payload_len(1ull << 31, 1ull << 31, 1), 16 + (1ull << 63) + (1ull << 34));
    ck_assert_uint_eq(moed_forward_payload_len(1ull << 32, 1ull << 31, 1), 0); /* 2*T*H = 2^64 */
    ck_assert_uint_eq(moed_forward_payload_len(1, 1, UINT64_MAX / 8 + 1), 0);
    ck_assert_uint_eq(moed_forward_payload_len(1, UINT64_MAX / 2, 0), 0); /* 16 + (2^64-2) */
    ck_assert_uint_eq(moed_forward_payload_len(1, (UINT64_MAX - 16) / 2, 0),
                      16 + 2 * ((UINT64_MAX - 16) / 2));
}
END_TEST

/* A FORWARD payload built by hand: layer, T, k, flags, then x, ids, w. */
struct fwd {
    uint8_t *buf;
    uint64_t len;
};

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static struct fwd make_fwd(uint32_t layer, uint32_t T, uint32_t H, uint32_t k, uint32_t E)
{
    struct fwd f;
    f.len = 16 + 2ull * T * H + 8ull * T * k;
    f.buf = calloc(1, f.len);
    ck_assert_ptr_nonnull(f.buf);
    put32(f.buf, layer);
    put32(f.buf + 4, T);
    put32(f.buf + 8, k);
    uint8_t *ids = f.buf + 16 + 2ull * T * H;
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t j = 0; j < k; j++)
            put32(ids + 4 * (t * k + j), (t + j) % E);
    return f;
}

static void set_id(struct fwd *f, uint32_t H, uint32_t k, uint32_t t, uint32_t j, int32_t id)
{
    uint32_t T = f->buf[4] | (uint32_t)f->buf[5] << 8;
    put32(f->buf + 16 + 2ull * T * H + 4 * (t * k + j), (uint32_t)id);
}

static int moe_layers_3_up(const void *ctx, uint32_t layer)
{
    const uint32_t *n_layers = ctx;
    return layer >= 3 && layer < *n_layers;
}

#define VAL(f, req, err)                                                                       \
    moed_forward_validate((f).buf, (f).len, 256, 128, 2, 512, moe_layers_3_up, &n_layers, req, \
                          err, sizeof err)

START_TEST(test_validate)
{
    const uint32_t n_layers = 10;
    char err[MOED_ERRLEN];
    struct moed_forward_req req;

    struct fwd ok = make_fwd(3, 4, 256, 2, 128);
    memset(&req, 0xff, sizeof req);
    err[0] = 0;
    ck_assert_int_eq(VAL(ok, &req, err), 0);
    ck_assert_uint_eq(req.layer, 3);
    ck_assert_uint_eq(req.n_tokens, 4);
    ck_assert_uint_eq(req.top_k, 2);
    ck_assert_uint_eq(req.flags, 0);
    ck_assert_str_eq(err, "");
    ck_assert_int_eq(moed_forward_validate(ok.buf, ok.len, 256, 128, 2, 512, NULL, NULL, NULL,
                                           NULL, 0), 0);

    set_id(&ok, 256, 2, 3, 1, 128);
    ck_assert_int_eq(VAL(ok, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "expert id 128 at token 3 slot 1 is out of range [0, 128)");
    set_id(&ok, 256, 2, 3, 1, -1);
    ck_assert_int_eq(VAL(ok, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "expert id -1 at token 3 slot 1 is out of range [0, 128) (-1 is an "
                          "empty slot only with forward flag 0x2)");
    /* FORWARD flag 0x2: -1 is an empty slot; any other negative id is still refused. */
    put32(ok.buf + 12, MOED_FORWARD_EMPTY_SLOTS);
    ck_assert_int_eq(VAL(ok, &req, err), 0);
    ck_assert_uint_eq(req.flags, MOED_FORWARD_EMPTY_SLOTS);
    set_id(&ok, 256, 2, 3, 1, -2);
    ck_assert_int_eq(VAL(ok, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "expert id -2 at token 3 slot 1 is out of range [0, 128)");
    put32(ok.buf + 12, 0);
    set_id(&ok, 256, 2, 3, 1, 127);
    set_id(&ok, 256, 2, 0, 0, INT32_MIN);
    ck_assert_int_eq(VAL(ok, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "expert id -2147483648 at token 0 slot 0 is out of range [0, 128)");
    free(ok.buf);

    struct fwd f = make_fwd(3, 2, 256, 2, 128);
    /* T = 0 is valid with the 16-byte head alone; its length is still checked. */
    put32(f.buf + 4, 0);
    ck_assert_int_eq(moed_forward_validate(f.buf, 16, 256, 128, 2, 512, NULL, NULL, &req, err,
                                           sizeof err), 0);
    ck_assert_uint_eq(req.n_tokens, 0);
    ck_assert_int_eq(VAL(f, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "payload is 1072 bytes but T=0, H=256, k=2 need 16");
    put32(f.buf + 4, 513);
    ck_assert_int_eq(VAL(f, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "n_tokens 513 is out of range [0, 512]");
    put32(f.buf + 4, 0xffffffffu);
    ck_assert_int_eq(VAL(f, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "n_tokens 4294967295 is out of range [0, 512]");
    put32(f.buf + 4, 2);

    put32(f.buf + 8, 4);
    ck_assert_int_eq(moed_forward_validate(f.buf, f.len, 256, 128, 8, 512, NULL, NULL, &req, err,
                                           sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "top_k 4 does not match the model's 8");
    put32(f.buf + 8, 2);

    ck_assert_int_eq(moed_forward_validate(f.buf, 1000, 256, 128, 2, 512, NULL, NULL, &req, err,
                                           sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "payload is 1000 bytes but T=2, H=256, k=2 need 1072");
    ck_assert_int_eq(moed_forward_validate(f.buf, f.len - 1, 256, 128, 2, 512, NULL, NULL, &req,
                                           err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "payload is 1071 bytes but T=2, H=256, k=2 need 1072");
    ck_assert_int_eq(moed_forward_validate(f.buf, 15, 256, 128, 2, 512, NULL, NULL, &req, err,
                                           sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "payload is 15 bytes, shorter than the 16-byte FORWARD head");
    /* A claimed length far beyond the buffer must be refused before any id is read. */
    ck_assert_int_eq(moed_forward_validate(f.buf, UINT64_MAX, 256, 128, 2, 512, NULL, NULL, &req,
                                           err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "payload is 18446744073709551615 bytes but T=2, H=256, k=2 need 1072");

    put32(f.buf, 7);
    const uint32_t few = 5;
    ck_assert_int_eq(moed_forward_validate(f.buf, f.len, 256, 128, 2, 512, moe_layers_3_up, &few,
                                           &req, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "layer 7 is not an MoE layer of this model");
    put32(f.buf, 2);
    ck_assert_int_eq(VAL(f, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "layer 2 is not an MoE layer of this model");
    put32(f.buf, 3);

    /* Flags 0x1 and 0x2 are known (version 2); any other bit is refused by name. */
    put32(f.buf + 12, MOED_FORWARD_ROUTED_ONLY | MOED_FORWARD_EMPTY_SLOTS);
    ck_assert_int_eq(VAL(f, &req, err), 0);
    ck_assert_uint_eq(req.flags, 3);
    put32(f.buf + 12, 0x5);
    ck_assert_int_eq(VAL(f, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "forward flags 0x5 has unknown bits 0x4 (known: 0x1 routed-only, 0x2 "
                          "empty slots)");
    put32(f.buf + 12, 0x80000000u);
    ck_assert_int_eq(VAL(f, &req, err), MOED_E_INVAL);
    ck_assert_str_eq(err, "forward flags 0x80000000 has unknown bits 0x80000000 (known: 0x1 "
                          "routed-only, 0x2 empty slots)");
    put32(f.buf + 12, 0);

    ck_assert_int_eq(VAL(f, &req, err), 0);
    /* A small err buffer truncates, never overflows. */
    char small[8];
    put32(f.buf + 4, 513);
    ck_assert_int_eq(moed_forward_validate(f.buf, f.len, 256, 128, 2, 512, NULL, NULL, NULL,
                                           small, sizeof small), MOED_E_INVAL);
    ck_assert_str_eq(small, "n_token");
    free(f.buf);
}
END_TEST

/* The byte-wise decoder must not depend on the buffer's alignment. */
/* HELLO replies: version 1 (64 bytes, layers first_moe_layer..), version 2
 * (the layer list), and the ones a client must refuse. */
START_TEST(test_hello_parse)
{
    uint8_t b[64 + 4 + 4 * 4] = {0};
    uint32_t layers[MOED_PROTO_MAX_LAYERS], n = 0;
    struct moed_hello_rep r;
    char err[256];
    b[0] = 1;
    put32(b + 4, 256);
    put32(b + 24, 6);  /* n_layers */
    put32(b + 28, 3);  /* first_moe_layer */
    memcpy(b + 48, "cpu", 3);
    ck_assert_int_eq(moed_hello_parse(b, 64, &r, layers, &n, err, sizeof err), 0);
    ck_assert_uint_eq(r.hidden, 256);
    ck_assert_str_eq(r.backend, "cpu");
    ck_assert_uint_eq(n, 3);
    ck_assert_uint_eq(layers[0], 3);
    ck_assert_uint_eq(layers[2], 5);
    ck_assert_int_eq(moed_hello_parse(b, 68, &r, layers, &n, err, sizeof err), MOED_E_PROTO);
    ck_assert_str_eq(err, "version-1 HELLO reply is 68 bytes; its layer list needs 64");
    b[0] = 2; /* layers 1, 3, 4 */
    put32(b + 64, 3);
    put32(b + 68, 1);
    put32(b + 72, 3);
    put32(b + 76, 4);
    ck_assert_int_eq(moed_hello_parse(b, 80, &r, layers, &n, err, sizeof err), 0);
    ck_assert_uint_eq(r.version, 2);
    ck_assert_uint_eq(n, 3);
    ck_assert_uint_eq(layers[0], 1);
    ck_assert_uint_eq(layers[1], 3);
    ck_assert_uint_eq(layers[2], 4);
    ck_assert_int_eq(moed_hello_parse(b, 84, &r, layers, &n, err, sizeof err), MOED_E_PROTO);
    ck_assert_str_eq(err, "version-2 HELLO reply is 84 bytes; its layer list needs 80");
    ck_assert_int_eq(moed_hello_parse(b, 64, &r, layers, &n, err, sizeof err), MOED_E_PROTO);
    put32(b + 76, 3); /* not ascending */
    ck_assert_int_eq(moed_hello_parse(b, 80, &r, layers, &n, err, sizeof err), MOED_E_PROTO);
    ck_assert_str_eq(err, "HELLO layer list: entry 2 (3) is not ascending and below n_layers 6");
    put32(b + 76, 6); /* not below n_layers */
    ck_assert_int_eq(moed_hello_parse(b, 80, &r, layers, &n, err, sizeof err), MOED_E_PROTO);
    put32(b + 64, MOED_PROTO_MAX_LAYERS + 1); /* a count over the limit is never read */
    ck_assert_int_eq(moed_hello_parse(b, 80, &r, layers, &n, err, sizeof err), MOED_E_PROTO);
    b[0] = 3;
    ck_assert_int_eq(moed_hello_parse(b, 64, &r, layers, &n, err, sizeof err), MOED_E_VERSION);
    ck_assert_str_eq(err, "daemon chose protocol version 3; this client speaks 1..2");
    ck_assert_int_eq(moed_hello_parse(b, 63, &r, layers, &n, err, sizeof err), MOED_E_PROTO);
}
END_TEST

/* CHAN_OPEN / CHAN_CLOSE payloads written from PROTOCOL.md section 10, and
 * the reply head a client decodes. */
static void chan_req(uint8_t b[88], uint32_t n_bufs, uint32_t flags)
{
    memset(b, 0, 88);
    memcpy(b, "0123456789abcdef", 16);
    put32(b + 16, n_bufs);
    put32(b + 20, flags);
    for (uint32_t i = 0; i < n_bufs && i < 16; i++)
        put32(b + 24 + 4 * i, 100 + i);
}

START_TEST(test_chan_open_decode)
{
    uint8_t b[89];
    struct moed_chan_open_req r;
    char err[256];
    chan_req(b, 3, 0);
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), 0);
    ck_assert_int_eq(memcmp(r.uuid, "0123456789abcdef", 16), 0);
    ck_assert_uint_eq(r.n_bufs, 3);
    ck_assert_uint_eq(r.buf_ids[0], 100);
    ck_assert_uint_eq(r.buf_ids[2], 102);
    ck_assert_uint_eq(r.buf_ids[3], 0);
    chan_req(b, 16, 0);
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), 0);
    ck_assert_uint_eq(r.buf_ids[15], 115);

    ck_assert_uint_eq(r.arena_bytes, 0); /* the 88-byte form has none */

    ck_assert_int_eq(moed_chan_open_decode(b, 87, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN payload is 87 bytes; expected 88 or 96");
    ck_assert_int_eq(moed_chan_open_decode(b, 89, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN payload is 89 bytes; expected 88 or 96");
    ck_assert_int_eq(moed_chan_open_decode(b, 0, &r, err, sizeof err), MOED_E_INVAL);
    chan_req(b, 0, 0);
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN n_bufs 0 is out of range [1, 16]");
    chan_req(b, 17, 0);
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN n_bufs 17 is out of range [1, 16]");
    chan_req(b, 0xffffffffu, 0);
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), MOED_E_INVAL);
    chan_req(b, 2, 1);
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN flags 0x1 are not 0");
    chan_req(b, 2, 0x80000000u);
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN flags 0x80000000 are not 0");
    chan_req(b, 2, 0);
    put32(b + 24 + 4 * 15, 9); /* the last unused id */
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN buf_ids[15] is 9 past n_bufs 2 (unused ids must be 0)");
    chan_req(b, 2, 0);
    put32(b + 24 + 4 * 2, 1); /* the first unused id */
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN buf_ids[2] is 1 past n_bufs 2 (unused ids must be 0)");
    chan_req(b, 2, 0);
    put32(b + 24 + 4 * 1, 0); /* a used id 0 */
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN buf_ids[1] is 0 (the first n_bufs 2 ids must name "
                          "registered buffers)");
    /* the byte-wise decoder does not care about alignment */
    chan_req(b + 1, 1, 0);
    ck_assert_int_eq(moed_chan_open_decode(b + 1, 88, &r, err, sizeof err), 0);
    ck_assert_uint_eq(r.buf_ids[0], 100);
}
END_TEST

/* FORWARD_DESC's flags: 0, or MOED_FORWARD_DESC_TIMES alone; any other bit
 * refused naming the unknown bits (the FORWARD flags included: they do not
 * apply to a descriptor). */
static void desc_req(uint8_t *b, uint32_t flags)
{
    memset(b, 0, 80);
    put32(b, 3);     /* layer */
    put32(b + 4, 2); /* T */
    put32(b + 8, 4); /* top_k */
    put32(b + 12, flags);
    for (int i = 0; i < 4; i++) {
        put32(b + 16 + 16 * i, 7 + i);             /* buf_id */
        put32(b + 16 + 16 * i + 8, (uint32_t)(64 * i)); /* offset (low word) */
    }
}

START_TEST(test_forward_desc_flags)
{
    uint8_t b[80];
    struct moed_forward_desc_req r;
    char err[256];
    desc_req(b, 0);
    ck_assert_int_eq(moed_forward_desc_decode(b, 80, 4, 16, NULL, NULL, &r, err, sizeof err), 0);
    ck_assert_uint_eq(r.head.flags, 0);
    ck_assert_uint_eq(r.ids.buf_id, 8);
    ck_assert_uint_eq(r.y.offset, 192);
    desc_req(b, MOED_FORWARD_DESC_TIMES);
    ck_assert_int_eq(moed_forward_desc_decode(b, 80, 4, 16, NULL, NULL, &r, err, sizeof err), 0);
    ck_assert_uint_eq(r.head.flags, 0x100);
    desc_req(b, MOED_FORWARD_ROUTED_ONLY);
    ck_assert_int_eq(moed_forward_desc_decode(b, 80, 4, 16, NULL, NULL, &r, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "FORWARD_DESC flags 0x1 have unknown bits 0x1 (known: 0x100 times)");
    desc_req(b, 0x300);
    ck_assert_int_eq(moed_forward_desc_decode(b, 80, 4, 16, NULL, NULL, &r, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "FORWARD_DESC flags 0x300 have unknown bits 0x200 (known: 0x100 times)");
}
END_TEST

/* The 96-byte form: arena_bytes at 88; with an arena n_bufs is 0..15 (the
 * arena is buffer 0), without one (0 there) 1..16 as in the 88-byte form. */
START_TEST(test_chan_open_decode_arena)
{
    uint8_t b[97];
    struct moed_chan_open_req r;
    char err[256];
    chan_req(b, 2, 0);
    memset(b + 88, 0, 9);
    put32(b + 88, 0x1000);
    put32(b + 92, 0x2); /* arena_bytes 0x200001000 */
    ck_assert_int_eq(moed_chan_open_decode(b, 96, &r, err, sizeof err), 0);
    ck_assert_uint_eq(r.arena_bytes, 0x200001000ull);
    ck_assert_uint_eq(r.n_bufs, 2);
    ck_assert_uint_eq(r.buf_ids[1], 101);
    /* the same bytes as the 88-byte form: no arena */
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), 0);
    ck_assert_uint_eq(r.arena_bytes, 0);
    ck_assert_int_eq(moed_chan_open_decode(b, 97, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN payload is 97 bytes; expected 88 or 96");
    ck_assert_int_eq(moed_chan_open_decode(b, 95, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN payload is 95 bytes; expected 88 or 96");
    /* an arena alone */
    chan_req(b, 0, 0);
    put32(b + 88, 64);
    put32(b + 92, 0);
    ck_assert_int_eq(moed_chan_open_decode(b, 96, &r, err, sizeof err), 0);
    ck_assert_uint_eq(r.n_bufs, 0);
    ck_assert_uint_eq(r.arena_bytes, 64);
    /* without one, n_bufs 0 is refused as before */
    ck_assert_int_eq(moed_chan_open_decode(b, 88, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN n_bufs 0 is out of range [1, 16]");
    /* 15 ids and the arena fill the table; 16 do not fit */
    chan_req(b, 15, 0);
    put32(b + 88, 64);
    ck_assert_int_eq(moed_chan_open_decode(b, 96, &r, err, sizeof err), 0);
    chan_req(b, 16, 0);
    put32(b + 88, 64);
    ck_assert_int_eq(moed_chan_open_decode(b, 96, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_OPEN n_bufs 16 is out of range [0, 15] (with an arena, buffer 0 "
                          "is the arena)");
    put32(b + 88, 0); /* 16 ids and arena_bytes 0: no arena, fine */
    ck_assert_int_eq(moed_chan_open_decode(b, 96, &r, err, sizeof err), 0);
}
END_TEST

START_TEST(test_chan_close_decode)
{
    uint8_t b[9] = {0};
    struct moed_chan_close_req r;
    char err[256];
    put32(b, 7);
    ck_assert_int_eq(moed_chan_close_decode(b, 8, &r, err, sizeof err), 0);
    ck_assert_uint_eq(r.chan_id, 7);
    ck_assert_int_eq(moed_chan_close_decode(b, 7, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_CLOSE payload is 7 bytes; expected 8 (channel id, reserved 0)");
    ck_assert_int_eq(moed_chan_close_decode(b, 9, &r, err, sizeof err), MOED_E_INVAL);
    put32(b + 4, 2);
    ck_assert_int_eq(moed_chan_close_decode(b, 8, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "CHAN_CLOSE reserved is 2, not 0");
}
END_TEST

START_TEST(test_chan_open_reply)
{
    uint8_t b[112 + 5];
    struct moed_chan_open_rep in = {.chan_id = 3, .slots = 8, .key = 0x1122334455667788ull,
                                    .size = 960, .abi_version = 2, .kernel_bytes = 5,
                                    .arena_off = 4096, .arena_bytes = 0x10203}, out;
    for (int i = 0; i < 64; i++)
        in.handle[i] = (uint8_t)(i + 1);
    moed_chan_open_rep_encode(b, &in);
    memcpy(b + 112, "FATBN", 5);
    /* the layout by hand: chan_id, slots, key, handle, size, abi, kernel_bytes,
     * arena_off, arena_bytes */
    ck_assert_uint_eq(b[0], 3);
    ck_assert_uint_eq(b[4], 8);
    ck_assert_uint_eq(b[8], 0x88);
    ck_assert_uint_eq(b[15], 0x11);
    ck_assert_uint_eq(b[16], 1);
    ck_assert_uint_eq(b[79], 64);
    ck_assert_uint_eq(b[80], 960 & 0xff);
    ck_assert_uint_eq(b[81], 960 >> 8);
    ck_assert_uint_eq(b[88], 2);
    ck_assert_uint_eq(b[92], 5);
    ck_assert_uint_eq(b[96], 0);
    ck_assert_uint_eq(b[97], 4096 >> 8);
    ck_assert_uint_eq(b[104], 0x03);
    ck_assert_uint_eq(b[105], 0x02);
    ck_assert_uint_eq(b[106], 0x01);
    char err[256];
    ck_assert_int_eq(moed_chan_open_rep_decode(b, sizeof b, &out, err, sizeof err), 0);
    ck_assert_int_eq(memcmp(&in, &out, sizeof in), 0);
    ck_assert_int_eq(moed_chan_open_rep_decode(b, sizeof b - 1, &out, err, sizeof err),
                     MOED_E_PROTO);
    ck_assert_str_eq(err, "CHAN_OPEN reply is 116 bytes for kernel_bytes 5 (expected 112 + "
                          "kernel_bytes, kernel_bytes in [1, 16777216])");
    ck_assert_int_eq(moed_chan_open_rep_decode(b, 111, &out, err, sizeof err), MOED_E_PROTO);
    ck_assert_str_eq(err, "CHAN_OPEN reply is 111 bytes, shorter than its 112-byte head");
    /* the arena: 4096-aligned past the ring, or no arena at offset 0 */
    put32(b + 96, 4096 + 16);
    ck_assert_int_eq(moed_chan_open_rep_decode(b, sizeof b, &out, err, sizeof err),
                     MOED_E_PROTO);
    ck_assert_str_eq(err, "CHAN_OPEN reply: arena_off 4112 for arena_bytes 66051 (an arena lies "
                          "4096-aligned past the 960-byte channel; none has offset 0)");
    put32(b + 96, 0);
    ck_assert_int_eq(moed_chan_open_rep_decode(b, sizeof b, &out, err, sizeof err),
                     MOED_E_PROTO);
    memset(b + 104, 0, 8); /* no arena */
    ck_assert_int_eq(moed_chan_open_rep_decode(b, sizeof b, &out, err, sizeof err), 0);
    put32(b + 96, 4096); /* an offset without an arena */
    ck_assert_int_eq(moed_chan_open_rep_decode(b, sizeof b, &out, err, sizeof err),
                     MOED_E_PROTO);
    put32(b + 96, 0);
    put32(b + 92, 0); /* no kernel */
    ck_assert_int_eq(moed_chan_open_rep_decode(b, 112, &out, err, sizeof err), MOED_E_PROTO);
    put32(b + 92, 5);
    put32(b, 0); /* chan_id 0 */
    ck_assert_int_eq(moed_chan_open_rep_decode(b, sizeof b, &out, err, sizeof err),
                     MOED_E_PROTO);
    ck_assert_str_eq(err, "CHAN_OPEN reply: chan_id 0, slots 8, size 960 (each must be > 0)");
}
END_TEST

START_TEST(test_unaligned)
{
    uint8_t raw[64 + 1];
    uint8_t *b = raw + 1;
    moed_frame_encode(b, MOED_MSG_STATUS, 42, 0);
    struct moed_frame_hdr h;
    ck_assert_int_eq(moed_frame_parse(b, 32, 16, &h), MOED_PARSE_COMPLETE);
    ck_assert_uint_eq(h.request_id, 42);
}
END_TEST

static Suite *proto_suite(void)
{
    Suite *s = suite_create("proto");
    TCase *tc = tcase_create("frame");
    tcase_add_test(tc, test_parse_byte_at_a_time);
    tcase_add_test(tc, test_parse_header_errors);
    tcase_add_test(tc, test_encode_round_trip);
    tcase_add_test(tc, test_payload_len);
    tcase_add_test(tc, test_validate);
    tcase_add_test(tc, test_unaligned);
    tcase_add_test(tc, test_hello_parse);
    tcase_add_test(tc, test_chan_open_decode);
    tcase_add_test(tc, test_forward_desc_flags);
    tcase_add_test(tc, test_chan_open_decode_arena);
    tcase_add_test(tc, test_chan_close_decode);
    tcase_add_test(tc, test_chan_open_reply);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return moed_check_run(proto_suite());
}
