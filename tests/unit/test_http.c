/* test_http.c - the request parser (table of good and bad heads, 1-byte
 * fragmentation, limits) and the real listener: a uv loop in the test process
 * serves 127.0.0.1:<port 0>, a plain blocking-socket client in a thread sends
 * raw requests, and the results are checked on the main thread after the
 * loop has stopped (Check asserts stay off the client thread).
 */
#include <arpa/inet.h>
#include <check.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "http.h"
#include "check_main.h"

/* ---------------------------------------------------------------- parser */

static int parse(const char *s, struct moed_http_req *r)
{
    return moed_http_parse_request(s, strlen(s), r);
}

START_TEST(parse_complete)
{
    struct moed_http_req r;
    const char *s = "GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: t\t1\r\n\r\n";
    ck_assert_int_eq(parse(s, &r), MOED_HTTP_COMPLETE);
    ck_assert_int_eq(r.route, MOED_HTTP_ROUTE_STATUS);
    ck_assert_uint_eq(r.consumed, strlen(s));
    ck_assert_int_eq(r.head, 0);
    ck_assert_int_eq(r.minor, 1);
    ck_assert_str_eq(r.path, "/status");

    ck_assert_int_eq(parse("HEAD /metrics HTTP/1.0\r\n\r\n", &r), MOED_HTTP_COMPLETE);
    ck_assert_int_eq(r.route, MOED_HTTP_ROUTE_METRICS);
    ck_assert_int_eq(r.head, 1);
    ck_assert_int_eq(r.minor, 0);

    /* a query string does not change the route; bytes after the head are not consumed */
    s = "GET /healthz?probe=1 HTTP/1.1\r\n\r\nEXTRA";
    ck_assert_int_eq(parse(s, &r), MOED_HTTP_COMPLETE);
    ck_assert_int_eq(r.route, MOED_HTTP_ROUTE_HEALTHZ);
    ck_assert_uint_eq(r.consumed, strlen(s) - 5);

    ck_assert_int_eq(parse("", &r), MOED_HTTP_NEED_MORE);
    ck_assert_int_eq(parse("GET /status HTTP/1.1\r\nHost: x\r\n", &r), MOED_HTTP_NEED_MORE);
    ck_assert_int_eq(parse("GET /status HTTP/1.1\r\n\r", &r), MOED_HTTP_NEED_MORE);
}
END_TEST

START_TEST(parse_fragmented)
{
    const char *s = "GET /metrics HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n";
    size_t n = strlen(s);
    struct moed_http_req r;
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(moed_http_parse_request(s, i, &r) == MOED_HTTP_NEED_MORE,
                      "prefix of %zu bytes: %d (%s)", i, moed_http_parse_request(s, i, &r),
                      r.why);
    ck_assert_int_eq(moed_http_parse_request(s, n, &r), MOED_HTTP_COMPLETE);
    ck_assert_int_eq(r.route, MOED_HTTP_ROUTE_METRICS);

    /* an error is reported as soon as its line is complete, not at the end */
    const char *bad = "PUT /status HTTP/1.1\r\n";
    ck_assert_int_eq(moed_http_parse_request(bad, strlen(bad) - 1, &r), MOED_HTTP_NEED_MORE);
    ck_assert_int_eq(moed_http_parse_request(bad, strlen(bad), &r), MOED_HTTP_BAD_METHOD);
}
END_TEST

static const struct {
    const char *in;
    int want;
    const char *why; /* substring of req.why */
} bad_cases[] = {
    {"POST /status HTTP/1.1\r\n\r\n", 405, "method \"POST\" not allowed (GET, HEAD)"},
    {"get /status HTTP/1.1\r\n\r\n", 405, "method \"get\" not allowed"},
    {"DELETEDELETEDELETE /", 400, "method longer than 16 bytes"},
    {"G(T /status HTTP/1.1\r\n\r\n", 400, "method has byte 0x28 at offset 1"},
    {" GET /status HTTP/1.1\r\n\r\n", 400, "request line starts with a space"},
    {"GET  /status HTTP/1.1\r\n\r\n", 400, "empty request target"},
    {"GET /status\r\n\r\n", 400, "request line has no HTTP version"},
    {"GET\r\n\r\n", 400, "request line is not \"METHOD SP PATH SP HTTP/1.x\""},
    {"GET /status HTTP/2.0\r\n\r\n", 505, "version \"HTTP/2.0\" not supported"},
    {"GET /status HTTP/1.2\r\n\r\n", 505, "version \"HTTP/1.2\" not supported"},
    {"GET /status HTTP/1.x\r\n\r\n", 400, "malformed version \"HTTP/1.x\""},
    {"GET /status HTTP/1.1 \r\n\r\n", 400, "version must be"},
    {"GET /status HTTPS/1.1", 400, "version must be"},
    {"GET /status FTP/", 400, "version must be"},
    {"GET /status HTTP/1.1\n\n", 400, "bare LF at offset 20 (lines must end in CRLF)"},
    {"GET /status HTTP/1.1\r\nHost: x\n\r\n", 400, "bare LF at offset 29"},
    {"GET /status HTTP/1.1\r\r\n", 400, "CR not followed by LF at offset 20"},
    {"GET /status HTTP/1.1\r\nHost: \x7f\r\n\r\n", 400, "byte 0x7f at offset 28"},
    {"GET /st\xc3\xa4tus HTTP/1.1\r\n\r\n", 400, "byte 0xc3 at offset 7 is not printable ASCII"},
    {"GET /st\tatus HTTP/1.1\r\n\r\n", 400, "byte 0x09 at offset 7"},
    {"GET http://localhost/status HTTP/1.1\r\n\r\n", 400,
     "request target \"http://localhost/status\" is not an absolute path (origin-form)"},
    {"GET status HTTP/1.1\r\n\r\n", 400, "is not an absolute path"},
    {"GET * HTTP/1.1\r\n\r\n", 400, "is not an absolute path"},
    {"GET /nope HTTP/1.1\r\n\r\n", 404, "no such path \"/nope\" (/status, /metrics, /healthz)"},
    {"GET /status/ HTTP/1.1\r\n\r\n", 404, "no such path \"/status/\""},
    {"GET /STATUS HTTP/1.1\r\n\r\n", 404, "no such path"},
    {"GET / HTTP/1.1\r\n\r\n", 404, "no such path \"/\""},
    {"GET /status HTTP/1.1\r\nNoColon\r\n\r\n", 400, "header line at offset 22 has no \"name:\""},
    {"GET /status HTTP/1.1\r\n: v\r\n\r\n", 400, "has no \"name:\""},
    {"GET /status HTTP/1.1\r\nBad Name: v\r\n\r\n", 400, "header name at offset 22 has byte 0x20"},
    {"GET /status HTTP/1.1\r\nA: b\r\n c\r\n\r\n", 400, "starts with whitespace (folding"},
};

START_TEST(parse_bad)
{
    for (size_t k = 0; k < sizeof bad_cases / sizeof bad_cases[0]; k++) {
        struct moed_http_req r;
        int rc = parse(bad_cases[k].in, &r);
        ck_assert_msg(rc == bad_cases[k].want, "case %zu: got %d (%s), want %d", k, rc, r.why,
                      bad_cases[k].want);
        ck_assert_msg(strstr(r.why, bad_cases[k].why) != NULL, "case %zu: why \"%s\" lacks \"%s\"",
                      k, r.why, bad_cases[k].why);
    }
}
END_TEST

START_TEST(parse_nul_bytes)
{
    struct moed_http_req r;
    static const char a[] = "GET /sta\0tus HTTP/1.1\r\n\r\n";
    ck_assert_int_eq(moed_http_parse_request(a, sizeof a - 1, &r), 400);
    ck_assert_str_eq(r.why, "byte 0x00 at offset 8 is not printable ASCII");
    static const char b[] = "GET /status HTTP/1.1\r\nX: a\0b\r\n\r\n";
    ck_assert_int_eq(moed_http_parse_request(b, sizeof b - 1, &r), 400);
    ck_assert_str_eq(r.why, "byte 0x00 at offset 26 is not printable ASCII");
    static const char c[] = "\0";
    ck_assert_int_eq(moed_http_parse_request(c, 1, &r), 400);
}
END_TEST

START_TEST(parse_limits)
{
    static char buf[3 * MOED_HTTP_MAX_REQUEST];
    struct moed_http_req r;
    /* a path of exactly MOED_HTTP_MAX_PATH bytes is judged on its route (404);
     * one byte more is 414, even before the line ends */
    char path[MOED_HTTP_MAX_PATH + 2];
    memset(path, 'a', sizeof path);
    path[0] = '/';
    path[MOED_HTTP_MAX_PATH] = '\0';
    snprintf(buf, sizeof buf, "GET %s HTTP/1.1\r\n\r\n", path);
    ck_assert_int_eq(parse(buf, &r), MOED_HTTP_NOT_FOUND);
    path[MOED_HTTP_MAX_PATH] = 'a';
    path[MOED_HTTP_MAX_PATH + 1] = '\0';
    snprintf(buf, sizeof buf, "GET %s", path);
    ck_assert_int_eq(parse(buf, &r), MOED_HTTP_URI_TOO_LONG);
    ck_assert_str_eq(r.why, "path longer than 256 bytes");

    /* a head of exactly MOED_HTTP_MAX_REQUEST bytes is fine, one more is 431 */
    const char *line = "GET /status HTTP/1.1\r\nX: ";
    size_t fill = MOED_HTTP_MAX_REQUEST - strlen(line) - 4;
    snprintf(buf, sizeof buf, "%s", line);
    memset(buf + strlen(line), 'v', fill);
    memcpy(buf + strlen(line) + fill, "\r\n\r\n", 5);
    ck_assert_uint_eq(strlen(buf), MOED_HTTP_MAX_REQUEST);
    ck_assert_int_eq(parse(buf, &r), MOED_HTTP_COMPLETE);
    ck_assert_uint_eq(r.consumed, MOED_HTTP_MAX_REQUEST);
    snprintf(buf, sizeof buf, "%s", line);
    memset(buf + strlen(line), 'v', fill + 1);
    memcpy(buf + strlen(line) + fill + 1, "\r\n\r\n", 5);
    ck_assert_int_eq(parse(buf, &r), MOED_HTTP_HEAD_TOO_LARGE);
    ck_assert_str_eq(r.why, "request head over 8192 bytes");
    /* many small headers, never ending: 431 at the cap, not before */
    size_t n = (size_t)snprintf(buf, sizeof buf, "GET /status HTTP/1.1\r\n");
    while (n < 2 * MOED_HTTP_MAX_REQUEST)
        n += (size_t)snprintf(buf + n, sizeof buf - n, "A: b\r\n");
    ck_assert_int_eq(moed_http_parse_request(buf, MOED_HTTP_MAX_REQUEST - 1, &r),
                     MOED_HTTP_NEED_MORE);
    ck_assert_int_eq(moed_http_parse_request(buf, MOED_HTTP_MAX_REQUEST, &r),
                     MOED_HTTP_HEAD_TOO_LARGE);
    ck_assert_int_eq(moed_http_parse_request(buf, n, &r), MOED_HTTP_HEAD_TOO_LARGE);
}
END_TEST

/* -------------------------------------------------------------- listener */

struct reply {
    int status;        /* -1: no status line (connection closed without reply) */
    char head[1024];
    char body[262144]; /* /metrics: ~50 KiB with a histogram per stage */
    size_t body_len;
    double secs;       /* connect to EOF */
};

enum { R_STATUS, R_METRICS, R_HEALTH_LOADING, R_HEALTH_UNHEALTHY, R_HEALTH_OK, R_HEAD, R_POST,
       R_404, R_GARBAGE, R_FRAG, R_PIPELINED, R_TIMEOUT, R_CAP_BUSY, R_WHILE_IDLE,
       R_OTHER_ADDR, R_PUSHED_OUT, R_COUNT };

struct harness {
    uv_loop_t loop;
    uv_async_t stop;
    struct moed_http *h;
    uint16_t port;
    struct moed_stats stats;
    struct moed_dims dims;
    uint64_t hits[3];
    atomic_int loaded, healthy;
    atomic_int snapshots;
    struct reply rep[R_COUNT];
    int idle_fd; /* left open across moed_http_stop */
};

static const struct moed_stats *snapshot(void *ctx)
{
    struct harness *t = ctx;
    t->stats.loaded = atomic_load(&t->loaded);
    t->stats.healthy = atomic_load(&t->healthy);
    atomic_fetch_add(&t->snapshots, 1);
    return &t->stats;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* A connection to 127.0.0.1:port from source address `from` (host order;
 * any 127/8 address is loopback). */
static int connect_from(uint16_t port, uint32_t from)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = {.tv_sec = 10};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in src = {.sin_family = AF_INET};
    src.sin_addr.s_addr = htonl(from);
    if (bind(fd, (struct sockaddr *)&src, sizeof src) != 0) {
        close(fd);
        return -1;
    }
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int connect_local(uint16_t port)
{
    return connect_from(port, INADDR_LOOPBACK);
}

/* Read to EOF and split the reply into status, head and body. */
static void read_reply(int fd, struct reply *r, double t0)
{
    static char raw[sizeof r->head + sizeof r->body];
    size_t n = 0;
    ssize_t k;
    while (n < sizeof raw - 1 && (k = read(fd, raw + n, sizeof raw - 1 - n)) > 0)
        n += (size_t)k;
    raw[n] = '\0';
    r->secs = now_s() - t0;
    r->status = -1;
    char *end = strstr(raw, "\r\n\r\n");
    if (!end || sscanf(raw, "HTTP/1.1 %d", &r->status) != 1)
        return;
    snprintf(r->head, sizeof r->head, "%.*s", (int)(end + 2 - raw), raw);
    r->body_len = n - (size_t)(end + 4 - raw);
    if (r->body_len > sizeof r->body - 1)
        r->body_len = sizeof r->body - 1;
    memcpy(r->body, end + 4, r->body_len);
    r->body[r->body_len] = '\0';
}

/* One request from `from`, written in pieces of `chunk` bytes (0: all at
 * once). */
static void request_from(uint16_t port, uint32_t from, const char *req, size_t chunk,
                         struct reply *r)
{
    double t0 = now_s();
    r->status = -2;
    int fd = connect_from(port, from);
    if (fd < 0)
        return;
    size_t n = strlen(req);
    for (size_t off = 0; off < n;) {
        size_t w = chunk && chunk < n - off ? chunk : n - off;
        if (write(fd, req + off, w) != (ssize_t)w)
            break;
        off += w;
        if (chunk)
            usleep(1000);
    }
    read_reply(fd, r, t0);
    close(fd);
}

static void request(uint16_t port, const char *req, size_t chunk, struct reply *r)
{
    request_from(port, INADDR_LOOPBACK, req, chunk, r);
}

static void *client(void *arg)
{
    struct harness *t = arg;
    uint16_t p = t->port;
    request(p, "GET /status HTTP/1.1\r\nHost: x\r\n\r\n", 0, &t->rep[R_STATUS]);
    request(p, "GET /metrics HTTP/1.0\r\n\r\n", 0, &t->rep[R_METRICS]);
    request(p, "GET /healthz HTTP/1.1\r\n\r\n", 0, &t->rep[R_HEALTH_LOADING]);
    atomic_store(&t->loaded, 1);
    request(p, "GET /healthz HTTP/1.1\r\n\r\n", 0, &t->rep[R_HEALTH_UNHEALTHY]);
    atomic_store(&t->healthy, 1);
    request(p, "GET /healthz HTTP/1.1\r\n\r\n", 0, &t->rep[R_HEALTH_OK]);
    request(p, "HEAD /healthz HTTP/1.1\r\n\r\n", 0, &t->rep[R_HEAD]);
    request(p, "POST /status HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 0, &t->rep[R_POST]);
    request(p, "GET /nope HTTP/1.1\r\n\r\n", 0, &t->rep[R_404]);
    request(p, "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 0, &t->rep[R_GARBAGE]);
    request(p, "GET /healthz HTTP/1.1\r\nHost: fragmented\r\n\r\n", 1, &t->rep[R_FRAG]);

    /* trailing bytes after the head (a pipelined request, junk): the reply
     * still arrives whole; they are drained, not answered */
    static char pipelined[6000];
    int n = snprintf(pipelined, sizeof pipelined, "GET /status HTTP/1.1\r\n\r\n");
    memset(pipelined + n, 'j', sizeof pipelined - 1 - (size_t)n);
    request(p, pipelined, 3000, &t->rep[R_PIPELINED]); /* 2nd write lands after the reply */

    /* slowloris: half a request, then silence -> 408 at the deadline */
    double t0 = now_s();
    int fd = connect_local(p);
    if (fd >= 0) {
        (void)!write(fd, "GET /sta", 8);
        read_reply(fd, &t->rep[R_TIMEOUT], t0);
        close(fd);
    }

    /* the cap (2 in this test): two idle connections fill it, a third is
     * answered 503; meanwhile the loop still serves once one slot frees */
    int a = connect_local(p), b = connect_local(p);
    usleep(200000); /* let the loop accept both */
    request(p, "GET /healthz HTTP/1.1\r\n\r\n", 0, &t->rep[R_CAP_BUSY]);
    if (a >= 0)
        close(a);
    usleep(100000);
    request(p, "GET /healthz HTTP/1.1\r\n\r\n", 0, &t->rep[R_WHILE_IDLE]);

    /* both slots held by idle connections of 127.0.0.1 (b, then c): a client
     * from 127.0.0.2 takes the slot of the oldest (b), which is answered 503 */
    int c = connect_local(p);
    usleep(200000);
    request_from(p, INADDR_LOOPBACK + 1, "GET /healthz HTTP/1.1\r\n\r\n", 0,
                 &t->rep[R_OTHER_ADDR]);
    if (b >= 0) {
        read_reply(b, &t->rep[R_PUSHED_OUT], now_s());
        close(b);
    }
    t->idle_fd = c; /* still open (and idle) when the server stops */
    uv_async_send(&t->stop);
    return NULL;
}

static void on_stop(uv_async_t *a)
{
    struct harness *t = a->data;
    moed_http_stop(t->h);
    uv_close((uv_handle_t *)a, NULL);
}

START_TEST(listener_routes)
{
    static struct harness t;
    memset(&t, 0, sizeof t);
    t.idle_fd = -1;
    ck_assert_int_eq(uv_loop_init(&t.loop), 0);
    t.dims.n_experts = 2;
    t.dims.n_shared = 1;
    t.dims.top_k = 1;
    snprintf(t.dims.family, sizeof t.dims.family, "qwen3_moe");
    t.hits[0] = 3;
    t.hits[1] = 4;
    t.hits[2] = 7;
    t.stats.version = "9.9.9";
    t.stats.dims = &t.dims;
    t.stats.model_path = "/tiny";
    t.stats.backend = "cpu";
    t.stats.requests = 42;
    t.stats.expert_hits = t.hits;
    t.stats.n_expert_hits = 3;
    char err[MOED_ERRLEN] = "";
    ck_assert_int_eq(moed_http_start(&t.loop, "127.0.0.1", 0, snapshot, &t, &t.h, err, sizeof err),
                     0);
    t.port = moed_http_port(t.h);
    ck_assert_uint_ne(t.port, 0);
    moed_http_set_limits(t.h, 2, 1000);

    /* the port is taken now: a second listener fails with BUSY and names it */
    struct moed_http *h2 = NULL;
    ck_assert_int_eq(moed_http_start(&t.loop, "127.0.0.1", t.port, snapshot, &t, &h2, err,
                                     sizeof err),
                     MOED_E_BUSY);
    ck_assert_ptr_null(h2);
    char want[64];
    snprintf(want, sizeof want, "listen on 127.0.0.1:%u failed: address already in use", t.port);
    ck_assert_msg(strstr(err, want), "err \"%s\" lacks \"%s\"", err, want);
    ck_assert_int_eq(moed_http_start(&t.loop, "localhost", 1, snapshot, &t, &h2, err, sizeof err),
                     MOED_E_CONFIG);
    ck_assert_str_eq(err, "http: address \"localhost\" is not an IPv4 or IPv6 literal");

    ck_assert_int_eq(uv_async_init(&t.loop, &t.stop, on_stop), 0);
    t.stop.data = &t;
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, client, &t), 0);
    /* returns only once every handle is closed: stop closed the idle one too */
    ck_assert_int_eq(uv_run(&t.loop, UV_RUN_DEFAULT), 0);
    pthread_join(th, NULL);
    ck_assert_int_eq(uv_loop_close(&t.loop), 0);
    /* the idle connection saw EOF, without a reply */
    if (t.idle_fd >= 0) {
        char c;
        ck_assert_int_le(read(t.idle_fd, &c, 1), 0);
        close(t.idle_fd);
    }

    struct reply *r = &t.rep[R_STATUS];
    ck_assert_int_eq(r->status, 200);
    ck_assert_ptr_nonnull(strstr(r->head, "Content-Type: application/json\r\n"));
    ck_assert_ptr_nonnull(strstr(r->head, "Connection: close\r\n"));
    char cl[64];
    snprintf(cl, sizeof cl, "Content-Length: %zu\r\n", r->body_len);
    ck_assert_msg(strstr(r->head, cl), "head lacks %s: %s", cl, r->head);
    cJSON *j = cJSON_Parse(r->body);
    ck_assert_msg(j != NULL, "body is not JSON: %s", r->body);
    ck_assert_str_eq(cJSON_GetObjectItem(j, "version")->valuestring, "9.9.9");
    ck_assert_double_eq(
        cJSON_GetObjectItem(cJSON_GetObjectItem(j, "requests"), "served")->valuedouble, 42);
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "model"), "family")->valuestring,
                     "qwen3_moe");
    cJSON_Delete(j);

    r = &t.rep[R_METRICS];
    ck_assert_int_eq(r->status, 200);
    ck_assert_ptr_nonnull(strstr(r->head, "Content-Type: text/plain; version=0.0.4"));
    ck_assert_ptr_nonnull(strstr(r->body, "\nmoed_requests_total 42\n"));
    ck_assert_ptr_nonnull(strstr(r->body, "\nmoed_expert_hits_total{layer=\"0\",expert=\"2\"} 7\n"));
    ck_assert(r->body_len > 0 && r->body[r->body_len - 1] == '\n');

    ck_assert_int_eq(t.rep[R_HEALTH_LOADING].status, 503);
    ck_assert_str_eq(t.rep[R_HEALTH_LOADING].body, "not ready\n");
    ck_assert_int_eq(t.rep[R_HEALTH_UNHEALTHY].status, 503);
    ck_assert_str_eq(t.rep[R_HEALTH_UNHEALTHY].body, "unhealthy\n");
    ck_assert_int_eq(t.rep[R_HEALTH_OK].status, 200);
    ck_assert_str_eq(t.rep[R_HEALTH_OK].body, "ok\n");
    ck_assert_ptr_nonnull(strstr(t.rep[R_HEALTH_OK].head, "Content-Type: text/plain"));

    r = &t.rep[R_HEAD]; /* HEAD: the GET headers, no body */
    ck_assert_int_eq(r->status, 200);
    ck_assert_ptr_nonnull(strstr(r->head, "Content-Length: 3\r\n"));
    ck_assert_uint_eq(r->body_len, 0);

    r = &t.rep[R_POST];
    ck_assert_int_eq(r->status, 405);
    ck_assert_ptr_nonnull(strstr(r->head, "HTTP/1.1 405 Method Not Allowed\r\n"));
    ck_assert_ptr_nonnull(strstr(r->head, "Allow: GET, HEAD\r\n"));
    ck_assert_str_eq(r->body, "405 method \"POST\" not allowed (GET, HEAD)\n");

    ck_assert_int_eq(t.rep[R_404].status, 404);
    ck_assert_str_eq(t.rep[R_404].body, "404 no such path \"/nope\" (/status, /metrics, /healthz)\n");

    r = &t.rep[R_GARBAGE]; /* a TLS ClientHello */
    ck_assert_int_eq(r->status, 400);
    ck_assert_str_eq(r->body, "400 byte 0x16 at offset 0 is not printable ASCII\n");

    ck_assert_int_eq(t.rep[R_FRAG].status, 200);
    ck_assert_str_eq(t.rep[R_FRAG].body, "ok\n");

    r = &t.rep[R_PIPELINED];
    ck_assert_int_eq(r->status, 200);
    j = cJSON_Parse(r->body);
    ck_assert_msg(j != NULL, "pipelined: body is not JSON: %s", r->body);
    cJSON_Delete(j);

    r = &t.rep[R_TIMEOUT]; /* answered 408 at the 1 s deadline (the answer deadline is
                              shorter than the default header deadline here) */
    ck_assert_int_eq(r->status, 408);
    ck_assert_str_eq(r->body, "408 request head not complete in time\n");
    ck_assert_msg(r->secs > 0.8 && r->secs < 5.0, "slow client closed after %.3f s", r->secs);

    r = &t.rep[R_CAP_BUSY];
    ck_assert_int_eq(r->status, 503);
    ck_assert_str_eq(r->body, "busy\n");
    ck_assert_int_eq(t.rep[R_WHILE_IDLE].status, 200);
    ck_assert_int_eq(t.rep[R_OTHER_ADDR].status, 200);
    ck_assert_int_eq(t.rep[R_PUSHED_OUT].status, 503);
    ck_assert_str_eq(t.rep[R_PUSHED_OUT].body, "busy\n");

    /* all requests but the busy ones and the timed-out one took a snapshot
     * (the errors did not) */
    ck_assert_int_eq(atomic_load(&t.snapshots), 10);
}
END_TEST

int main(void)
{
    /* as in the daemon: a peer that hangs up must give EPIPE, not kill us */
    signal(SIGPIPE, SIG_IGN);
    Suite *su = suite_create("http");
    TCase *tp = tcase_create("parser");
    tcase_add_test(tp, parse_complete);
    tcase_add_test(tp, parse_fragmented);
    tcase_add_test(tp, parse_bad);
    tcase_add_test(tp, parse_nul_bytes);
    tcase_add_test(tp, parse_limits);
    suite_add_tcase(su, tp);
    TCase *tl = tcase_create("listener");
    tcase_set_timeout(tl, 30);
    tcase_add_test(tl, listener_routes);
    suite_add_tcase(su, tl);
    return moed_check_run(su);
}
