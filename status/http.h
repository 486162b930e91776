/* http.h - a minimal GET-only HTTP/1.1 server for /status, /metrics and
 * /healthz on a libuv TCP listener (loopback by default).
 *
 * One request per connection, answered with `Connection: close`. Every input
 * is bounded: the request head (request line + headers through CRLFCRLF) is at
 * most MOED_HTTP_MAX_REQUEST bytes and must arrive within the header deadline
 * (MOED_HTTP_HEADER_TIMEOUT_MS, else 408), the path is at most
 * MOED_HTTP_MAX_PATH bytes, the answer must be written within
 * MOED_HTTP_TIMEOUT_MS, and at most MOED_HTTP_MAX_CONNS connections are served
 * at once, at most MOED_HTTP_MAX_PER_ADDR of them from one peer address.
 *
 * Slow clients cannot starve the rest: a connection from an address over its
 * share is answered 503; when every slot is taken, a newcomer from an address
 * holding fewer slots than the biggest takes the slot of that address's
 * oldest connection still sending its head (which is answered 503), else it
 * is answered 503 itself. Every answer (503, 408 included) is followed by a
 * clean close: FIN, then the input read to EOF for at most
 * MOED_HTTP_LINGER_MS without holding a slot, so the client reads the answer
 * instead of a reset (at most MOED_HTTP_MAX_LINGER connections linger; past
 * that the answer is written at once, the input there is read, and the
 * connection closed). Nothing here blocks the loop.
 *
 * All calls on the loop thread.
 */
#ifndef MOED_HTTP_H
#define MOED_HTTP_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "stats.h"

#define MOED_HTTP_MAX_REQUEST 8192 /* request head bytes, CRLFCRLF included; over -> 431 */
#define MOED_HTTP_MAX_PATH 256     /* request-target bytes (query included); over -> 414 */
#define MOED_HTTP_MAX_METHOD 16    /* method token bytes; longer is malformed -> 400 */
#define MOED_HTTP_MAX_CONNS 64     /* concurrent connections; more get 503 */
#define MOED_HTTP_MAX_PER_ADDR 16  /* default: of them from one peer address */
#define MOED_HTTP_HEADER_TIMEOUT_MS 2000 /* default: accept -> whole request head */
#define MOED_HTTP_TIMEOUT_MS 5000  /* head complete -> answer written */
#define MOED_HTTP_LINGER_MS 2000   /* after an answer: read to the client's EOF */
#define MOED_HTTP_MAX_LINGER 128   /* connections lingering at once */

/* moed_http_parse_request results: COMPLETE, NEED_MORE, or the HTTP status
 * to answer (>= 400). */
enum moed_http_result {
    MOED_HTTP_COMPLETE = 0,
    MOED_HTTP_NEED_MORE = 1,
    MOED_HTTP_BAD_REQUEST = 400,      /* malformed request line or header */
    MOED_HTTP_NOT_FOUND = 404,        /* well-formed, unknown path */
    MOED_HTTP_BAD_METHOD = 405,       /* a method other than GET / HEAD */
    MOED_HTTP_URI_TOO_LONG = 414,     /* path over MOED_HTTP_MAX_PATH */
    MOED_HTTP_HEAD_TOO_LARGE = 431,   /* head over MOED_HTTP_MAX_REQUEST */
    MOED_HTTP_BAD_VERSION = 505,      /* HTTP/x.y other than 1.0 / 1.1 */
};

enum moed_http_route {
    MOED_HTTP_ROUTE_NONE = 0,
    MOED_HTTP_ROUTE_STATUS,  /* GET /status  -> application/json */
    MOED_HTTP_ROUTE_METRICS, /* GET /metrics -> text/plain; version=0.0.4 */
    MOED_HTTP_ROUTE_HEALTHZ, /* GET /healthz -> 200 "ok" / 503 */
};

/* Filled by the parser (caller-allocated). */
struct moed_http_req {
    int head;                  /* 1 for HEAD (answer without a body) */
    int minor;                 /* HTTP/1.<minor>: 0 or 1 */
    enum moed_http_route route;
    size_t consumed;           /* bytes of the head, CRLFCRLF included (COMPLETE only) */
    char path[MOED_HTTP_MAX_PATH + 1]; /* request target as sent, NUL-terminated */
    char why[160];             /* for errors: what was wrong, one line */
};

/* Parse the request head at buf[0..len). Pure: same bytes, same answer, so a
 * connection re-parses its whole buffer after each read. Returns
 * MOED_HTTP_COMPLETE (req filled, route set), MOED_HTTP_NEED_MORE (no error
 * so far, head not finished) or an error status with req->why set. Errors
 * are reported as early as the bytes allow (a bad method before the headers
 * arrive). Accepted: "GET|HEAD SP origin-form SP HTTP/1.0|1.1 CRLF", then
 * header lines "name: value" CRLF of printable ASCII (and HTAB), then CRLF. */
int moed_http_parse_request(const char *buf, size_t len, struct moed_http_req *req);

/* The engine's stats, refreshed for a render (heartbeat, busy time copied in).
 * The engine owns the struct; the pointer is read before the callback
 * returns to the loop. NULL answers 503. */
typedef const struct moed_stats *(*moed_http_snapshot_fn)(void *ctx);

struct moed_http; /* opaque */

/* Bind addr:port (IPv4 or IPv6 literal; port 0 picks a free port, see
 * moed_http_port) and listen on `loop`. On success *out owns the listener
 * until moed_http_stop. On failure returns MOED_E_BUSY when addr:port is in
 * use, MOED_E_IO otherwise (or MOED_E_CONFIG for a
 * bad address) with err naming addr:port and the libuv error; memory already
 * taken is freed in a close callback on the loop's next pass. */
int moed_http_start(uv_loop_t *loop, const char *addr, uint16_t port, moed_http_snapshot_fn fn,
                    void *ctx, struct moed_http **out, char *err, size_t errlen);

/* The bound port (useful after binding port 0); 0 if unknown. */
uint16_t moed_http_port(const struct moed_http *h);

/* Override the connection cap and the answer deadline (tests); 0 keeps a
 * value unchanged. */
void moed_http_set_limits(struct moed_http *h, uint32_t max_conns, uint32_t timeout_ms);

/* status.header_timeout_ms and status.max_conns_per_addr; 0 keeps a value
 * unchanged. */
void moed_http_set_client_limits(struct moed_http *h, uint32_t header_timeout_ms,
                                 uint32_t max_per_addr);

/* Connections answered so far (any status but a refusal), refused for the
 * caps (503), pushed out of their slot by a newcomer from another address
 * (503), and answered 408 at the header deadline. */
uint64_t moed_http_served(const struct moed_http *h);
uint64_t moed_http_refused(const struct moed_http *h);
uint64_t moed_http_evicted(const struct moed_http *h);
uint64_t moed_http_head_timeouts(const struct moed_http *h);

/* Close the listener and every connection. `h` must not be used afterwards;
 * its memory is freed in the last close callback (run the loop to finish). */
void moed_http_stop(struct moed_http *h);

#endif
