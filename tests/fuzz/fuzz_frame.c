/* fuzz_frame.c - libFuzzer target over the wire parser (moed_frame_parse),
 * FORWARD validation (moed_forward_validate) and the version-2 payload
 * decoders (registration, FORWARD_DESC, channels), the functions that see
 * untrusted bytes from every client (and, for the CHAN_OPEN reply, from the
 * daemon).
 *
 * Input layout: byte 0 picks the model limits used for validation, the rest
 * is a byte stream fed to the parser the way the server does: frame after
 * frame, each complete frame's payload also validated as a FORWARD. Besides
 * the sanitizers, the target checks the parser's own contract (a result is
 * COMPLETE, NEED_MORE or one of its four codes; COMPLETE means the frame fits
 * in the bytes given; a frame that parses re-encodes to the same header).
 *
 *   make fuzz && build/fuzz/fuzz_frame -max_total_time=60
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moed_err.h"
#include "moed_proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int odd_layers(const void *ctx, uint32_t layer)
{
    (void)ctx;
    return layer & 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    /* Small model dims so that random inputs reach the id checks. */
    static const struct {
        uint32_t hidden, n_experts, top_k, max_tokens;
        uint64_t max_payload;
    } limits[4] = {
        {1, 4, 1, 8, 256},
        {2, 8, 2, 4, 4096},
        {4, 3, 2, 16, 1u << 20},
        {0, 1, 0, 1, UINT64_MAX},
    };
    const uint8_t sel = data[0] & 3;
    const uint8_t *p = data + 1;
    size_t left = size - 1;
    char err[MOED_ERRLEN];

    while (left > 0) {
        struct moed_frame_hdr h;
        int rc = moed_frame_parse(p, left, limits[sel].max_payload, &h);
        if (rc == MOED_PARSE_NEED_MORE)
            break;
        if (rc != MOED_PARSE_COMPLETE) {
            if (rc != MOED_E_PROTO && rc != MOED_E_VERSION && rc != MOED_E_TYPE &&
                rc != MOED_E_TOOBIG)
                abort();
            /* A type error leaves a trustworthy length: skip the frame, as
             * the server does; every other error ends the stream. */
            if (rc != MOED_E_TYPE || left - MOED_PROTO_HDR_SIZE < h.payload_len)
                break;
            p += MOED_PROTO_HDR_SIZE + h.payload_len;
            left -= MOED_PROTO_HDR_SIZE + h.payload_len;
            continue;
        }
        if (h.payload_len > left - MOED_PROTO_HDR_SIZE)
            abort();
        uint8_t re[MOED_PROTO_HDR_SIZE];
        moed_frame_encode(re, h.type, h.request_id, h.payload_len);
        /* the encoder writes the type's own version (1, or 2 for 16..31);
         * the parser accepts either for any type */
        if (memcmp(re, p, 4) != 0 || memcmp(re + 6, p + 6, MOED_PROTO_HDR_SIZE - 6) != 0 ||
            (h.version != 1 && h.version != 2) ||
            re[4] != (uint8_t)moed_type_min_version(h.type))
            abort();
        /* Copy the payload so that ASan sees reads past its end. */
        size_t n = (size_t)h.payload_len;
        uint8_t *payload = malloc(n ? n : 1);
        if (!payload)
            return 0;
        memcpy(payload, p + MOED_PROTO_HDR_SIZE, n);
        struct moed_forward_req req;
        err[0] = 0;
        rc = moed_forward_validate(payload, n, limits[sel].hidden, limits[sel].n_experts,
                                   limits[sel].top_k, limits[sel].max_tokens,
                                   sel & 1 ? odd_layers : NULL, NULL, &req, err, sizeof err);
        if (rc != 0 && (rc != MOED_E_INVAL || err[0] == 0))
            abort();
        /* T = 0 is a valid FORWARD (protocol v2: an empty [0, H] result) */
        if (rc == 0 && (n != moed_forward_payload_len(req.n_tokens, limits[sel].hidden,
                                                       req.top_k) ||
                        req.n_tokens > limits[sel].max_tokens))
            abort();
        /* the version-2 decoders on the same bytes */
        struct moed_register_req rr;
        err[0] = 0;
        rc = moed_register_decode(payload, n, &rr, err, sizeof err);
        if (rc != 0 && ((rc != MOED_E_INVAL && rc != MOED_E_RANGE) || err[0] == 0))
            abort();
        if (rc == 0 && (rr.size == 0 || rr.offset % 16 != 0 || rr.size > UINT64_MAX - rr.offset))
            abort();
        struct moed_forward_desc_req dr;
        err[0] = 0;
        rc = moed_forward_desc_decode(payload, n, limits[sel].top_k, limits[sel].max_tokens,
                                      sel & 1 ? odd_layers : NULL, NULL, &dr, err, sizeof err);
        if (rc != 0 && (rc != MOED_E_INVAL || err[0] == 0))
            abort();
        if (rc == 0 && (dr.head.n_tokens < 1 || dr.head.n_tokens > limits[sel].max_tokens ||
                        dr.x.offset % 16 || dr.y.offset % 16 || dr.ids.offset % 4 ||
                        dr.w.offset % 4 || !dr.x.buf_id || !dr.y.buf_id))
            abort();
        /* the channel decoders on the same bytes: the daemon's two and the
         * client's reply decoder */
        struct moed_chan_open_req co;
        err[0] = 0;
        rc = moed_chan_open_decode(payload, n, &co, err, sizeof err);
        if (rc != 0 && (rc != MOED_E_INVAL || err[0] == 0))
            abort();
        if (rc == 0) {
            /* with an arena (only in the 96-byte form) 0..15 ids, else 1..16 */
            uint32_t lo = co.arena_bytes ? 0 : 1, hi = MOED_PROTO_CHAN_BUFS - !!co.arena_bytes;
            if ((n != sizeof co && n != MOED_PROTO_CHAN_OPEN_SHORT) ||
                (n == MOED_PROTO_CHAN_OPEN_SHORT && co.arena_bytes) || co.flags ||
                co.n_bufs < lo || co.n_bufs > hi)
                abort();
            for (uint32_t i = 0; i < MOED_PROTO_CHAN_BUFS; i++)
                if ((i < co.n_bufs) != (co.buf_ids[i] != 0))
                    abort();
        }
        struct moed_chan_close_req cc;
        err[0] = 0;
        rc = moed_chan_close_decode(payload, n, &cc, err, sizeof err);
        if (rc != 0 && (rc != MOED_E_INVAL || err[0] == 0))
            abort();
        if (rc == 0 && (n != sizeof cc || cc.reserved))
            abort();
        struct moed_chan_open_rep cr;
        err[0] = 0;
        rc = moed_chan_open_rep_decode(payload, n, &cr, err, sizeof err);
        if (rc != 0 && (rc != MOED_E_PROTO || err[0] == 0))
            abort();
        if (rc == 0) {
            if (n != sizeof cr + cr.kernel_bytes || !cr.chan_id || !cr.slots || !cr.size ||
                (cr.arena_bytes ? cr.arena_off < cr.size || cr.arena_off % 4096
                                : cr.arena_off != 0))
                abort();
            uint8_t re2[sizeof cr];
            moed_chan_open_rep_encode(re2, &cr);
            if (memcmp(re2, payload, sizeof cr) != 0)
                abort();
        }
        free(payload);
        p += MOED_PROTO_HDR_SIZE + n;
        left -= MOED_PROTO_HDR_SIZE + n;
    }
    return 0;
}
