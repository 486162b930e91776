/* config_int.h - what config.c (the parser, validator and renderers) and
 * config_keys.c (the table of keys) share; private to config/.
 */
#ifndef MOED_CONFIG_INT_H
#define MOED_CONFIG_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"

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
    bool repeats;              /* arrays: an element may be listed more than once */
    const char *doc;
};

#define FIELD(f) .off = offsetof(struct moed_cfg, f), .size = sizeof(((struct moed_cfg *)0)->f)
#define COUNT(f) .count_off = offsetof(struct moed_cfg, f)

#define CFG_SHOW_MAX 64             /* bytes of a user's string quoted in a message */
#define CFG_SHOW_BUF (CFG_SHOW_MAX * 6 + 8)  /* ... escaped ("\u00xx"), quoted, "..." */
#define CFG_KEYS_MAX 64 /* rows the parser's seen-table holds */
#define N_SECTIONS 5

extern const struct cfg_key cfg_keys[];
extern const size_t cfg_n_keys;
extern const char *const cfg_sections[N_SECTIONS];
extern const char *const cfg_backend_names[];
extern const char *const cfg_loglevel_names[];

/* Field access and JSON strings (config.c). */
struct moed_sbuf;
uint64_t cfg_load_uint(const void *field, size_t size);
int cfg_load_int(const void *field);
void cfg_sb_json_str(struct moed_sbuf *b, const char *s); /* quoted, escaped */

/* Shared by config.c and config_check.c. */
bool cfg_parse_dec(const char *s, size_t n, uint64_t max, uint64_t *out);
void cfg_show_str(const char *s, char *out, size_t outlen);

/* String checks of the table (config_check.c). */
bool cfg_check_ipv4(const char *s, char *why, size_t whylen);
bool cfg_check_model(const char *s, char *why, size_t whylen);

#endif
