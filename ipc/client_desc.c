/* client_desc.c - the client library's version-2 calls (moed_client.h):
 * REGISTER_BUF, UNREGISTER_BUF and FORWARD_DESC. */
#include "client_int.h"
#include "moed_le.h"
#include "moed_util.h"

#include <inttypes.h>
#include <string.h>

int moedc__v2_ready(struct moedc *c, const char *what, char *err, size_t errlen)
{
    int rc = moedc__usable(c, 1, err, errlen);
    if (rc)
        return rc;
    if (!c->have_hello) {
        struct moed_hello_rep rep;
        rc = moedc_hello(c, &rep, err, errlen);
        if (rc)
            return rc;
    }
    if (c->version < 2)
        return moed_seterr(err, errlen, MOED_E_UNSUPPORTED,
                           "the daemon speaks protocol version %u; %s need 2",
                           (unsigned)c->version, what);
    return 0;
}

int moedc_register_buf(struct moedc *c, const uint8_t handle[64], uint64_t offset, uint64_t size,
                       const uint8_t uuid[16], uint32_t *buf_id, char *err, size_t errlen)
{
    int rc = moedc__v2_ready(c, "registered buffers", err, errlen);
    if (rc)
        return rc;
    uint8_t p[sizeof(struct moed_register_req)];
    memcpy(p, handle, MOED_PROTO_IPC_HANDLE_BYTES);
    le_put64(p + 64, offset);
    le_put64(p + 72, size);
    memcpy(p + 80, uuid, MOED_PROTO_UUID_BYTES);
    struct moed_frame_hdr h;
    rc = moedc__call(c, MOED_MSG_REGISTER_BUF, p, sizeof p, &h, err, errlen);
    if (rc)
        return rc;
    if (h.payload_len != sizeof(struct moed_register_rep)) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "REGISTER_BUF reply is %" PRIu64 " bytes, expected %zu", h.payload_len,
                           sizeof(struct moed_register_rep));
    }
    *buf_id = le_get32(c->rbuf);
    return 0;
}

int moedc__id_call(struct moedc *c, uint16_t type, uint32_t id, const char *what,
                   const char *name, char *err, size_t errlen)
{
    int rc = moedc__v2_ready(c, what, err, errlen);
    if (rc)
        return rc;
    uint8_t p[8];
    le_put32(p, id);
    le_put32(p + 4, 0);
    struct moed_frame_hdr h;
    rc = moedc__call(c, type, p, sizeof p, &h, err, errlen);
    if (rc == 0 && h.payload_len != 0) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO, "%s reply is not empty", name);
    }
    return rc;
}

int moedc_unregister_buf(struct moedc *c, uint32_t buf_id, char *err, size_t errlen)
{
    return moedc__id_call(c, MOED_MSG_UNREGISTER_BUF, buf_id, "registered buffers",
                          "UNREGISTER_BUF", err, errlen);
}

static void put_ref(uint8_t *p, const struct moedc_bufref *r)
{
    le_put32(p, r->buf_id);
    le_put32(p + 4, 0);
    le_put64(p + 8, r->offset);
}

/* FORWARD_DESC; with times (not NULL) flag 0x100 and the reply's times. */
static int forward_desc(struct moedc *c, uint32_t layer, uint32_t n_tokens, uint32_t top_k,
                        const struct moedc_bufref *x, const struct moedc_bufref *ids,
                        const struct moedc_bufref *w, const struct moedc_bufref *y,
                        struct moedc_desc_times *times, char *err, size_t errlen)
{
    if (!x || !ids || !w || !y)
        return moed_seterr(err, errlen, MOED_E_INVAL, "moedc_forward_desc: a NULL buffer ref");
    int rc = moedc__v2_ready(c, "registered buffers", err, errlen);
    if (rc)
        return rc;
    uint8_t p[sizeof(struct moed_forward_desc_req)];
    le_put32(p, layer);
    le_put32(p + 4, n_tokens);
    le_put32(p + 8, top_k);
    le_put32(p + 12, times ? MOED_FORWARD_DESC_TIMES : 0);
    put_ref(p + 16, x);
    put_ref(p + 32, ids);
    put_ref(p + 48, w);
    put_ref(p + 64, y);
    struct moed_frame_hdr h;
    c->spin_until_ns = c->spin_us ? moed_mono_ns() + (uint64_t)c->spin_us * 1000 : 0;
    rc = moedc__call(c, MOED_MSG_FORWARD_DESC, p, sizeof p, &h, err, errlen);
    c->spin_until_ns = 0;
    if (rc)
        return rc;
    const size_t want = times ? sizeof(struct moed_forward_desc_times_rep)
                              : sizeof(struct moed_forward_rep);
    if (h.payload_len != want || le_get32(c->rbuf) != n_tokens) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "FORWARD_DESC reply is %" PRIu64 " bytes for T=%u (expected %zu, T "
                           "echoed)",
                           h.payload_len, n_tokens, want);
    }
    if (times) {
        times->kernel_ns = le_get64(c->rbuf + 8);
        times->daemon_ns = le_get64(c->rbuf + 16);
        times->rx_ns = le_get64(c->rbuf + 24);
        times->queued_ns = le_get64(c->rbuf + 32);
    }
    return 0;
}

int moedc_forward_desc(struct moedc *c, uint32_t layer, uint32_t n_tokens, uint32_t top_k,
                       const struct moedc_bufref *x, const struct moedc_bufref *ids,
                       const struct moedc_bufref *w, const struct moedc_bufref *y, char *err,
                       size_t errlen)
{
    return forward_desc(c, layer, n_tokens, top_k, x, ids, w, y, NULL, err, errlen);
}

int moedc_forward_desc_times(struct moedc *c, uint32_t layer, uint32_t n_tokens,
                             uint32_t top_k, const struct moedc_bufref *x,
                             const struct moedc_bufref *ids, const struct moedc_bufref *w,
                             const struct moedc_bufref *y, struct moedc_desc_times *times,
                             char *err, size_t errlen)
{
    if (!times)
        return moed_seterr(err, errlen, MOED_E_INVAL, "moedc_forward_desc_times: times is NULL");
    return forward_desc(c, layer, n_tokens, top_k, x, ids, w, y, times, err, errlen);
}
