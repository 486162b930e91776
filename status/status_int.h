/* status_int.h - what the renderers of status/ share (internal: status.c
 * and status_zc.c only). The short names are the ones the renderers use. */
#ifndef MOED_STATUS_INT_H
#define MOED_STATUS_INT_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "moed_sbuf.h"
#include "stats.h"

/* A number member; 0, or -1 when out of memory. */
int moed_status_jnum(cJSON *obj, const char *key, double v);
/* A metric's HELP and TYPE lines; a whole gauge or counter of one sample. */
void moed_status_sb_head(struct moed_sbuf *b, const char *name, const char *type,
                         const char *help);
void moed_status_prom_u64(struct moed_sbuf *b, const char *name, const char *type,
                          const char *help, uint64_t v);
void moed_status_prom_dbl(struct moed_sbuf *b, const char *name, const char *type,
                          const char *help, double v);
#define jnum moed_status_jnum
#define sb_head moed_status_sb_head
#define prom_u64 moed_status_prom_u64
#define prom_dbl moed_status_prom_dbl

/* The zero-copy path (status_zc.c): "registered_buffers" and "channels" of
 * /status (0, or -1 when out of memory), and their metrics. */
int moed_status_json_zero_copy(cJSON *root, const struct moed_stats *s);
void moed_status_prom_zero_copy(struct moed_sbuf *b, const struct moed_stats *s);

#endif
