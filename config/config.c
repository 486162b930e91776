/* config.c - moed's configuration: one JSON file, one table of keys.
 *
 * The table `keys` below is the only place a key exists. Each row names the
 * key's dotted path, its type, its bounds, its default (as text), where it
 * lives in struct moed_cfg and a one-line doc. Everything else walks the
 * table: defaults, validation of a parsed file, the effective-config JSON
 * (moed --check-config) and the Markdown reference (config/README.md).
 *
 * Validation never stops at the first problem: every error is collected into
 * a list, one line each, naming the key path, the value and what is allowed,
 * so that a user fixes a file in one pass (as compilers do).
 */
#include "config.h"

#include "moed_err.h"
#include "moed_log.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CFG_FILE_MAX (1u << 20)     /* config files larger than 1 MiB are refused */
#define CFG_INT_EXACT (1ull << 53)  /* a JSON number (a double) is exact up to 2^53 */
#define CFG_MAX_ERRORS 100          /* lines kept; a garbage file must not make megabytes */
#define CFG_SHOW_MAX 64             /* bytes of a user's string quoted in a message */
#define CFG_SHOW_BUF (CFG_SHOW_MAX * 6 + 8)  /* ... escaped ("\u00xx"), quoted, "..." */
#define CFG_DESC_BUF (CFG_SHOW_BUF + 16)     /* ... with its JSON type in front */

/* Both are stored through an int-sized slot. */
_Static_assert(sizeof(enum moed_cfg_backend) == sizeof(int), "backend enum is int-sized");

enum cfg_type {
    T_STRING,     /* free text, length bounds in min/max */
    T_PATH,       /* a file-system path, length bounds in min/max */
    T_UINT,       /* unsigned integer in [min, max], stored in a 4- or 8-byte field */
    T_MODE,       /* octal mode string "0660", value in [min, max] */
    T_BOOL,       /* true/false, stored in a bool */
    T_ENUM,       /* one of names[], stored as an int index */
    T_UINT_ARRAY, /* uint32_t elements in [min, max], count in count_off */
    T_INT_ARRAY,  /* int elements in [min, max], count in count_off */
    T_LOGLEVEL,   /* "error" | "warn" | "info" | "debug", stored as an int */
};

/* Extra check of a string value; writes the reason (after "KEY: ") on failure. */
typedef bool (*cfg_check_fn)(const char *s, char *why, size_t whylen);

struct cfg_key {
    const char *path;          /* "section.name" */
    enum cfg_type type;
    int64_t min, max;          /* numbers: value bounds; strings: byte-length bounds;
                                  arrays: bounds of each element */
    const char *def;           /* default as text (strings unquoted, arrays "[]") */
    size_t off, size;          /* the field in struct moed_cfg */
    size_t count_off;          /* arrays: the uint32_t element count */
    const char *const *names;  /* T_ENUM: the allowed names, NULL-terminated */
    cfg_check_fn check;        /* strings: extra syntax check, or NULL */
    const char *too_long;      /* strings: why max is what it is (message and docs) */
    const char *allowed;       /* docs: extra words in the "Allowed" column */
    bool bytes;                /* docs: show byte counts also in KiB/MiB/GiB */
    const char *doc;
};

#define FIELD(f) .off = offsetof(struct moed_cfg, f), .size = sizeof(((struct moed_cfg *)0)->f)
#define COUNT(f) .count_off = offsetof(struct moed_cfg, f)

static const char *const backend_names[] = {"auto", "cuda", "cpu", NULL};
static const char *const loglevel_names[] = {"error", "warn", "info", "debug", NULL};

static bool check_ipv4(const char *s, char *why, size_t whylen);
static bool check_model(const char *s, char *why, size_t whylen);

/* The one table. Keep keys of a section together and sections in this order:
 * the effective-config JSON and the reference follow the table order. */
static const struct cfg_key keys[] = {
    /* server */
    {.path = "server.socket", .type = T_PATH, .min = 1, .max = MOED_SOCKET_PATH_MAX,
     .def = "/tmp/moed.sock", FIELD(socket_path),
     .too_long = "a Unix socket path may be at most 107 bytes",
     .doc = "Unix socket the daemon listens on (created at start, removed at exit); a "
            "relative path is relative to the daemon's working directory."},
    {.path = "server.socket_mode", .type = T_MODE, .min = 0, .max = 0777, .def = "0660",
     FIELD(socket_mode),
     .doc = "File mode of the socket, an octal string; connecting needs write permission."},
    {.path = "server.socket_group", .type = T_STRING, .min = 0, .max = 63, .def = "",
     FIELD(socket_group),
     .doc = "Group name given to the socket file; empty leaves the daemon's group."},
    {.path = "server.allowed_uids", .type = T_UINT_ARRAY, .min = 0, .max = 4294967294LL,
     .def = "[]", FIELD(allowed_uids), COUNT(n_allowed_uids),
     .doc = "Peer uids allowed to connect (checked with SO_PEERCRED), in addition to the "
            "daemon's own uid and root, which are always allowed."},
    {.path = "server.allowed_gids", .type = T_UINT_ARRAY, .min = 0, .max = 4294967294LL,
     .def = "[]", FIELD(allowed_gids), COUNT(n_allowed_gids),
     .doc = "Peer primary gids allowed to connect, in addition to allowed_uids."},
    {.path = "server.max_clients", .type = T_UINT, .min = 1, .max = 4096, .def = "64",
     FIELD(max_clients),
     .doc = "Connections served at once; further connections get a busy error and are closed."},
    {.path = "server.max_pending_per_client", .type = T_UINT, .min = 1, .max = 4096,
     .def = "64", FIELD(max_pending_per_client),
     .doc = "Requests one client may have in flight, of every kind (FORWARD, STATUS, PING, "
            "HELLO), counted until the reply is written to its socket; over it the daemon "
            "stops reading that client until replies drain (back-pressure)."},
    {.path = "server.max_frame_bytes", .type = T_UINT, .min = 65536, .max = 4294967296LL,
     .def = "67108864", FIELD(max_frame_bytes), .bytes = true,
     .doc = "Largest request payload accepted; a larger frame is answered with a too-big "
            "error and the connection is closed."},
    {.path = "server.max_client_buffer_bytes", .type = T_UINT, .min = 65536,
     .max = 68719476736LL, .def = "268435456", FIELD(max_client_buffer_bytes), .bytes = true,
     .allowed = "at least server.max_frame_bytes",
     .doc = "Reply memory queued for one client (frames plus their allocation overhead) "
            "before the daemon stops reading its requests (back-pressure for a slow reader); "
            "a client that does not read them within server.frame_timeout_ms is "
            "disconnected."},
    {.path = "server.frame_timeout_ms", .type = T_UINT, .min = 1, .max = 600000,
     .def = "5000", FIELD(frame_timeout_ms),
     .doc = "Once a frame's first byte has arrived, the whole frame must arrive within this "
            "many milliseconds or the client gets a timeout error and is closed."},
    {.path = "server.read_buffer_keep_bytes", .type = T_UINT, .min = 0, .max = 4294967296LL,
     .def = "8388608", FIELD(read_buffer_keep_bytes), .bytes = true,
     .doc = "A connection keeps its read buffer between frames as long as it is at most this "
            "big, so the next frame of a steady client is read without allocating; a buffer "
            "grown beyond it for a bigger frame is freed once the connection is idle (0: "
            "always freed). Also the largest ordinary buffer kept as one of the 16 spares that "
            "read buffers, reply frames and batches are taken from (a connection reads into one "
            "while the engine works on its last frame in place), so the worst case is "
            "max_clients + 16 times this, besides server.pinned_pool_bytes."},
    {.path = "server.socket_buffer_bytes", .type = T_UINT, .min = 0, .max = 1073741824,
     .def = "1048576", FIELD(socket_buffer_bytes), .bytes = true,
     .doc = "Kernel send buffer (SO_SNDBUF) asked for each client socket, so that a reply up "
            "to about this size is written in one system call instead of waiting for the "
            "client to read part of it; the kernel caps it at net.core.wmem_max (and doubles "
            "it for its own bookkeeping). 0 keeps the kernel default (about 208 KiB)."},
    {.path = "server.pinned_pool_bytes", .type = T_UINT, .min = 0, .max = 68719476736LL,
     .def = "268435456", FIELD(pinned_pool_bytes), .bytes = true,
     .doc = "Most host memory taken from the backend's own allocator (CUDA: pinned, "
            "device-mapped) for read buffers, reply frames and batches, so that the GPU reads x "
            "and writes y where they lie instead of through copies. Taken as needed in "
            "power-of-two buffers from 64 KiB and kept for reuse until the daemon stops "
            "(freeing pinned memory waits for the resident kernel to exit); beyond it, buffers "
            "are ordinary memory and go through the backend's staging copies. 0: never. No "
            "effect on a backend without such an allocator (CPU)."},
    {.path = "server.idle_timeout_ms", .type = T_UINT, .min = 0, .max = 86400000, .def = "0",
     FIELD(idle_timeout_ms),
     .doc = "A client with nothing in progress (no partial frame, no request unanswered) for "
            "this many milliseconds gets a timeout error and is closed, so idle connections "
            "cannot hold every server.max_clients slot. 0 (the default): never, because an "
            "LLM server keeps one connection per worker open through quiet hours; set it when "
            "clients reconnect on their own."},
    {.path = "server.max_reply_bytes", .type = T_UINT, .min = 65536, .max = 1099511627776LL,
     .def = "1073741824", FIELD(max_reply_bytes), .bytes = true,
     .doc = "Memory that queued replies (frames and their bookkeeping) may hold for all "
            "clients together; past it the client holding the most is disconnected. Each "
            "client is also held to server.max_client_buffer_bytes (to this, if smaller)."},
    /* status */
    {.path = "status.address", .type = T_STRING, .min = 1, .max = 15, .def = "127.0.0.1",
     FIELD(status_addr), .check = check_ipv4, .allowed = "an IPv4 literal",
     .doc = "Address of the HTTP status server (/status, /metrics, /healthz); keep it on "
            "loopback unless the port is firewalled."},
    {.path = "status.port", .type = T_UINT, .min = 0, .max = 65535, .def = "9464",
     FIELD(status_port), .doc = "TCP port of the HTTP status server; 0 turns it off."},
    {.path = "status.header_timeout_ms", .type = T_UINT, .min = 100, .max = 60000,
     .def = "2000", FIELD(status_header_timeout_ms),
     .doc = "A status connection must send its whole request head within this many "
            "milliseconds of connecting, or it is answered 408 and closed, so a slow sender "
            "(slowloris) holds one of the 64 connection slots only this long."},
    {.path = "status.max_conns_per_addr", .type = T_UINT, .min = 1, .max = 64, .def = "16",
     FIELD(status_max_conns_per_addr),
     .doc = "Status connections one client address may hold of the 64 served at once; more "
            "are answered 503. When all 64 are taken, a client from an address holding fewer "
            "takes the slot of the oldest unfinished request of the address holding the most, "
            "so one address's slow connections cannot keep probes and scrapes from others "
            "out. Every refusal is an answer followed by a clean close (no reset)."},
    /* model */
    {.path = "model.path", .type = T_PATH, .min = 1, .max = MOED_CFG_PATH_MAX - 1,
     .def = "synthetic:tiny", FIELD(model), .check = check_model,
     .allowed = "a directory, or synthetic:PRESET[:layers=N][:seed=S] with N in 1 .. 1024",
     .doc = "NVFP4 checkpoint directory (ModelOpt layout), or a synthetic model generated "
            "on first use into model.synthetic_dir. The checkpoint's hidden_size and "
            "moe_intermediate_size must be multiples of 16 (whole E4M3 scale blocks; enough "
            "for the CPU backend); the CUDA backend needs multiples of 64 (its kernel streams "
            "K in 64-weight units). A NaN block scale (E4M3 0x7f or 0xff) is refused at "
            "load (exit code 3)."},
    {.path = "model.synthetic_dir", .type = T_PATH, .min = 1, .max = MOED_CFG_PATH_MAX - 1,
     .def = "/tmp/moed-models", FIELD(synthetic_dir),
     .doc = "Directory where synthetic models are generated and reused."},
    /* engine */
    {.path = "engine.backend", .type = T_ENUM, .def = "auto", FIELD(backend),
     .names = backend_names,
     .doc = "auto: CUDA when this build has it and a GPU is visible, else the CPU reference."},
    {.path = "engine.gpus", .type = T_INT_ARRAY, .min = 0, .max = 1023, .def = "[]",
     FIELD(gpus), COUNT(n_gpus),
     .doc = "CUDA device ordinals to hold experts on (no repeats); empty: every visible GPU."},
    {.path = "engine.sms_free", .type = T_UINT, .min = 0, .max = 255, .def = "0",
     FIELD(sms_free),
     .doc = "SMs per GPU left free of the persistent kernel (for NCCL or a co-located "
            "server)."},
    {.path = "engine.max_tokens", .type = T_UINT, .min = 1, .max = 4096, .def = "512",
     FIELD(max_tokens), .doc = "Most tokens in one batch (and in one request)."},
    {.path = "engine.cpu_threads", .type = T_UINT, .min = 0, .max = 1024, .def = "0",
     FIELD(cpu_threads), .doc = "Threads of the CPU backend; 0: one per core."},
    {.path = "engine.batch_deadline_ms", .type = T_UINT, .min = 1, .max = 600000,
     .def = "10000", FIELD(batch_deadline_ms),
     .doc = "A batch not finished within this many milliseconds fails with a timeout and "
            "marks the backend unhealthy."},
    {.path = "engine.idle_exit_ms", .type = T_UINT, .min = 0, .max = 86400000, .def = "0",
     FIELD(idle_exit_ms),
     .doc = "Idle milliseconds after which the persistent kernel exits, to be relaunched "
            "by the next batch; 0: never."},
    {.path = "engine.drain_stall_ms", .type = T_UINT, .min = 1, .max = 600000, .def = "10000",
     FIELD(drain_stall_ms),
     .doc = "On SIGTERM the daemon answers every request it took before it exits; it gives up "
            "(exit 4, the rest unanswered) only when no batch has completed for "
            "engine.batch_deadline_ms plus this many milliseconds (a hung backend). Every "
            "completed batch restarts the wait, so a long queue drains completely."},
    /* log */
    {.path = "log.level", .type = T_LOGLEVEL, .def = "info", FIELD(log_level),
     .names = loglevel_names, .doc = "Lines above this level are not written to stderr."},
};
#define N_KEYS (sizeof keys / sizeof keys[0])

static const char *const sections[] = {"server", "status", "model", "engine", "log"};
#define N_SECTIONS (sizeof sections / sizeof sections[0])

/* ------------------------------------------------------------------------ */
/* Growing text buffer. A failed allocation sets `oom` and drops later text,
 * so callers check once at the end. */

struct sbuf {
    char *s;
    size_t len, cap;
    bool oom;
};

static void sb_addn(struct sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

static void sb_add(struct sbuf *b, const char *s) { sb_addn(b, s, strlen(s)); }

static void sb_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(struct sbuf *b, const char *fmt, ...)
{
    char tmp[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0)
        sb_addn(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* JSON string literal of s (quotes and escapes), the whole string. */
static void sb_json_str(struct sbuf *b, const char *s)
{
    sb_add(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            sb_printf(b, "\\%c", *p);
        else if (*p == '\n')
            sb_add(b, "\\n");
        else if (*p == '\t')
            sb_add(b, "\\t");
        else if (*p < 0x20 || *p == 0x7f)
            sb_printf(b, "\\u%04x", *p);
        else
            sb_addn(b, (const char *)p, 1);
    }
    sb_add(b, "\"");
}

/* ------------------------------------------------------------------------ */
/* The error list: one line per error, each prefixed with the origin. */

struct errs {
    const char *origin;
    struct sbuf text;
    int count;
};

static void err_add(struct errs *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void err_add(struct errs *e, const char *fmt, ...)
{
    char line[1024];
    if (e->count++ >= CFG_MAX_ERRORS)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (e->count > 1)
        sb_add(&e->text, "\n");
    sb_printf(&e->text, "%s: %s", e->origin, line);
}

/* Copy the list into err[errlen]; a list that does not fit ends in "..." so
 * the reader knows lines were dropped. */
static void err_export(struct errs *e, char *err, size_t errlen)
{
    if (!err || !errlen)
        return;
    if (e->count > CFG_MAX_ERRORS)
        sb_printf(&e->text, "\n%s: %d more errors not shown", e->origin,
                  e->count - CFG_MAX_ERRORS);
    const char *s = e->text.oom ? "out of memory while reporting config errors"
                                : (e->text.s ? e->text.s : "");
    size_t n = strlen(s);
    if (n < errlen) {
        memcpy(err, s, n + 1);
        return;
    }
    memcpy(err, s, errlen - 1);
    err[errlen - 1] = '\0';
    if (errlen > 4)
        memcpy(err + errlen - 4, "...", 4);
}

/* A user's string for a message: quoted, escaped, cut at CFG_SHOW_MAX bytes. */
static void show_str(const char *s, char *out, size_t outlen)
{
    struct sbuf b = {0};
    size_t n = strlen(s);
    char cut[CFG_SHOW_MAX + 1];
    memcpy(cut, s, n > CFG_SHOW_MAX ? CFG_SHOW_MAX : n);
    cut[n > CFG_SHOW_MAX ? CFG_SHOW_MAX : n] = '\0';
    sb_json_str(&b, cut);
    if (n > CFG_SHOW_MAX)
        sb_add(&b, "...");
    snprintf(out, outlen, "%s", b.oom || !b.s ? "\"?\"" : b.s);
    free(b.s);
}

/* Shortest text that reads back as the same double. */
static void show_num(double v, char *out, size_t outlen)
{
    snprintf(out, outlen, "%.15g", v);
    if (strtod(out, NULL) != v)
        snprintf(out, outlen, "%.17g", v);
}

/* "string \"ten\"", "number 1.5", "true", "null", "an array", "an object". */
static void show_json(const cJSON *v, char *out, size_t outlen)
{
    char tmp[CFG_SHOW_BUF];
    if (cJSON_IsString(v)) {
        show_str(v->valuestring, tmp, sizeof tmp);
        snprintf(out, outlen, "string %s", tmp);
    } else if (cJSON_IsNumber(v)) {
        show_num(v->valuedouble, tmp, sizeof tmp);
        snprintf(out, outlen, "number %s", tmp);
    } else if (cJSON_IsTrue(v)) {
        snprintf(out, outlen, "true");
    } else if (cJSON_IsFalse(v)) {
        snprintf(out, outlen, "false");
    } else if (cJSON_IsNull(v)) {
        snprintf(out, outlen, "null");
    } else if (cJSON_IsArray(v)) {
        snprintf(out, outlen, "an array");
    } else if (cJSON_IsObject(v)) {
        snprintf(out, outlen, "an object");
    } else {
        snprintf(out, outlen, "an invalid value");
    }
}

/* '"auto", "cuda", "cpu"' */
static void show_names(const char *const *names, char *out, size_t outlen)
{
    size_t o = 0;
    out[0] = '\0';
    for (int i = 0; names[i] && o < outlen; i++)
        o += (size_t)snprintf(out + o, outlen - o, "%s\"%s\"", i ? ", " : "", names[i]);
}

/* ------------------------------------------------------------------------ */
/* Extra string checks. */

static bool check_ipv4(const char *s, char *why, size_t whylen)
{
    struct in_addr a;
    if (inet_pton(AF_INET, s, &a) == 1)
        return true;
    char q[CFG_SHOW_BUF];
    show_str(s, q, sizeof q);
    snprintf(why, whylen, "%s is not an IPv4 address literal like \"127.0.0.1\"", q);
    return false;
}

/* Decimal digits only, no sign, value <= max. */
static bool parse_dec(const char *s, size_t n, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    if (n == 0 || n > 20)
        return false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return false;
        unsigned d = (unsigned)(s[i] - '0');
        if (v > (max - d) / 10)
            return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

/* A checkpoint path, or synthetic:PRESET[:layers=N][:seed=S] (preset names
 * are checked when the model is generated: the list lives in genmodel.c). */
static bool check_model(const char *s, char *why, size_t whylen)
{
    static const char prefix[] = "synthetic:";
    if (strncmp(s, prefix, sizeof prefix - 1) != 0)
        return true;
    char q[CFG_SHOW_BUF];
    show_str(s, q, sizeof q);
    const char *p = s + sizeof prefix - 1;
    size_t plen = strcspn(p, ":");
    for (size_t i = 0; i < plen; i++) {
        char c = p[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
              c == '.')) {
            plen = 0;
            break;
        }
    }
    if (plen == 0) {
        snprintf(why, whylen,
                 "%s: the preset must be a name of [a-z0-9._-]; expected "
                 "synthetic:PRESET[:layers=N][:seed=S]",
                 q);
        return false;
    }
    bool seen_layers = false, seen_seed = false;
    for (p += plen; *p == ':';) {
        p++;
        size_t n = strcspn(p, ":");
        uint64_t v;
        bool ok;
        if (n > 7 && strncmp(p, "layers=", 7) == 0 && !seen_layers) {
            ok = parse_dec(p + 7, n - 7, 1024, &v) && v >= 1;
            seen_layers = true;
        } else if (n > 5 && strncmp(p, "seed=", 5) == 0 && !seen_seed) {
            ok = parse_dec(p + 5, n - 5, UINT64_MAX, &v);
            seen_seed = true;
        } else {
            ok = false;
        }
        if (!ok) {
            char opt[CFG_SHOW_MAX + 1];
            snprintf(opt, sizeof opt, "%.*s", (int)(n < CFG_SHOW_MAX ? n : CFG_SHOW_MAX), p);
            char qo[CFG_SHOW_BUF];
            show_str(opt, qo, sizeof qo);
            snprintf(why, whylen,
                     "%s: bad option %s; expected synthetic:PRESET[:layers=N][:seed=S] with "
                     "N in [1, 1024] and S a 64-bit unsigned integer, each at most once",
                     q, qo);
            return false;
        }
        p += n;
    }
    return true;
}

/* ------------------------------------------------------------------------ */
/* Storing values. Each setter validates, reports into e, stores on success. */

static void store_uint(void *field, size_t size, uint64_t v)
{
    if (size == 8) {
        uint64_t x = v;
        memcpy(field, &x, 8);
    } else {
        uint32_t x = (uint32_t)v;
        memcpy(field, &x, 4);
    }
}

static uint64_t load_uint(const void *field, size_t size)
{
    if (size == 8) {
        uint64_t x;
        memcpy(&x, field, 8);
        return x;
    }
    uint32_t x;
    memcpy(&x, field, 4);
    return x;
}

static int load_int(const void *field)
{
    int x;
    memcpy(&x, field, sizeof x);
    return x;
}

static const char *type_noun(const struct cfg_key *k)
{
    switch (k->type) {
    case T_STRING: return "a string";
    case T_PATH: return "a path string";
    case T_UINT: return "an unsigned integer";
    case T_MODE: return "an octal mode string like \"0660\"";
    case T_BOOL: return "true or false";
    case T_ENUM:
    case T_LOGLEVEL: return "a string";
    case T_UINT_ARRAY: return "an array of unsigned integers";
    case T_INT_ARRAY: return "an array of integers";
    }
    return "?";
}

static void set_uint(const struct cfg_key *k, struct moed_cfg *c, int64_t v, struct errs *e)
{
    if (v < k->min || v > k->max) {
        err_add(e, "%s: %lld is out of range [%lld, %lld]", k->path, (long long)v,
                (long long)k->min, (long long)k->max);
        return;
    }
    store_uint((char *)c + k->off, k->size, (uint64_t)v);
}

/* A string-typed value (also every default, whatever its type). */
static void set_text(const struct cfg_key *k, struct moed_cfg *c, const char *s, struct errs *e)
{
    char *field = (char *)c + k->off;
    char q[CFG_SHOW_BUF];
    show_str(s, q, sizeof q);
    size_t n = strlen(s);

    switch (k->type) {
    case T_STRING:
    case T_PATH: {
        const char *what = k->type == T_PATH ? "path" : "value";
        if (n < (size_t)k->min) {
            if (n == 0)
                err_add(e, "%s: must not be empty", k->path);
            else
                err_add(e, "%s: %s %s is %zu bytes; at least %lld are needed", k->path, what,
                        q, n, (long long)k->min);
            return;
        }
        /* The syntax check first: its message says more than a length would. */
        char why[512];
        if (k->check && !k->check(s, why, sizeof why)) {
            err_add(e, "%s: %s", k->path, why);
            return;
        }
        if (n > (size_t)k->max) {
            if (k->too_long)
                err_add(e, "%s: %s is %zu bytes; %s", k->path, what, n, k->too_long);
            else
                err_add(e, "%s: %s is %zu bytes; at most %lld are allowed", k->path, what, n,
                        (long long)k->max);
            return;
        }
        memset(field, 0, k->size);
        memcpy(field, s, n);
        return;
    }
    case T_MODE: {
        /* 3 or 4 octal digits; a 4th (leading) digit would carry setuid/setgid/sticky. */
        bool ok = (n == 3 || n == 4);
        uint32_t v = 0;
        for (size_t i = 0; ok && i < n; i++) {
            if (s[i] < '0' || s[i] > '7')
                ok = false;
            else
                v = v * 8 + (uint32_t)(s[i] - '0');
        }
        if (!ok) {
            err_add(e, "%s: %s is not an octal mode; expected 3 or 4 octal digits like \"0660\"",
                    k->path, q);
            return;
        }
        if ((int64_t)v < k->min || (int64_t)v > k->max) {
            err_add(e,
                    "%s: %s is out of range [\"%04llo\", \"%04llo\"] (setuid, setgid and sticky "
                    "bits are not allowed)",
                    k->path, q, (unsigned long long)k->min, (unsigned long long)k->max);
            return;
        }
        store_uint(field, k->size, v);
        return;
    }
    case T_ENUM:
    case T_LOGLEVEL:
        for (int i = 0; k->names[i]; i++) {
            if (strcmp(s, k->names[i]) == 0) {
                memcpy(field, &i, sizeof i);
                return;
            }
        }
        {
            char names[256];
            show_names(k->names, names, sizeof names);
            err_add(e, "%s: %s is not one of %s", k->path, q, names);
        }
        return;
    case T_UINT: { /* defaults only: plain decimal */
        uint64_t v;
        if (!parse_dec(s, n, INT64_MAX, &v)) {
            err_add(e, "%s: default %s is not a decimal integer", k->path, q);
            return;
        }
        set_uint(k, c, (int64_t)v, e);
        return;
    }
    case T_BOOL: /* defaults only */
        if (strcmp(s, "true") == 0 || strcmp(s, "false") == 0) {
            bool b = s[0] == 't';
            memcpy(field, &b, sizeof b);
        } else {
            err_add(e, "%s: default %s is not true or false", k->path, q);
        }
        return;
    case T_UINT_ARRAY:
    case T_INT_ARRAY: /* defaults only: arrays default to empty */
        if (strcmp(s, "[]") == 0) {
            uint32_t zero = 0;
            memset(field, 0, k->size);
            memcpy((char *)c + k->count_off, &zero, sizeof zero);
        } else {
            err_add(e, "%s: default %s: array defaults must be []", k->path, q);
        }
        return;
    }
}

/* A JSON number that must be an exact integer: reports and returns false otherwise. */
static bool get_integer(const char *path, const char *noun, const cJSON *v, int64_t *out,
                        struct errs *e)
{
    char shown[CFG_DESC_BUF];
    if (!cJSON_IsNumber(v)) {
        show_json(v, shown, sizeof shown);
        err_add(e, "%s: expected %s, got %s", path, noun, shown);
        return false;
    }
    double d = v->valuedouble;
    show_num(d, shown, sizeof shown);
    if (!isfinite(d) || fabs(d) > (double)CFG_INT_EXACT) {
        err_add(e, "%s: %s is beyond 2^53 and cannot be an exact integer", path, shown);
        return false;
    }
    if (d != floor(d)) {
        err_add(e, "%s: expected %s, got number %s", path, noun, shown);
        return false;
    }
    *out = (int64_t)d;
    return true;
}

static void set_array(const struct cfg_key *k, struct moed_cfg *c, const cJSON *arr,
                      struct errs *e)
{
    size_t cap = k->size / 4; /* uint32_t and int elements */
    size_t n = (size_t)cJSON_GetArraySize(arr);
    bool ok = true;
    if (n > cap) {
        err_add(e, "%s: %zu entries; at most %zu are allowed", k->path, n, cap);
        ok = false;
    }
    int64_t vals[MOED_CFG_MAX_IDS];
    bool have[MOED_CFG_MAX_IDS] = {0}; /* vals[j] set: element j passed its checks */
    const char *noun = k->type == T_UINT_ARRAY ? "an unsigned integer" : "an integer";
    size_t i = 0;
    for (const cJSON *it = arr->child; it; it = it->next, i++) {
        char path[128];
        snprintf(path, sizeof path, "%s[%zu]", k->path, i);
        int64_t v;
        if (!get_integer(path, noun, it, &v, e)) {
            ok = false;
            continue;
        }
        if (v < k->min || v > k->max) {
            err_add(e, "%s: %lld is out of range [%lld, %lld]", path, (long long)v,
                    (long long)k->min, (long long)k->max);
            ok = false;
            continue;
        }
        if (i >= cap)
            continue;
        vals[i] = v;
        have[i] = true;
        /* A repeat is harmless for ids but a real mistake for GPUs; refuse both. */
        for (size_t j = 0; j < i; j++) {
            if (have[j] && vals[j] == v) {
                err_add(e, "%s: %lld is already listed at index %zu", path, (long long)v, j);
                ok = false;
                break;
            }
        }
    }
    if (!ok)
        return;
    char *field = (char *)c + k->off;
    memset(field, 0, k->size);
    for (i = 0; i < n; i++) {
        if (k->type == T_UINT_ARRAY) {
            uint32_t x = (uint32_t)vals[i];
            memcpy(field + 4 * i, &x, 4);
        } else {
            int x = (int)vals[i];
            memcpy(field + 4 * i, &x, 4);
        }
    }
    uint32_t cnt = (uint32_t)n;
    memcpy((char *)c + k->count_off, &cnt, sizeof cnt);
}

static void set_json(const struct cfg_key *k, struct moed_cfg *c, const cJSON *v, struct errs *e)
{
    char shown[CFG_DESC_BUF];
    switch (k->type) {
    case T_STRING:
    case T_PATH:
    case T_MODE:
    case T_ENUM:
    case T_LOGLEVEL:
        if (!cJSON_IsString(v)) {
            show_json(v, shown, sizeof shown);
            if (k->names) {
                char names[256];
                show_names(k->names, names, sizeof names);
                err_add(e, "%s: expected one of %s, got %s", k->path, names, shown);
            } else {
                err_add(e, "%s: expected %s, got %s", k->path, type_noun(k), shown);
            }
            return;
        }
        set_text(k, c, v->valuestring, e);
        return;
    case T_UINT: {
        int64_t x;
        if (get_integer(k->path, type_noun(k), v, &x, e))
            set_uint(k, c, x, e);
        return;
    }
    case T_BOOL:
        if (!cJSON_IsBool(v)) {
            show_json(v, shown, sizeof shown);
            err_add(e, "%s: expected true or false, got %s", k->path, shown);
            return;
        }
        {
            bool b = cJSON_IsTrue(v);
            memcpy((char *)c + k->off, &b, sizeof b);
        }
        return;
    case T_UINT_ARRAY:
    case T_INT_ARRAY:
        if (!cJSON_IsArray(v)) {
            show_json(v, shown, sizeof shown);
            err_add(e, "%s: expected %s, got %s", k->path, type_noun(k), shown);
            return;
        }
        set_array(k, c, v, e);
        return;
    }
}

/* Checks that involve more than one key. */
static void check_cross(const struct moed_cfg *c, struct errs *e)
{
    if (c->max_client_buffer_bytes < c->max_frame_bytes)
        err_add(e,
                "server.max_client_buffer_bytes: %llu is less than server.max_frame_bytes "
                "(%llu); a client must be able to queue at least one full frame",
                (unsigned long long)c->max_client_buffer_bytes,
                (unsigned long long)c->max_frame_bytes);
}

/* ------------------------------------------------------------------------ */
/* Defaults, parse, load. */

static void apply_defaults(struct moed_cfg *cfg, struct errs *e)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < N_KEYS; i++)
        set_text(&keys[i], cfg, keys[i].def, e);
}

void moed_cfg_defaults(struct moed_cfg *cfg)
{
    /* The table's defaults are checked by the unit test (parse of "{}"). */
    struct errs e = {.origin = "defaults"};
    apply_defaults(cfg, &e);
    free(e.text.s);
}

static const struct cfg_key *key_find(const char *path)
{
    for (size_t i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].path, path) == 0)
            return &keys[i];
    return NULL;
}

/* Levenshtein distance, for "did you mean", or `limit` when it is at least
 * `limit` (the length difference and each row's minimum bound it from below,
 * so most keys are ruled out without filling the table); strings longer than
 * 63 bytes are never close to a key. */
static size_t edit_distance(const char *a, const char *b, size_t limit)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63)
        return limit;
    if ((la > lb ? la - lb : lb - la) >= limit)
        return limit;
    size_t row[64];
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        size_t lo = row[0];
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
            if (best < lo)
                lo = best;
        }
        if (lo >= limit)
            return limit;
    }
    return row[lb] < limit ? row[lb] : limit;
}

/* "unknown key 'server.sockett' (did you mean 'server.socket'?)" */
static void report_unknown(const char *path, bool top_level, struct errs *e)
{
    /* The key as a JSON string, its double quotes turned into single ones. */
    char q[CFG_SHOW_BUF];
    if (e->count >= CFG_MAX_ERRORS) { /* the line is not kept: skip the search */
        e->count++;
        return;
    }
    show_str(path, q, sizeof q);
    char *close = strrchr(q, '"');
    q[0] = '\'';
    *close = '\'';
    const char *best = NULL;
    size_t bestd = 3; /* suggest only within 2 edits */
    if (top_level && key_find(path)) {
        err_add(e, "unknown key %s (keys are nested: write it inside the \"%.*s\" object)", q,
                (int)strcspn(path, "."), path);
        return;
    }
    for (size_t i = 0; i < N_KEYS + N_SECTIONS; i++) {
        const char *cand = i < N_KEYS ? keys[i].path : sections[i - N_KEYS];
        if (top_level != (i >= N_KEYS))
            continue;
        size_t d = edit_distance(path, cand, bestd);
        if (d < bestd) {
            bestd = d;
            best = cand;
        }
    }
    if (best)
        err_add(e, "unknown key %s (did you mean '%s'?)", q, best);
    else
        err_add(e, "unknown key %s", q);
}

/* "origin:3:17: malformed JSON near ..." from cJSON's error position. */
static void report_syntax(const char *text, size_t len, const char *at, struct errs *e)
{
    size_t off = (at && at >= text && at <= text + len) ? (size_t)(at - text) : len;
    unsigned line = 1, col = 1;
    for (size_t i = 0; i < off; i++) {
        if (text[i] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    e->count++;
    if (off >= len) {
        sb_printf(&e->text, "%s:%u:%u: malformed JSON: unexpected end of input", e->origin, line,
                  col);
        return;
    }
    /* Up to 16 bytes either side of the error, within its line, single-quoted
     * (JSON text is full of double quotes); control bytes shown as '?'. */
    size_t lo = off, hi = off;
    while (lo > 0 && off - lo < 16 && text[lo - 1] != '\n')
        lo--;
    while (hi < len && hi - off < 16 && text[hi] != '\n')
        hi++;
    char near[40];
    size_t n = 0;
    for (size_t i = lo; i < hi; i++)
        near[n++] = ((unsigned char)text[i] < 0x20) ? '?' : text[i];
    near[n] = '\0';
    sb_printf(&e->text, "%s:%u:%u: malformed JSON near '%s'", e->origin, line, col, near);
}

static void apply_json(const cJSON *root, struct moed_cfg *c, struct errs *e)
{
    bool seen_key[N_KEYS] = {0};
    bool seen_sec[N_SECTIONS] = {0};
    for (const cJSON *sec = root->child; sec; sec = sec->next) {
        const char *sname = sec->string ? sec->string : "";
        size_t si = 0;
        while (si < N_SECTIONS && strcmp(sections[si], sname) != 0)
            si++;
        if (si == N_SECTIONS) {
            report_unknown(sname, true, e);
            continue;
        }
        if (seen_sec[si]) {
            err_add(e, "duplicate key '%s'", sname);
            continue;
        }
        seen_sec[si] = true;
        if (!cJSON_IsObject(sec)) {
            char shown[CFG_DESC_BUF];
            show_json(sec, shown, sizeof shown);
            err_add(e, "%s: expected an object, got %s", sname, shown);
            continue;
        }
        for (const cJSON *v = sec->child; v; v = v->next) {
            char path[256];
            snprintf(path, sizeof path, "%s.%s", sname, v->string ? v->string : "");
            const struct cfg_key *k = key_find(path);
            if (!k) {
                report_unknown(path, false, e);
                continue;
            }
            if (seen_key[k - keys]) {
                err_add(e, "duplicate key '%s'", k->path);
                continue;
            }
            seen_key[k - keys] = true;
            set_json(k, c, v, e);
        }
    }
}

int moed_cfg_parse(const char *json, size_t len, const char *origin, struct moed_cfg *cfg,
                   char *err, size_t errlen)
{
    struct errs e = {.origin = origin ? origin : "config"};
    char *text = NULL;
    cJSON *root = NULL;
    struct moed_cfg *tmp = NULL;
    int rc = MOED_E_CONFIG;

    if (len == 0) {
        err_add(&e, "empty; expected a JSON object");
        goto out;
    }
    if (len > CFG_FILE_MAX) {
        err_add(&e, "%zu bytes; a config may be at most %u bytes", len, CFG_FILE_MAX);
        goto out;
    }
    const char *nul = memchr(json, '\0', len);
    if (nul) {
        err_add(&e, "NUL byte at offset %zu; a config is JSON text", (size_t)(nul - json));
        goto out;
    }
    /* cJSON wants the NUL inside the length to reject trailing garbage. */
    text = malloc(len + 1);
    tmp = malloc(sizeof *tmp);
    if (!text || !tmp) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory", e.origin);
        goto out_noexport;
    }
    memcpy(text, json, len);
    text[len] = '\0';
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts(text, len + 1, &end, 1);
    if (!root) {
        report_syntax(text, len, end ? end : cJSON_GetErrorPtr(), &e);
        goto out;
    }
    if (!cJSON_IsObject(root)) {
        char shown[CFG_DESC_BUF];
        show_json(root, shown, sizeof shown);
        err_add(&e, "expected a JSON object at the top level, got %s", shown);
        goto out;
    }
    apply_defaults(tmp, &e);
    apply_json(root, tmp, &e);
    if (e.count == 0)
        check_cross(tmp, &e);
    if (e.count == 0) {
        *cfg = *tmp;
        rc = 0;
    }
out:
    if (rc != 0)
        err_export(&e, err, errlen);
out_noexport:
    cJSON_Delete(root);
    free(tmp);
    free(text);
    free(e.text.s);
    return rc;
}

int moed_cfg_load(const char *path, struct moed_cfg *cfg, char *err, size_t errlen)
{
    int rc = 0;
    char *buf = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return moed_seterr(err, errlen, MOED_E_IO, "config file %s: cannot open: %s", path,
                           strerror(errno));
    /* Read one byte past the cap to tell "exactly 1 MiB" from "more". */
    buf = malloc(CFG_FILE_MAX + 1);
    if (!buf) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "config file %s: out of memory", path);
        goto close_fd;
    }
    size_t len = 0;
    while (len < CFG_FILE_MAX + 1) {
        ssize_t r = read(fd, buf + len, CFG_FILE_MAX + 1 - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = moed_seterr(err, errlen, MOED_E_IO, "config file %s: read failed: %s", path,
                             strerror(errno));
            goto free_buf;
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    if (len > CFG_FILE_MAX) {
        rc = moed_seterr(err, errlen, MOED_E_CONFIG,
                         "config file %s: larger than %u bytes (1 MiB), the limit", path,
                         CFG_FILE_MAX);
        goto free_buf;
    }
    rc = moed_cfg_parse(buf, len, path, cfg, err, errlen);
free_buf:
    free(buf);
close_fd:
    close(fd);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Printing: the effective config and the reference. */

const char *moed_cfg_backend_name(enum moed_cfg_backend b)
{
    return ((unsigned)b < 3) ? backend_names[b] : "?";
}

/* The JSON text of one key's value in c. */
static void emit_value(struct sbuf *b, const struct cfg_key *k, const struct moed_cfg *c)
{
    const char *field = (const char *)c + k->off;
    switch (k->type) {
    case T_STRING:
    case T_PATH: {
        char tmp[MOED_CFG_PATH_MAX + 1];
        size_t n = strnlen(field, k->size);
        memcpy(tmp, field, n);
        tmp[n] = '\0';
        sb_json_str(b, tmp);
        return;
    }
    case T_MODE:
        sb_printf(b, "\"%04llo\"", (unsigned long long)load_uint(field, k->size));
        return;
    case T_UINT:
        sb_printf(b, "%llu", (unsigned long long)load_uint(field, k->size));
        return;
    case T_BOOL: {
        bool x;
        memcpy(&x, field, sizeof x);
        sb_add(b, x ? "true" : "false");
        return;
    }
    case T_ENUM:
    case T_LOGLEVEL: {
        int i = load_int(field), n = 0;
        while (k->names[n])
            n++;
        sb_json_str(b, (i >= 0 && i < n) ? k->names[i] : "?");
        return;
    }
    case T_UINT_ARRAY:
    case T_INT_ARRAY: {
        uint32_t cnt = (uint32_t)load_uint((const char *)c + k->count_off, 4);
        if (cnt > k->size / 4)
            cnt = (uint32_t)(k->size / 4);
        sb_add(b, "[");
        for (uint32_t i = 0; i < cnt; i++) {
            if (k->type == T_UINT_ARRAY)
                sb_printf(b, "%s%u", i ? ", " : "", (unsigned)load_uint(field + 4 * i, 4));
            else
                sb_printf(b, "%s%d", i ? ", " : "", load_int(field + 4 * i));
        }
        sb_add(b, "]");
        return;
    }
    }
}

static void emit_json(struct sbuf *b, const struct moed_cfg *c)
{
    sb_add(b, "{\n");
    for (size_t s = 0; s < N_SECTIONS; s++) {
        size_t slen = strlen(sections[s]);
        sb_printf(b, "  \"%s\": {", sections[s]);
        bool first = true;
        for (size_t i = 0; i < N_KEYS; i++) {
            if (strncmp(keys[i].path, sections[s], slen) != 0 || keys[i].path[slen] != '.')
                continue;
            sb_printf(b, "%s\n    \"%s\": ", first ? "" : ",", keys[i].path + slen + 1);
            emit_value(b, &keys[i], c);
            first = false;
        }
        sb_printf(b, "\n  }%s\n", s + 1 < N_SECTIONS ? "," : "");
    }
    sb_add(b, "}\n");
}

char *moed_cfg_to_json(const struct moed_cfg *cfg)
{
    struct sbuf b = {0};
    emit_json(&b, cfg);
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

/* "67108864 (64 MiB)" for byte counts that are whole KiB/MiB/GiB. */
static void md_bytes(struct sbuf *b, uint64_t v)
{
    static const char *const units[] = {"KiB", "MiB", "GiB"};
    int u = -1;
    uint64_t x = v;
    while (u < 2 && x >= 1024 && x % 1024 == 0) {
        x /= 1024;
        u++;
    }
    if (u >= 0)
        sb_printf(b, "%llu (%llu %s)", (unsigned long long)v, (unsigned long long)x, units[u]);
    else
        sb_printf(b, "%llu", (unsigned long long)v);
}

static void md_cell(struct sbuf *b, const char *s)
{
    for (; *s; s++) {
        if (*s == '|')
            sb_add(b, "\\|");
        else
            sb_addn(b, s, 1);
    }
}

static const char *type_name(const struct cfg_key *k)
{
    switch (k->type) {
    case T_STRING: return "string";
    case T_PATH: return "path";
    case T_UINT: return "unsigned integer";
    case T_MODE: return "octal mode string";
    case T_BOOL: return "boolean";
    case T_ENUM: return "enum";
    case T_UINT_ARRAY: return "array of unsigned integers";
    case T_INT_ARRAY: return "array of integers";
    case T_LOGLEVEL: return "log level";
    }
    return "?";
}

static void md_allowed(struct sbuf *b, const struct cfg_key *k)
{
    switch (k->type) {
    case T_STRING:
    case T_PATH:
        if (k->min > 0)
            sb_printf(b, "non-empty, at most %lld bytes", (long long)k->max);
        else
            sb_printf(b, "at most %lld bytes", (long long)k->max);
        break;
    case T_UINT:
        if (k->bytes) {
            md_bytes(b, (uint64_t)k->min);
            sb_add(b, " .. ");
            md_bytes(b, (uint64_t)k->max);
        } else {
            sb_printf(b, "%lld .. %lld", (long long)k->min, (long long)k->max);
        }
        break;
    case T_MODE:
        sb_printf(b, "`\"%04llo\"` .. `\"%04llo\"`", (unsigned long long)k->min,
                  (unsigned long long)k->max);
        break;
    case T_BOOL:
        sb_add(b, "`true`, `false`");
        break;
    case T_ENUM:
    case T_LOGLEVEL:
        for (int i = 0; k->names[i]; i++)
            sb_printf(b, "%s`\"%s\"`", i ? ", " : "", k->names[i]);
        break;
    case T_UINT_ARRAY:
    case T_INT_ARRAY:
        sb_printf(b, "up to %zu entries, each %lld .. %lld, no repeats", k->size / 4,
                  (long long)k->min, (long long)k->max);
        break;
    }
    if (k->allowed) {
        sb_add(b, "; ");
        md_cell(b, k->allowed);
    }
}

/* A small example file; the unit test parses it out of the reference. */
static const char example_json[] =
    "{\n"
    "  \"server\": { \"socket\": \"/run/moed/moed.sock\", \"socket_mode\": \"0660\",\n"
    "              \"socket_group\": \"moed\", \"allowed_gids\": [1001] },\n"
    "  \"model\": { \"path\": \"/models/DeepSeek-V3-NVFP4\" },\n"
    "  \"engine\": { \"backend\": \"cuda\", \"gpus\": [4, 5, 6, 7], \"sms_free\": 8 },\n"
    "  \"log\": { \"level\": \"info\" }\n"
    "}\n";

char *moed_cfg_reference_md(void)
{
    struct sbuf b = {0};
    struct moed_cfg *def = malloc(sizeof *def);
    if (!def)
        return NULL;
    moed_cfg_defaults(def);

    sb_add(&b,
           "# moed configuration reference\n"
           "\n"
           "<!-- Generated from the key table in config/config.c by moed_cfg_reference_md();\n"
           "     do not edit: run `make config-doc` after changing the table. -->\n"
           "\n"
           "moed reads one JSON file (at most 1 MiB): `moed --config FILE`, else the file\n"
           "named by `$MOED_CONFIG`, else `/etc/moed/moed.json` (`moed --builtin` starts on\n"
           "the defaults below without a file). The environment overrides two keys:\n"
           "`MOED_SOCKET` replaces `server.socket` and `MOED_STATUS_PORT` `status.port`.\n"
           "The top level is an object of sections (`server`, `status`, `model`, `engine`,\n"
           "`log`), each an object of keys. Every key is optional and takes its default when left\n"
           "out. Unknown keys, repeated keys, wrong types and out-of-range values are errors:\n"
           "moed reports every one, naming the key, the value and what is allowed, and does\n"
           "not start. Numbers must be exact integers (no fraction, at most 2^53).\n"
           "`moed --check-config` prints the effective configuration, every key included.\n"
           "\n"
           "| Key | Type | Default | Allowed | Description |\n"
           "|---|---|---|---|---|\n");
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct cfg_key *k = &keys[i];
        struct sbuf v = {0};
        emit_value(&v, k, def);
        sb_printf(&b, "| `%s` | %s | `", k->path, type_name(k));
        md_cell(&b, v.s ? v.s : "");
        sb_add(&b, "`");
        if (k->bytes && k->type == T_UINT) {
            struct sbuf h = {0};
            md_bytes(&h, load_uint((const char *)def + k->off, k->size));
            const char *paren = h.s ? strchr(h.s, '(') : NULL;
            if (paren) {
                sb_add(&b, " ");
                sb_add(&b, paren);
            }
            b.oom |= h.oom;
            free(h.s);
        }
        sb_add(&b, " | ");
        md_allowed(&b, k);
        sb_add(&b, " | ");
        md_cell(&b, k->doc);
        sb_add(&b, " |\n");
        b.oom |= v.oom;
        free(v.s);
    }
    sb_add(&b,
           "\n"
           "## Example\n"
           "\n"
           "A daemon on four dedicated GPUs serving a real checkpoint to members of group\n"
           "`moed`:\n"
           "\n"
           "```json\n");
    sb_add(&b, example_json);
    sb_add(&b,
           "```\n"
           "\n"
           "## Defaults\n"
           "\n"
           "The effective configuration of an empty file `{}`:\n"
           "\n"
           "```json\n");
    emit_json(&b, def);
    sb_add(&b, "```\n");
    free(def);
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}
