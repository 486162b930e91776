/* nccl_host.c - the NCCL group's host-side parts (nccl_group.h): its unique
 * id in a file, the check of a header a worker receives, a ROWS batch's
 * entries; code of every build, so CI tests it without a GPU. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "moed_err.h"
#include "moed_file.h"
#include "nccl_group.h"

int moed_nccl_id_write(const char *path, const uint8_t id[MOED_NCCL_ID_BYTES], char *err,
                       size_t errlen)
{
    char tmp[4200], text[2 * MOED_NCCL_ID_BYTES + 2];
    for (int i = 0; i < MOED_NCCL_ID_BYTES; i++)
        snprintf(text + 2 * i, 3, "%02x", id[i]);
    text[2 * MOED_NCCL_ID_BYTES] = '\n';
    text[2 * MOED_NCCL_ID_BYTES + 1] = '\0';
    if (snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid()) >= (int)sizeof tmp)
        return moed_seterr(err, errlen, MOED_E_IO, "engine.nccl_id_file %s: path too long", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return moed_seterr(err, errlen, MOED_E_IO, "engine.nccl_id_file %s: cannot create %s: %s",
                           path, tmp, strerror(errno));
    const size_t n = 2 * MOED_NCCL_ID_BYTES + 1;
    ssize_t w = write(fd, text, n);
    const int werr = errno;
    if (w != (ssize_t)n || fsync(fd) != 0) {
        close(fd);
        unlink(tmp);
        return moed_seterr(err, errlen, MOED_E_IO, "engine.nccl_id_file %s: write failed: %s",
                           path, w < 0 ? strerror(werr) : "short write");
    }
    close(fd);
    if (rename(tmp, path) != 0) {
        const int e = errno;
        unlink(tmp);
        return moed_seterr(err, errlen, MOED_E_IO, "engine.nccl_id_file %s: rename from %s: %s",
                           path, tmp, strerror(e));
    }
    return 0;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* 0 with id filled, MOED_E_CONFIG naming what is wrong. */
static int id_parse(const char *path, const char *s, size_t len, uint8_t *id, char *err,
                    size_t errlen)
{
    if (len == 2 * MOED_NCCL_ID_BYTES + 1 && s[len - 1] == '\n')
        len--;
    if (len != 2 * MOED_NCCL_ID_BYTES)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "engine.nccl_id_file %s: %zu bytes, not an NCCL id (%d hex digits "
                           "and a newline, as rank 0 writes it)",
                           path, len, 2 * MOED_NCCL_ID_BYTES);
    for (size_t i = 0; i < len; i += 2) {
        const int hi = hexval(s[i]), lo = hexval(s[i + 1]);
        if (hi < 0 || lo < 0)
            return moed_seterr(err, errlen, MOED_E_CONFIG,
                               "engine.nccl_id_file %s: byte %zu is not a hex digit; not an "
                               "NCCL id", path, hi < 0 ? i : i + 1);
        id[i / 2] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

int moed_nccl_id_read(const char *path, uint32_t timeout_ms, uint8_t id[MOED_NCCL_ID_BYTES],
                      char *err, size_t errlen)
{
    const uint64_t end = now_ms() + timeout_ms;
    for (;;) {
        char *text = NULL;
        size_t len = 0;
        int missing = 0;
        int rc = moed_file_read_small(path, "engine.nccl_id_file", 4096, MOED_E_CONFIG, &text,
                                      &len, &missing, err, errlen);
        if (rc)
            return rc;
        if (!missing) {
            rc = id_parse(path, text, len, id, err, errlen);
            free(text);
            return rc;
        }
        if (now_ms() >= end)
            return moed_seterr(err, errlen, MOED_E_TIMEOUT,
                               "engine.nccl_id_file %s: rank 0 did not write it within "
                               "engine.nccl_timeout_ms (%u ms)", path, timeout_ms);
        const struct timespec nap = {0, 20 * 1000 * 1000};
        nanosleep(&nap, NULL);
    }
}

const char *moed_nccl_hdr_check(const struct moed_nccl_hdr *h, const struct moed_model *m,
                                uint32_t ranks, uint32_t rank, uint32_t max_tokens)
{
    const uint32_t known = MOED_BATCH_ROUTED_ONLY | MOED_BATCH_ROWS;
    if (h->magic != MOED_NCCL_MAGIC)
        return "bad magic";
    if (h->kind == MOED_NCCL_PING || h->kind == MOED_NCCL_STOP)
        return NULL;
    if (h->kind != MOED_NCCL_BATCH)
        return "unknown kind";
    if (h->n_tokens < 1 || h->n_tokens > max_tokens)
        return "n_tokens out of range";
    if (h->layer >= moed_model_dims(m)->n_layers || !moed_model_is_moe_layer(m, h->layer))
        return "not a MoE layer";
    if ((h->flags & ~known) || !(h->flags & MOED_BATCH_ROWS))
        return "flags";
    if (h->ep_n != ranks || h->ep_shard != rank)
        return "ep_n / ep_shard are not this group's";
    return NULL;
}

uint32_t moed_nccl_rows_entries(const struct moed_batch *b, uint32_t k, uint32_t S,
                                uint32_t *out)
{
    const uint32_t KS = k + S;
    const int32_t *ids = b->ids.ptr;
    const int shared = !(b->flags & MOED_BATCH_ROUTED_ONLY) && b->ep_n > 0;
    uint32_t n = 0;
    for (uint32_t t = 0; t < b->n_tokens; t++) {
        for (uint32_t j = 0; j < k; j++)
            if (ids[(size_t)t * k + j] >= 0)
                out[n++] = t * KS + j;
        if (shared && t % b->ep_n == b->ep_shard)
            for (uint32_t s = 0; s < S; s++)
                out[n++] = t * KS + k + s;
    }
    return n;
}
