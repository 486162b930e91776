/* http.c - GET-only HTTP/1.1 status server (see http.h).
 *
 * Parser: a pure function over the bytes received so far; the connection
 * re-parses its whole buffer after each read (at most 8 KiB, so the quadratic
 * worst case of a 1-byte-at-a-time client is a few million byte checks,
 * bounded by the connection deadline anyway).
 *
 * Server: one uv_tcp_t listener; per connection a uv_tcp_t, a deadline timer
 * and a fixed request buffer. A connection goes read (header deadline) ->
 * parse -> write the whole response (answer deadline) -> shutdown -> linger
 * (not holding a slot: read to EOF, linger deadline) -> close. A refused or
 * pushed-out connection goes straight to the answer (503) and the linger.
 * The per-address counts are linear scans of the live list (at most
 * MOED_HTTP_MAX_CONNS + MOED_HTTP_MAX_LINGER entries). Every handle's memory
 * is freed only in its close callback (libuv rule); the server itself is
 * freed when the listener and the last connection have closed after
 * moed_http_stop.
 */
#include "http.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "moed_err.h"
#include "moed_check_uv.h"
#include "moed_log.h"
#include "moed_util.h"

/* ------------------------------------------------------------- server */

enum conn_state {
    C_READING,   /* counted: reading the request head (header deadline) */
    C_ANSWERING, /* counted: head complete, writing the answer */
    C_LINGER,    /* answered (or refused): half-closed, reading to EOF; not counted */
};

struct moed_http_conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t wreq;
    uv_shutdown_t sreq;
    struct moed_http *h;
    struct moed_http_conn *prev, *next;
    enum conn_state state;
    int counted;              /* holds a slot (n_conns and its address's share) */
    int lingering;            /* counted in n_linger */
    int closing;
    int draining;             /* reply sent: discard input until EOF */
    int pending_close;        /* handles not yet closed (tcp, timer) */
    uint64_t t_accept;        /* uv_now at accept (eviction picks the oldest) */
    uint8_t addr[16];         /* peer address (IPv4: 4 bytes, v4-mapped IPv6 too) */
    uint8_t addr_len;
    char *resp;               /* response bytes, owned, freed with the conn */
    size_t len;               /* bytes in buf */
    char buf[MOED_HTTP_MAX_REQUEST];
};

struct moed_http {
    uv_loop_t *loop;
    uv_tcp_t listener;
    moed_http_snapshot_fn fn;
    void *ctx;
    struct moed_http_conn *conns; /* live, not closing (counted or lingering) */
    uint32_t n_conns;             /* counted: reading or answering */
    uint32_t n_linger;            /* answered or refused, reading to EOF */
    uint32_t max_conns;
    uint32_t max_per_addr;
    uint32_t timeout_ms;
    uint32_t header_timeout_ms;
    uint64_t served, refused, evicted, head_timeouts;
    int stopping;
    int refs; /* listener + every connection not yet freed */
};

static void http_unref(struct moed_http *h)
{
    if (--h->refs == 0)
        free(h);
}

static void conn_on_close(uv_handle_t *hd)
{
    struct moed_http_conn *c = hd->data;
    if (--c->pending_close > 0)
        return;
    struct moed_http *h = c->h;
    free(c->resp);
    free(c);
    http_unref(h);
}

/* Give up the connection's slot (it is answered, or being refused). */
static void conn_uncount(struct moed_http_conn *c)
{
    if (c->counted) {
        c->counted = 0;
        c->h->n_conns--;
    }
}

static void conn_close(struct moed_http_conn *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    struct moed_http *h = c->h;
    if (c->prev)
        c->prev->next = c->next;
    else if (h->conns == c)
        h->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->prev = c->next = NULL;
    conn_uncount(c);
    if (c->lingering) {
        c->lingering = 0;
        h->n_linger--;
    }
    uv_close((uv_handle_t *)&c->tcp, conn_on_close);
    uv_close((uv_handle_t *)&c->timer, conn_on_close);
}

static void conn_on_timeout(uv_timer_t *t);

/* The header deadline: the answer deadline when that is shorter (tests). */
static uint32_t head_deadline_ms(const struct moed_http *h)
{
    return h->header_timeout_ms < h->timeout_ms ? h->header_timeout_ms : h->timeout_ms;
}

/* Move to C_LINGER (not counted, reading to EOF for at most
 * MOED_HTTP_LINGER_MS); 0, or -1 when MOED_HTTP_MAX_LINGER are lingering
 * already (the caller closes at once then). */
static int conn_linger(struct moed_http_conn *c)
{
    struct moed_http *h = c->h;
    conn_uncount(c);
    c->state = C_LINGER;
    if (!c->lingering) {
        if (h->n_linger >= MOED_HTTP_MAX_LINGER)
            return -1;
        c->lingering = 1;
        h->n_linger++;
    }
    return uv_timer_start(&c->timer, conn_on_timeout, MOED_HTTP_LINGER_MS, 0) < 0 ? -1 : 0;
}

static void conn_answer_linger(struct moed_http_conn *c, int status, const char *body);

static void conn_on_timeout(uv_timer_t *t)
{
    struct moed_http_conn *c = t->data;
    struct moed_http *h = c->h;
    if (c->state == C_READING) { /* the head did not arrive in time: say so */
        LOG_D("http: request head not complete after %" PRIu32 " ms (%zu bytes read)",
              head_deadline_ms(h), c->len);
        h->head_timeouts++;
        conn_answer_linger(c, 408, "408 request head not complete in time\n");
        return;
    }
    LOG_D("http: connection closed at its deadline (%zu bytes read)", c->len);
    conn_close(c);
}

static void conn_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf);
static void conn_on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf);

/* Lingering close: closing a socket that still has unread input makes the
 * kernel send RST, which can destroy the reply before the client reads it.
 * So after our FIN, read and discard until the client's EOF, for at most
 * MOED_HTTP_LINGER_MS, without holding a slot. */
static void conn_on_shutdown(uv_shutdown_t *r, int status)
{
    struct moed_http_conn *c = r->data;
    if (status < 0 || c->closing) {
        conn_close(c);
        return;
    }
    c->draining = 1;
    if (c->state != C_LINGER && conn_linger(c) < 0) {
        conn_close(c);
        return;
    }
    if (uv_read_start((uv_stream_t *)&c->tcp, conn_alloc, conn_on_read) < 0)
        conn_close(c);
}

static void conn_on_write(uv_write_t *w, int status)
{
    struct moed_http_conn *c = w->data;
    if (status < 0 || c->closing) {
        if (status < 0)
            LOG_D("http: write failed: %s", uv_strerror(status));
        conn_close(c);
        return;
    }
    /* Half-close so the client sees EOF after the body rather than a reset. */
    c->sreq.data = c;
    if (uv_shutdown(&c->sreq, (uv_stream_t *)&c->tcp, conn_on_shutdown) < 0)
        conn_close(c);
}

static const char *reason_of(int status)
{
    switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
    }
}

/* The response head for a body of blen bytes, into hdr[256]; its length. */
static int format_head(char *hdr, size_t len, int status, const char *ctype, size_t blen)
{
    return snprintf(hdr, len,
                    "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                    "Cache-Control: no-store\r\n%sConnection: close\r\n\r\n",
                    status, reason_of(status), ctype, blen,
                    status == 405 ? "Allow: GET, HEAD\r\n" : "");
}

/* Queue the whole response; takes ownership of `body` (may be NULL). */
static void conn_respond(struct moed_http_conn *c, int status, const char *ctype, char *body,
                         int head_only)
{
    size_t blen = body ? strlen(body) : 0;
    char hdr[256];
    int n = format_head(hdr, sizeof hdr, status, ctype, blen);
    size_t total = (size_t)n + (head_only ? 0 : blen);
    c->resp = malloc(total);
    if (!c->resp) {
        free(body);
        LOG_W("http: out of memory for a %zu-byte response", total);
        conn_close(c);
        return;
    }
    memcpy(c->resp, hdr, (size_t)n);
    if (!head_only && blen)
        memcpy(c->resp + n, body, blen);
    free(body);
    if (status != 503 || c->state != C_LINGER)
        c->h->served++;
    uv_buf_t b = uv_buf_init(c->resp, (unsigned)total);
    c->wreq.data = c;
    int rc = uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &b, 1, conn_on_write);
    if (rc < 0) {
        LOG_D("http: uv_write: %s", uv_strerror(rc));
        conn_close(c);
    }
}

static char *dupstr(const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p)
        memcpy(p, s, n);
    return p;
}

static void conn_serve(struct moed_http_conn *c, const struct moed_http_req *req)
{
    const char *text = "text/plain; charset=utf-8";
    const struct moed_stats *s = c->h->fn ? c->h->fn(c->h->ctx) : NULL;
    if (!s) {
        conn_respond(c, 503, text, dupstr("not ready\n"), req->head);
        return;
    }
    uint64_t now = moed_mono_ns();
    switch (req->route) {
    case MOED_HTTP_ROUTE_STATUS: {
        char *j = moed_status_json(s, now);
        if (!j) {
            conn_respond(c, 500, text, dupstr("out of memory\n"), req->head);
            return;
        }
        size_t n = strlen(j);
        char *body = malloc(n + 2); /* a trailing newline for curl users */
        if (body) {
            memcpy(body, j, n);
            memcpy(body + n, "\n", 2);
        }
        free(j);
        if (!body)
            conn_respond(c, 500, text, dupstr("out of memory\n"), req->head);
        else
            conn_respond(c, 200, "application/json", body, req->head);
        return;
    }
    case MOED_HTTP_ROUTE_METRICS: {
        char *m = moed_status_prometheus(s, now);
        if (!m)
            conn_respond(c, 500, text, dupstr("out of memory\n"), req->head);
        else
            conn_respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", m, req->head);
        return;
    }
    case MOED_HTTP_ROUTE_HEALTHZ:
        if (!s->loaded)
            conn_respond(c, 503, text, dupstr("not ready\n"), req->head);
        else if (!s->healthy)
            conn_respond(c, 503, text, dupstr("unhealthy\n"), req->head);
        else
            conn_respond(c, 200, text, dupstr("ok\n"), req->head);
        return;
    case MOED_HTTP_ROUTE_NONE:
        break;
    }
    conn_respond(c, 404, text, dupstr("not found\n"), req->head);
}

static void conn_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    struct moed_http_conn *c = hd->data;
    if (c->draining) { /* the request is done with: reuse the buffer */
        *buf = uv_buf_init(c->buf, sizeof c->buf);
        return;
    }
    /* Never more than the request cap: the parser answers 431 at the cap, so
     * a full buffer is never read into again. */
    *buf = uv_buf_init(c->buf + c->len, (unsigned)(sizeof c->buf - c->len));
}

static void conn_on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    struct moed_http_conn *c = st->data;
    if (nread == 0 || c->closing)
        return; /* EAGAIN */
    if (nread < 0) { /* EOF (before a full request, or after our reply), or an error */
        conn_close(c);
        return;
    }
    if (c->draining)
        return;
    c->len += (size_t)nread;
    struct moed_http_req req;
    int rc = moed_http_parse_request(c->buf, c->len, &req);
    if (rc == MOED_HTTP_NEED_MORE)
        return;
    uv_read_stop(st);
    /* the answer gets the whole-connection deadline from here */
    c->state = C_ANSWERING;
    if (uv_timer_start(&c->timer, conn_on_timeout, c->h->timeout_ms, 0) < 0) {
        conn_close(c);
        return;
    }
    if (rc == MOED_HTTP_COMPLETE) {
        conn_serve(c, &req);
        return;
    }
    LOG_D("http: %d: %s", rc, req.why);
    size_t n = strlen(req.why);
    char *body = malloc(n + 16);
    if (body)
        snprintf(body, n + 16, "%d %s\n", rc, req.why);
    conn_respond(c, rc, "text/plain; charset=utf-8", body, req.head);
}

/* Counted connections from c's address. */
static uint32_t addr_count(const struct moed_http *h, const uint8_t *addr, uint8_t len)
{
    uint32_t n = 0;
    for (const struct moed_http_conn *o = h->conns; o; o = o->next)
        n += o->counted && o->addr_len == len && !memcmp(o->addr, addr, len);
    return n;
}

/* All slots taken: the connection to give up for a newcomer whose address
 * holds `mine` of them, or NULL. The victim is the oldest connection still
 * sending its head from the address holding the most slots, and only if that
 * address holds more than the newcomer's: an address within its fair share
 * is never pushed out, and an answer being written never is. */
static struct moed_http_conn *pick_victim(const struct moed_http *h, uint32_t mine)
{
    const struct moed_http_conn *top = NULL;
    uint32_t top_n = 0;
    for (const struct moed_http_conn *o = h->conns; o; o = o->next) {
        if (!o->counted)
            continue;
        uint32_t n = addr_count(h, o->addr, o->addr_len); /* 64 x 64 at most */
        if (n > top_n) {
            top_n = n;
            top = o;
        }
    }
    if (!top || top_n <= mine + 1)
        return NULL;
    struct moed_http_conn *victim = NULL;
    for (struct moed_http_conn *o = h->conns; o; o = o->next)
        if (o->counted && o->state == C_READING && o->addr_len == top->addr_len &&
            !memcmp(o->addr, top->addr, top->addr_len) &&
            (!victim || o->t_accept < victim->t_accept))
            victim = o;
    return victim;
}

/* When MOED_HTTP_MAX_LINGER connections linger already: write the answer
 * now (the socket's buffer is empty, so it fits), read the input that is
 * there (closing with unread input sends a reset), half-close and close. */
static void conn_answer_now(struct moed_http_conn *c, int status, const char *body)
{
    char msg[512];
    int n = format_head(msg, sizeof msg, status, "text/plain; charset=utf-8", strlen(body));
    n += snprintf(msg + n, sizeof msg - (size_t)n, "%s", body);
    uv_buf_t b = uv_buf_init(msg, (unsigned)n);
    (void)uv_try_write((uv_stream_t *)&c->tcp, &b, 1);
    uv_os_fd_t fd;
    if (uv_fileno((const uv_handle_t *)&c->tcp, &fd) == 0) {
        char sink[4096];
        for (int i = 0; i < 16 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++)
            ;
        (void)shutdown(fd, SHUT_WR);
    }
    conn_close(c);
}

/* Answer `status` with `body` and close cleanly: FIN after the answer, then
 * the input read to EOF (conn_linger), so the client reads the answer
 * instead of a reset. For refusals (503), pushed-out connections (503) and
 * the header deadline (408). */
static void conn_answer_linger(struct moed_http_conn *c, int status, const char *body)
{
    uv_read_stop((uv_stream_t *)&c->tcp);
    if (conn_linger(c) < 0) {
        conn_answer_now(c, status, body);
        return;
    }
    conn_respond(c, status, "text/plain; charset=utf-8", dupstr(body), 0);
}

static void peer_addr(struct moed_http_conn *c)
{
    struct sockaddr_storage sa;
    int n = sizeof sa;
    c->addr_len = 0;
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&sa, &n) != 0)
        return;
    if (sa.ss_family == AF_INET) {
        memcpy(c->addr, &((struct sockaddr_in *)&sa)->sin_addr, 4);
        c->addr_len = 4;
    } else if (sa.ss_family == AF_INET6) {
        const uint8_t *a = ((struct sockaddr_in6 *)&sa)->sin6_addr.s6_addr;
        static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (!memcmp(a, v4mapped, 12)) {
            memcpy(c->addr, a + 12, 4);
            c->addr_len = 4;
        } else {
            memcpy(c->addr, a, 16);
            c->addr_len = 16;
        }
    }
}

static void http_on_connection(uv_stream_t *srv, int status)
{
    struct moed_http *h = srv->data;
    if (status < 0) {
        LOG_W("http: accept: %s", uv_strerror(status));
        return;
    }
    if (h->stopping)
        return;
    struct moed_http_conn *c = calloc(1, sizeof *c);
    if (!c) {
        LOG_W("http: out of memory for a connection");
        return;
    }
    c->h = h;
    int rc = uv_tcp_init(h->loop, &c->tcp);
    if (rc < 0) {
        LOG_W("http: uv_tcp_init: %s", uv_strerror(rc));
        free(c);
        return;
    }
    rc = uv_timer_init(h->loop, &c->timer);
    if (rc < 0) { /* tcp is initialised: it must be closed, not freed */
        LOG_W("http: uv_timer_init: %s", uv_strerror(rc));
        c->tcp.data = c;
        c->pending_close = 1;
        c->closing = 1;
        h->refs++;
        uv_close((uv_handle_t *)&c->tcp, conn_on_close);
        return;
    }
    c->tcp.data = c;
    c->timer.data = c;
    c->pending_close = 2;
    h->refs++;
    c->next = h->conns;
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    c->t_accept = uv_now(h->loop);

    rc = uv_accept(srv, (uv_stream_t *)&c->tcp);
    if (rc < 0) {
        LOG_W("http: accept: %s", uv_strerror(rc));
        conn_close(c);
        return;
    }
    peer_addr(c);
    uint32_t mine = addr_count(h, c->addr, c->addr_len);
    if (mine >= h->max_per_addr) {
        LOG_D("http: %" PRIu32 " connections from one address, refusing one", mine);
        h->refused++;
        conn_answer_linger(c, 503, "busy (too many connections from this address)\n");
        return;
    }
    if (h->n_conns >= h->max_conns) {
        struct moed_http_conn *victim = pick_victim(h, mine);
        if (!victim) {
            LOG_D("http: %" PRIu32 " connections open, refusing one", h->n_conns);
            h->refused++;
            conn_answer_linger(c, 503, "busy\n");
            return;
        }
        LOG_D("http: all %" PRIu32 " slots taken: a new address takes the slot of an "
              "unfinished request head", h->n_conns);
        h->evicted++;
        conn_answer_linger(victim, 503, "busy\n");
    }
    c->counted = 1;
    c->state = C_READING;
    h->n_conns++;
    rc = uv_timer_start(&c->timer, conn_on_timeout, head_deadline_ms(h), 0);
    if (rc == 0)
        rc = uv_read_start((uv_stream_t *)&c->tcp, conn_alloc, conn_on_read);
    if (rc < 0) {
        LOG_W("http: read_start: %s", uv_strerror(rc));
        conn_close(c);
    }
}

static void listener_on_close(uv_handle_t *hd)
{
    http_unref(hd->data);
}

int moed_http_start(uv_loop_t *loop, const char *addr, uint16_t port, moed_http_snapshot_fn fn,
                    void *ctx, struct moed_http **out, char *err, size_t errlen)
{
    int rc;
    struct sockaddr_storage sa;
    *out = NULL;
    if (!addr || (uv_ip4_addr(addr, port, (struct sockaddr_in *)&sa) != 0 &&
                  uv_ip6_addr(addr, port, (struct sockaddr_in6 *)&sa) != 0))
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "http: address \"%s\" is not an IPv4 or IPv6 literal",
                           addr ? addr : "(null)");

    struct moed_http *h = calloc(1, sizeof *h);
    if (!h)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "http: out of memory");
    h->loop = loop;
    h->fn = fn;
    h->ctx = ctx;
    h->max_conns = MOED_HTTP_MAX_CONNS;
    h->max_per_addr = MOED_HTTP_MAX_PER_ADDR;
    h->timeout_ms = MOED_HTTP_TIMEOUT_MS;
    h->header_timeout_ms = MOED_HTTP_HEADER_TIMEOUT_MS;
    rc = uv_tcp_init(loop, &h->listener);
    if (rc < 0) {
        free(h);
        return moed_seterr(err, errlen, MOED_E_IO, "http: uv_tcp_init: %s", uv_strerror(rc));
    }
    h->listener.data = h;
    h->refs = 1;

    /* a failing call is logged with its text, file and line (moed_check_uv.h) */
    if ((rc = MOED_UV_CHECK(uv_tcp_bind(&h->listener, (const struct sockaddr *)&sa, 0))) < 0 ||
        (rc = MOED_UV_CHECK(uv_listen((uv_stream_t *)&h->listener, 128, http_on_connection))) < 0)
        goto close_listener;
    *out = h;
    LOG_I("http: listening on %s:%" PRIu16, addr, moed_http_port(h));
    return 0;

close_listener:
    /* libuv often reports EADDRINUSE at listen, not bind: name both. */
    moed_seterr(err, errlen, rc == UV_EADDRINUSE ? MOED_E_BUSY : MOED_E_IO,
                "http: listen on %s:%" PRIu16 " failed: %s", addr, port, uv_strerror(rc));
    uv_close((uv_handle_t *)&h->listener, listener_on_close);
    return rc == UV_EADDRINUSE ? MOED_E_BUSY : MOED_E_IO; /* BUSY: the port is taken */
}

uint16_t moed_http_port(const struct moed_http *h)
{
    struct sockaddr_storage sa;
    int n = sizeof sa;
    if (!h || uv_tcp_getsockname(&h->listener, (struct sockaddr *)&sa, &n) != 0)
        return 0;
    if (sa.ss_family == AF_INET)
        return ntohs(((struct sockaddr_in *)&sa)->sin_port);
    if (sa.ss_family == AF_INET6)
        return ntohs(((struct sockaddr_in6 *)&sa)->sin6_port);
    return 0;
}

void moed_http_set_limits(struct moed_http *h, uint32_t max_conns, uint32_t timeout_ms)
{
    if (max_conns)
        h->max_conns = max_conns;
    if (timeout_ms)
        h->timeout_ms = timeout_ms;
}

void moed_http_set_client_limits(struct moed_http *h, uint32_t header_timeout_ms,
                                 uint32_t max_per_addr)
{
    if (header_timeout_ms)
        h->header_timeout_ms = header_timeout_ms;
    if (max_per_addr)
        h->max_per_addr = max_per_addr;
}

uint64_t moed_http_served(const struct moed_http *h)
{
    return h->served;
}

uint64_t moed_http_refused(const struct moed_http *h)
{
    return h->refused;
}

uint64_t moed_http_evicted(const struct moed_http *h)
{
    return h->evicted;
}

uint64_t moed_http_head_timeouts(const struct moed_http *h)
{
    return h->head_timeouts;
}

void moed_http_stop(struct moed_http *h)
{
    if (!h || h->stopping)
        return;
    h->stopping = 1;
    while (h->conns)
        conn_close(h->conns);
    uv_close((uv_handle_t *)&h->listener, listener_on_close);
}
