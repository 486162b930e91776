/* fuzz_safetensors.c - libFuzzer target for the safetensors reader
 * (st_open_mem: the same checks st_open makes on a mapped file).
 *
 * The input is a whole file image: u64 header length, JSON header, data.
 * Besides the sanitizers, it checks the reader's contract on every input:
 *   - the result is 0, MOED_E_FORMAT or MOED_E_NOMEM; an error has a message
 *     that names the file;
 *   - success: every tensor lies inside the data section, its byte count is
 *     numel * dtype size, its name is found by st_find (and only it), no two
 *     non-empty tensors overlap, and st_data_bytes is what follows the header;
 *   - the reader is pure: the same bytes give the same answer.
 *
 *   make fuzz && build/fuzz/fuzz_safetensors -max_total_time=60 \
 *       -dict=tests/fuzz/json.dict tests/fuzz/corpus/safetensors
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moed_err.h"
#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_file(const struct st_file *f, const uint8_t *buf, size_t size)
{
    size_t n = st_count(f);
    uint64_t data_size = st_data_bytes(f);
    if (data_size > size - 8)
        abort();
    const uint8_t *dbeg = buf + (size - data_size), *dend = buf + size;
    for (size_t i = 0; i < n; i++) {
        const struct st_tensor *t = st_at(f, i);
        if (!t || !t->name || t->ndim > ST_MAX_DIMS || st_dtype_size(t->dtype) == 0)
            abort();
        uint64_t numel = 1;
        for (uint32_t d = 0; d < t->ndim; d++)
            if (__builtin_mul_overflow(numel, t->shape[d], &numel))
                abort();
        uint64_t want;
        if (__builtin_mul_overflow(numel, (uint64_t)st_dtype_size(t->dtype), &want) ||
            want != t->nbytes)
            abort();
        const uint8_t *p = t->data;
        if (p < dbeg || p > dend || t->nbytes > (uint64_t)(dend - p))
            abort();
        if (st_find(f, t->name) != t)
            abort();
        for (size_t j = 0; j < i; j++) { /* inputs are small: quadratic is fine */
            const struct st_tensor *u = st_at(f, j);
            if (!strcmp(u->name, t->name))
                abort();
            const uint8_t *q = u->data;
            if (t->nbytes && u->nbytes && p < q + u->nbytes && q < p + t->nbytes)
                abort();
        }
    }
    if (st_at(f, n) != NULL || st_find(f, "\x01 no such tensor") != NULL)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an exact-size copy so any read past `size` is an ASan error */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    char err[512] = "", err2[512] = "";
    struct st_file *f = NULL, *g = NULL;
    int rc = st_open_mem("fuzz.safetensors", buf, size, &f, err, sizeof err);
    int rc2 = st_open_mem("fuzz.safetensors", buf, size, &g, err2, sizeof err2);
    if (rc != rc2 || strcmp(err, err2))
        abort();
    if (rc == 0) {
        if (!f || !g || st_count(f) != st_count(g))
            abort();
        check_file(f, buf, size);
    } else {
        if (f || g || (rc != MOED_E_FORMAT && rc != MOED_E_NOMEM))
            abort();
        if (strncmp(err, "fuzz.safetensors: ", 18) != 0)
            abort();
    }
    st_close(f);
    st_close(g);
    free(buf);
    return 0;
}
