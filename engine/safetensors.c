/* safetensors.c - validating mmap reader and a small writer for safetensors.
 *
 * The reader maps the whole file read-only (virtual only: nothing is read
 * until a caller touches tensor data), copies the header into a NUL-terminated
 * buffer (cJSON must never read past the header), and checks every rule listed
 * in safetensors.h before handing out a single pointer. Lookups by name use a
 * name-sorted index, because a sharded DeepSeek-size checkpoint holds ~10^5
 * tensors per model and the loader looks each expert tensor up once.
 */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "moed_err.h"

/* JSON numbers are doubles: integers above 2^53 are not exact, so refuse them. */
#define ST_MAX_JSON_INT 9007199254740992.0 /* 2^53 */

struct st_file {
    char *path;
    void *map;             /* whole file, PROT_READ; NULL for an empty mapping */
    size_t map_len;
    uint64_t data_size;    /* bytes after the header */
    size_t n;
    struct st_tensor *tensors; /* file order */
    uint64_t *begin;           /* data_offsets[0] per tensor */
    size_t *by_name;           /* indices into tensors, sorted by name */
};

static const struct {
    const char *name;
    size_t size;
} st_dtypes[ST_DTYPE_COUNT] = {
    [ST_BOOL] = {"BOOL", 1},     [ST_U8] = {"U8", 1},   [ST_I8] = {"I8", 1},
    [ST_F8_E4M3] = {"F8_E4M3", 1}, [ST_F8_E5M2] = {"F8_E5M2", 1},
    [ST_I16] = {"I16", 2},       [ST_U16] = {"U16", 2}, [ST_F16] = {"F16", 2},
    [ST_BF16] = {"BF16", 2},     [ST_I32] = {"I32", 4}, [ST_U32] = {"U32", 4},
    [ST_F32] = {"F32", 4},       [ST_I64] = {"I64", 8}, [ST_U64] = {"U64", 8},
    [ST_F64] = {"F64", 8},
};

const char *st_dtype_name(enum st_dtype t)
{
    if ((int)t < 0 || t >= ST_DTYPE_COUNT)
        return "?";
    return st_dtypes[t].name;
}

int st_dtype_parse(const char *name)
{
    if (!name)
        return -1;
    for (int i = 0; i < ST_DTYPE_COUNT; i++)
        if (strcmp(name, st_dtypes[i].name) == 0)
            return i;
    return -1;
}

size_t st_dtype_size(enum st_dtype t)
{
    if ((int)t < 0 || t >= ST_DTYPE_COUNT)
        return 0;
    return st_dtypes[t].size;
}

/* "[3, 4]" into buf; used only in messages. */
static const char *shape_str(char *buf, size_t len, uint32_t ndim, const uint64_t *shape)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, len - o, "[");
    for (uint32_t i = 0; i < ndim && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%llu", i ? ", " : "",
                              (unsigned long long)shape[i]);
    if (o < len)
        snprintf(buf + o, len - o, "]");
    return buf;
}

/* A JSON number that is an exact non-negative integer <= 2^53. */
static int json_u64(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v))
        return -1;
    double d = v->valuedouble;
    if (!isfinite(d) || d < 0 || d > ST_MAX_JSON_INT || floor(d) != d)
        return -1;
    *out = (uint64_t)d;
    return 0;
}

static int mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}

static int cmp_name(const void *a, const void *b, void *ctx)
{
    const struct st_tensor *t = ctx;
    return strcmp(t[*(const size_t *)a].name, t[*(const size_t *)b].name);
}

static int cmp_begin(const void *a, const void *b, void *ctx)
{
    const uint64_t *begin = ctx;
    uint64_t x = begin[*(const size_t *)a], y = begin[*(const size_t *)b];
    return x < y ? -1 : x > y;
}

/* Parse one tensor entry into t (name already set). */
static int parse_entry(const char *path, const cJSON *e, struct st_tensor *t, uint64_t *begin,
                       uint64_t data_size, char *err, size_t errlen)
{
    char sb[160];
    if (!cJSON_IsObject(e))
        return moed_seterr(err, errlen, MOED_E_FORMAT, "%s: tensor '%s': entry is not an object",
                           path, t->name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt))
        return moed_seterr(err, errlen, MOED_E_FORMAT,
                           "%s: tensor '%s': missing or non-string 'dtype'", path, t->name);
    int d = st_dtype_parse(dt->valuestring);
    if (d < 0)
        return moed_seterr(err, errlen, MOED_E_FORMAT, "%s: tensor '%s': unknown dtype '%.32s'",
                           path, t->name, dt->valuestring);
    t->dtype = (enum st_dtype)d;
    if (!cJSON_IsArray(sh))
        return moed_seterr(err, errlen, MOED_E_FORMAT,
                           "%s: tensor '%s': missing or non-array 'shape'", path, t->name);
    int nd = cJSON_GetArraySize(sh);
    if (nd > ST_MAX_DIMS)
        return moed_seterr(err, errlen, MOED_E_FORMAT,
                           "%s: tensor '%s': shape has %d dims (at most %d allowed)", path,
                           t->name, nd, ST_MAX_DIMS);
    t->ndim = (uint32_t)nd;
    uint64_t numel = 1;
    int i = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, sh) {
        if (json_u64(v, &t->shape[i]) != 0)
            return moed_seterr(err, errlen, MOED_E_FORMAT,
                               "%s: tensor '%s': shape entry %d is not a non-negative integer "
                               "<= 2^53",
                               path, t->name, i);
        if (mul_u64(numel, t->shape[i], &numel) != 0)
            return moed_seterr(err, errlen, MOED_E_FORMAT,
                               "%s: tensor '%s': shape %s overflows 64 bits", path, t->name,
                               shape_str(sb, sizeof sb, t->ndim, t->shape));
        i++;
    }
    uint64_t need;
    int over = mul_u64(numel, st_dtypes[d].size, &need);
    uint64_t b, en;
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 ||
        json_u64(cJSON_GetArrayItem(off, 0), &b) != 0 ||
        json_u64(cJSON_GetArrayItem(off, 1), &en) != 0)
        return moed_seterr(err, errlen, MOED_E_FORMAT,
                           "%s: tensor '%s': 'data_offsets' must be [begin, end] of "
                           "non-negative integers",
                           path, t->name);
    if (b > en)
        return moed_seterr(err, errlen, MOED_E_FORMAT,
                           "%s: tensor '%s': data_offsets [%llu, %llu] end before begin", path,
                           t->name, (unsigned long long)b, (unsigned long long)en);
    if (over || need != en - b)
        return moed_seterr(err, errlen, MOED_E_FORMAT,
                           "%s: tensor '%s': data_offsets [%llu, %llu] give %llu bytes but %s %s "
                           "needs %s%llu",
                           path, t->name, (unsigned long long)b, (unsigned long long)en,
                           (unsigned long long)(en - b), st_dtypes[d].name,
                           shape_str(sb, sizeof sb, t->ndim, t->shape), over ? "more than " : "",
                           (unsigned long long)(over ? UINT64_MAX : need));
    if (en > data_size)
        return moed_seterr(err, errlen, MOED_E_FORMAT,
                           "%s: tensor '%s': data_offsets [%llu, %llu] past the end of the "
                           "%llu-byte data section",
                           path, t->name, (unsigned long long)b, (unsigned long long)en,
                           (unsigned long long)data_size);
    t->nbytes = need;
    *begin = b;
    return 0;
}

/* Header JSON -> f->tensors; checks names, overlaps. */
static int parse_header(struct st_file *f, const char *hdr, size_t hlen, const uint8_t *data,
                        char *err, size_t errlen)
{
    int rc = 0;
    const char *end = NULL;
    size_t *by_begin = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, hlen, &end, 0);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        size_t pos = (at && at >= hdr && at <= hdr + hlen) ? (size_t)(at - hdr) : 0;
        rc = moed_seterr(err, errlen, MOED_E_FORMAT, "%s: malformed JSON header near byte %zu",
                         f->path, pos);
        goto out;
    }
    /* The reference writer pads with spaces; anything else after the object is junk. */
    for (const char *p = end; p && p < hdr + hlen; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            rc = moed_seterr(err, errlen, MOED_E_FORMAT,
                             "%s: malformed JSON header: trailing data at byte %zu", f->path,
                             (size_t)(p - hdr));
            goto out;
        }
    }
    if (!cJSON_IsObject(root)) {
        rc = moed_seterr(err, errlen, MOED_E_FORMAT,
                         "%s: malformed JSON header: not a JSON object", f->path);
        goto out;
    }
    size_t n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (e->string && strcmp(e->string, "__metadata__") == 0)
            continue;
        n++;
    }
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    f->begin = calloc(n ? n : 1, sizeof *f->begin);
    f->by_name = calloc(n ? n : 1, sizeof *f->by_name);
    by_begin = calloc(n ? n : 1, sizeof *by_begin);
    if (!f->tensors || !f->begin || !f->by_name || !by_begin) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory for %zu tensors", f->path,
                         n);
        goto out;
    }
    cJSON_ArrayForEach(e, root) {
        if (!e->string) {
            rc = moed_seterr(err, errlen, MOED_E_FORMAT, "%s: malformed JSON header", f->path);
            goto out;
        }
        if (strcmp(e->string, "__metadata__") == 0) {
            const cJSON *m;
            if (!cJSON_IsObject(e)) {
                rc = moed_seterr(err, errlen, MOED_E_FORMAT,
                                 "%s: '__metadata__' must be an object of strings", f->path);
                goto out;
            }
            cJSON_ArrayForEach(m, e) {
                if (!cJSON_IsString(m)) {
                    rc = moed_seterr(err, errlen, MOED_E_FORMAT,
                                     "%s: '__metadata__' must be an object of strings "
                                     "(key '%.64s' is not a string)",
                                     f->path, m->string ? m->string : "");
                    goto out;
                }
            }
            continue;
        }
        struct st_tensor *t = &f->tensors[f->n];
        t->name = strdup(e->string);
        if (!t->name) {
            rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory", f->path);
            goto out;
        }
        f->n++; /* counted now so that close frees the name */
        rc = parse_entry(f->path, e, t, &f->begin[f->n - 1], f->data_size, err, errlen);
        if (rc)
            goto out;
        t->data = data + f->begin[f->n - 1];
    }
    for (size_t i = 0; i < n; i++)
        f->by_name[i] = by_begin[i] = i;
    qsort_r(f->by_name, n, sizeof *f->by_name, cmp_name, f->tensors);
    for (size_t i = 1; i < n; i++) {
        if (strcmp(f->tensors[f->by_name[i]].name, f->tensors[f->by_name[i - 1]].name) == 0) {
            rc = moed_seterr(err, errlen, MOED_E_FORMAT, "%s: duplicate tensor name '%s'",
                             f->path, f->tensors[f->by_name[i]].name);
            goto out;
        }
    }
    /* Overlaps: sort by begin; a zero-byte tensor occupies nothing and cannot overlap. */
    qsort_r(by_begin, n, sizeof *by_begin, cmp_begin, f->begin);
    size_t prev = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        size_t c = by_begin[i];
        if (f->tensors[c].nbytes == 0)
            continue;
        if (prev != SIZE_MAX &&
            f->begin[c] < f->begin[prev] + f->tensors[prev].nbytes) {
            rc = moed_seterr(err, errlen, MOED_E_FORMAT,
                             "%s: tensor '%s' [%llu, %llu] overlaps tensor '%s' [%llu, %llu]",
                             f->path, f->tensors[c].name, (unsigned long long)f->begin[c],
                             (unsigned long long)(f->begin[c] + f->tensors[c].nbytes),
                             f->tensors[prev].name, (unsigned long long)f->begin[prev],
                             (unsigned long long)(f->begin[prev] + f->tensors[prev].nbytes));
            goto out;
        }
        if (prev == SIZE_MAX || f->begin[c] + f->tensors[c].nbytes >
                                    f->begin[prev] + f->tensors[prev].nbytes)
            prev = c;
    }
out:
    free(by_begin);
    cJSON_Delete(root);
    return rc;
}

/* The whole file p[0..size) (size >= 8): header length, header, data
 * section; f->path names it in messages. */
static int parse_bytes(struct st_file *f, const uint8_t *p, size_t size, char *err,
                       size_t errlen)
{
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | p[i];
    if (hlen > ST_MAX_HEADER_BYTES)
        return moed_seterr(err, errlen, MOED_E_FORMAT,
                           "%s: header length %llu over the %u-byte cap", f->path,
                           (unsigned long long)hlen, ST_MAX_HEADER_BYTES);
    if (hlen > (uint64_t)size - 8)
        return moed_seterr(err, errlen, MOED_E_FORMAT,
                           "%s: truncated: header length %llu past the end of the %zu-byte file",
                           f->path, (unsigned long long)hlen, size);
    f->data_size = (uint64_t)size - 8 - hlen;
    /* A private NUL-terminated copy: cJSON then cannot run past the header. */
    char *hdr = malloc(hlen + 1);
    if (!hdr)
        return moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory for a %llu-byte header",
                           f->path, (unsigned long long)hlen);
    memcpy(hdr, p + 8, hlen);
    hdr[hlen] = '\0';
    int rc = parse_header(f, hdr, hlen, p + 8 + hlen, err, errlen);
    free(hdr);
    return rc;
}

int st_open(const char *path, struct st_file **out, char *err, size_t errlen)
{
    int rc = 0, fd = -1;
    struct st_file *f = NULL;
    struct stat sb;
    *out = NULL;
    f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory", path);
        goto fail;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "%s: cannot open: %s", path, strerror(errno));
        goto fail;
    }
    if (fstat(fd, &sb) != 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "%s: cannot stat: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "%s: not a regular file", path);
        goto fail;
    }
    /* off_t is signed 64-bit; a size_t mapping must hold the whole file. */
    if (sb.st_size < 8) {
        rc = moed_seterr(err, errlen, MOED_E_FORMAT,
                         "%s: truncated: %lld bytes, need at least 8 for the header length", path,
                         (long long)sb.st_size);
        goto fail;
    }
    if ((uint64_t)sb.st_size > (uint64_t)SIZE_MAX) {
        rc = moed_seterr(err, errlen, MOED_E_FORMAT, "%s: file too large to map (%lld bytes)",
                         path, (long long)sb.st_size);
        goto fail;
    }
    f->map_len = (size_t)sb.st_size;
    f->map = mmap(NULL, f->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        rc = moed_seterr(err, errlen, MOED_E_IO, "%s: mmap of %zu bytes failed: %s", path,
                         f->map_len, strerror(errno));
        goto fail;
    }
    rc = parse_bytes(f, f->map, f->map_len, err, errlen);
    if (rc)
        goto fail;
    close(fd);
    *out = f;
    return 0;
fail:
    if (fd >= 0)
        close(fd);
    st_close(f);
    return rc;
}

int st_open_mem(const char *name, const void *buf, size_t len, struct st_file **out, char *err,
                size_t errlen)
{
    int rc;
    struct st_file *f = calloc(1, sizeof *f);
    *out = NULL;
    if (!f || !(f->path = strdup(name))) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory", name);
        goto fail;
    }
    if (len < 8) {
        rc = moed_seterr(err, errlen, MOED_E_FORMAT,
                         "%s: truncated: %zu bytes, need at least 8 for the header length", name,
                         len);
        goto fail;
    }
    rc = parse_bytes(f, buf, len, err, errlen);
    if (rc)
        goto fail;
    *out = f;
    return 0;
fail:
    st_close(f);
    return rc;
}

void st_close(struct st_file *f)
{
    if (!f)
        return;
    for (size_t i = 0; i < f->n; i++)
        free((char *)f->tensors[i].name);
    free(f->tensors);
    free(f->begin);
    free(f->by_name);
    if (f->map)
        munmap(f->map, f->map_len);
    free(f->path);
    free(f);
}

size_t st_count(const struct st_file *f)
{
    return f->n;
}

const struct st_tensor *st_at(const struct st_file *f, size_t i)
{
    return i < f->n ? &f->tensors[i] : NULL;
}

const struct st_tensor *st_find(const struct st_file *f, const char *name)
{
    size_t lo = 0, hi = f->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const struct st_tensor *t = &f->tensors[f->by_name[mid]];
        int c = strcmp(name, t->name);
        if (c == 0)
            return t;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

const char *st_path(const struct st_file *f)
{
    return f->path;
}

uint64_t st_data_bytes(const struct st_file *f)
{
    return f->data_size;
}

/* ------------------------------------------------------------------ writer */

struct st_wentry {
    char *name;
    enum st_dtype dtype;
    uint32_t ndim;
    uint64_t shape[ST_MAX_DIMS];
    const void *data;
    uint64_t nbytes;
};

struct st_writer {
    struct st_wentry *e;
    size_t n, cap;
};

int st_writer_new(struct st_writer **out)
{
    *out = calloc(1, sizeof **out);
    return *out ? 0 : MOED_E_NOMEM;
}

void st_writer_free(struct st_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n; i++)
        free(w->e[i].name);
    free(w->e);
    free(w);
}

int st_writer_add(struct st_writer *w, const char *name, enum st_dtype dtype, uint32_t ndim,
                  const uint64_t *shape, const void *data, uint64_t nbytes)
{
    if (!w || !name || !*name || (int)dtype < 0 || dtype >= ST_DTYPE_COUNT ||
        ndim > ST_MAX_DIMS || (ndim && !shape) || (nbytes && !data) ||
        strcmp(name, "__metadata__") == 0)
        return MOED_E_INVAL;
    uint64_t need = st_dtypes[dtype].size;
    for (uint32_t i = 0; i < ndim; i++)
        if (mul_u64(need, shape[i], &need) != 0)
            return MOED_E_RANGE;
    if (need != nbytes)
        return MOED_E_INVAL;
    if (w->n == w->cap) {
        size_t nc = w->cap ? w->cap * 2 : 64;
        struct st_wentry *ne = realloc(w->e, nc * sizeof *ne);
        if (!ne)
            return MOED_E_NOMEM;
        w->e = ne;
        w->cap = nc;
    }
    struct st_wentry *e = &w->e[w->n];
    memset(e, 0, sizeof *e);
    e->name = strdup(name);
    if (!e->name)
        return MOED_E_NOMEM;
    e->dtype = dtype;
    e->ndim = ndim;
    for (uint32_t i = 0; i < ndim; i++)
        e->shape[i] = shape[i];
    e->data = data;
    e->nbytes = nbytes;
    w->n++;
    return 0;
}

static int cmp_wname(const void *a, const void *b)
{
    return strcmp((*(const struct st_wentry *const *)a)->name,
                  (*(const struct st_wentry *const *)b)->name);
}

int st_writer_write(struct st_writer *w, const char *path, char *err, size_t errlen)
{
    int rc = 0;
    cJSON *root = NULL;
    char *json = NULL, *tmp = NULL;
    const struct st_wentry **sorted = NULL;
    FILE *fp = NULL;
    size_t plen = strlen(path);

    /* Refuse to write what st_open would refuse: duplicate names. */
    sorted = malloc((w->n ? w->n : 1) * sizeof *sorted);
    if (!sorted) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory", path);
        goto out;
    }
    for (size_t i = 0; i < w->n; i++)
        sorted[i] = &w->e[i];
    qsort(sorted, w->n, sizeof *sorted, cmp_wname);
    for (size_t i = 1; i < w->n; i++) {
        if (strcmp(sorted[i]->name, sorted[i - 1]->name) == 0) {
            rc = moed_seterr(err, errlen, MOED_E_INVAL, "%s: duplicate tensor name '%s'", path,
                             sorted[i]->name);
            goto out;
        }
    }
    root = cJSON_CreateObject();
    if (!root)
        goto nomem;
    uint64_t off = 0;
    for (size_t i = 0; i < w->n; i++) {
        const struct st_wentry *e = &w->e[i];
        cJSON *t = cJSON_CreateObject(), *sh = cJSON_CreateArray(), *o = cJSON_CreateArray();
        if (!t || !sh || !o || !cJSON_AddItemToObject(root, e->name, t)) {
            cJSON_Delete(t);
            cJSON_Delete(sh);
            cJSON_Delete(o);
            goto nomem;
        }
        if (!cJSON_AddItemToObject(t, "shape", sh)) {
            cJSON_Delete(sh);
            cJSON_Delete(o);
            goto nomem;
        }
        if (!cJSON_AddItemToObject(t, "data_offsets", o)) {
            cJSON_Delete(o);
            goto nomem;
        }
        if (!cJSON_AddStringToObject(t, "dtype", st_dtypes[e->dtype].name))
            goto nomem;
        if (off + e->nbytes > (uint64_t)ST_MAX_JSON_INT || off + e->nbytes < off) {
            rc = moed_seterr(err, errlen, MOED_E_RANGE, "%s: data section over 2^53 bytes",
                             path);
            goto out;
        }
        for (uint32_t d = 0; d < e->ndim; d++) {
            cJSON *v = cJSON_CreateNumber((double)e->shape[d]);
            if (!v || !cJSON_AddItemToArray(sh, v)) {
                cJSON_Delete(v);
                goto nomem;
            }
        }
        double ob[2] = {(double)off, (double)(off + e->nbytes)};
        for (int k = 0; k < 2; k++) {
            cJSON *v = cJSON_CreateNumber(ob[k]);
            if (!v || !cJSON_AddItemToArray(o, v)) {
                cJSON_Delete(v);
                goto nomem;
            }
        }
        off += e->nbytes;
    }
    json = cJSON_PrintUnformatted(root);
    if (!json)
        goto nomem;
    size_t jlen = strlen(json);
    /* Pad to a multiple of 8 so the data section starts 8-aligned (as the reference does). */
    size_t hlen = (jlen + 7) & ~(size_t)7;
    if (hlen > ST_MAX_HEADER_BYTES) {
        rc = moed_seterr(err, errlen, MOED_E_RANGE, "%s: header of %zu bytes over the %u cap",
                         path, hlen, ST_MAX_HEADER_BYTES);
        goto out;
    }
    tmp = malloc(plen + 5);
    if (!tmp)
        goto nomem;
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);
    fp = fopen(tmp, "wb");
    if (!fp) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "%s: cannot create: %s", tmp, strerror(errno));
        goto out;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    int ok = fwrite(len8, 1, 8, fp) == 8 && fwrite(json, 1, jlen, fp) == jlen;
    for (size_t i = jlen; ok && i < hlen; i++)
        ok = fputc(' ', fp) != EOF;
    for (size_t i = 0; ok && i < w->n; i++) {
        const uint8_t *d = w->e[i].data;
        uint64_t left = w->e[i].nbytes;
        while (ok && left) {
            size_t chunk = left > (1u << 30) ? (1u << 30) : (size_t)left;
            ok = fwrite(d, 1, chunk, fp) == chunk;
            d += chunk;
            left -= chunk;
        }
    }
    if (fflush(fp) != 0)
        ok = 0;
    if (fclose(fp) != 0)
        ok = 0;
    fp = NULL;
    if (!ok) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "%s: write failed: %s", tmp, strerror(errno));
        unlink(tmp);
        goto out;
    }
    if (rename(tmp, path) != 0) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "%s: rename from %s failed: %s", path, tmp,
                         strerror(errno));
        unlink(tmp);
        goto out;
    }
    goto out;
nomem:
    rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory building the header", path);
out:
    if (fp) {
        fclose(fp);
        unlink(tmp);
    }
    free(tmp);
    cJSON_free(json);
    cJSON_Delete(root);
    free(sorted);
    return rc;
}
