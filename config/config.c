/* config.c - moed's configuration: one JSON file, one table of keys.
 *
 * The table `cfg_keys` (config_keys.c) is the only place a key exists. Each row names the
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
#include "config_int.h"

#include "moed_err.h"
#include "moed_log.h"
#include "moed_sbuf.h"

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
#define CFG_DESC_BUF (CFG_SHOW_BUF + 16)     /* ... with its JSON type in front */

/* Both are stored through an int-sized slot. */
_Static_assert(sizeof(enum moed_cfg_backend) == sizeof(int), "backend enum is int-sized");


/* ------------------------------------------------------------------------ */
/* Text is built in a struct moed_sbuf (common/moed_sbuf.h). */

/* JSON string literal of s (quotes and escapes), the whole string. */
void cfg_sb_json_str(struct moed_sbuf *b, const char *s)
{
    moed_sb_add(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            moed_sb_printf(b, "\\%c", *p);
        else if (*p == '\n')
            moed_sb_add(b, "\\n");
        else if (*p == '\t')
            moed_sb_add(b, "\\t");
        else if (*p < 0x20 || *p == 0x7f)
            moed_sb_printf(b, "\\u%04x", *p);
        else
            moed_sb_addn(b, (const char *)p, 1);
    }
    moed_sb_add(b, "\"");
}

/* ------------------------------------------------------------------------ */
/* The error list: one line per error, each prefixed with the origin. */

struct errs {
    const char *origin;
    struct moed_sbuf text;
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
        moed_sb_add(&e->text, "\n");
    moed_sb_printf(&e->text, "%s: %s", e->origin, line);
}

/* Copy the list into err[errlen]; a list that does not fit ends in "..." so
 * the reader knows lines were dropped. */
static void err_export(struct errs *e, char *err, size_t errlen)
{
    if (!err || !errlen)
        return;
    if (e->count > CFG_MAX_ERRORS)
        moed_sb_printf(&e->text, "\n%s: %d more errors not shown", e->origin,
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
void cfg_show_str(const char *s, char *out, size_t outlen)
{
    struct moed_sbuf b = {0};
    size_t n = strlen(s);
    char cut[CFG_SHOW_MAX + 1];
    memcpy(cut, s, n > CFG_SHOW_MAX ? CFG_SHOW_MAX : n);
    cut[n > CFG_SHOW_MAX ? CFG_SHOW_MAX : n] = '\0';
    cfg_sb_json_str(&b, cut);
    if (n > CFG_SHOW_MAX)
        moed_sb_add(&b, "...");
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
        cfg_show_str(v->valuestring, tmp, sizeof tmp);
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

uint64_t cfg_load_uint(const void *field, size_t size)
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

int cfg_load_int(const void *field)
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
    cfg_show_str(s, q, sizeof q);
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
        if (!cfg_parse_dec(s, n, INT64_MAX, &v)) {
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
        /* A repeated id is a mistake; a GPU may be listed twice (engine.gpus:
         * expert parallelism on one GPU), which the key says. */
        for (size_t j = 0; j < i && !k->repeats; j++) {
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
    if (c->nccl_rank >= c->nccl_ranks)
        err_add(e, "engine.nccl_rank: %u is not below engine.nccl_ranks (%u)", c->nccl_rank,
                c->nccl_ranks);
    if (c->nccl_keepalive_ms >= c->nccl_timeout_ms)
        err_add(e, "engine.nccl_keepalive_ms: %u is not less than engine.nccl_timeout_ms (%u)",
                c->nccl_keepalive_ms, c->nccl_timeout_ms);
    if (c->nccl_ranks > 1) {
        if (c->backend != MOED_CFG_BACKEND_CUDA)
            err_add(e, "engine.nccl_ranks: %u ranks need engine.backend \"cuda\"",
                    c->nccl_ranks);
        if (c->n_gpus > 1)
            err_add(e, "engine.nccl_ranks: %u ranks and %u engine.gpus entries; a rank of an "
                    "NCCL group holds one GPU", c->nccl_ranks, c->n_gpus);
        if (c->sms_free < 2)
            err_add(e, "engine.nccl_ranks: %u ranks need engine.sms_free >= 2 (it is %u): "
                    "NCCL's kernels need SMs the persistent kernel leaves free",
                    c->nccl_ranks, c->sms_free);
    }
}

/* ------------------------------------------------------------------------ */
/* Defaults, parse, load. */

static void apply_defaults(struct moed_cfg *cfg, struct errs *e)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < cfg_n_keys; i++)
        set_text(&cfg_keys[i], cfg, cfg_keys[i].def, e);
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
    for (size_t i = 0; i < cfg_n_keys; i++)
        if (strcmp(cfg_keys[i].path, path) == 0)
            return &cfg_keys[i];
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
    cfg_show_str(path, q, sizeof q);
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
    for (size_t i = 0; i < cfg_n_keys + N_SECTIONS; i++) {
        const char *cand = i < cfg_n_keys ? cfg_keys[i].path : cfg_sections[i - cfg_n_keys];
        if (top_level != (i >= cfg_n_keys))
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
        moed_sb_printf(&e->text, "%s:%u:%u: malformed JSON: unexpected end of input", e->origin, line,
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
    moed_sb_printf(&e->text, "%s:%u:%u: malformed JSON near '%s'", e->origin, line, col, near);
}

static void apply_json(const cJSON *root, struct moed_cfg *c, struct errs *e)
{
    bool seen_key[CFG_KEYS_MAX] = {0};
    bool seen_sec[N_SECTIONS] = {0};
    for (const cJSON *sec = root->child; sec; sec = sec->next) {
        const char *sname = sec->string ? sec->string : "";
        size_t si = 0;
        while (si < N_SECTIONS && strcmp(cfg_sections[si], sname) != 0)
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
            if (seen_key[k - cfg_keys]) {
                err_add(e, "duplicate key '%s'", k->path);
                continue;
            }
            seen_key[k - cfg_keys] = true;
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
