/* moed_err.h - the one error convention of moed.
 *
 * Every library function returns 0 on success or a negative MOED_E_* code.
 * Functions that can say more than the code take `char *err, size_t errlen`
 * (may be NULL) and write one human-readable line naming what was wrong
 * (file, key, tensor, value and what was allowed). Only main() may exit.
 *
 * The numeric values are part of the wire protocol (ERROR frames carry them),
 * so never renumber; add new codes at the end.
 */
#ifndef MOED_ERR_H
#define MOED_ERR_H

#include <stddef.h>

#define MOED_ERRLEN 512 /* size of an error-message buffer */

enum moed_err {
    MOED_OK = 0,
    MOED_E_NOMEM = -1,       /* allocation failed */
    MOED_E_IO = -2,          /* open/read/write/mmap failed */
    MOED_E_FORMAT = -3,      /* malformed file (safetensors, JSON) */
    MOED_E_RANGE = -4,       /* value out of the allowed range */
    MOED_E_CONFIG = -5,      /* bad config key, type or value */
    MOED_E_MODEL = -6,       /* checkpoint inconsistent or unsupported */
    MOED_E_NOFIT = -7,       /* model does not fit in the memory available */
    MOED_E_PROTO = -8,       /* malformed frame (magic, length, ...) */
    MOED_E_VERSION = -9,     /* protocol version not supported */
    MOED_E_TYPE = -10,       /* unknown message type */
    MOED_E_TOOBIG = -11,     /* payload over the configured maximum */
    MOED_E_INVAL = -12,      /* request fields invalid (T, top-k, ids, layer, sizes) */
    MOED_E_BUSY = -13,       /* too many clients / pending requests */
    MOED_E_TIMEOUT = -14,    /* a deadline passed (frame body, batch) */
    MOED_E_SHUTDOWN = -15,   /* daemon is stopping */
    MOED_E_BACKEND = -16,    /* backend failed (device error, kernel stalled) */
    MOED_E_UNSUPPORTED = -17,/* feature not available in this build */
    MOED_E_PERM = -18,       /* peer not allowed (uid/gid) */
    MOED_E_NOTREADY = -19,   /* model still loading / backend not healthy */
    MOED_E_CONN = -20,       /* connection lost / refused (client side) */
    MOED_E__COUNT = 21
};

/* Static string for a code ("invalid request", ...); never NULL. */
const char *moed_strerror(int err);

/* Short stable name for a code ("EINVAL"-like: "inval", "toobig"), used as a
 * metrics label and in JSON; never NULL. */
const char *moed_errname(int err);

/* printf into err[errlen] if err != NULL; returns `code` so callers can write
 * `return moed_seterr(err, errlen, MOED_E_MODEL, "tensor %s: ...", name);` */
int moed_seterr(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
