/* client_int.h - what the client library's files share (private to ipc/):
 * client.c (connection, I/O, HELLO, FORWARD, STATUS, PING) and
 * client_desc.c (version 2: registered buffers, FORWARD_DESC) and
 * client_chan.c (version 2: doorbell channels). */
#ifndef MOED_CLIENT_INT_H
#define MOED_CLIENT_INT_H

#include <stddef.h>
#include <stdint.h>

#include "moed_client.h"

struct moedc {
    int fd;
    int timeout_ms;          /* <= 0: no deadline */
    uint32_t spin_us;        /* moedc_set_spin_us (default MOEDC_DEFAULT_SPIN_US) */
    uint64_t spin_until_ns;  /* a read that finds nothing polls until then, not poll() */
    int broken;              /* a local failure happened; stream position lost */
    int have_hello;
    uint16_t version;        /* the version the daemon chose at HELLO */
    struct moed_hello_rep hello;
    uint32_t n_moe_layers;   /* from HELLO: the MoE layer ids (moed_hello_parse) */
    uint32_t moe_layers[MOED_PROTO_MAX_LAYERS];
    uint64_t next_id;        /* ids of the blocking calls */
    uint32_t inflight;       /* pipelined FORWARDs not yet answered */
    uint8_t *rbuf;           /* receive buffer (payload of the last reply) */
    size_t rcap;
    uint16_t *ybuf;          /* decoded y of the last pipelined reply (BE hosts) */
    size_t ycap;
};

/* Common entry checks of every call (blocking: no pipelined request out). */
int moedc__usable(struct moedc *c, int blocking, char *err, size_t errlen);
/* Send one request frame and read its reply (header in *h, payload in
 * c->rbuf); the daemon's ERROR comes back as its code. */
int moedc__call(struct moedc *c, uint16_t type, const void *payload, size_t len,
                struct moed_frame_hdr *h, char *err, size_t errlen);
/* Blocking-call checks, then HELLO first if needed; the daemon must have
 * chosen version 2 (else MOED_E_UNSUPPORTED: "<what> need 2"). */
int moedc__v2_ready(struct moedc *c, const char *what, char *err, size_t errlen);
/* A version-2 request whose payload is (id u32, u32 0) and whose reply is
 * empty (UNREGISTER_BUF, CHAN_CLOSE; `name` for the messages). */
int moedc__id_call(struct moedc *c, uint16_t type, uint32_t id, const char *what,
                   const char *name, char *err, size_t errlen);

#endif
