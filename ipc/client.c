/* client.c - the moed C client library (moed_client.h).
 *
 * Blocking Unix-socket I/O with poll() deadlines. Every read and write loops
 * over partial transfers and EINTR; every reply length is checked against
 * what that reply type may carry before a byte of its payload is read, so a
 * broken or hostile daemon gets an error, never an oversized allocation or a
 * buffer overrun. The stream position is lost after any local failure, so the
 * connection is then marked broken (see moed_client.h).
 */
#include "moed_client.h"
#include "client_int.h"
#include "moed_le.h"
#include "moed_util.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#define MOEDC_BIG_ENDIAN 1
#endif

/* Kernel send buffer asked for at connect (SO_SNDBUF). An AF_UNIX stream
 * socket charges the bytes in flight to the sender's send buffer, and the
 * default (~208 KiB) is smaller than one T=64, H=2048 FORWARD request
 * (256 KiB of x): the write would stop half-way until the daemon has read
 * the first part, a wake-up of each side per request. The kernel caps this at
 * net.core.wmem_max; a failure leaves the default (it only costs speed). */
#define MOEDC_SNDBUF_BYTES (1 << 20)

/* After a failed write, how long to wait for the daemon's ERROR frame that
 * says why it closed (it is normally in the receive queue already). */
#define PENDING_ERROR_WAIT_MS 100

/* Sanity caps on a HELLO reply (far above any real model). */
#define MOEDC_MAX_HIDDEN (1u << 20)
#define MOEDC_MAX_TOKENS (1u << 24)


static int64_t now_ms(void) { return (int64_t)(moed_mono_ns() / 1000000u); }

/* Mark the connection broken (the stream position is lost) and set err. */
static int fail(struct moedc *c, int code, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static int fail(struct moedc *c, int code, char *err, size_t errlen, const char *fmt, ...)
{
    c->broken = 1;
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* Wait until fd is ready for `events` or the deadline (<0: none) passes. */
static int wait_fd(struct moedc *c, short events, int64_t deadline, char *err, size_t errlen)
{
    for (;;) {
        int ms = -1;
        if (deadline >= 0) {
            int64_t left = deadline - now_ms();
            if (left <= 0)
                return fail(c, MOED_E_TIMEOUT, err, errlen,
                            "no reply from the daemon within %d ms", c->timeout_ms);
            ms = left > 0x7fffffff ? 0x7fffffff : (int)left;
        }
        struct pollfd p = {.fd = c->fd, .events = events};
        int r = poll(&p, 1, ms);
        if (r > 0)
            return 0;
        if (r < 0 && errno != EINTR)
            return fail(c, MOED_E_CONN, err, errlen, "poll on the daemon socket: %s",
                        strerror(errno));
    }
}

static int64_t deadline_of(const struct moedc *c)
{
    return c->timeout_ms > 0 ? now_ms() + c->timeout_ms : -1;
}

static int read_frame(struct moedc *c, int64_t deadline, struct moed_frame_hdr *h, char *err,
                      size_t errlen);

/* A write failed with EPIPE or ECONNRESET: the daemon closed the connection,
 * usually after an ERROR saying why (busy, peer not allowed, a framing
 * error). That frame may still be unread in our receive queue: report it
 * rather than the bare write error. */
static int write_failed(struct moedc *c, int e, char *err, size_t errlen)
{
    if (e == EPIPE || e == ECONNRESET) {
        struct moed_frame_hdr h;
        char msg[MOED_ERRLEN];
        memset(&h, 0, sizeof h);
        int rc = read_frame(c, now_ms() + PENDING_ERROR_WAIT_MS, &h, msg, sizeof msg);
        if (rc < 0 && h.type == (MOED_MSG_ERROR | MOED_PROTO_REPLY))
            return fail(c, rc, err, errlen, "%s", msg);
    }
    return fail(c, MOED_E_CONN, err, errlen, "write to the daemon: %s", strerror(e));
}

/* Write every byte of the iovecs (modified in place). */
static int write_all(struct moedc *c, struct iovec *iov, int n, int64_t deadline, char *err,
                     size_t errlen)
{
    while (n > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        /* MSG_NOSIGNAL: a daemon that went away is an error, not a SIGPIPE. */
        ssize_t w = sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int rc = wait_fd(c, POLLOUT, deadline, err, errlen);
                if (rc)
                    return rc;
                continue;
            }
            return write_failed(c, errno, err, errlen);
        }
        size_t left = (size_t)w;
        while (n > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

static int read_all(struct moedc *c, uint8_t *buf, size_t len, int64_t deadline, char *err,
                    size_t errlen)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = recv(c->fd, buf + got, len - got, MSG_DONTWAIT);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0)
            return fail(c, MOED_E_CONN, err, errlen, "the daemon closed the connection%s",
                        got ? " in the middle of a reply" : "");
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (c->spin_until_ns && moed_mono_ns() < c->spin_until_ns &&
                (deadline < 0 || now_ms() < deadline))
                continue; /* moedc_set_spin_us: poll without sleeping a while */
            int rc = wait_fd(c, POLLIN, deadline, err, errlen);
            if (rc)
                return rc;
            continue;
        }
        return fail(c, MOED_E_CONN, err, errlen, "read from the daemon: %s", strerror(errno));
    }
    return 0;
}

static int reserve(struct moedc *c, size_t n, char *err, size_t errlen)
{
    if (n <= c->rcap)
        return 0;
    size_t cap = c->rcap ? c->rcap : 4096;
    while (cap < n)
        cap = cap > SIZE_MAX / 2 ? n : cap * 2;
    uint8_t *p = realloc(c->rbuf, cap);
    if (!p)
        return fail(c, MOED_E_NOMEM, err, errlen, "cannot allocate a %zu-byte receive buffer", cap);
    c->rbuf = p;
    c->rcap = cap;
    return 0;
}

/* Largest payload a reply of this type may have; UINT64_MAX marks a type
 * the client never expects (an error). */
static uint64_t reply_bound(const struct moedc *c, uint16_t type)
{
    switch (type) {
    case MOED_MSG_REGISTER_BUF | MOED_PROTO_REPLY:
        return 8;
    case MOED_MSG_FORWARD_DESC | MOED_PROTO_REPLY: /* with times, 24 */
        return sizeof(struct moed_forward_desc_times_rep);
    case MOED_MSG_UNREGISTER_BUF | MOED_PROTO_REPLY:
    case MOED_MSG_CHAN_CLOSE | MOED_PROTO_REPLY:
        return 0;
    case MOED_MSG_CHAN_OPEN | MOED_PROTO_REPLY:
        return sizeof(struct moed_chan_open_rep) + MOED_PROTO_MAX_CHAN_KERNEL;
    case MOED_MSG_HELLO | MOED_PROTO_REPLY:
        return MOED_HELLO_V1_BYTES + 4 + 4 * MOED_PROTO_MAX_LAYERS;
    case MOED_MSG_FORWARD | MOED_PROTO_REPLY:
        if (!c->have_hello)
            return UINT64_MAX;
        return sizeof(struct moed_forward_rep) +
               2ull * c->hello.max_tokens * (uint64_t)c->hello.hidden;
    case MOED_MSG_STATUS | MOED_PROTO_REPLY:
        return MOEDC_MAX_STATUS_BYTES;
    case MOED_MSG_PING | MOED_PROTO_REPLY:
        return MOED_PROTO_MAX_PING;
    case MOED_MSG_ERROR | MOED_PROTO_REPLY:
        return sizeof(struct moed_error_rep) + MOED_PROTO_MAX_ERRMSG;
    default:
        return UINT64_MAX;
    }
}

/* Read one reply frame: header checked, payload bounded by its type, then
 * read into c->rbuf. An ERROR reply is decoded here (message into err). */
static int read_frame(struct moedc *c, int64_t deadline, struct moed_frame_hdr *h, char *err,
                      size_t errlen)
{
    uint8_t hb[MOED_PROTO_HDR_SIZE];
    int rc = read_all(c, hb, sizeof hb, deadline, err, errlen);
    if (rc)
        return rc;
    rc = moed_frame_parse(hb, sizeof hb, UINT64_MAX, h);
    if (rc < 0) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "malformed reply header from the daemon (%s: magic 0x%08" PRIx32
                           " version %u type 0x%04x)",
                           moed_strerror(rc), h->magic, (unsigned)h->version, (unsigned)h->type);
    }
    uint64_t bound = reply_bound(c, h->type);
    if (!(h->type & MOED_PROTO_REPLY) || bound == UINT64_MAX) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "unexpected frame type 0x%04x from the daemon", (unsigned)h->type);
    }
    if (h->payload_len > bound) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "reply type 0x%04x has a %" PRIu64 "-byte payload, over its bound %"
                           PRIu64, (unsigned)h->type, h->payload_len, bound);
    }
    rc = reserve(c, (size_t)h->payload_len + 1, err, errlen);
    if (rc)
        return rc;
    rc = read_all(c, c->rbuf, (size_t)h->payload_len, deadline, err, errlen);
    if (rc)
        return rc;
    if (h->type == (MOED_MSG_ERROR | MOED_PROTO_REPLY)) {
        if (h->payload_len < sizeof(struct moed_error_rep)) {
            c->broken = 1;
            return moed_seterr(err, errlen, MOED_E_PROTO,
                               "ERROR reply of %" PRIu64 " bytes, shorter than its 8-byte head",
                               h->payload_len);
        }
        int32_t code = (int32_t)le_get32(c->rbuf);
        uint32_t mlen = le_get32(c->rbuf + 4);
        if (mlen != h->payload_len - sizeof(struct moed_error_rep)) {
            c->broken = 1;
            return moed_seterr(err, errlen, MOED_E_PROTO,
                               "ERROR reply says msg_len %" PRIu32 " but carries %" PRIu64
                               " bytes", mlen, h->payload_len - sizeof(struct moed_error_rep));
        }
        /* A well-formed error must carry a negative code; anything else
         * would read as success to the caller. */
        if (code >= 0)
            code = MOED_E_PROTO;
        if (err && errlen) {
            size_t n = mlen < errlen - 1 ? mlen : errlen - 1;
            memcpy(err, c->rbuf + 8, n);
            err[n] = 0;
            if (n == 0)
                moed_seterr(err, errlen, code, "%s", moed_strerror(code));
        }
        return code;
    }
    return 0;
}

static int send_frame(struct moedc *c, uint16_t type, uint64_t id, const void *payload,
                      size_t len, int64_t deadline, char *err, size_t errlen)
{
    uint8_t hb[MOED_PROTO_HDR_SIZE];
    moed_frame_encode(hb, type, id, len);
    struct iovec iov[2] = {{hb, sizeof hb}, {(void *)payload, len}};
    return write_all(c, iov, len ? 2 : 1, deadline, err, errlen);
}

/* Common entry checks of every call. */
int moedc__usable(struct moedc *c, int blocking, char *err, size_t errlen)
{
    if (!c)
        return moed_seterr(err, errlen, MOED_E_INVAL, "connection is NULL");
    if (c->broken)
        return moed_seterr(err, errlen, MOED_E_CONN,
                           "connection is unusable after an earlier failure; reconnect");
    if (blocking && c->inflight)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "%" PRIu32 " pipelined requests are outstanding; moedc_recv them first",
                           c->inflight);
    return 0;
}

/* Send a request and wait for its reply (matching id). */
int moedc__call(struct moedc *c, uint16_t type, const void *payload, size_t len,
                struct moed_frame_hdr *h, char *err, size_t errlen)
{
    int64_t deadline = deadline_of(c);
    uint64_t id = ++c->next_id;
    int rc = send_frame(c, type, id, payload, len, deadline, err, errlen);
    if (rc)
        return rc;
    rc = read_frame(c, deadline, h, err, errlen);
    if (rc && c->broken)
        return rc;
    /* An error frame about the connection (id 0) or about this request. */
    if (h->request_id != id && !(rc < 0 && h->request_id == 0)) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "reply carries request id %" PRIu64 ", expected %" PRIu64,
                           h->request_id, id);
    }
    if (rc)
        return rc;
    if (h->type != (type | MOED_PROTO_REPLY)) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "reply type 0x%04x does not answer request type 0x%04x",
                           (unsigned)h->type, (unsigned)type);
    }
    return 0;
}

void moedc_set_spin_us(struct moedc *c, uint32_t us)
{
    if (c)
        c->spin_us = us;
}

int moedc_connect(const char *path, int timeout_ms, struct moedc **out, char *err, size_t errlen)
{
    int rc = 0;
    struct moedc *c = NULL;
    if (!path || !out)
        return moed_seterr(err, errlen, MOED_E_INVAL, "moedc_connect: path and out are required");
    *out = NULL;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "socket path '%s' is %zu bytes, over the %zu-byte limit", path,
                           strlen(path), sizeof sa.sun_path - 1);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    c = calloc(1, sizeof *c);
    if (!c)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "cannot allocate a connection");
    c->timeout_ms = timeout_ms;
    c->spin_us = MOEDC_DEFAULT_SPIN_US;
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (c->fd < 0) {
        rc = moed_seterr(err, errlen, MOED_E_CONN, "socket: %s", strerror(errno));
        goto free_c;
    }
    int sndbuf = MOEDC_SNDBUF_BYTES;
    (void)setsockopt(c->fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    /* A non-blocking AF_UNIX connect completes at once, or fails with
     * EAGAIN when the listener's backlog is full: that is a failure, not
     * "in progress" (the socket stays unconnected yet polls writable), so
     * retry until the deadline. EINPROGRESS is waited for with poll. */
    int64_t deadline = deadline_of(c);
    int cr;
    while ((cr = connect(c->fd, (struct sockaddr *)&sa, sizeof sa)) < 0 &&
           (errno == EINTR || errno == EAGAIN)) {
        if (errno == EAGAIN) {
            if (deadline >= 0 && now_ms() >= deadline) {
                rc = moed_seterr(err, errlen, MOED_E_TIMEOUT,
                                 "connect to %s: listener busy (backlog full) for %d ms", path,
                                 timeout_ms);
                goto close_fd;
            }
            usleep(1000);
        }
    }
    if (cr < 0) {
        if (errno != EINPROGRESS) {
            rc = moed_seterr(err, errlen, MOED_E_CONN, "connect to %s: %s", path,
                             strerror(errno));
            goto close_fd;
        }
        rc = wait_fd(c, POLLOUT, deadline, err, errlen);
        if (rc) {
            moed_seterr(err, errlen, rc, "connect to %s: timed out after %d ms", path,
                        timeout_ms);
            goto close_fd;
        }
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0 || soerr) {
            rc = moed_seterr(err, errlen, MOED_E_CONN, "connect to %s: %s", path,
                             strerror(soerr ? soerr : errno));
            goto close_fd;
        }
    }
    *out = c;
    return 0;

close_fd:
    close(c->fd);
free_c:
    free(c);
    return rc;
}

void moedc_close(struct moedc *c)
{
    if (!c)
        return;
    if (c->fd >= 0)
        close(c->fd);
    free(c->rbuf);
    free(c->ybuf);
    free(c);
}

const char *moedc_strerror(int code)
{
    return moed_strerror(code);
}

uint32_t moedc_inflight(const struct moedc *c)
{
    return c ? c->inflight : 0;
}

int moedc_hello(struct moedc *c, struct moed_hello_rep *rep, char *err, size_t errlen)
{
    int rc = moedc__usable(c, 1, err, errlen);
    if (rc)
        return rc;
    uint8_t p[sizeof(struct moed_hello_req)] = {0};
    le_put16(p, MOED_PROTO_MIN_VERSION);
    le_put16(p + 2, MOED_PROTO_VERSION);
    struct moed_frame_hdr h;
    rc = moedc__call(c, MOED_MSG_HELLO, p, sizeof p, &h, err, errlen);
    if (rc)
        return rc;
    struct moed_hello_rep r;
    rc = moed_hello_parse(c->rbuf, h.payload_len, &r, c->moe_layers, &c->n_moe_layers, err,
                          errlen);
    if (rc) {
        c->broken = 1;
        return rc;
    }
    c->version = r.version;
    /* The reply bounds of FORWARD derive from these; refuse absurd values so
     * that arithmetic on them stays far from overflow. */
    if (r.hidden < 1 || r.hidden > MOEDC_MAX_HIDDEN || r.max_tokens < 1 ||
        r.max_tokens > MOEDC_MAX_TOKENS || r.top_k < 1 || r.top_k > r.n_experts) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "HELLO reply has implausible dims: hidden %" PRIu32 ", max_tokens %"
                           PRIu32 ", top_k %" PRIu32 ", n_experts %" PRIu32,
                           r.hidden, r.max_tokens, r.top_k, r.n_experts);
    }
    c->hello = r;
    c->have_hello = 1;
    if (rep)
        *rep = r;
    return 0;
}

/* Check a FORWARD request's shape against HELLO and the local limits before
 * anything is sent (the daemon checks it again; this only gives an early and
 * clear message and keeps our size arithmetic in range). */
static int forward_precheck(struct moedc *c, uint32_t n_tokens, uint32_t top_k, const void *x,
                            const void *ids, const void *w, uint32_t flags, uint64_t *plen,
                            char *err, size_t errlen)
{
    if (!c->have_hello) {
        int rc = moedc_hello(c, NULL, err, errlen);
        if (rc)
            return rc;
    }
    if (n_tokens > 0 && (!x || !ids || !w))
        return moed_seterr(err, errlen, MOED_E_INVAL, "forward: x, ids and w are required");
    if (n_tokens > c->hello.max_tokens)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "n_tokens %" PRIu32 " is out of range [0, %" PRIu32 "]", n_tokens,
                           c->hello.max_tokens);
    if (flags & ~MOED_FORWARD_FLAGS_KNOWN)
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "forward flags 0x%" PRIx32 " has unknown bits 0x%" PRIx32, flags,
                           flags & ~MOED_FORWARD_FLAGS_KNOWN);
    if (n_tokens == 0 && c->hello.version < 2)
        return moed_seterr(err, errlen, MOED_E_VERSION,
                           "n_tokens 0 needs protocol version 2; the daemon speaks version %u",
                           (unsigned)c->hello.version);
    if (flags && c->hello.version < 2)
        return moed_seterr(err, errlen, MOED_E_VERSION,
                           "forward flags 0x%" PRIx32 " need protocol version 2; the daemon "
                           "speaks version %u", flags, (unsigned)c->hello.version);
    uint64_t n = moed_forward_payload_len(n_tokens, c->hello.hidden, top_k);
    if (n == 0 || n > c->hello.max_frame_bytes || n > SIZE_MAX)
        return moed_seterr(err, errlen, MOED_E_TOOBIG,
                           "FORWARD payload of T=%" PRIu32 ", H=%" PRIu32 ", k=%" PRIu32
                           " is over the daemon's max frame %" PRIu64 " bytes",
                           n_tokens, c->hello.hidden, top_k, c->hello.max_frame_bytes);
    *plen = n;
    return 0;
}

#ifdef MOEDC_BIG_ENDIAN
/* Byte-swap into a little-endian copy (big-endian hosts only). */
static void *le_copy(const void *src, size_t n_elems, size_t elem)
{
    uint8_t *d = malloc(n_elems ? n_elems * elem : 1); /* T = 0: nothing, but not NULL */
    const uint8_t *s = src;
    if (!d)
        return NULL;
    for (size_t i = 0; i < n_elems; i++)
        for (size_t b = 0; b < elem; b++)
            d[i * elem + b] = s[i * elem + elem - 1 - b];
    return d;
}
#endif

static int send_forward(struct moedc *c, uint64_t id, uint32_t layer, uint32_t n_tokens,
                        uint32_t top_k, const uint16_t *x, const int32_t *ids, const float *w,
                        uint32_t flags, int64_t deadline, char *err, size_t errlen)
{
    uint64_t plen = 0;
    int rc = forward_precheck(c, n_tokens, top_k, x, ids, w, flags, &plen, err, errlen);
    if (rc)
        return rc;
    uint8_t hb[MOED_PROTO_HDR_SIZE + sizeof(struct moed_forward_req)];
    moed_frame_encode(hb, MOED_MSG_FORWARD, id, plen);
    le_put32(hb + 32, layer);
    le_put32(hb + 36, n_tokens);
    le_put32(hb + 40, top_k);
    le_put32(hb + 44, flags);
    size_t nx = (size_t)n_tokens * c->hello.hidden, nk = (size_t)n_tokens * top_k;
    const void *px = x, *pi = ids, *pw = w;
#ifdef MOEDC_BIG_ENDIAN
    void *bx = le_copy(x, nx, 2), *bi = le_copy(ids, nk, 4), *bw = le_copy(w, nk, 4);
    if (!bx || !bi || !bw) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "cannot allocate the request copy");
        goto free_copies;
    }
    px = bx;
    pi = bi;
    pw = bw;
#endif
    /* The arrays go out straight from the caller's memory (no copy on
     * little-endian hosts: the wire order is the host order). */
    struct iovec iov[4] = {
        {hb, sizeof hb}, {(void *)px, nx * 2}, {(void *)pi, nk * 4}, {(void *)pw, nk * 4}};
    rc = write_all(c, iov, 4, deadline, err, errlen);
#ifdef MOEDC_BIG_ENDIAN
free_copies:
    free(bx);
    free(bi);
    free(bw);
#endif
    return rc;
}

/* Check a FORWARD reply's head against HELLO (and T when known) and point
 * *y at its output in native order. */
static int forward_reply(struct moedc *c, const struct moed_frame_hdr *h, int64_t expect_t,
                         uint32_t *n_tokens, const uint16_t **y, char *err, size_t errlen)
{
    if (h->payload_len < sizeof(struct moed_forward_rep)) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO, "FORWARD reply of %" PRIu64
                           " bytes, shorter than its 8-byte head", h->payload_len);
    }
    uint32_t t = le_get32(c->rbuf), hid = le_get32(c->rbuf + 4);
    uint64_t need = sizeof(struct moed_forward_rep) + 2ull * t * hid;
    if (hid != c->hello.hidden || t > c->hello.max_tokens ||
        (expect_t >= 0 && t != (uint64_t)expect_t) || h->payload_len != need) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "FORWARD reply says T=%" PRIu32 ", H=%" PRIu32 " in %" PRIu64
                           " bytes; expected T=%" PRIu64 ", H=%" PRIu32 " in %" PRIu64 " bytes",
                           t, hid, h->payload_len, expect_t >= 0 ? (uint64_t)expect_t : t,
                           c->hello.hidden,
                           (uint64_t)(sizeof(struct moed_forward_rep) +
                                      2ull * (expect_t >= 0 ? (uint64_t)expect_t : t) *
                                          c->hello.hidden));
    }
    *n_tokens = t;
#ifdef MOEDC_BIG_ENDIAN
    size_t n = (size_t)t * hid;
    if (n > c->ycap) {
        uint16_t *p = realloc(c->ybuf, n * 2);
        if (!p)
            return fail(c, MOED_E_NOMEM, err, errlen, "cannot allocate the output");
        c->ybuf = p;
        c->ycap = n;
    }
    for (size_t i = 0; i < n; i++)
        c->ybuf[i] = le_get16(c->rbuf + 8 + 2 * i);
    *y = c->ybuf;
#else
    /* rbuf comes from malloc, so +8 is 2-byte aligned. */
    *y = (const uint16_t *)(const void *)(c->rbuf + 8);
#endif
    return 0;
}

int moedc_forward(struct moedc *c, uint32_t layer, uint32_t n_tokens, uint32_t top_k,
                  const uint16_t *x, const int32_t *ids, const float *w, uint16_t *y, char *err,
                  size_t errlen)
{
    return moedc_forward_flags(c, layer, n_tokens, top_k, x, ids, w, 0, y, err, errlen);
}

int moedc_forward_flags(struct moedc *c, uint32_t layer, uint32_t n_tokens, uint32_t top_k,
                        const uint16_t *x, const int32_t *ids, const float *w, uint32_t flags,
                        uint16_t *y, char *err, size_t errlen)
{
    int rc = moedc__usable(c, 1, err, errlen);
    if (rc)
        return rc;
    if (!y && n_tokens > 0)
        return moed_seterr(err, errlen, MOED_E_INVAL, "forward: y is required");
    int64_t deadline = deadline_of(c);
    uint64_t id = ++c->next_id;
    rc = send_forward(c, id, layer, n_tokens, top_k, x, ids, w, flags, deadline, err, errlen);
    if (rc)
        return rc;
    struct moed_frame_hdr h;
    rc = read_frame(c, deadline, &h, err, errlen);
    if (rc && c->broken)
        return rc;
    if (h.request_id != id && !(rc < 0 && h.request_id == 0)) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "reply carries request id %" PRIu64 ", expected %" PRIu64,
                           h.request_id, id);
    }
    if (rc)
        return rc;
    if (h.type != (MOED_MSG_FORWARD | MOED_PROTO_REPLY)) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO, "reply type 0x%04x does not answer FORWARD",
                           (unsigned)h.type);
    }
    uint32_t t;
    const uint16_t *yy;
    rc = forward_reply(c, &h, n_tokens, &t, &yy, err, errlen);
    if (rc)
        return rc;
    if (t)
        memcpy(y, yy, (size_t)t * c->hello.hidden * 2);
    return 0;
}

int moedc_status(struct moedc *c, char **json_out, char *err, size_t errlen)
{
    int rc = moedc__usable(c, 1, err, errlen);
    if (rc)
        return rc;
    if (!json_out)
        return moed_seterr(err, errlen, MOED_E_INVAL, "status: json_out is required");
    struct moed_frame_hdr h;
    rc = moedc__call(c, MOED_MSG_STATUS, NULL, 0, &h, err, errlen);
    if (rc)
        return rc;
    char *s = malloc((size_t)h.payload_len + 1);
    if (!s)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "cannot allocate %" PRIu64 " bytes",
                           h.payload_len + 1);
    memcpy(s, c->rbuf, (size_t)h.payload_len);
    s[h.payload_len] = 0;
    *json_out = s;
    return 0;
}

int moedc_ping(struct moedc *c, uint64_t *rtt_ns, char *err, size_t errlen)
{
    int rc = moedc__usable(c, 1, err, errlen);
    if (rc)
        return rc;
    uint64_t t0 = moed_mono_ns();
    uint8_t p[8];
    le_put64(p, t0);
    struct moed_frame_hdr h;
    rc = moedc__call(c, MOED_MSG_PING, p, sizeof p, &h, err, errlen);
    if (rc)
        return rc;
    uint64_t t1 = moed_mono_ns();
    if (h.payload_len != sizeof p || memcmp(c->rbuf, p, sizeof p) != 0) {
        c->broken = 1;
        return moed_seterr(err, errlen, MOED_E_PROTO,
                           "PING reply of %" PRIu64 " bytes does not echo the 8-byte payload",
                           h.payload_len);
    }
    if (rtt_ns)
        *rtt_ns = t1 - t0;
    return 0;
}

int moedc_send_forward(struct moedc *c, uint64_t request_id, uint32_t layer, uint32_t n_tokens,
                       uint32_t top_k, const uint16_t *x, const int32_t *ids, const float *w,
                       char *err, size_t errlen)
{
    return moedc_send_forward_flags(c, request_id, layer, n_tokens, top_k, x, ids, w, 0, err,
                                    errlen);
}

int moedc_send_forward_flags(struct moedc *c, uint64_t request_id, uint32_t layer,
                             uint32_t n_tokens, uint32_t top_k, const uint16_t *x,
                             const int32_t *ids, const float *w, uint32_t flags, char *err,
                             size_t errlen)
{
    int rc = moedc__usable(c, 0, err, errlen);
    if (rc)
        return rc;
    rc = send_forward(c, request_id, layer, n_tokens, top_k, x, ids, w, flags, deadline_of(c),
                      err, errlen);
    if (rc)
        return rc;
    c->inflight++;
    return 0;
}

int moedc_recv(struct moedc *c, struct moedc_reply *rep, char *err, size_t errlen)
{
    struct moedc_reply r = {0};
    int rc = moedc__usable(c, 0, err, errlen);
    if (!rc && c->inflight == 0)
        rc = moed_seterr(err, errlen, MOED_E_INVAL, "moedc_recv: no request is in flight");
    if (rc)
        goto out;
    struct moed_frame_hdr h;
    rc = read_frame(c, deadline_of(c), &h, err, errlen);
    if (rc && c->broken)
        goto out;
    r.from_daemon = 1;
    r.request_id = h.request_id;
    if (rc) {
        r.code = rc;
        /* An error with id 0 is about the connection, not one request. */
        if (h.request_id != 0)
            c->inflight--;
        goto out;
    }
    if (h.type != (MOED_MSG_FORWARD | MOED_PROTO_REPLY)) {
        c->broken = 1;
        r.from_daemon = 0;
        rc = moed_seterr(err, errlen, MOED_E_PROTO,
                         "reply type 0x%04x while only FORWARDs are in flight", (unsigned)h.type);
        goto out;
    }
    rc = forward_reply(c, &h, -1, &r.n_tokens, &r.y, err, errlen);
    if (rc) {
        r.from_daemon = 0;
        goto out;
    }
    r.hidden = c->hello.hidden;
    c->inflight--;
out:
    if (rep)
        *rep = r;
    return rc;
}

uint32_t moedc_moe_layers(const struct moedc *c, uint32_t *out, uint32_t max)
{
    if (!c || !c->have_hello)
        return 0;
    for (uint32_t i = 0; i < c->n_moe_layers && i < max; i++)
        out[i] = c->moe_layers[i];
    return c->n_moe_layers;
}
