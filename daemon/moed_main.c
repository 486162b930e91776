/* moed_main.c - the moed daemon: config, model, engine, server, signals.
 *
 * Start-up order: config -> status HTTP (served by a loop thread while the
 * model loads, so /status shows load progress and /healthz says 503) ->
 * model (generated first for "synthetic:...") -> loop thread stopped ->
 * engine + backend -> self-check -> socket -> READY=1.
 * Shutdown (SIGTERM/SIGINT, or a backend failure): STOPPING=1, stop
 * accepting and remove the socket, answer everything in flight, close the
 * clients, close the backend, exit.
 */
#include "moed_daemon.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moed [-c FILE | --builtin]\n"
            "       moed --check-config FILE | --config-reference | -h | -V\n"
            "\n"
            "Serves Mixture-of-Experts layers (NVFP4 expert weights) over a Unix socket.\n"
            "Runs in the foreground and logs to stderr; systemd Type=notify aware.\n"
            "\n"
            "options:\n"
            "  -c, --config FILE    JSON config (default: $MOED_CONFIG, else " MOED_DEFAULT_CONFIG ")\n"
            "      --builtin        no config file: built-in defaults, a tiny synthetic model\n"
            "                       on /tmp/moed.sock (what a quick try needs)\n"
            "      --check-config FILE  validate FILE and that this machine can honour it\n"
            "                       (GPUs named in engine.gpus, backend \"cuda\"), print the\n"
            "                       effective config as JSON (or every error) and exit\n"
            "      --config-reference  print the reference of every config key (Markdown)\n"
            "  -V, --version        print the version and the build's features\n"
            "  -h, --help           this text\n"
            "\n"
            "environment (applied over the config file, also by --check-config):\n"
            "  MOED_CONFIG          config file used when -c is not given\n"
            "  MOED_SOCKET          server.socket\n"
            "  MOED_STATUS_PORT     status.port (0 turns the HTTP status server off)\n"
            "\n"
            "signals: SIGTERM/SIGINT stop accepting, answer every request in flight,\n"
            "remove the socket file and exit 0.\n"
            "\n"
            "exit codes: (in brackets: what scripts/moed.service makes systemd do)\n"
            "  0  clean shutdown                                     (not restarted)\n"
            "  1  runtime failure (socket or status port in use, out\n"
            "     of memory, ...)                                    (restarted)\n"
            "  2  config or usage error, or a config this machine cannot\n"
            "     honour (no GPU for engine.gpus / backend \"cuda\"),\n"
            "     found before the weights are loaded                (not restarted)\n"
            "  3  model load error (checkpoint missing, malformed, does\n"
            "     not fit)                                           (not restarted)\n"
            "  4  backend failure (sticky device error, stalled kernel,\n"
            "     self-check mismatch)                               (restarted)\n");
}

/* The build's features for --version: backends, CUDA archs, NCCL. */
static void print_version(void)
{
    printf("moed %s\n", MOED_VERSION);
#ifdef MOED_HAVE_CUDA
    int n = moed_backend_cuda_device_count();
    printf("backends: cpu, cuda\n");
    printf("cuda: yes (archs %s; %d device%s visible)\n", MOED_CUDA_ARCHS, n, n == 1 ? "" : "s");
    printf("nccl: yes (engine.nccl_ranks: a group of daemons across hosts; one host's GPUs "
           "use peer access)\n");
#else
    printf("backends: cpu\n");
    printf("cuda: no (built with CUDA=0)\n");
    printf("nccl: no\n");
#endif
}

/* ---- daemon state and shutdown -------------------------------------------- */

struct daemon {
    uv_loop_t loop;
    /* start-up: until the engine exists, /status serves `boot` (load
     * progress), written by the loading thread under boot_mu and copied into
     * boot_snap by the loop thread */
    pthread_mutex_t boot_mu;
    struct moed_stats boot, boot_snap;
    uint64_t notify_last_ns;
    uv_async_t boot_stop;      /* stops the start-up loop thread */
    pthread_t loop_thread;
    int loop_thread_on;
    uv_signal_t sigterm, sigint;
    uv_timer_t drain_timer;    /* bounds the drain if the backend hangs: restarted by
                                  every completed batch */
    uv_timer_t watchdog;       /* WATCHDOG=1 pings when systemd asks for them */
    uint32_t drain_ms;
    int abandoned;             /* drain gave up: skip the orderly teardown */
    struct moed_engine *engine;
    struct moed_server *server;
    struct moed_server_limits limits;
    struct moed_http *http;
    int stopping;
    int exit_code;
};

/* The server.* keys the socket server reads. */
_Static_assert(sizeof((struct moed_cfg *)0)->socket_path ==
                   sizeof((struct moed_server_limits *)0)->socket_path &&
               sizeof((struct moed_cfg *)0)->socket_group ==
                   sizeof((struct moed_server_limits *)0)->socket_group &&
               sizeof((struct moed_cfg *)0)->allowed_uids ==
                   sizeof((struct moed_server_limits *)0)->allowed_uids &&
               sizeof((struct moed_cfg *)0)->allowed_gids ==
                   sizeof((struct moed_server_limits *)0)->allowed_gids,
               "server limits hold every configurable value");
static void server_limits(const struct moed_cfg *cfg, struct moed_server_limits *l)
{
    memset(l, 0, sizeof *l);
    memcpy(l->socket_path, cfg->socket_path, sizeof l->socket_path);
    l->socket_mode = cfg->socket_mode;
    memcpy(l->socket_group, cfg->socket_group, sizeof l->socket_group);
    memcpy(l->allowed_uids, cfg->allowed_uids, sizeof l->allowed_uids);
    l->n_allowed_uids = cfg->n_allowed_uids;
    memcpy(l->allowed_gids, cfg->allowed_gids, sizeof l->allowed_gids);
    l->n_allowed_gids = cfg->n_allowed_gids;
    l->max_clients = cfg->max_clients;
    l->max_pending_per_client = cfg->max_pending_per_client;
    l->max_frame_bytes = cfg->max_frame_bytes;
    l->max_client_buffer_bytes = cfg->max_client_buffer_bytes;
    l->frame_timeout_ms = cfg->frame_timeout_ms;
    l->read_buffer_keep_bytes = cfg->read_buffer_keep_bytes;
    l->socket_buffer_bytes = cfg->socket_buffer_bytes;
    l->idle_timeout_ms = cfg->idle_timeout_ms;
    l->max_reply_bytes = cfg->max_reply_bytes;
}

static void on_server_closed(void *arg)
{
    struct daemon *d = arg;
    d->server = NULL;
    moed_engine_set_server(d->engine, NULL); /* its counters were freed */
    uv_close((uv_handle_t *)&d->sigterm, NULL);
    uv_close((uv_handle_t *)&d->sigint, NULL);
    uv_close((uv_handle_t *)&d->watchdog, NULL);
    moed_engine_close(d->engine);
    d->engine = NULL;
    LOG_I("stopped");
}

static void on_drained(void *arg)
{
    struct daemon *d = arg;
    uv_close((uv_handle_t *)&d->drain_timer, NULL);
    LOG_I("every request answered; closing clients");
    moed_server_close(d->server, on_server_closed, d);
}

/* A backend that never completes its batches (hung device) would block the
 * drain forever: give up, and leave without joining the backend's threads.
 * The deadline follows progress (on_drain_progress), so a long queue that
 * keeps completing batches drains completely. */
static void on_drain_timeout(uv_timer_t *t)
{
    struct daemon *d = t->data;
    LOG_E("requests still in flight and no batch completed for %u ms "
          "(engine.batch_deadline_ms + engine.drain_stall_ms); giving up on them", d->drain_ms);
    d->exit_code = EXIT_BACKEND;
    d->abandoned = 1;
    uv_stop(t->loop);
}

static void on_drain_progress(void *arg)
{
    struct daemon *d = arg;
    MOED_UV_CHECK(uv_timer_start(&d->drain_timer, on_drain_timeout, d->drain_ms, 0));
}

static void daemon_stop(struct daemon *d, const char *why)
{
    if (d->stopping)
        return;
    d->stopping = 1;
    LOG_I("stopping: %s", why);
    sd_notifyf(0, "STOPPING=1\nSTATUS=stopping: %s", why);
    if (d->http) {
        moed_http_stop(d->http);
        d->http = NULL;
    }
    moed_server_stop_listening(d->server);
    MOED_UV_CHECK(uv_timer_start(&d->drain_timer, on_drain_timeout, d->drain_ms, 0));
    moed_engine_drain(d->engine, on_drained, on_drain_progress, d);
}

static void on_signal(uv_signal_t *h, int signum)
{
    struct daemon *d = h->data;
    if (d->stopping) {
        LOG_W("%s again: already stopping", strsignal(signum));
        return;
    }
    daemon_stop(d, strsignal(signum));
}

static void on_backend_failure(void *arg)
{
    struct daemon *d = arg;
    d->exit_code = EXIT_BACKEND;
    sd_notify(0, "STATUS=backend failed");
    daemon_stop(d, "backend failure");
}

/* Ping systemd only while the backend is healthy: a stuck device stops the
 * pings and systemd restarts the service (WatchdogSec=). */
static void on_watchdog(uv_timer_t *t)
{
    struct daemon *d = t->data;
    if (d->engine && !moed_engine_failed(d->engine) && moed_engine_stats(d->engine)->healthy)
        sd_notify(0, "WATCHDOG=1");
    else
        LOG_W("backend unhealthy: not pinging the systemd watchdog");
}

static const struct moed_stats *http_snapshot(void *ctx)
{
    struct daemon *d = ctx;
    if (d->engine)
        return moed_engine_stats(d->engine);
    pthread_mutex_lock(&d->boot_mu);
    d->boot_snap = d->boot;
    pthread_mutex_unlock(&d->boot_mu);
    return &d->boot_snap;
}

static void boot_phase(struct daemon *d, const char *phase)
{
    pthread_mutex_lock(&d->boot_mu);
    d->boot.load_phase = phase;
    d->boot.load_done = d->boot.load_total = 0;
    pthread_mutex_unlock(&d->boot_mu);
}

static void on_load_progress(void *ctx, uint64_t done, uint64_t total)
{
    struct daemon *d = ctx;
    pthread_mutex_lock(&d->boot_mu);
    d->boot.load_done = done;
    d->boot.load_total = total;
    pthread_mutex_unlock(&d->boot_mu);
    uint64_t t = uv_hrtime();
    if (t - d->notify_last_ns < 1000000000ull && done < total)
        return; /* rate limit: one notification a second */
    d->notify_last_ns = t;
    sd_notifyf(0, "EXTEND_TIMEOUT_USEC=%llu\nSTATUS=loading model: %" PRIu64 "/%" PRIu64 " MiB",
               EXTEND_TIMEOUT_US, done >> 20, total >> 20);
}

/* The loop runs on a thread of its own while main() loads the model, so the
 * status listener answers during long loads. Nothing else touches the loop
 * then; main() stops and joins the thread before it adds the engine. */
static void on_boot_stop(uv_async_t *h) { uv_stop(h->loop); }

static void *loop_thread_main(void *arg)
{
    struct daemon *d = arg;
    uv_run(&d->loop, UV_RUN_DEFAULT);
    return NULL;
}

static void boot_loop_join(struct daemon *d)
{
    if (!d->loop_thread_on)
        return;
    MOED_UV_CHECK(uv_async_send(&d->boot_stop));
    pthread_join(d->loop_thread, NULL);
    d->loop_thread_on = 0;
    uv_close((uv_handle_t *)&d->boot_stop, NULL);
}

static int start_status(struct daemon *d, const struct moed_cfg *cfg, char *err, size_t errlen)
{
    int rc = moed_http_start(&d->loop, cfg->status_addr, (uint16_t)cfg->status_port, http_snapshot,
                             d, &d->http, err, errlen);
    if (rc < 0)
        return rc;
    moed_http_set_client_limits(d->http, cfg->status_header_timeout_ms,
                                cfg->status_max_conns_per_addr);
    LOG_I("status on http://%s:%u/status", cfg->status_addr, moed_http_port(d->http));
    if (MOED_UV_CHECK(uv_async_init(&d->loop, &d->boot_stop, on_boot_stop)) != 0)
        return 0; /* no loop thread: /status answers once loaded */
    if (pthread_create(&d->loop_thread, NULL, loop_thread_main, d) != 0) {
        uv_close((uv_handle_t *)&d->boot_stop, NULL);
        return 0;
    }
    d->loop_thread_on = 1;
    return 0;
}

static void close_walk(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

/* ---- main ---------------------------------------------------------------------- */

/* Every FORWARD allocates and frees blocks of its payload's size on the loop
 * thread (the request copy, the reply frame: 256 KiB each at T=64, H=2048).
 * glibc gives a block over M_MMAP_THRESHOLD (128 KiB until its adaptive
 * threshold has seen a large free) a fresh mmap, paid for with a page fault
 * per 4 KiB on first touch and an munmap on free, and hands free heap top
 * over M_TRIM_THRESHOLD back to the kernel, to be faulted in again by the
 * next request. Fixing both keeps these blocks on the heap, recycled warm
 * from one request to the next; the cost is at most M_TRIM_THRESHOLD of free
 * heap kept after a burst. Called once the model is loaded, so the loader's
 * temporary buffers were placed as before. */
static void tune_malloc(void)
{
#ifdef __GLIBC__
    if (mallopt(M_MMAP_THRESHOLD, (int)MALLOC_MMAP_THRESHOLD) != 1 ||
        mallopt(M_TRIM_THRESHOLD, (int)MALLOC_TRIM_THRESHOLD) != 1)
        LOG_D("mallopt refused the mmap/trim thresholds; request buffers may be mmap'ed");
#endif
}

/* The directory server.socket is created in must exist and be writable:
 * checked before the (possibly long) model load, and named plainly (binding
 * a socket in a missing directory reports "permission denied"). */
static int check_socket_dir(const char *sock, char *err, size_t errlen)
{
    char dir[MOED_CFG_PATH_MAX];
    const char *slash = strrchr(sock, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == sock)
        snprintf(dir, sizeof dir, "/");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - sock), sock);
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        if (errno == ENOENT)
            return moed_seterr(err, errlen, MOED_E_IO,
                               "server.socket %s: socket directory %s does not exist", sock,
                               dir);
        return moed_seterr(err, errlen, MOED_E_IO, "server.socket %s: socket directory %s: %s",
                           sock, dir, strerror(errno));
    }
    if (!S_ISDIR(sb.st_mode))
        return moed_seterr(err, errlen, MOED_E_IO,
                           "server.socket %s: %s is not a directory", sock, dir);
    if (access(dir, W_OK | X_OK) != 0)
        return moed_seterr(err, errlen, MOED_E_IO,
                           "server.socket %s: no permission to create the socket in %s (%s)",
                           sock, dir, strerror(errno));
    return 0;
}

static int run_daemon(const struct moed_cfg *cfg)
{
    char err[MOED_ERRLEN * 4] = "";
    int rc;
    struct daemon d;
    memset(&d, 0, sizeof d);
    signal(SIGPIPE, SIG_IGN);
    if (MOED_UV_CHECK(uv_loop_init(&d.loop)) < 0)
        return EXIT_RUNTIME; /* nothing started yet */
    d.exit_code = EXIT_CLEAN;
    pthread_mutex_init(&d.boot_mu, NULL);
    d.boot.version = MOED_VERSION;
    d.boot.start_ns = uv_hrtime();
    d.boot.model_path = cfg->model;
    d.boot.backend = "";
    /* the phase /status shows from the first request on */
    d.boot.load_phase = strncmp(cfg->model, "synthetic:", 10) == 0 ? "generating synthetic model"
                                                                   : "checkpoint";

    rc = check_socket_dir(cfg->socket_path, err, sizeof err);
    if (rc < 0) {
        LOG_E("%s", err);
        d.exit_code = EXIT_RUNTIME; /* as a failed bind */
        goto out_loop;
    }

    /* status first: it reports the load */
    if (cfg->status_port != 0) {
        rc = start_status(&d, cfg, err, sizeof err);
        if (rc == MOED_E_BUSY) {
            LOG_E("status port %u on %s is already in use (another moed?); set status.port or "
                  "MOED_STATUS_PORT (0 turns the status server off)",
                  (unsigned)cfg->status_port, cfg->status_addr);
            d.exit_code = EXIT_RUNTIME;
            goto out_loop;
        }
        if (rc < 0) {
            LOG_E("status: %s", err);
            d.exit_code = rc == MOED_E_CONFIG ? EXIT_USAGE : EXIT_RUNTIME;
            goto out_loop;
        }
    }

    /* model */
    char dir[MOED_CFG_PATH_MAX];
    if (strncmp(cfg->model, "synthetic:", 10) == 0) {
        boot_phase(&d, "generating synthetic model");
        rc = resolve_synthetic(cfg, dir, sizeof dir, err, sizeof err);
        if (rc < 0) {
            LOG_E("%s", err);
            d.exit_code = rc == MOED_E_CONFIG ? EXIT_USAGE : EXIT_MODEL;
            boot_loop_join(&d);
            goto out_loop;
        }
    } else {
        snprintf(dir, sizeof dir, "%s", cfg->model);
    }
    int use_cuda = cfg->backend == MOED_CFG_BACKEND_CUDA ||
                   (cfg->backend == MOED_CFG_BACKEND_AUTO && moed_backend_cuda_available());
    /* The CPU backend computes from the host mapping: the weights must fit in
     * the memory available now. On CUDA they must fit in the device's free
     * memory: checked against the checkpoint's header before any weight is
     * read (the backend checks again with its scratch memory). */
    uint64_t budget = mem_available(), dev_total = 0;
    const char *budget_of = "host memory";
    if (use_cuda) {
        int dev = cfg->n_gpus >= 1 ? cfg->gpus[0] : 0;
        rc = moed_backend_cuda_mem(dev, &budget, &dev_total);
        /* expert parallelism: the routed experts spread over the GPUs listed
         * (each GPU counted once; the backends check their own share) */
        for (uint32_t i = 1; rc >= 0 && i < cfg->n_gpus; i++) {
            uint32_t j = 0;
            uint64_t f = 0, t = 0;
            while (j < i && cfg->gpus[j] != cfg->gpus[i])
                j++;
            if (j < i)
                continue;
            dev = cfg->gpus[i];
            rc = moed_backend_cuda_mem(dev, &f, &t);
            budget += f;
        }
        if (rc < 0) {
            boot_loop_join(&d);
            LOG_E("engine: cannot query the memory of CUDA device %d (driver or device error)",
                  dev);
            d.exit_code = EXIT_BACKEND;
            goto out_loop;
        }
        budget_of = "free GPU memory";
    }
    sd_notifyf(0, "STATUS=loading model %s", dir);
    LOG_I("loading model %s (budget: %" PRIu64 " MiB of %s%s)", dir, budget >> 20, budget_of,
          budget ? "" : ", unlimited");
    struct moed_model *model = NULL;
    boot_phase(&d, "checkpoint");
    rc = moed_model_open(dir, budget, on_load_progress, &d, &model, err, sizeof err);
    if (rc < 0) {
        boot_loop_join(&d);
        LOG_E("model: %s", err);
        d.exit_code = EXIT_MODEL;
        goto out_loop;
    }
    const struct moed_dims *dims = moed_model_dims(model);
    LOG_I("model %s: %s, H=%u I=%u E=%u k=%u shared=%u, %u MoE layers of %u, %" PRIu64 " MiB",
          dir, dims->family, dims->hidden, dims->inter, dims->n_experts, dims->top_k,
          dims->n_shared, dims->n_moe_layers, dims->n_layers, moed_model_weight_bytes(model) >> 20);

    /* engine + backend (the engine owns the model from here) */
    struct moed_engine *engine = NULL;
    boot_phase(&d, "placing weights");
    rc = moed_engine_open(&d.loop, model, cfg, on_load_progress, &d, &engine, err, sizeof err);
    boot_loop_join(&d); /* the loop is this thread's again */
    if (rc < 0) {
        LOG_E("engine: %s", err);
        d.exit_code = rc == MOED_E_CONFIG ? EXIT_USAGE : EXIT_BACKEND;
        goto out_loop;
    }
    d.engine = engine;
    rc = moed_engine_attach(d.engine, err, sizeof err);
    if (rc < 0) {
        LOG_E("engine: %s", err);
        d.exit_code = EXIT_RUNTIME;
        goto out_engine;
    }
    struct moed_stats *st = moed_engine_stats(d.engine);
    st->load_done = st->load_total = moed_model_weight_bytes(model);
    st->load_phase = "self-check";
    sd_notify(0, "STATUS=self-check");
    rc = moed_engine_self_check(d.engine, err, sizeof err);
    if (rc < 0) {
        LOG_E("%s", err);
        d.exit_code = EXIT_BACKEND;
        goto out_engine;
    }
    /* the health timer runs from attach on: a failure it saw during the
     * self-check (before the failure callback exists) stops the start here */
    if (moed_engine_failed(d.engine)) {
        LOG_E("backend failed during start-up");
        d.exit_code = EXIT_BACKEND;
        goto out_engine;
    }

    tune_malloc();

    /* socket */
    server_limits(cfg, &d.limits);
    rc = moed_server_open(&d.loop, &d.limits, moed_engine_server_ops(), d.engine,
                          moed_engine_bufpool(d.engine), &d.server, err, sizeof err);
    if (rc < 0) {
        LOG_E("%s", err);
        d.exit_code = rc == MOED_E_CONFIG ? EXIT_USAGE : EXIT_RUNTIME;
        goto out_engine;
    }
    moed_engine_set_server(d.engine, d.server);
    moed_engine_on_failure(d.engine, on_backend_failure, &d);

    MOED_UV_CHECK(uv_signal_init(&d.loop, &d.sigterm));
    MOED_UV_CHECK(uv_signal_init(&d.loop, &d.sigint));
    d.sigterm.data = d.sigint.data = &d;
    MOED_UV_CHECK(uv_signal_start(&d.sigterm, on_signal, SIGTERM));
    MOED_UV_CHECK(uv_signal_start(&d.sigint, on_signal, SIGINT));
    MOED_UV_CHECK(uv_timer_init(&d.loop, &d.drain_timer));
    d.drain_timer.data = &d;
    d.drain_ms = cfg->batch_deadline_ms + cfg->drain_stall_ms;

    MOED_UV_CHECK(uv_timer_init(&d.loop, &d.watchdog));
    d.watchdog.data = &d;
    uint64_t wd_usec = 0;
    if (sd_watchdog_enabled(0, &wd_usec) > 0 && wd_usec > 0) {
        uint64_t every_ms = wd_usec / 2000 ? wd_usec / 2000 : 1; /* half the interval */
        MOED_UV_CHECK(uv_timer_start(&d.watchdog, on_watchdog, every_ms, every_ms));
        uv_unref((uv_handle_t *)&d.watchdog);
        LOG_I("systemd watchdog: pinging every %llu ms", (unsigned long long)every_ms);
    }

    LOG_I("ready: socket %s, backend %s", cfg->socket_path, st->backend);
    sd_notifyf(0, "READY=1\nSTATUS=serving on %s (backend %s)", cfg->socket_path, st->backend);
    uv_run(&d.loop, UV_RUN_DEFAULT);
    if (d.abandoned)
        return d.exit_code; /* backend threads may be stuck: no teardown */
    goto out_loop;

out_engine:
    moed_engine_close(d.engine);
    d.engine = NULL;
out_loop:
    if (d.http) { /* a start-up failure after the status listener started */
        moed_http_stop(d.http);
        d.http = NULL;
    }
    /* Let pending close callbacks run, then close whatever is left. */
    uv_run(&d.loop, UV_RUN_DEFAULT);
    uv_walk(&d.loop, close_walk, NULL);
    uv_run(&d.loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&d.loop) != 0)
        LOG_W("event loop closed with handles still open");
    return d.exit_code;
}

int main(int argc, char **argv)
{
    enum { OPT_CHECK = 256, OPT_REFERENCE, OPT_BUILTIN };
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'},
        {"check-config", required_argument, NULL, OPT_CHECK},
        {"config-reference", no_argument, NULL, OPT_REFERENCE},
        {"builtin", no_argument, NULL, OPT_BUILTIN},
        {"version", no_argument, NULL, 'V'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *config_path = NULL;
    const char *check_path = NULL;
    int builtin = 0;
    char err[MOED_ERRLEN * 8] = "";
    opterr = 0; /* our own messages, below */
    for (int c; (c = getopt_long(argc, argv, ":c:hV", longopts, NULL)) != -1;) {
        switch (c) {
        case 'h':
            usage(stdout);
            return EXIT_CLEAN;
        case 'V':
            print_version();
            return EXIT_CLEAN;
        case OPT_REFERENCE: {
            char *md = moed_cfg_reference_md();
            if (!md) {
                fprintf(stderr, "moed: out of memory\n");
                return EXIT_RUNTIME;
            }
            fputs(md, stdout);
            free(md);
            return EXIT_CLEAN;
        }
        case 'c':
            config_path = optarg;
            break;
        case OPT_CHECK:
            check_path = optarg;
            break;
        case OPT_BUILTIN:
            builtin = 1;
            break;
        case ':':
            fprintf(stderr, "moed: missing FILE after '%s'\n", argv[optind - 1]);
            usage(stderr);
            return EXIT_USAGE;
        default:
            fprintf(stderr, "moed: unknown argument '%s'\n", argv[optind - 1]);
            usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "moed: unknown argument '%s'\n", argv[optind]);
        usage(stderr);
        return EXIT_USAGE;
    }
    if (builtin && config_path) {
        fprintf(stderr, "moed: --builtin and --config exclude each other\n");
        return EXIT_USAGE;
    }

    struct moed_cfg *cfg = calloc(1, sizeof *cfg);
    if (!cfg) {
        fprintf(stderr, "moed: out of memory\n");
        return EXIT_RUNTIME;
    }
    int code = EXIT_CLEAN;
    const char *used;
    if (check_path) {
        if (load_config(check_path, 0, cfg, &used, err, sizeof err) < 0) {
            fprintf(stderr, "%s\n", err);
            code = EXIT_USAGE;
        } else {
            char *js = moed_cfg_to_json(cfg);
            if (js) {
                fputs(js, stdout);
                if (js[0] && js[strlen(js) - 1] != '\n')
                    fputc('\n', stdout);
            }
            code = js ? EXIT_CLEAN : EXIT_RUNTIME;
            free(js);
        }
        goto out;
    }
    if (load_config(config_path, builtin, cfg, &used, err, sizeof err) < 0) {
        fprintf(stderr, "moed: %s\n", err);
        code = EXIT_USAGE;
        goto out;
    }
    moed_log_set_level((enum moed_log_level)cfg->log_level);
    LOG_I("moed %s starting (config %s)", MOED_VERSION, used);
    code = run_daemon(cfg);
out:
    free(cfg);
    return code;
}

