/* test_chan_gpu.c - doorbell channels on the GPU, in one process: the
 * backend (the persistent kernel, engine.sms_free SMs left free) and a
 * client that launches the real client kernel (the embedded fatbin, through
 * the driver API as a serving engine would) on its own stream.
 *
 * Checks: a doorbell batch equals the same batch through the host ring bit
 * for bit and the CPU reference within tolerance; a run of calls over two
 * layers; every malformed descriptor gets its status (key, flags, T, layer,
 * buffer, range, alignment, overlap, expert ids, sequence) with y untouched
 * and the next good call still right; counters; a CUDA graph of calls
 * replayed (each answered once: done advances by exactly the calls); host
 * batches and doorbell calls at the same time; close, drain, reopen with a
 * fresh key (the old key refused); the table full (MOED_E_BUSY); a channel
 * with a daemon-owned arena over 2 MiB (the reused entry's allocation
 * grows; zeroed; x, ids, w in the arena and y at its far end or in the
 * registered buffer after it, index 1).
 * Prints "gpu tests: N passed, N failed" (scripts/run-gpu-tests.sh).
 */
#include <cuda.h>
#include <cuda_runtime.h>

#include "backend.h"
#include "backend_cuda.h"
#include "backend_cuda_hooks.h"
#include "gpu/moe_cases.h"
#include "moe_gpu.h"
#include "moe_ref.h"
#include "moed_err.h"
#include "moed_log.h"
#include "nvfp4.h"

#include "gpu/moe_io.h"

/* ---------------- the client side, through the driver API ---------------- */

typedef CUresult (*load_fn)(CUmodule *, const void *);
typedef CUresult (*getfn_fn)(CUfunction *, CUmodule, const char *);
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);
static load_fn p_load;
static getfn_fn p_getfn;
static launch_fn p_launch;
static CUfunction g_call;

static void *entry(const char *name)
{
    void *p = NULL;
    enum cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
        return NULL;
    return p;
}

static int client_init(const void *fatbin)
{
    p_load = (load_fn)entry("cuModuleLoadData");
    p_getfn = (getfn_fn)entry("cuModuleGetFunction");
    p_launch = (launch_fn)entry("cuLaunchKernel");
    if (!p_load || !p_getfn || !p_launch)
        return -1;
    CUmodule m;
    if (p_load(&m, fatbin) != CUDA_SUCCESS)
        return -2;
    return p_getfn(&g_call, m, "moed_chan_call") == CUDA_SUCCESS ? 0 : -3;
}

struct client {
    struct moe_gpu_chan *chan; /* device */
    uint64_t key;
    unsigned long long *err;   /* device */
    cudaStream_t stream;
};

static int call(struct client *c, const struct moe_gpu_chan_desc *d)
{
    struct moe_gpu_chan_desc dd = *d;
    unsigned long long timeout = 10000000000ull;
    void *args[] = {&c->chan, &dd, &c->err, &timeout};
    return p_launch(g_call, 1, 1, 1, 32, 1, 1, 0, (CUstream)c->stream, args, NULL) == CUDA_SUCCESS
               ? 0
               : -1;
}

/* The first error word since the last take (0: none); resets it. */
static unsigned long long take_err(struct client *c)
{
    unsigned long long v = 0, z = 0;
    cudaStreamSynchronize(c->stream);
    cudaMemcpy(&v, c->err, 8, cudaMemcpyDeviceToHost);
    cudaMemcpy(c->err, &z, 8, cudaMemcpyHostToDevice);
    return v;
}

static uint64_t chan_word(struct client *c, size_t off)
{
    uint64_t v = 0;
    cudaMemcpy(&v, (uint8_t *)c->chan + off, 8, cudaMemcpyDeviceToHost);
    return v;
}

static int cmp_u64(const void *a, const void *b)
{
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double median_us(uint64_t *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_u64);
    return n ? (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0) / 1e3 : 0.0;
}

/* Where the last MOE_GPU_CHAN_SLOTS calls' time went, from the channel's
 * %globaltimer stamps (moe_gpu_chan.stamp: rang, taken, answered, seen):
 * the medians of rang -> taken, taken -> answered (the kernel), answered ->
 * seen and seen -> the next call's ring (the client kernel's exit and the
 * next graph node's launch). 1 if every stamp is in order. The calls must
 * be back to back in one graph replay (seq `last` the last of them). */
static void read_stamps(struct client *c, uint64_t st[MOE_GPU_CHAN_SLOTS][4])
{
    cudaMemcpy(st, (uint8_t *)c->chan + offsetof(struct moe_gpu_chan, stamp),
               sizeof(uint64_t) * MOE_GPU_CHAN_SLOTS * 4, cudaMemcpyDeviceToHost);
}

static int stamp_breakdown(struct client *c, uint64_t last, char *out, size_t len)
{
    enum { N = MOE_GPU_CHAN_SLOTS };
    uint64_t st[N][4], take[N], kern[N], seen[N], gap[N - 1];
    read_stamps(c, st);
    int ordered = 1;
    for (int i = 0; i < N; i++) {
        const uint64_t *a = st[(last - N + 1 + i) % N];
        ordered &= a[0] && a[0] <= a[1] && a[1] <= a[2] && a[2] <= a[3];
        take[i] = a[1] - a[0];
        kern[i] = a[2] - a[1];
        seen[i] = a[3] - a[2];
        if (i) {
            const uint64_t *prev = st[(last - N + i) % N];
            ordered &= prev[3] <= a[0];
            gap[i - 1] = a[0] - prev[3];
        }
    }
    snprintf(out, len, "medians of %d calls: rang->taken %.2f us, kernel %.2f us, "
             "answered->seen %.2f us, seen->next ring %.2f us", N, median_us(take, N),
             median_us(kern, N), median_us(seen, N), median_us(gap, N - 1));
    return ordered;
}

/* Where rang -> taken went, in a kernel built with MOE_GPU_TAKE_STAMPS=1
 * (moe_gpu_take_stamps): the medians over the same calls of rang -> the bell
 * seen (poll_sources), -> the slot and table entry loaded, -> the descriptor
 * checked, -> ids and w staged (the taken stamp). 0: not such a build; 1 if
 * every stamp is in order, -1 if not. */
static int take_breakdown(struct client *c, uint64_t last, char *out, size_t len)
{
    enum { N = MOE_GPU_CHAN_SLOTS };
    uint64_t st[N][4], tk[N][4], d[4][N];
    char err[MOED_ERRLEN];
    if (moe_gpu_take_stamps(tk, err, sizeof err))
        return 0;
    read_stamps(c, st);
    int ordered = 1;
    for (int i = 0; i < N; i++) {
        const unsigned k = (unsigned)((last - N + 1 + i) % N);
        const uint64_t *a = st[k], *t = tk[k];
        ordered &= a[0] <= t[0] && t[0] <= t[1] && t[1] <= t[2] && t[2] <= t[3] && t[3] == a[1];
        d[0][i] = t[0] - a[0];
        for (int j = 1; j < 4; j++)
            d[j][i] = t[j] - t[j - 1];
    }
    snprintf(out, len, "take stamps, medians of %d calls: rang->bell seen %.2f us, ->slot "
             "loaded %.2f us, ->checked %.2f us, ->ids and w staged %.2f us", N,
             median_us(d[0], N), median_us(d[1], N), median_us(d[2], N), median_us(d[3], N));
    return ordered ? 1 : -1;
}

/* ---------------- progress (a hang says where it is) ---------------- */

static const char *volatile g_stage = "start";
static struct moed_backend *g_be;
static struct moe_gpu_chan *volatile g_chan;
static void *watchdog(void *arg)
{
    (void)arg;
    for (int i = 0;; i++) {
        sleep(15);
        struct moe_gpu_chan *ch = g_chan;
        uint64_t w[2] = {0, 0};
        cudaStream_t s;
        if (ch && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess) {
            cudaMemcpyAsync(w, ch, 8, cudaMemcpyDeviceToHost, s);
            cudaMemcpyAsync(w + 1, &ch->done, 8, cudaMemcpyDeviceToHost, s);
            cudaStreamSynchronize(s);
            cudaStreamDestroy(s);
        }
        fprintf(stderr, "watchdog %ds: at \"%s\"; kernel %s, heartbeat %llu; bell %llu done %llu\n",
                15 * (i + 1), g_stage, g_be && moed_backend_cuda_running(g_be) ? "resident" : "not resident",
                g_be ? (unsigned long long)moed_backend_cuda_heartbeat(g_be) : 0ull,
                (unsigned long long)w[0], (unsigned long long)w[1]);
    }
    return NULL;
}

/* ---------------- the test ---------------- */

/* The arena: x | ids | w | y for T <= MT tokens, one registered buffer;
 * buffer 2 is a second y. Offsets are those of the descriptor refs. */
enum { MT = 64 };
struct arena {
    uint8_t *dev, *y2;
    size_t x_off, ids_off, w_off, y_off, bytes, y2_bytes;
};

static struct moe_gpu_chan_desc desc_for(const struct arena *a, const struct client *c,
                                         uint32_t layer, uint32_t T, unsigned flags)
{
    struct moe_gpu_chan_desc d;
    memset(&d, 0, sizeof d);
    d.layer = layer;
    d.n_tokens = T;
    d.key = c->key;
    d.flags = flags;
    d.x = (struct moe_gpu_chan_ref){0, 0, a->x_off};
    d.ids = (struct moe_gpu_chan_ref){0, 0, a->ids_off};
    d.w = (struct moe_gpu_chan_ref){0, 0, a->w_off};
    d.y = (struct moe_gpu_chan_ref){0, 0, a->y_off};
    return d;
}

/* Inputs of io into the arena; y poisoned. */
static void arena_put(const struct arena *a, const struct io *io)
{
    const size_t T = io->T, H = io->H, k = io->k;
    cudaMemcpy(a->dev + a->x_off, io->x, T * H * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(a->dev + a->ids_off, io->ids, T * k * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(a->dev + a->w_off, io->w, T * k * 4, cudaMemcpyHostToDevice);
    cudaMemset(a->dev + a->y_off, 0x7f, T * H * 2);
}

static int y_equal(const struct arena *a, const uint16_t *want, size_t n)
{
    uint16_t *got = malloc(n * 2);
    cudaMemcpy(got, a->dev + a->y_off, n * 2, cudaMemcpyDeviceToHost);
    int eq = memcmp(got, want, n * 2) == 0;
    free(got);
    return eq;
}

static int y_poisoned(const struct arena *a, size_t n)
{
    uint8_t *got = malloc(n * 2);
    cudaMemcpy(got, a->dev + a->y_off, n * 2, cudaMemcpyDeviceToHost);
    int ok = 1;
    for (size_t i = 0; i < n * 2; i++)
        ok &= got[i] == 0x7f;
    free(got);
    return ok;
}

/* A batch of T tokens on `layer` through the host ring first (io->y: the
 * result a doorbell call must equal), its inputs then put in the arena; the
 * descriptor of the same batch on channel c. */
static struct moe_gpu_chan_desc host_then_arena(struct moed_backend *be, struct waiter *wt,
                                                const struct arena *a, const struct client *c,
                                                struct io *io, uint32_t T, uint32_t layer,
                                                const struct moe_shape *p, enum moe_routing r,
                                                uint64_t seed)
{
    io_alloc(io, T, p->H, p->k);
    io_fill(io, p->E, r, seed);
    run_batch(be, wt, io, layer);
    arena_put(a, io);
    return desc_for(a, c, layer, T, 0);
}

int main(void)
{
    if (moe_shapes_resolve())
        return 2;
    /* The client shares the daemon's context here (a serving engine has its
     * own): a module loaded lazily at first launch would wait for the
     * context, i.e. for the resident persistent kernel (CUDA's lazy loading
     * and concurrently running kernels) */
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    if (!gpu_test_start(0))
        return 1;
    const struct moe_shape *p = &moe_shapes[0]; /* tiny */
    const uint32_t H = p->H, k = p->k, E = p->E;
    struct synth sy[2];
    if (synth_make(&sy[0], p, 11) || synth_make(&sy[1], p, 12)) {
        printf("FAIL  synth\ngpu tests: 0 passed, 1 failed\n");
        return 1;
    }
    static const int gpu0[1] = {0};
    struct moed_backend_cfg cfg = {0};
    cfg.gpus = gpu0;
    cfg.n_gpus = 1;
    cfg.sms_free = 8; /* the client kernel's SM */
    cfg.max_tokens = MT;
    cfg.batch_deadline_ms = 20000;
    cfg.max_channels = 2;
    /* the kernel idles out before the channel opens and is launched again
     * by it: its launch then comes after every allocation it reads (under
     * compute-sanitizer, memory allocated after a kernel's launch is outside
     * every allocation that kernel knows) */
    cfg.idle_exit_ms = 20;
    const struct moe_layer *ls[2] = {&sy[0].layer, &sy[1].layer};
    uint32_t lids[2] = {3, 5};
    struct moed_cuda_src src = {0};
    src.n_layers = 2;
    src.layers = ls;
    src.layer_ids = lids;
    src.dims = (struct moe_gpu_dims){H, p->I, E, p->S, k, MT};
    struct waiter wt = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, NULL};
    struct moed_backend *be = NULL;
    char err[MOED_ERRLEN] = "";
    pthread_t wd;
    pthread_create(&wd, NULL, watchdog, NULL);
    pthread_detach(wd);
    if (moed_backend_cuda_open_src(&src, &cfg, on_done, &wt, &be, err, sizeof err)) {
        printf("FAIL  open: %s\ngpu tests: 0 passed, 1 failed\n", err);
        return 1;
    }

    struct arena a = {0};
    a.x_off = 0;
    a.ids_off = a.x_off + (size_t)MT * H * 2;
    a.w_off = a.ids_off + (size_t)MT * k * 4;
    a.y_off = (a.w_off + (size_t)MT * k * 4 + 255) & ~(size_t)255;
    a.bytes = a.y_off + (size_t)MT * H * 2;
    a.y2_bytes = (size_t)MT * H * 2;
    cudaMalloc((void **)&a.dev, a.bytes);
    cudaMalloc((void **)&a.y2, a.y2_bytes);
    struct moed_chan_buf bufs[2] = {{a.dev, a.bytes}, {a.y2, a.y2_bytes}};
    for (int i = 0; i < 5000 && moed_backend_cuda_running(be); i++)
        usleep(1000);
    result(!moed_backend_cuda_running(be), "the kernel idled out before the channel opens");

    g_be = be;
    /* the client's set-up before the kernel is resident again */
    g_stage = "client_init (cuModuleLoadData)";
    struct client c = {NULL, 0, NULL, NULL};
    cudaMalloc((void **)&c.err, 8);
    cudaMemset(c.err, 0, 8);
    cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking);
    const int ci = client_init(moe_chan_client_fatbin);
    result(ci == 0, "client kernel loaded from the fatbin (%d)", ci);
    g_stage = "chan_open";
    struct moed_chan_info info;
    int rc = be->ops->chan_open(be, bufs, 1, 0, &info, err, sizeof err);
    result(rc == 0 && info.kernel == moe_chan_client_fatbin &&
               info.kernel_bytes == (uint64_t)(moe_chan_client_fatbin_end - moe_chan_client_fatbin) &&
               info.size == sizeof(struct moe_gpu_chan),
           "chan_open: index %u, the %llu-byte client fatbin: %s", info.index,
           (unsigned long long)info.kernel_bytes, rc ? err : "ok");
    if (rc || ci)
        goto out;
    c.chan = moed_backend_cuda_chan_ptr(be, info.index);
    c.key = info.key;
    g_chan = c.chan;

    /* 1. one doorbell batch = the host ring's, bit for bit; the reference */
    static const uint32_t Ts[] = {1, 7, 64};
    for (unsigned ti = 0; ti < 3; ti++) {
        struct io io;
        const uint32_t T = Ts[ti];
        io_alloc(&io, T, H, k);
        io_fill(&io, E, R_UNIFORM, 100 + T);
        g_stage = "1: host batch";
        int hs = run_batch(be, &wt, &io, 3);
        g_stage = "1: arena";
        arena_put(&a, &io);
        struct moe_gpu_chan_desc d = desc_for(&a, &c, 3, T, 0);
        g_stage = "1: doorbell call";
        call(&c, &d);
        unsigned long long e = take_err(&c);
        g_stage = "1: check";
        int nan = 0;
        double rel = check_ref(&sy[0].layer, &io, 64, &nan, 2e-2);
        result(hs == 0 && e == 0 && y_equal(&a, io.y, (size_t)T * H) && rel < 2e-2 && !nan,
               "doorbell T=%u: err 0x%llx, y = the host ring's bit for bit, rel L2 %.2e", T, e,
               rel);
        io_free(&io);
    }

    g_stage = "2";
    /* 2. a run of calls over both layers, each against the host ring */
    {
        int ok = 1;
        for (unsigned i = 0; i < 40 && ok; i++) {
            struct io io;
            const uint32_t T = 1 + (i * 13) % MT, layer = i % 2 ? 5 : 3;
            io_alloc(&io, T, H, k);
            io_fill(&io, E, i % 3 ? R_UNIFORM : R_SKEW, 500 + i);
            ok &= run_batch(be, &wt, &io, layer) == 0;
            arena_put(&a, &io);
            struct moe_gpu_chan_desc d = desc_for(&a, &c, layer, T, 0);
            call(&c, &d);
            ok &= take_err(&c) == 0 && y_equal(&a, io.y, (size_t)T * H);
            io_free(&io);
        }
        result(ok, "40 doorbell calls over layers 3 and 5, T 1..64: each = the host ring's");
    }

    g_stage = "3";
    /* 3. malformed descriptors: their status, y untouched, the next call right */
    {
        struct io io;
        const uint32_t T = 8;
        io_alloc(&io, T, H, k);
        io_fill(&io, E, R_UNIFORM, 77);
        run_batch(be, &wt, &io, 3);
        struct bad {
            const char *what;
            unsigned status;
            int ids_edit; /* 1: an id E, 2: an id -1 */
        } bads[] = {
            {"wrong key", MOE_GPU_CHAN_E_KEY, 0},      {"unknown flag", MOE_GPU_CHAN_E_FLAGS, 0},
            {"T = 0", MOE_GPU_CHAN_E_TOKENS, 0},       {"T > max_tokens", MOE_GPU_CHAN_E_TOKENS, 0},
            {"not an MoE layer", MOE_GPU_CHAN_E_LAYER, 0}, {"unregistered buffer", MOE_GPU_CHAN_E_BUF, 0},
            {"buffer index 99", MOE_GPU_CHAN_E_BUF, 0}, {"offset past the end", MOE_GPU_CHAN_E_RANGE, 0},
            {"offset overflowing", MOE_GPU_CHAN_E_RANGE, 0}, {"x misaligned", MOE_GPU_CHAN_E_ALIGN, 0},
            {"y overlapping x", MOE_GPU_CHAN_E_OVERLAP, 0}, {"expert id E", MOE_GPU_CHAN_E_EXPERT, 1},
            {"id -1 without EMPTY_SLOTS", MOE_GPU_CHAN_E_EXPERT, 2},
        };
        int all = 1;
        for (unsigned i = 0; i < sizeof bads / sizeof bads[0]; i++) {
            arena_put(&a, &io);
            struct moe_gpu_chan_desc d = desc_for(&a, &c, 3, T, 0);
            switch (i) {
            case 0: d.key ^= 1; break;
            case 1: d.flags = 0x4; break;
            case 2: d.n_tokens = 0; break;
            case 3: d.n_tokens = MT + 1; break;
            case 4: d.layer = 4; break;
            case 5: d.w.buf = 1; break;
            case 6: d.ids.buf = 99; break;
            case 7: d.y.off = a.bytes - 16; break;
            case 8: d.x.off = UINT64_MAX - 15; break;
            case 9: d.x.off += 8; break;
            case 10: d.y.off = a.x_off; break;
            default: break;
            }
            if (bads[i].ids_edit) {
                int32_t v = bads[i].ids_edit == 1 ? (int32_t)E : -1;
                cudaMemcpy(a.dev + a.ids_off + 4 * 5, &v, 4, cudaMemcpyHostToDevice);
            }
            const uint64_t seq = chan_word(&c, offsetof(struct moe_gpu_chan, bell)) + 1;
            call(&c, &d);
            unsigned long long e = take_err(&c);
            const int ok = e == moe_gpu_chan_word(seq, bads[i].status) && y_poisoned(&a, (size_t)T * H);
            all &= ok;
            if (!ok)
                result(0, "malformed (%s): err 0x%llx, want 0x%llx", bads[i].what, e,
                       (unsigned long long)moe_gpu_chan_word(seq, bads[i].status));
        }
        result(all, "13 malformed descriptors: each its status at its seq, y untouched");
        /* -1 with EMPTY_SLOTS is an empty slot; then a plain good call */
        arena_put(&a, &io);
        struct moe_gpu_chan_desc d = desc_for(&a, &c, 3, T, 0);
        call(&c, &d);
        unsigned long long e = take_err(&c);
        result(e == 0 && y_equal(&a, io.y, (size_t)T * H),
               "after the malformed ones a good call: err 0x%llx, y right", e);
        int32_t v = -1;
        cudaMemcpy(a.dev + a.ids_off + 4 * 5, &v, 4, cudaMemcpyHostToDevice);
        d.flags = MOE_GPU_CHAN_EMPTY_SLOTS;
        call(&c, &d);
        e = take_err(&c);
        result(e == 0 && !y_poisoned(&a, (size_t)T * H), "id -1 with EMPTY_SLOTS runs: err 0x%llx", e);
        result(io_guard_errors(&io) == 0, "guards around the host batches' buffers intact");
        io_free(&io);
    }

    g_stage = "4";
    /* 4. the bell jumped ahead: answered E_SEQ at its value, then on as normal */
    {
        const uint64_t bell = chan_word(&c, offsetof(struct moe_gpu_chan, bell));
        const uint64_t jump = bell + 100;
        cudaMemcpy(&c.chan->bell, &jump, 8, cudaMemcpyHostToDevice);
        uint64_t done = 0;
        for (int i = 0; i < 2000000 && done != jump; i++)
            done = chan_word(&c, offsetof(struct moe_gpu_chan, done));
        const uint64_t st = chan_word(&c, offsetof(struct moe_gpu_chan, status) + 8 * (jump % 8));
        struct io io;
        struct moe_gpu_chan_desc d = host_then_arena(be, &wt, &a, &c, &io, 4, 3, p, R_UNIFORM, 9);
        call(&c, &d);
        unsigned long long e = take_err(&c);
        result(done == jump && st == moe_gpu_chan_word(jump, MOE_GPU_CHAN_E_SEQ) && e == 0 &&
                   y_equal(&a, io.y, 4 * H),
               "bell rung 100 ahead: done %llu, status E_SEQ; the next call right (err 0x%llx)",
               (unsigned long long)done, e);
        io_free(&io);
    }

    /* 5. counters */
    struct moed_chan_stats cs;
    be->ops->chan_stats(be, info.index, &cs);
    result(cs.served == 3 + 40 + 2 + 1 && cs.refused == 13 + 1 && cs.kernel_ns > 0,
           "counters: %llu served, %llu refused, kernel %.1f us each", (unsigned long long)cs.served,
           (unsigned long long)cs.refused, cs.served ? cs.kernel_ns / 1e3 / cs.served : 0.0);

    g_stage = "6";
    /* 6. a CUDA graph of 10 calls replayed 1000 times: each answered once */
    {
        struct io io;
        struct moe_gpu_chan_desc d =
            host_then_arena(be, &wt, &a, &c, &io, 16, 5, p, R_UNIFORM, 4242);
        cudaGraph_t g;
        cudaGraphExec_t ge;
        cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeThreadLocal);
        for (int i = 0; i < 10; i++)
            call(&c, &d);
        cudaError_t ce = cudaStreamEndCapture(c.stream, &g);
        if (ce == cudaSuccess)
            ce = cudaGraphInstantiate(&ge, g, 0);
        const uint64_t done0 = chan_word(&c, offsetof(struct moe_gpu_chan, done));
        be->ops->chan_stats(be, info.index, &cs);
        const uint64_t served0 = cs.served, kns0 = cs.kernel_ns;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int r = 0; r < 1000 && ce == cudaSuccess; r++)
            ce = cudaGraphLaunch(ge, c.stream);
        unsigned long long e = take_err(&c);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const uint64_t done1 = chan_word(&c, offsetof(struct moe_gpu_chan, done));
        be->ops->chan_stats(be, info.index, &cs);
        const double us = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / 1e3 / 10000;
        const double kus = (cs.kernel_ns - kns0) / 1e3 / 10000;
        result(ce == cudaSuccess && e == 0 && done1 - done0 == 10000 &&
                   cs.served - served0 == 10000 && y_equal(&a, io.y, 16 * H),
               "graph of 10 calls x 1000 replays: done +%llu, served +%llu, err 0x%llx; "
               "%.2f us per call, kernel %.2f us (tiny, T=16)", (unsigned long long)(done1 - done0),
               (unsigned long long)(cs.served - served0), e, us, kus);
        char bd[256];
        result(stamp_breakdown(&c, done1, bd, sizeof bd), "graph calls' stamps in order; %s",
               bd);
        const int tb = take_breakdown(&c, done1, bd, sizeof bd);
        if (tb)
            result(tb > 0, "the take's stamps in order; %s", bd);
        if (ce == cudaSuccess) {
            cudaGraphExecDestroy(ge);
            cudaGraphDestroy(g);
        }
        io_free(&io);
    }

    g_stage = "7";
    /* 7. host batches while the doorbell runs */
    {
        struct io hio, dio;
        io_alloc(&hio, 32, H, k);
        io_alloc(&dio, 16, H, k);
        io_fill(&hio, E, R_SKEW, 31);
        io_fill(&dio, E, R_UNIFORM, 32);
        run_batch(be, &wt, &dio, 3); /* dio.y: the reference result */
        uint16_t *want = malloc((size_t)16 * H * 2);
        memcpy(want, dio.y, (size_t)16 * H * 2);
        run_batch(be, &wt, &hio, 5);
        uint16_t *hwant = malloc((size_t)32 * H * 2);
        memcpy(hwant, hio.y, (size_t)32 * H * 2);
        arena_put(&a, &dio);
        struct moe_gpu_chan_desc d = desc_for(&a, &c, 3, 16, 0);
        for (int i = 0; i < 200; i++)
            call(&c, &d);
        int hok = 1;
        for (int i = 0; i < 50; i++)
            hok &= run_batch(be, &wt, &hio, 5) == 0 && !memcmp(hio.y, hwant, (size_t)32 * H * 2);
        unsigned long long e = take_err(&c);
        result(hok && e == 0 && y_equal(&a, want, 16 * H),
               "50 host batches during 200 doorbell calls: both right (err 0x%llx)", e);
        free(want);
        free(hwant);
        io_free(&hio);
        io_free(&dio);
    }

    g_stage = "8";
    /* 8. table full; close, drain, reopen: a fresh key, the old one refused */
    {
        struct moed_chan_info i2, i3;
        int r2 = be->ops->chan_open(be, bufs, 2, 0, &i2, err, sizeof err);
        int r3 = be->ops->chan_open(be, bufs, 1, 0, &i3, err, sizeof err);
        result(r2 == 0 && r3 == MOED_E_BUSY, "a second channel opens; a third: %s (%s)",
               moed_strerror(r3), err);
        if (r2 == 0) { /* the second channel serves, its y in its second buffer */
            struct client c2 = {moed_backend_cuda_chan_ptr(be, i2.index), i2.key, c.err, c.stream};
            struct io io;
            struct moe_gpu_chan_desc d =
                host_then_arena(be, &wt, &a, &c2, &io, 8, 5, p, R_UNIFORM, 808);
            d.y = (struct moe_gpu_chan_ref){1, 0, 0};
            call(&c2, &d);
            call(&c2, &d);
            unsigned long long e = take_err(&c2);
            uint16_t *got = malloc((size_t)8 * H * 2);
            cudaMemcpy(got, a.y2, (size_t)8 * H * 2, cudaMemcpyDeviceToHost);
            result(e == 0 && !memcmp(got, io.y, (size_t)8 * H * 2) &&
                       chan_word(&c2, offsetof(struct moe_gpu_chan, done)) == 2,
                   "channel %u (the second entry): 2 calls, y in its second buffer = the host "
                   "ring's (err 0x%llx)", i2.index, e);
            free(got);
            io_free(&io);
        }
        be->ops->chan_close(be, info.index);
        int quiet = 0;
        for (int i = 0; i < 100000 && !quiet; i++) {
            quiet = be->ops->chan_quiet(be, info.index);
            if (!quiet)
                usleep(10);
        }
        struct moed_chan_info i4;
        int r4 = quiet ? be->ops->chan_open(be, bufs, 1, 0, &i4, err, sizeof err) : -1;
        result(quiet && r4 == 0 && i4.index == info.index && i4.key != info.key,
               "closed channel drains (quiet), reopens at index %u with a fresh key", i4.index);
        if (r4 == 0) {
            struct moe_gpu_chan_desc d = desc_for(&a, &c, 3, 4, 0); /* the old key */
            const uint64_t seq = chan_word(&c, offsetof(struct moe_gpu_chan, bell)) + 1;
            call(&c, &d);
            unsigned long long e = take_err(&c);
            result(seq == 1 && e == moe_gpu_chan_word(1, MOE_GPU_CHAN_E_KEY),
                   "the closed channel's key on the reused channel: err 0x%llx (E_KEY at seq 1)", e);
            be->ops->chan_close(be, i4.index);
        }
        if (r2 == 0) { /* a closed channel: a call ends at once with E_CLOSED */
            be->ops->chan_close(be, i2.index);
            struct client c2 = {moed_backend_cuda_chan_ptr(be, i2.index), i2.key, c.err, c.stream};
            struct moe_gpu_chan_desc d = desc_for(&a, &c2, 5, 8, 0);
            const uint64_t seq = chan_word(&c2, offsetof(struct moe_gpu_chan, bell)) + 1;
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            call(&c2, &d);
            unsigned long long e = take_err(&c2);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            const double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
            result(e == moe_gpu_chan_word(seq, MOE_GPU_CHAN_E_CLOSED) &&
                       chan_word(&c2, offsetof(struct moe_gpu_chan, bell)) == seq - 1,
                   "a call on a closed channel: err 0x%llx (E_CLOSED, not rung) after %.1f ms", e, ms);
        }
    }
    g_stage = "9";
    /* 9. an arena of 3 MiB: the entry's 2 MiB allocation is outgrown (a new
     * one; the old one freed later with no kernel resident) */
    {
        int quiet = 0;
        for (int i = 0; i < 100000 && !quiet; i++) {
            quiet = be->ops->chan_quiet(be, 0) && be->ops->chan_quiet(be, 1);
            if (!quiet)
                usleep(10);
        }
        const uint64_t ab = 3u << 20;
        struct moed_chan_info i5;
        int r5 = quiet ? be->ops->chan_open(be, bufs, 1, ab, &i5, err, sizeof err) : -1;
        result(r5 == 0 && i5.arena_off == MOE_GPU_CHAN_ARENA_OFF && i5.arena_bytes == ab,
               "a channel with a %llu-byte arena and one buffer opens: %s",
               (unsigned long long)ab, r5 ? err : "ok");
        if (r5 == 0) {
            uint8_t *mem = (uint8_t *)moed_backend_cuda_chan_ptr(be, i5.index);
            uint8_t *ar = mem + i5.arena_off;
            uint8_t *probe = malloc(ab);
            cudaMemcpy(probe, ar, ab, cudaMemcpyDeviceToHost);
            size_t nz = 0;
            for (size_t i = 0; i < ab; i++)
                nz += probe[i] != 0;
            free(probe);
            result(nz == 0, "the arena comes zeroed (%zu bytes not 0)", nz);
            struct client c5 = {(struct moe_gpu_chan *)mem, i5.key, c.err, c.stream};
            struct io io;
            const uint32_t T = 8;
            io_alloc(&io, T, H, k);
            io_fill(&io, E, R_UNIFORM, 909);
            run_batch(be, &wt, &io, 3);
            const size_t xb = (size_t)T * H * 2, ib = (size_t)T * k * 4, yoff = ab - xb;
            cudaMemcpy(ar, io.x, xb, cudaMemcpyHostToDevice);
            cudaMemcpy(ar + xb, io.ids, ib, cudaMemcpyHostToDevice);
            cudaMemcpy(ar + xb + ib, io.w, ib, cudaMemcpyHostToDevice);
            struct moe_gpu_chan_desc d;
            memset(&d, 0, sizeof d);
            d.layer = 3;
            d.n_tokens = T;
            d.key = i5.key;
            d.x = (struct moe_gpu_chan_ref){0, 0, 0};
            d.ids = (struct moe_gpu_chan_ref){0, 0, xb};
            d.w = (struct moe_gpu_chan_ref){0, 0, xb + ib};
            d.y = (struct moe_gpu_chan_ref){0, 0, yoff}; /* past 2 MiB */
            call(&c5, &d);
            cudaMemset(a.dev + a.y_off, 0x7f, xb);
            d.y = (struct moe_gpu_chan_ref){1, 0, a.y_off}; /* the registered buffer */
            call(&c5, &d);
            unsigned long long e = take_err(&c5);
            uint16_t *got = malloc(xb);
            cudaMemcpy(got, ar + yoff, xb, cudaMemcpyDeviceToHost);
            result(e == 0 && !memcmp(got, io.y, xb) && y_equal(&a, io.y, (size_t)T * H) &&
                       chan_word(&c5, offsetof(struct moe_gpu_chan, done)) == 2,
                   "arena channel %u: y at arena offset %zu and in buffer 1 = the host ring's "
                   "(err 0x%llx)", i5.index, yoff, e);
            free(got);
            io_free(&io);
            be->ops->chan_close(be, i5.index);
        }
    }
out: {
    char gerr[MOED_ERRLEN] = "";
    int g = moed_backend_cuda_check_guards(be, gerr, sizeof gerr);
    result(g == 0 || g == MOED_E_INVAL, "guards: %s", g == 0 ? "intact" : g == MOED_E_INVAL ? "off" : gerr);
}
    g_stage = "close";
    moed_backend_close(be);
    /* cudaFree waits for every kernel of the context: after the close */
    cudaStreamDestroy(c.stream);
    cudaFree(c.err);
    cudaFree(a.dev);
    cudaFree(a.y2);
    synth_free(&sy[0]);
    synth_free(&sy[1]);
    printf("gpu tests: %d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
