/* test_client.c - the C client library (ipc/client.c) against an in-process
 * fake daemon on a temporary Unix socket: round trips, daemon errors passed
 * through with their message, pipelined out-of-order replies, and malformed
 * replies (oversized, truncated, wrong id, silence) turned into errors. */
#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "moed_client.h"
#include "check_main.h"
#include "moe_gpu_abi.h"

#define H 8
#define K 2
#define E 4
#define MAX_T 16

enum mode {
    MODE_GOOD,       /* a correct daemon; FORWARD y = x */
    MODE_REVERSE3,   /* FORWARDs answered in reverse order, 3 at a time */
    MODE_HUGE,       /* replies with payload_len 2^40 */
    MODE_TRUNCATE,   /* a reply header, then hang up */
    MODE_WRONG_ID,   /* a reply with request_id + 1 */
    MODE_SILENT,     /* never answers */
    MODE_SILENT_V2,  /* HELLO answered with version 2, then nothing */
    MODE_BAD_FWD,    /* FORWARD reply with the wrong T */
    MODE_REFUSE,     /* an ERROR busy at accept, then close without reading */
};

struct fake {
    char dir[64];
    char path[108];
    int lfd;
    enum mode mode;
    pthread_t tid;
};

static int read_n(int fd, uint8_t *b, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, b + got, n - got);
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

static void write_n(int fd, const void *b, size_t n)
{
    const uint8_t *p = b;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w <= 0)
            return;
        p += w;
        n -= (size_t)w;
    }
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void send_frame(int fd, uint16_t type, uint64_t id, const void *p, size_t n)
{
    uint8_t h[32];
    moed_frame_encode(h, type, id, n);
    write_n(fd, h, 32);
    if (n)
        write_n(fd, p, n);
}

static void send_error(int fd, uint64_t id, int code, const char *msg)
{
    uint8_t b[8 + MOED_PROTO_MAX_ERRMSG];
    size_t n = strlen(msg);
    put32(b, (uint32_t)code);
    put32(b + 4, (uint32_t)n);
    memcpy(b + 8, msg, n);
    send_frame(fd, MOED_MSG_ERROR | MOED_PROTO_REPLY, id, b, 8 + n);
}

static int layers_1_to_3(const void *ctx, uint32_t layer)
{
    (void)ctx;
    return layer >= 1 && layer <= 3;
}

/* The FORWARD reply payload (y = x) into out; returns its length, or 0 with
 * the code and message of moed_forward_validate. */
static size_t forward_reply(const uint8_t *p, uint64_t n, uint8_t *out, char *msg, int *code)
{
    struct moed_forward_req req;
    *code = moed_forward_validate(p, n, H, E, K, MAX_T, layers_1_to_3, NULL, &req, msg,
                                  MOED_PROTO_MAX_ERRMSG);
    if (*code)
        return 0;
    put32(out, req.n_tokens);
    put32(out + 4, H);
    memcpy(out + 8, p + 16, 2u * req.n_tokens * H);
    return 8 + 2u * req.n_tokens * H;
}

static void *fake_main(void *arg)
{
    struct fake *f = arg;
    int fd = accept(f->lfd, NULL, NULL);
    if (f->mode == MODE_REFUSE) {
        send_error(fd, 0, MOED_E_BUSY, "too many clients (limit 1)");
        close(fd);
        return NULL;
    }
    uint8_t *p = malloc(1 << 20);
    uint8_t *queued[3];
    size_t qlen[3];
    uint64_t qid[3];
    int nq = 0;
    char msg[MOED_PROTO_MAX_ERRMSG];
    for (;;) {
        uint8_t hb[32];
        struct moed_frame_hdr h;
        if (fd < 0 || read_n(fd, hb, 32) || moed_frame_parse(hb, 32, 1 << 20, &h) < 0 ||
            read_n(fd, p, (size_t)h.payload_len))
            break;
        if (f->mode == MODE_SILENT || (f->mode == MODE_SILENT_V2 && h.type != MOED_MSG_HELLO))
            continue;
        if (f->mode == MODE_HUGE) {
            uint8_t r[32];
            moed_frame_encode(r, h.type | MOED_PROTO_REPLY, h.request_id, 1ull << 40);
            write_n(fd, r, 32);
            continue;
        }
        if (f->mode == MODE_TRUNCATE) {
            uint8_t r[32];
            moed_frame_encode(r, h.type | MOED_PROTO_REPLY, h.request_id, 8);
            write_n(fd, r, 32);
            break;
        }
        uint64_t id = h.request_id + (f->mode == MODE_WRONG_ID);
        switch (h.type) {
        case MOED_MSG_HELLO: {
            uint8_t r[64 + 4 + 3 * 4] = {0}; /* version 2: and the MoE layers 1, 2, 3 */
            const int v2 = f->mode == MODE_SILENT_V2;
            r[0] = v2 ? 2 : 1;
            put32(r + 4, H);
            put32(r + 8, 16);
            put32(r + 12, E);
            put32(r + 16, K);
            put32(r + 24, 4);
            put32(r + 28, 1);
            put32(r + 32, MAX_T);
            put32(r + 40, 1 << 20);
            memcpy(r + 48, "fake", 4);
            put32(r + 64, 3);
            for (int l = 0; l < 3; l++)
                put32(r + 68 + 4 * l, (uint32_t)l + 1);
            send_frame(fd, MOED_MSG_HELLO | MOED_PROTO_REPLY, h.request_id, r, v2 ? sizeof r : 64);
            break;
        }
        case MOED_MSG_PING:
            send_frame(fd, MOED_MSG_PING | MOED_PROTO_REPLY, id, p, (size_t)h.payload_len);
            break;
        case MOED_MSG_STATUS:
            send_frame(fd, MOED_MSG_STATUS | MOED_PROTO_REPLY, id, "{\"ok\":true}", 11);
            break;
        case MOED_MSG_FORWARD: {
            uint8_t *out = malloc(8 + 2 * MAX_T * H);
            int code;
            size_t n = forward_reply(p, h.payload_len, out, msg, &code);
            if (!n) {
                send_error(fd, id, code, msg);
                free(out);
                break;
            }
            if (f->mode == MODE_BAD_FWD)
                put32(out, 1 + (out[0] | out[1] << 8));
            if (f->mode != MODE_REVERSE3) {
                send_frame(fd, MOED_MSG_FORWARD | MOED_PROTO_REPLY, id, out, n);
                free(out);
                break;
            }
            queued[nq] = out;
            qlen[nq] = n;
            qid[nq++] = id;
            if (nq == 3) {
                while (nq--) {
                    send_frame(fd, MOED_MSG_FORWARD | MOED_PROTO_REPLY, qid[nq], queued[nq],
                               qlen[nq]);
                    free(queued[nq]);
                }
                nq = 0;
            }
            break;
        }
        default:
            send_error(fd, id, MOED_E_UNSUPPORTED, "not supported");
        }
    }
    free(p);
    if (fd >= 0)
        close(fd);
    return NULL;
}

static void fake_start(struct fake *f, enum mode mode)
{
    memset(f, 0, sizeof *f);
    strcpy(f->dir, "/tmp/moedc-test-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(f->dir));
    snprintf(f->path, sizeof f->path, "%s/s", f->dir);
    f->mode = mode;
    f->lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, f->path);
    ck_assert_int_eq(bind(f->lfd, (struct sockaddr *)&sa, sizeof sa), 0);
    ck_assert_int_eq(listen(f->lfd, 4), 0);
    ck_assert_int_eq(pthread_create(&f->tid, NULL, fake_main, f), 0);
}

static void fake_stop(struct fake *f, struct moedc *c)
{
    moedc_close(c); /* the fake's read fails and its thread ends */
    pthread_join(f->tid, NULL);
    close(f->lfd);
    unlink(f->path);
    rmdir(f->dir);
}

static void batch(uint32_t T, uint16_t *x, int32_t *ids, float *w, uint32_t seed)
{
    for (uint32_t i = 0; i < T * H; i++)
        x[i] = (uint16_t)(0x3f80 + (i * 7 + seed) % 300);
    for (uint32_t i = 0; i < T * K; i++) {
        ids[i] = (int32_t)((i + seed) % E);
        w[i] = 0.5f;
    }
}

START_TEST(test_round_trip)
{
    struct fake f;
    struct moedc *c;
    char err[MOED_ERRLEN];
    fake_start(&f, MODE_GOOD);
    ck_assert_int_eq(moedc_connect(f.path, 5000, &c, err, sizeof err), 0);
    struct moed_hello_rep h;
    ck_assert_int_eq(moedc_hello(c, &h, err, sizeof err), 0);
    ck_assert_uint_eq(h.hidden, H);
    ck_assert_uint_eq(h.top_k, K);
    ck_assert_uint_eq(h.n_experts, E);
    ck_assert_uint_eq(h.max_tokens, MAX_T);
    ck_assert_uint_eq(h.first_moe_layer, 1);
    ck_assert_uint_eq(h.max_frame_bytes, 1 << 20);
    ck_assert_str_eq(h.backend, "fake");

    uint16_t x[5 * H], y[5 * H];
    int32_t ids[5 * K];
    float w[5 * K];
    batch(5, x, ids, w, 1);
    memset(y, 0, sizeof y);
    ck_assert_int_eq(moedc_forward(c, 2, 5, K, x, ids, w, y, err, sizeof err), 0);
    ck_assert_mem_eq(x, y, sizeof x);

    uint64_t rtt = 0;
    ck_assert_int_eq(moedc_ping(c, &rtt, err, sizeof err), 0);
    ck_assert_uint_gt(rtt, 0);
    char *js = NULL;
    ck_assert_int_eq(moedc_status(c, &js, err, sizeof err), 0);
    ck_assert_str_eq(js, "{\"ok\":true}");
    free(js);
    fake_stop(&f, c);
}
END_TEST

START_TEST(test_daemon_error_passthrough)
{
    struct fake f;
    struct moedc *c;
    char err[MOED_ERRLEN];
    fake_start(&f, MODE_GOOD);
    ck_assert_int_eq(moedc_connect(f.path, 5000, &c, err, sizeof err), 0);
    uint16_t x[2 * H], y[2 * H];
    int32_t ids[2 * K];
    float w[2 * K];
    batch(2, x, ids, w, 0);
    /* No explicit HELLO: forward sends it. */
    ck_assert_int_eq(moedc_forward(c, 7, 2, K, x, ids, w, y, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "layer 7 is not an MoE layer of this model");
    ids[3] = 4;
    ck_assert_int_eq(moedc_forward(c, 1, 2, K, x, ids, w, y, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "expert id 4 at token 1 slot 1 is out of range [0, 4)");
    ids[3] = 3;
    /* The connection survives daemon errors. */
    ck_assert_int_eq(moedc_forward(c, 1, 2, K, x, ids, w, y, err, sizeof err), 0);
    ck_assert_mem_eq(x, y, sizeof x);
    /* Local checks before sending. */
    ck_assert_int_eq(moedc_forward(c, 1, MAX_T + 1, K, x, ids, w, y, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "n_tokens 17 is out of range [0, 16]");
    /* This fake daemon speaks version 1: flags are refused before anything is sent. */
    ck_assert_int_eq(moedc_forward_flags(c, 1, 2, K, x, ids, w, MOED_FORWARD_ROUTED_ONLY, y, err,
                                         sizeof err), MOED_E_VERSION);
    ck_assert_str_eq(err, "forward flags 0x1 need protocol version 2; the daemon speaks version 1");
    ck_assert_int_eq(moedc_forward_flags(c, 1, 2, K, x, ids, w, 0x4, y, err, sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "forward flags 0x4 has unknown bits 0x4");
    ck_assert_int_eq(moedc_forward(c, 1, 0, K, NULL, NULL, NULL, NULL, err, sizeof err),
                     MOED_E_VERSION);
    ck_assert_str_eq(err, "n_tokens 0 needs protocol version 2; the daemon speaks version 1");
    uint32_t layers[8];
    ck_assert_uint_eq(moedc_moe_layers(c, layers, 8), 3); /* version 1: first_moe_layer 1 .. 3 */
    ck_assert_uint_eq(layers[0], 1);
    ck_assert_uint_eq(layers[2], 3);
    ck_assert_int_eq(moedc_forward(c, 1, 2, K, x, ids, w, NULL, err, sizeof err), MOED_E_INVAL);
    fake_stop(&f, c);
}
END_TEST

START_TEST(test_pipelined_out_of_order)
{
    struct fake f;
    struct moedc *c;
    char err[MOED_ERRLEN];
    fake_start(&f, MODE_REVERSE3);
    ck_assert_int_eq(moedc_connect(f.path, 5000, &c, err, sizeof err), 0);
    uint16_t x[3][3 * H];
    int32_t ids[3][3 * K];
    float w[3][3 * K];
    for (uint32_t i = 0; i < 3; i++) {
        batch(i + 1, x[i], ids[i], w[i], i);
        ck_assert_int_eq(moedc_send_forward(c, 100 + i, 1, i + 1, K, x[i], ids[i], w[i], err,
                                            sizeof err), 0);
    }
    ck_assert_uint_eq(moedc_inflight(c), 3);
    uint64_t rtt;
    ck_assert_int_eq(moedc_ping(c, &rtt, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "3 pipelined requests are outstanding; moedc_recv them first");
    for (int i = 2; i >= 0; i--) {
        struct moedc_reply r;
        ck_assert_int_eq(moedc_recv(c, &r, err, sizeof err), 0);
        ck_assert_uint_eq(r.request_id, 100 + (uint64_t)i);
        ck_assert_int_eq(r.from_daemon, 1);
        ck_assert_int_eq(r.code, 0);
        ck_assert_uint_eq(r.n_tokens, (uint32_t)i + 1);
        ck_assert_uint_eq(r.hidden, H);
        ck_assert_mem_eq(r.y, x[i], (size_t)(i + 1) * H * 2);
    }
    struct moedc_reply r;
    ck_assert_int_eq(moedc_recv(c, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "moedc_recv: no request is in flight");
    fake_stop(&f, c);
}
END_TEST

START_TEST(test_pipelined_error)
{
    struct fake f;
    struct moedc *c;
    char err[MOED_ERRLEN];
    fake_start(&f, MODE_GOOD);
    ck_assert_int_eq(moedc_connect(f.path, 5000, &c, err, sizeof err), 0);
    uint16_t x[H];
    int32_t ids[K];
    float w[K];
    batch(1, x, ids, w, 0);
    ck_assert_int_eq(moedc_send_forward(c, 41, 0, 1, K, x, ids, w, err, sizeof err), 0);
    struct moedc_reply r;
    ck_assert_int_eq(moedc_recv(c, &r, err, sizeof err), MOED_E_INVAL);
    ck_assert_uint_eq(r.request_id, 41);
    ck_assert_int_eq(r.from_daemon, 1);
    ck_assert_int_eq(r.code, MOED_E_INVAL);
    ck_assert_str_eq(err, "layer 0 is not an MoE layer of this model");
    ck_assert_uint_eq(moedc_inflight(c), 0);
    fake_stop(&f, c);
}
END_TEST

/* A malformed reply is a local error, never a crash; the connection is then
 * unusable. */
static void bad_reply_case(enum mode mode, int code, const char *msg)
{
    struct fake f;
    struct moedc *c;
    char err[MOED_ERRLEN];
    fake_start(&f, mode);
    ck_assert_int_eq(moedc_connect(f.path, mode == MODE_SILENT ? 200 : 5000, &c, err,
                                   sizeof err), 0);
    uint64_t rtt;
    ck_assert_int_eq(moedc_ping(c, &rtt, err, sizeof err), code);
    ck_assert_msg(strstr(err, msg) != NULL, "'%s' does not contain '%s'", err, msg);
    ck_assert_int_eq(moedc_ping(c, &rtt, err, sizeof err), MOED_E_CONN);
    ck_assert_str_eq(err, "connection is unusable after an earlier failure; reconnect");
    fake_stop(&f, c);
}

START_TEST(test_bad_replies)
{
    bad_reply_case(MODE_HUGE, MOED_E_PROTO,
                   "reply type 0x8004 has a 1099511627776-byte payload, over its bound 64");
    bad_reply_case(MODE_TRUNCATE, MOED_E_CONN,
                   "the daemon closed the connection");
    bad_reply_case(MODE_WRONG_ID, MOED_E_PROTO, "reply carries request id 2, expected 1");
    bad_reply_case(MODE_SILENT, MOED_E_TIMEOUT, "no reply from the daemon within 200 ms");
}
END_TEST

/* moedc_forward_desc's spin for its reply ends at the call's timeout: with a
 * 200 ms timeout and a spin of 10 minutes the silent daemon's call fails with
 * the timeout (a spin past it would outlast the test case's limit). */
START_TEST(test_forward_desc_spin_ends_at_the_timeout)
{
    struct fake f;
    struct moedc *c;
    char err[MOED_ERRLEN];
    struct moed_hello_rep h;
    fake_start(&f, MODE_SILENT_V2);
    ck_assert_int_eq(moedc_connect(f.path, 200, &c, err, sizeof err), 0);
    ck_assert_int_eq(moedc_hello(c, &h, err, sizeof err), 0);
    ck_assert_int_eq(h.version, 2);
    moedc_set_spin_us(c, 600u * 1000 * 1000);
    const struct moedc_bufref r = {1, 0};
    ck_assert_int_eq(moedc_forward_desc(c, 1, 1, K, &r, &r, &r, &r, err, sizeof err),
                     MOED_E_TIMEOUT);
    ck_assert_str_eq(err, "no reply from the daemon within 200 ms");
    fake_stop(&f, c);
}
END_TEST

/* moedc_forward_desc_times refuses a NULL place for the times before it
 * sends anything: the connection stays usable (a PING after it). */
START_TEST(test_forward_desc_times_null_args)
{
    struct fake f;
    struct moedc *c;
    char err[MOED_ERRLEN];
    struct moed_hello_rep h;
    fake_start(&f, MODE_GOOD);
    ck_assert_int_eq(moedc_connect(f.path, 5000, &c, err, sizeof err), 0);
    ck_assert_int_eq(moedc_hello(c, &h, err, sizeof err), 0);
    const struct moedc_bufref r = {1, 0};
    ck_assert_int_eq(moedc_forward_desc_times(c, 1, 1, K, &r, &r, &r, &r, NULL, err,
                                              sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "moedc_forward_desc_times: times is NULL");
    uint64_t rtt = 0;
    ck_assert_int_eq(moedc_ping(c, &rtt, err, sizeof err), 0);
    fake_stop(&f, c);
}
END_TEST

START_TEST(test_bad_forward_reply)
{
    struct fake f;
    struct moedc *c;
    char err[MOED_ERRLEN];
    fake_start(&f, MODE_BAD_FWD);
    ck_assert_int_eq(moedc_connect(f.path, 5000, &c, err, sizeof err), 0);
    uint16_t x[2 * H], y[2 * H];
    int32_t ids[2 * K];
    float w[2 * K];
    batch(2, x, ids, w, 0);
    ck_assert_int_eq(moedc_forward(c, 1, 2, K, x, ids, w, y, err, sizeof err), MOED_E_PROTO);
    ck_assert_str_eq(err, "FORWARD reply says T=3, H=8 in 40 bytes; expected T=2, H=8 in 40 bytes");
    fake_stop(&f, c);
}
END_TEST

/* A daemon that refuses a client writes its ERROR and closes: the client's
 * next write fails with EPIPE, and the client reports the daemon's error
 * that is waiting in its receive queue, not the broken pipe. */
START_TEST(test_refused_error_after_epipe)
{
    struct fake f;
    struct moedc *c;
    char err[MOED_ERRLEN];
    fake_start(&f, MODE_REFUSE);
    ck_assert_int_eq(moedc_connect(f.path, 5000, &c, err, sizeof err), 0);
    pthread_join(f.tid, NULL); /* the fake has written and closed */
    uint16_t x[MAX_T * H], y[MAX_T * H];
    int32_t ids[MAX_T * K];
    float w[MAX_T * K];
    batch(MAX_T, x, ids, w, 0);
    /* moedc_forward sends HELLO first: the write that fails */
    int rc = moedc_forward(c, 1, MAX_T, K, x, ids, w, y, err, sizeof err);
    ck_assert_int_eq(rc, MOED_E_BUSY);
    ck_assert_str_eq(err, "too many clients (limit 1)");
    moedc_close(c);
    close(f.lfd);
    unlink(f.path);
    rmdir(f.dir);
}
END_TEST

START_TEST(test_connect_errors)
{
    struct moedc *c = (struct moedc *)1;
    char err[MOED_ERRLEN];
    ck_assert_int_eq(moedc_connect("/nonexistent-dir/moed.sock", 100, &c, err, sizeof err),
                     MOED_E_CONN);
    ck_assert_ptr_null(c);
    ck_assert_str_eq(err, "connect to /nonexistent-dir/moed.sock: No such file or directory");
    char longp[200];
    memset(longp, 'a', sizeof longp - 1);
    longp[sizeof longp - 1] = 0;
    ck_assert_int_eq(moedc_connect(longp, 100, &c, err, sizeof err), MOED_E_INVAL);
    ck_assert_msg(strstr(err, "is 199 bytes, over the 107-byte limit") != NULL, "%s", err);
    ck_assert_str_eq(moedc_strerror(MOED_E_TOOBIG), "payload too large");
    moedc_close(NULL);
}
END_TEST

/* A listener whose backlog is full and that never accepts: once the backlog
 * is taken, moedc_connect must fail with a timeout naming the cause, never
 * return a socket that is not connected. */
START_TEST(test_connect_backlog_full)
{
    char dir[] = "/tmp/moedc-bl-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s/s", dir);
    int l = socket(AF_UNIX, SOCK_STREAM, 0);
    ck_assert_int_ge(l, 0);
    ck_assert_int_eq(bind(l, (struct sockaddr *)&sa, sizeof sa), 0);
    ck_assert_int_eq(listen(l, 0), 0);
    char err[MOED_ERRLEN];
    struct moedc *cs[8] = {0};
    int timeouts = 0, ok = 0;
    for (int i = 0; i < 8; i++) {
        int rc = moedc_connect(sa.sun_path, 100, &cs[i], err, sizeof err);
        if (rc == 0) {
            ck_assert_msg(timeouts == 0, "connect %d succeeded after a refusal", i);
            ok++;
        } else {
            ck_assert_int_eq(rc, MOED_E_TIMEOUT);
            ck_assert_msg(strstr(err, "listener busy (backlog full) for 100 ms") != NULL, "%s", err);
            timeouts++;
        }
    }
    ck_assert_int_ge(timeouts, 1);
    ck_assert_int_le(ok, 2);
    for (int i = 0; i < 8; i++)
        moedc_close(cs[i]);
    close(l);
    unlink(sa.sun_path);
    rmdir(dir);
}
END_TEST

/* The GPU side of a channel (client_gpu.c) where it can run without a GPU:
 * its argument checks, and, for a plausible channel, MOED_E_UNSUPPORTED
 * with the reason: this process has no current CUDA context (or no driver,
 * or no GPU), so the driver is never asked to open the handle. */
START_TEST(test_chan_gpu_errors)
{
    char err[MOED_ERRLEN];
    struct moedc_chan *ch = (struct moedc_chan *)&err; /* must be cleared */
    static const char fatbin[] = "not a fatbin";
    struct moedc_chan_info info = {.chan_id = 1, .slots = 8, .key = 5,
                                   .size = sizeof(struct moe_gpu_chan),
                                   .abi_version = MOE_GPU_ABI_VERSION, .kernel = (void *)fatbin,
                                   .kernel_bytes = sizeof fatbin};
    ck_assert_int_eq(moedc_chan_attach(NULL, &ch, err, sizeof err), MOED_E_INVAL);
    ck_assert_ptr_null(ch);
    info.abi_version = 1;
    ck_assert_int_eq(moedc_chan_attach(&info, &ch, err, sizeof err), MOED_E_VERSION);
    char want[128];
    snprintf(want, sizeof want, "the daemon's channel ABI is version 1; this library speaks %u",
             (unsigned)MOE_GPU_ABI_VERSION);
    ck_assert_str_eq(err, want);
    info.abi_version = MOE_GPU_ABI_VERSION;
    info.size = sizeof(struct moe_gpu_chan) - 1; /* 1215 */
    ck_assert_int_eq(moedc_chan_attach(&info, &ch, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "moedc_chan_attach: not an open channel's info (kernel 13 bytes, "
                          "size 1215, slots 8)");
    info.size = sizeof(struct moe_gpu_chan);
    info.arena_bytes = 64; /* an arena inside the ring */
    info.arena_off = 512;
    ck_assert_int_eq(moedc_chan_attach(&info, &ch, err, sizeof err), MOED_E_INVAL);
    ck_assert_str_eq(err, "moedc_chan_attach: an arena at offset 512 overlaps the 1216-byte "
                          "channel");
    info.arena_off = 4096;
    uint64_t ab = 7;
    ck_assert_uint_eq(moedc_chan_arena(NULL, &ab), 0); /* no channel: no arena */
    ck_assert_uint_eq(ab, 0);
    int rc = moedc_chan_attach(&info, &ch, err, sizeof err);
    ck_assert_int_eq(rc, MOED_E_UNSUPPORTED);
    ck_assert_ptr_null(ch);
    ck_assert_msg(strncmp(err, "moedc_chan_attach: ", 19) == 0 &&
                      (strstr(err, "libcuda.so.1") || strstr(err, "cuInit") ||
                       strstr(err, "no current CUDA context")),
                  "%s", err);
    struct moedc_chanref r = {0, 0};
    uint64_t dev = 0;
    ck_assert_int_eq(moedc_chan_call(NULL, NULL, 0, 1, 0, &r, &r, &r, &r, &dev, 1000, err,
                                     sizeof err),
                     MOED_E_INVAL);
    ck_assert_str_eq(err, "moedc_chan_call: the channel, the four refs and err_dev are required");
    moedc_chan_detach(NULL);
}
END_TEST

static Suite *client_suite(void)
{
    Suite *s = suite_create("client");
    TCase *tc = tcase_create("fake-daemon");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_daemon_error_passthrough);
    tcase_add_test(tc, test_pipelined_out_of_order);
    tcase_add_test(tc, test_pipelined_error);
    tcase_add_test(tc, test_bad_replies);
    tcase_add_test(tc, test_bad_forward_reply);
    tcase_add_test(tc, test_forward_desc_spin_ends_at_the_timeout);
    tcase_add_test(tc, test_forward_desc_times_null_args);
    tcase_add_test(tc, test_refused_error_after_epipe);
    tcase_add_test(tc, test_connect_errors);
    tcase_add_test(tc, test_connect_backlog_full);
    tcase_add_test(tc, test_chan_gpu_errors);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return moed_check_run(client_suite());
}
