/* status_zc.c - /status and /metrics of the zero-copy path: registered
 * client buffers (PROTOCOL.md section 9) and doorbell channels (section
 * 10). Documented in docs/STATUS.md with the rest. */
#include "status_int.h"

#include <inttypes.h>

static int json_channel(cJSON *list, const struct moed_stats_chan *ch)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return -1;
    if (!cJSON_AddItemToArray(list, o)) {
        cJSON_Delete(o);
        return -1;
    }
    if (jnum(o, "id", ch->id) || jnum(o, "index", ch->index) || jnum(o, "buffers", ch->n_bufs) ||
        jnum(o, "arena_bytes", (double)ch->arena_bytes) ||
        !cJSON_AddBoolToObject(o, "draining", ch->draining != 0) ||
        !(ch->gpu < 0 ? cJSON_AddNullToObject(o, "peer_gpu")
                      : cJSON_AddNumberToObject(o, "peer_gpu", ch->gpu)) ||
        jnum(o, "requests", (double)ch->served) || jnum(o, "refused", (double)ch->refused) ||
        jnum(o, "kernel_seconds", (double)ch->kernel_ns / 1e9) ||
        jnum(o, "last_status_seq", (double)(ch->last >> 8)) ||
        jnum(o, "last_status_code", (double)(ch->last & 0xff)))
        return -1;
    return 0;
}

int moed_status_json_zero_copy(cJSON *root, const struct moed_stats *s)
{
    cJSON *zc = cJSON_AddObjectToObject(root, "registered_buffers");
    if (!zc || jnum(zc, "registered", (double)s->zc_registered) ||
        jnum(zc, "mappings", (double)s->zc_mappings) ||
        jnum(zc, "mapped_bytes", (double)s->zc_mapped_bytes) ||
        jnum(zc, "peer_mappings", (double)s->zc_peer_mappings) ||
        jnum(zc, "registers", (double)s->zc_registers) ||
        jnum(zc, "refused", (double)s->zc_refused) ||
        jnum(zc, "descriptor_requests", (double)s->zc_requests))
        return -1;
    cJSON *ch = cJSON_AddObjectToObject(root, "channels");
    if (!ch || jnum(ch, "open", (double)s->ch_open) ||
        jnum(ch, "draining", (double)s->ch_draining) ||
        jnum(ch, "arena_bytes", (double)s->ch_arena_bytes) ||
        jnum(ch, "opened", (double)s->ch_opens) || jnum(ch, "refused", (double)s->ch_refused) ||
        jnum(ch, "doorbell_requests", (double)s->db_served) ||
        jnum(ch, "doorbell_refused", (double)s->db_refused) ||
        jnum(ch, "doorbell_kernel_seconds", (double)s->db_kernel_ns / 1e9))
        return -1;
    cJSON *list = cJSON_AddArrayToObject(ch, "list");
    if (!list)
        return -1;
    for (uint32_t i = 0; i < s->n_chans && i < MOED_STATS_MAX_CHANS; i++)
        if (json_channel(list, &s->chans[i]))
            return -1;
    return 0;
}

void moed_status_prom_zero_copy(struct moed_sbuf *b, const struct moed_stats *s)
{
    prom_u64(b, "moed_registered_buffers", "gauge",
             "Client GPU buffers registered now (all connections).", s->zc_registered);
    prom_u64(b, "moed_registered_mappings", "gauge",
             "Client allocations mapped into the daemon now.", s->zc_mappings);
    prom_u64(b, "moed_registered_mapped_bytes", "gauge", "Bytes of those allocations.",
             s->zc_mapped_bytes);
    prom_u64(b, "moed_registered_peer_mappings", "gauge",
             "Of those, allocations on a peer GPU (read over NVLink).", s->zc_peer_mappings);
    prom_u64(b, "moed_registered_buffers_total", "counter",
             "REGISTER_BUF requests accepted since start.", s->zc_registers);
    prom_u64(b, "moed_registered_refused_total", "counter",
             "REGISTER_BUF and FORWARD_DESC requests refused by their checks.", s->zc_refused);
    prom_u64(b, "moed_descriptor_requests_total", "counter",
             "FORWARD_DESC requests taken since start.", s->zc_requests);
    prom_u64(b, "moed_channels_open", "gauge", "Doorbell channels open now (all connections).",
             s->ch_open);
    prom_u64(b, "moed_channels_draining", "gauge",
             "Doorbell channels closed that the kernel has not let go of yet.", s->ch_draining);
    prom_u64(b, "moed_channel_arena_bytes", "gauge",
             "Bytes of the daemon-owned arenas of the open and draining channels.",
             s->ch_arena_bytes);
    prom_u64(b, "moed_channel_opens_total", "counter", "CHAN_OPEN requests accepted since start.",
             s->ch_opens);
    prom_u64(b, "moed_channel_refused_total", "counter",
             "CHAN_OPEN requests refused since start.", s->ch_refused);
    prom_u64(b, "moed_doorbell_requests_total", "counter",
             "Doorbell descriptors served by the kernel since start (all channels).",
             s->db_served);
    prom_u64(b, "moed_doorbell_refused_total", "counter",
             "Doorbell descriptors the kernel answered with an error status since start.",
             s->db_refused);
    prom_dbl(b, "moed_doorbell_kernel_seconds_total", "counter",
             "Kernel seconds of the doorbell batches served since start.",
             (double)s->db_kernel_ns / 1e9);
}
