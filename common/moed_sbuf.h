/* moed_sbuf.h - the growing text buffer of the renderers (config JSON and
 * reference, /status JSON's neighbours, Prometheus text).
 *
 * Start from {0}. Appends never truncate; an allocation failure sets `oom`,
 * after which appends do nothing, so a renderer appends unconditionally and
 * checks once at the end (then frees `s`). `s` is NUL-terminated once
 * anything was appended (NULL before). */
#ifndef MOED_SBUF_H
#define MOED_SBUF_H

#include <stdbool.h>
#include <stddef.h>

struct moed_sbuf {
    char *s;
    size_t len, cap;
    bool oom;
};

void moed_sb_addn(struct moed_sbuf *b, const char *s, size_t n);
void moed_sb_add(struct moed_sbuf *b, const char *s);
void moed_sb_printf(struct moed_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
