/* bufpool.h - host buffers for frames, kept for reuse (prefix moed_bufpool_).
 *
 * The server reads requests into these buffers and writes replies out of
 * them; the engine hands a lent read buffer to the backend as a batch's x and
 * has the backend write y straight into a reply frame taken from here. A
 * backend that can use host memory in place (CUDA: pinned, device-mapped)
 * offers an allocator for it (moed_backend_ops.host_alloc): buffers from it
 * are "pinned", batches mark them MOED_BUF_PINNED, and the backend then reads
 * x and writes y where they lie instead of copying them through its own
 * staging memory.
 *
 * Pinned buffers come in power-of-two sizes from MOED_BUFPOOL_MIN_BYTES and
 * are not given back while the pool serves: allocating pinned memory costs up
 * to milliseconds, and freeing it waits until the device is idle
 * (cudaFreeHost synchronizes with a resident persistent kernel, i.e. never
 * returns while it runs). So a pinned buffer, once allocated, is kept on its
 * size's free list and reused, and the bytes ever taken from the allocator
 * are capped at `pinned_limit` (server.pinned_pool_bytes); past the cap, and
 * after an allocation failure, buffers are plain.
 *
 * Plain buffers are malloc'd. Up to MOED_BUFPOOL_SPARES of them between
 * MOED_BUFPOOL_MIN_BYTES and `keep_bytes` (server.read_buffer_keep_bytes) are
 * kept as spares (LIFO: the warmest first); others are freed when put back.
 *
 * Everything here runs on the loop thread.
 */
#ifndef MOED_BUFPOOL_H
#define MOED_BUFPOOL_H

#include <stddef.h>
#include <stdint.h>

#define MOED_BUFPOOL_SPARES 16               /* plain buffers kept, pool-wide */
#define MOED_BUFPOOL_MIN_BYTES (64u * 1024u) /* smallest pinned buffer and kept spare */

/* One buffer. The holder owns it until it puts it back. */
struct moed_hbuf {
    uint8_t *base; /* NULL: no buffer */
    size_t cap;    /* usable bytes at base */
    int pinned;    /* 1: from the pinned allocator (a batch marks it MOED_BUF_PINNED) */
};

/* Where pinned buffers come from (the backend's host_alloc / host_free);
 * alloc returns NULL on failure, with the reason logged. Buffers are aligned
 * at least as malloc's. */
struct moed_host_allocator {
    void *(*alloc)(void *ctx, size_t bytes);
    void (*free)(void *ctx, void *p);
    void *ctx;
};

struct moed_bufpool_cfg {
    struct moed_host_allocator pinned; /* alloc NULL: plain buffers only */
    uint64_t pinned_limit;             /* most bytes ever taken from `pinned` (0: none) */
    uint64_t keep_bytes;               /* largest plain buffer kept as a spare */
};

struct moed_bufpool_stats {
    uint64_t pinned_bytes;      /* taken from the allocator and held (in use or free) */
    uint64_t pinned_free_bytes; /* of those, on the free lists */
    uint64_t pinned_allocs;     /* successful allocator calls since open */
    uint64_t pinned_limit;      /* the cap (lowered to pinned_bytes after a failure) */
    uint64_t spare_bytes;       /* plain spares kept */
};

struct moed_bufpool;

/* 0 or MOED_E_NOMEM. The allocator must outlive the pool's pinned buffers:
 * see moed_bufpool_release_pinned. */
int moed_bufpool_open(const struct moed_bufpool_cfg *cfg, struct moed_bufpool **out);

/* A buffer of at least `bytes` into *out. With `pinned_ok`, a pinned one when
 * the pool has or may allocate one (a free one of the fitting size first,
 * then a new one under the cap, then a larger free one); otherwise a kept
 * spare big enough, else a fresh malloc. 0 or MOED_E_NOMEM (*out untouched). */
int moed_bufpool_get(struct moed_bufpool *p, size_t bytes, int pinned_ok, struct moed_hbuf *out);

/* Make *b at least `bytes`, keeping its first `keep` bytes (b->base NULL:
 * a plain get). With a pinned allocator the new buffer is a pinned one if the
 * pool can give one (and the old one is put back); without, realloc. 0, or
 * MOED_E_NOMEM with *b unchanged. */
int moed_bufpool_grow(struct moed_bufpool *p, struct moed_hbuf *b, size_t bytes, size_t keep);

/* Give *b back (b->base becomes NULL; NULL base: nothing). Pinned: onto its
 * free list. Plain: kept as a spare or freed (see above). */
void moed_bufpool_put(struct moed_bufpool *p, struct moed_hbuf *b);

/* The device may still read or write *b (its batch failed while in flight):
 * a pinned buffer is never reused but stays counted, left to process exit
 * (b->base becomes NULL). A plain one stays with the caller (the backend went
 * through its own staging memory for it). */
void moed_bufpool_abandon(struct moed_bufpool *p, struct moed_hbuf *b);

/* The allocator's owner is about to close: give every free pinned buffer back
 * to it and allocate no more. Pinned buffers still out (batches at the
 * backend: never after a drain) are dropped when they come back, left to
 * process exit, and counted in a warning at close. */
void moed_bufpool_release_pinned(struct moed_bufpool *p);

/* Release everything kept (moed_bufpool_release_pinned first, if not done)
 * and free the pool. Buffers still out must not be put back afterwards. */
void moed_bufpool_close(struct moed_bufpool *p);

void moed_bufpool_get_stats(const struct moed_bufpool *p, struct moed_bufpool_stats *out);

#endif
