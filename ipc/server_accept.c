/* server_accept.c - the socket server's listener (see server.c and
 * server_int.h): accept and peer check (SO_PEERCRED), socket path, mode and
 * group, open, stop and close. */
#include "server.h"
#include "server_int.h"

#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "bufpool.h"
#include "moed_check_uv.h"
#include "moed_err.h"
#include "moed_le.h"
#include "moed_log.h"

/* ---- accept ---------------------------------------------------------------- */

static int peer_allowed(const struct moed_server *srv, uid_t uid, gid_t gid)
{
    /* The daemon's own uid and root are always allowed (the operator must be
     * able to run moectl); the lists add more. */
    if (uid == 0 || uid == geteuid())
        return 1;
    for (uint32_t i = 0; i < srv->cfg.n_allowed_uids; i++)
        if (srv->cfg.allowed_uids[i] == uid)
            return 1;
    for (uint32_t i = 0; i < srv->cfg.n_allowed_gids; i++)
        if (srv->cfg.allowed_gids[i] == gid)
            return 1;
    return 0;
}

/* Ask for a kernel send buffer that holds a whole reply. An AF_UNIX stream
 * socket charges queued bytes to the sender's SO_SNDBUF (the receiver's
 * SO_RCVBUF plays no part), and the default (net.core.wmem_default, ~208 KiB)
 * is smaller than one T=64, H=2048 FORWARD reply (256 KiB): the write then
 * stops half-way until the client has read the first part, which costs a
 * wake-up of each side and a second pass through the loop per reply. The
 * kernel caps the value at net.core.wmem_max; we say so once. */
static void conn_set_sndbuf(struct moed_conn *c, uv_os_fd_t fd)
{
    struct moed_server *srv = c->srv;
    uint64_t want64 = srv->cfg.socket_buffer_bytes;
    if (want64 == 0)
        return;
    int want = want64 > INT_MAX / 2 ? INT_MAX / 2 : (int)want64;
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want) < 0) {
        LOG_D("client %llu: SO_SNDBUF %d: %s", (unsigned long long)c->id, want, strerror(errno));
        return;
    }
    if (srv->sndbuf_logged)
        return;
    srv->sndbuf_logged = 1;
    int got = 0;
    socklen_t gl = sizeof got;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &got, &gl) < 0)
        return;
    /* Linux reports twice the value it accepted (the other half is its
     * bookkeeping overhead). */
    if (got / 2 < want)
        LOG_I("server.socket_buffer_bytes %d capped by the kernel to %d (net.core.wmem_max); "
              "replies larger than that are written in several steps",
              want, got / 2);
    else
        LOG_D("client sockets: SO_SNDBUF %d (kernel reports %d)", want, got);
}

static void on_connection(uv_stream_t *ls, int status)
{
    struct moed_server *srv = ls->data;
    if (status < 0) {
        LOG_W("accept: %s", uv_strerror(status));
        return;
    }
    struct moed_conn *c = calloc(1, sizeof *c);
    if (!c) {
        LOG_E("accept: out of memory");
        return;
    }
    c->srv = srv;
    c->id = ++srv->next_id;
    /* On Unix neither init can fail (libuv 1.x returns 0): checked for the log. */
    MOED_UV_CHECK(uv_pipe_init(srv->loop, &c->pipe, 0));
    MOED_UV_CHECK(uv_timer_init(srv->loop, &c->timer));
    c->pipe.data = c;
    c->timer.data = c;
    c->handles_open = 2;
    c->next = srv->conns;
    if (srv->conns)
        srv->conns->prev = c;
    srv->conns = c;
    if (uv_accept(ls, (uv_stream_t *)&c->pipe) < 0) {
        c->closing = 1;
        conn_close_now(c);
        return;
    }
    uv_os_fd_t fd;
    struct ucred cred = {0};
    socklen_t clen = sizeof cred;
    if (uv_fileno((uv_handle_t *)&c->pipe, &fd) < 0 ||
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) < 0) {
        LOG_W("client %llu: SO_PEERCRED failed: %s", (unsigned long long)c->id, strerror(errno));
        c->closing = 1;
        conn_close_now(c);
        return;
    }
    char msg[160];
    if (!peer_allowed(srv, cred.uid, cred.gid)) {
        srv->counters.clients_refused++;
        snprintf(msg, sizeof msg, "peer uid %u gid %u is not allowed (server.allowed_uids/allowed_gids)",
                 (unsigned)cred.uid, (unsigned)cred.gid);
        LOG_W("client %llu (pid %d): %s", (unsigned long long)c->id, (int)cred.pid, msg);
        conn_send_error(c, 0, MOED_E_PERM, msg);
        c->linger = 1;
        conn_close(c, 1);
        return;
    }
    if (srv->n_clients >= srv->cfg.max_clients) {
        srv->counters.clients_refused++;
        snprintf(msg, sizeof msg, "too many clients (limit %u)", srv->cfg.max_clients);
        LOG_W("client %llu (pid %d): %s", (unsigned long long)c->id, (int)cred.pid, msg);
        conn_send_error(c, 0, MOED_E_BUSY, msg);
        c->linger = 1;
        conn_close(c, 1);
        return;
    }
    conn_set_sndbuf(c, fd);
    c->counted = 1;
    srv->n_clients++;
    srv->counters.clients = srv->n_clients;
    srv->counters.clients_total++;
    LOG_D("client %llu connected (pid %d uid %u)", (unsigned long long)c->id, (int)cred.pid,
          (unsigned)cred.uid);
    conn_update(c);
}

/* ---- open / close ------------------------------------------------------------ */

/* Refuse a non-socket at the path; replace a stale socket only if nothing
 * listens on it. */
static int prepare_path(const char *path, char *err, size_t errlen)
{
    struct stat st;
    if (lstat(path, &st) < 0) {
        if (errno == ENOENT)
            return 0;
        return moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: stat: %s", path,
                           strerror(errno));
    }
    if (!S_ISSOCK(st.st_mode))
        return moed_seterr(err, errlen, MOED_E_IO,
                           "server.socket %s exists and is not a socket; refusing to replace it",
                           path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return moed_seterr(err, errlen, MOED_E_IO, "socket(): %s", strerror(errno));
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, strlen(path));
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    int e = errno;
    close(fd);
    if (rc == 0)
        return moed_seterr(err, errlen, MOED_E_IO, "another moed is listening on %s", path);
    if (e != ECONNREFUSED)
        return moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: probing the old socket: %s",
                           path, strerror(e));
    LOG_I("removing stale socket %s (nothing listens on it)", path);
    if (unlink(path) < 0 && errno != ENOENT)
        return moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: unlink stale socket: %s", path,
                           strerror(errno));
    return 0;
}

static int apply_group(const char *path, const char *group, char *err, size_t errlen)
{
    if (!group[0])
        return 0;
    struct group gr, *res = NULL;
    char buf[4096];
    gid_t gid;
    int rc = getgrnam_r(group, &gr, buf, sizeof buf, &res);
    if (rc == 0 && res) {
        gid = res->gr_gid;
    } else {
        char *end;
        unsigned long v = strtoul(group, &end, 10);
        if (*end || end == group)
            return moed_seterr(err, errlen, MOED_E_CONFIG, "server.socket_group: no group named '%s'",
                               group);
        gid = (gid_t)v;
    }
    if (chown(path, (uid_t)-1, gid) < 0)
        return moed_seterr(err, errlen, MOED_E_IO, "server.socket_group: chgrp %s to %s: %s", path,
                           group, strerror(errno));
    return 0;
}

static void on_server_handle_closed(uv_handle_t *h)
{
    struct moed_server *srv = h->data;
    srv->n_handles--;
    server_maybe_done(srv);
}

int moed_server_open(uv_loop_t *loop, const struct moed_server_limits *cfg,
                     const struct moed_server_ops *ops, void *ctx, struct moed_bufpool *pool,
                     struct moed_server **out, char *err, size_t errlen)
{
    int rc;
    *out = NULL;
    size_t plen = strnlen(cfg->socket_path, sizeof cfg->socket_path);
    if (plen == 0 || plen > MOED_SOCKET_PATH_MAX)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "server.socket: path is %zu bytes; must be 1..%d (sun_path)", plen,
                           MOED_SOCKET_PATH_MAX);
    if (cfg->max_clients == 0 || cfg->max_pending_per_client == 0 || cfg->frame_timeout_ms == 0)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "server: max_clients, max_pending_per_client and frame_timeout_ms must be > 0");
    rc = prepare_path(cfg->socket_path, err, errlen);
    if (rc < 0)
        return rc;
    struct moed_server *srv = calloc(1, sizeof *srv);
    if (!srv)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "out of memory");
    srv->loop = loop;
    srv->cfg = *cfg;
    if (srv->cfg.max_client_buffer_bytes > srv->cfg.max_reply_bytes)
        srv->cfg.max_client_buffer_bytes = srv->cfg.max_reply_bytes; /* one client under the cap */
    srv->ops = ops;
    srv->ctx = ctx;
    srv->pool = pool;
    /* On Unix these inits cannot fail (libuv 1.x returns 0): checked for the log. */
    MOED_UV_CHECK(uv_pipe_init(loop, &srv->listener, 0));
    srv->listener.data = srv;
    MOED_UV_CHECK(uv_idle_init(loop, &srv->closer));
    srv->closer.data = srv;
    MOED_UV_CHECK(uv_idle_init(loop, &srv->runner));
    srv->runner.data = srv;
    srv->n_handles = 3;
    /* The socket is created with the configured mode (umask), then chmod'ed
     * in case the umask was not enough (e.g. 0666 under a 022 umask). */
    mode_t old = umask((mode_t)(~cfg->socket_mode & 0777));
    rc = uv_pipe_bind(&srv->listener, cfg->socket_path);
    umask(old);
    if (rc < 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: bind: %s", cfg->socket_path,
                         uv_strerror(rc));
        goto fail_handles;
    }
    if (chmod(cfg->socket_path, (mode_t)cfg->socket_mode) < 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: chmod %o: %s", cfg->socket_path,
                         cfg->socket_mode, strerror(errno));
        goto fail_unlink;
    }
    rc = apply_group(cfg->socket_path, cfg->socket_group, err, errlen);
    if (rc < 0)
        goto fail_unlink;
    rc = uv_listen((uv_stream_t *)&srv->listener, LISTEN_BACKLOG, on_connection);
    if (rc < 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: listen: %s", cfg->socket_path,
                         uv_strerror(rc));
        goto fail_unlink;
    }
    srv->listening = 1;
    LOG_I("listening on %s (mode %04o%s%s)", cfg->socket_path, cfg->socket_mode,
          cfg->socket_group[0] ? ", group " : "", cfg->socket_group);
    *out = srv;
    return 0;

fail_unlink:
    unlink(cfg->socket_path);
fail_handles:
    /* The handles were initialised on the loop: close them, free after. */
    srv->closing = 1;
    srv->done = NULL;
    srv->n_handles = 3;
    uv_close((uv_handle_t *)&srv->listener, on_server_handle_closed);
    uv_close((uv_handle_t *)&srv->closer, on_server_handle_closed);
    uv_close((uv_handle_t *)&srv->runner, on_server_handle_closed);
    return rc;
}

void moed_server_stop_listening(struct moed_server *srv)
{
    if (!srv->listening)
        return;
    srv->listening = 0;
    uv_close((uv_handle_t *)&srv->listener, on_server_handle_closed);
    if (unlink(srv->cfg.socket_path) < 0 && errno != ENOENT)
        LOG_W("unlink %s: %s", srv->cfg.socket_path, strerror(errno));
}

void server_maybe_done(struct moed_server *srv)
{
    if (!srv->closing || srv->n_handles > 0 || srv->conns)
        return;
    void (*done)(void *) = srv->done;
    void *arg = srv->done_arg;
    free(srv);
    if (done)
        done(arg);
}

void moed_server_close(struct moed_server *srv, void (*done)(void *arg), void *arg)
{
    moed_server_stop_listening(srv);
    srv->done = done;
    srv->done_arg = arg;
    /* Every request was answered (the engine drained first): the replies
     * still queued are owed, so each client gets as long as an open one to
     * read them (frame_timeout_ms per stall), not CLOSE_GRACE_MS in all. */
    for (struct moed_conn *c = srv->conns; c; c = c->next) {
        conn_close(c, 1);
        c->drain_on_close = 1;
    }
    /* The closer handle is closed only after it ran for the marked clients;
     * deferred clients are all closing now: the runner has nothing to do. */
    srv->closing = 1;
    for (struct moed_conn *c = srv->ready_head, *nx; c; c = nx) {
        nx = c->ready_next;
        c->ready_next = NULL;
        c->deferred = 0;
    }
    srv->ready_head = srv->ready_tail = NULL;
    if (srv->close_list)
        on_closer(&srv->closer);
    uv_close((uv_handle_t *)&srv->closer, on_server_handle_closed);
    uv_close((uv_handle_t *)&srv->runner, on_server_handle_closed);
}

