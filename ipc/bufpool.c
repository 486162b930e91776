/* bufpool.c - host buffers for frames, kept for reuse (see bufpool.h).
 *
 * Pinned buffers: size class k holds buffers of MOED_BUFPOOL_MIN_BYTES << k
 * bytes; a free buffer stores the next free one of its class in its first
 * bytes, so the free lists cost no memory and cannot fail. Plain spares: a
 * small LIFO array.
 */
#include "bufpool.h"

#include <stdlib.h>
#include <string.h>

#include "moed_err.h"
#include "moed_log.h"

#define N_CLASSES 32 /* 64 KiB << 31 = 128 TiB: more than any limit */

struct free_buf {
    struct free_buf *next;
};

struct moed_bufpool {
    struct moed_bufpool_cfg cfg;
    struct free_buf *free_list[N_CLASSES];
    uint64_t pinned_bytes, pinned_free_bytes, pinned_allocs;
    uint64_t pinned_dropped;  /* bytes that came back after release_pinned */
    int released;             /* release_pinned ran: the allocator is off limits */
    struct moed_hbuf spares[MOED_BUFPOOL_SPARES];
    int n_spares;
    uint64_t spare_bytes;
};

int moed_bufpool_open(const struct moed_bufpool_cfg *cfg, struct moed_bufpool **out)
{
    *out = NULL;
    struct moed_bufpool *p = calloc(1, sizeof *p);
    if (!p)
        return MOED_E_NOMEM;
    p->cfg = *cfg;
    if (!p->cfg.pinned.alloc)
        p->cfg.pinned_limit = 0;
    *out = p;
    return 0;
}

static size_t class_bytes(unsigned k) { return (size_t)MOED_BUFPOOL_MIN_BYTES << k; }

/* The smallest class that holds `bytes`; N_CLASSES when none does. */
static unsigned class_of(size_t bytes)
{
    unsigned k = 0;
    while (k < N_CLASSES && class_bytes(k) < bytes)
        k++;
    return k;
}

static void *pop_free(struct moed_bufpool *p, unsigned k)
{
    struct free_buf *f = p->free_list[k];
    if (f) {
        p->free_list[k] = f->next;
        p->pinned_free_bytes -= class_bytes(k);
    }
    return f;
}

/* A pinned buffer for `bytes`, or 0 when there is none to be had. */
static int get_pinned(struct moed_bufpool *p, size_t bytes, struct moed_hbuf *out)
{
    if (p->released || bytes > p->cfg.pinned_limit)
        return 0;
    unsigned k = class_of(bytes);
    if (k >= N_CLASSES)
        return 0;
    void *b = pop_free(p, k);
    if (!b && p->pinned_bytes + class_bytes(k) <= p->cfg.pinned_limit) {
        b = p->cfg.pinned.alloc(p->cfg.pinned.ctx, class_bytes(k));
        if (b) {
            p->pinned_bytes += class_bytes(k);
            p->pinned_allocs++;
        } else {
            /* the allocator logged why; stay at what we hold */
            LOG_W("pinned buffers: allocating %zu bytes failed; keeping the %llu bytes held and "
                  "using ordinary memory (with the backend's staging copies) beyond them",
                  class_bytes(k), (unsigned long long)p->pinned_bytes);
            p->cfg.pinned_limit = p->pinned_bytes;
        }
    }
    for (unsigned j = k + 1; !b && j < N_CLASSES; j++)
        if ((b = pop_free(p, j)) != NULL)
            k = j;
    if (!b)
        return 0;
    *out = (struct moed_hbuf){b, class_bytes(k), 1};
    return 1;
}

int moed_bufpool_get(struct moed_bufpool *p, size_t bytes, int pinned_ok, struct moed_hbuf *out)
{
    if (pinned_ok && get_pinned(p, bytes, out))
        return 0;
    for (int i = p->n_spares - 1; i >= 0; i--) {
        if (p->spares[i].cap < bytes)
            continue;
        *out = p->spares[i];
        p->spare_bytes -= out->cap;
        p->n_spares--;
        memmove(&p->spares[i], &p->spares[i + 1], (size_t)(p->n_spares - i) * sizeof *p->spares);
        return 0;
    }
    uint8_t *b = malloc(bytes ? bytes : 1);
    if (!b)
        return MOED_E_NOMEM;
    *out = (struct moed_hbuf){b, bytes, 0};
    return 0;
}

int moed_bufpool_grow(struct moed_bufpool *p, struct moed_hbuf *b, size_t bytes, size_t keep)
{
    if (b->base && b->cap >= bytes)
        return 0;
    if (p->cfg.pinned_limit == 0 && !b->pinned) {
        uint8_t *nb = realloc(b->base, bytes);
        if (!nb)
            return MOED_E_NOMEM;
        b->base = nb;
        b->cap = bytes;
        return 0;
    }
    struct moed_hbuf nb;
    if (moed_bufpool_get(p, bytes, 1, &nb))
        return MOED_E_NOMEM;
    if (b->base && keep)
        memcpy(nb.base, b->base, keep < b->cap ? keep : b->cap);
    moed_bufpool_put(p, b);
    *b = nb;
    return 0;
}

void moed_bufpool_put(struct moed_bufpool *p, struct moed_hbuf *b)
{
    if (!b->base)
        return;
    if (b->pinned) {
        if (p->released) {
            p->pinned_dropped += b->cap;
        } else {
            unsigned k = class_of(b->cap);
            struct free_buf *f = (struct free_buf *)(void *)b->base;
            f->next = p->free_list[k];
            p->free_list[k] = f;
            p->pinned_free_bytes += b->cap;
        }
    } else if (b->cap >= MOED_BUFPOOL_MIN_BYTES && b->cap <= p->cfg.keep_bytes &&
               p->n_spares < MOED_BUFPOOL_SPARES) {
        p->spares[p->n_spares++] = *b;
        p->spare_bytes += b->cap;
    } else {
        free(b->base);
    }
    b->base = NULL;
    b->cap = 0;
    b->pinned = 0;
}

void moed_bufpool_abandon(struct moed_bufpool *p, struct moed_hbuf *b)
{
    (void)p;
    if (b->base && b->pinned)
        *b = (struct moed_hbuf){0};
}

void moed_bufpool_release_pinned(struct moed_bufpool *p)
{
    if (p->released)
        return;
    for (unsigned k = 0; k < N_CLASSES; k++) {
        void *b;
        while ((b = pop_free(p, k)) != NULL) {
            p->cfg.pinned.free(p->cfg.pinned.ctx, b);
            p->pinned_bytes -= class_bytes(k);
        }
    }
    p->released = 1;
    p->cfg.pinned_limit = 0;
}

void moed_bufpool_close(struct moed_bufpool *p)
{
    if (!p)
        return;
    moed_bufpool_release_pinned(p);
    if (p->pinned_bytes)
        LOG_W("pinned buffers: %llu bytes were in use when the backend closed (%llu of them "
              "came back after it, the rest were abandoned to a failed device); left to "
              "process exit",
              (unsigned long long)p->pinned_bytes, (unsigned long long)p->pinned_dropped);
    for (int i = 0; i < p->n_spares; i++)
        free(p->spares[i].base);
    free(p);
}

void moed_bufpool_get_stats(const struct moed_bufpool *p, struct moed_bufpool_stats *out)
{
    *out = (struct moed_bufpool_stats){
        .pinned_bytes = p->pinned_bytes,
        .pinned_free_bytes = p->pinned_free_bytes,
        .pinned_allocs = p->pinned_allocs,
        .pinned_limit = p->cfg.pinned_limit,
        .spare_bytes = p->spare_bytes,
    };
}
