/* client_chan.c - the client library's doorbell channel calls
 * (moed_client.h; protocol version 2, PROTOCOL.md section 10): CHAN_OPEN
 * and CHAN_CLOSE over the socket. */
#include "client_int.h"
#include "moed_le.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

int moedc_chan_open(struct moedc *c, const uint32_t *buf_ids, uint32_t n, uint64_t arena_bytes,
                    const uint8_t uuid[16], struct moedc_chan_info *out, char *err,
                    size_t errlen)
{
    if ((!buf_ids && n) || !uuid || !out)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "moedc_chan_open: buf_ids (for n > 0), uuid and out are required");
    memset(out, 0, sizeof *out);
    /* with an arena it is buffer 0 and the ids follow it */
    const uint32_t lo = arena_bytes ? 0 : 1, hi = MOED_PROTO_CHAN_BUFS - (arena_bytes != 0);
    if (n < lo || n > hi)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "moedc_chan_open: %" PRIu32 " buffers; a channel names %" PRIu32
                           "..%" PRIu32 "%s",
                           n, lo, hi, arena_bytes ? " besides its arena" : "");
    int rc = moedc__v2_ready(c, "doorbell channels", err, errlen);
    if (rc)
        return rc;
    uint8_t p[sizeof(struct moed_chan_open_req)] = {0};
    memcpy(p, uuid, MOED_PROTO_UUID_BYTES);
    le_put32(p + 16, n);
    le_put32(p + 20, 0);
    for (uint32_t i = 0; i < n; i++)
        le_put32(p + 24 + 4 * i, buf_ids[i]);
    le_put64(p + 88, arena_bytes);
    struct moed_frame_hdr h;
    /* without an arena the 88-byte form, which every version-2 daemon reads */
    rc = moedc__call(c, MOED_MSG_CHAN_OPEN, p, arena_bytes ? sizeof p : MOED_PROTO_CHAN_OPEN_SHORT,
                     &h, err, errlen);
    if (rc)
        return rc;
    struct moed_chan_open_rep rep;
    rc = moed_chan_open_rep_decode(c->rbuf, h.payload_len, &rep, err, errlen);
    if (rc == 0 && rep.arena_bytes != arena_bytes)
        rc = moed_seterr(err, errlen, MOED_E_PROTO,
                         "CHAN_OPEN reply: an arena of %" PRIu64 " bytes for the %" PRIu64
                         " asked",
                         rep.arena_bytes, arena_bytes);
    if (rc) {
        /* the daemon holds a channel this call cannot name: the connection
         * goes, and the channel with it */
        c->broken = 1;
        return rc;
    }
    void *kernel = malloc(rep.kernel_bytes);
    if (!kernel) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_NOMEM,
                           "cannot allocate the %" PRIu32 "-byte client kernel", rep.kernel_bytes);
    }
    memcpy(kernel, c->rbuf + sizeof rep, rep.kernel_bytes);
    *out = (struct moedc_chan_info){.chan_id = rep.chan_id, .slots = rep.slots, .key = rep.key,
                                    .size = rep.size, .abi_version = rep.abi_version,
                                    .arena_off = rep.arena_off, .arena_bytes = rep.arena_bytes,
                                    .kernel = kernel, .kernel_bytes = rep.kernel_bytes};
    memcpy(out->handle, rep.handle, sizeof out->handle);
    return 0;
}

int moedc_chan_close(struct moedc *c, uint32_t chan_id, char *err, size_t errlen)
{
    return moedc__id_call(c, MOED_MSG_CHAN_CLOSE, chan_id, "doorbell channels", "CHAN_CLOSE",
                          err, errlen);
}

void moedc_chan_info_free(struct moedc_chan_info *info)
{
    if (!info)
        return;
    free(info->kernel);
    info->kernel = NULL;
    info->kernel_bytes = 0;
}
