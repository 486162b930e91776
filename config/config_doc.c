/* config_doc.c - the config's renderers: the effective config as JSON
 * (moed --check-config) and the Markdown reference of every key
 * (config/README.md, make config-doc), both walking the table of keys. */
#include "config.h"
#include "config_int.h"

#include "moed_sbuf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* Printing: the effective config and the reference. */

const char *moed_cfg_backend_name(enum moed_cfg_backend b)
{
    return ((unsigned)b < 3) ? cfg_backend_names[b] : "?";
}

/* The JSON text of one key's value in c. */
static void emit_value(struct moed_sbuf *b, const struct cfg_key *k, const struct moed_cfg *c)
{
    const char *field = (const char *)c + k->off;
    switch (k->type) {
    case T_STRING:
    case T_PATH: {
        char tmp[MOED_CFG_PATH_MAX + 1];
        size_t n = strnlen(field, k->size);
        memcpy(tmp, field, n);
        tmp[n] = '\0';
        cfg_sb_json_str(b, tmp);
        return;
    }
    case T_MODE:
        moed_sb_printf(b, "\"%04llo\"", (unsigned long long)cfg_load_uint(field, k->size));
        return;
    case T_UINT:
        moed_sb_printf(b, "%llu", (unsigned long long)cfg_load_uint(field, k->size));
        return;
    case T_BOOL: {
        bool x;
        memcpy(&x, field, sizeof x);
        moed_sb_add(b, x ? "true" : "false");
        return;
    }
    case T_ENUM:
    case T_LOGLEVEL: {
        int i = cfg_load_int(field), n = 0;
        while (k->names[n])
            n++;
        cfg_sb_json_str(b, (i >= 0 && i < n) ? k->names[i] : "?");
        return;
    }
    case T_UINT_ARRAY:
    case T_INT_ARRAY: {
        uint32_t cnt = (uint32_t)cfg_load_uint((const char *)c + k->count_off, 4);
        if (cnt > k->size / 4)
            cnt = (uint32_t)(k->size / 4);
        moed_sb_add(b, "[");
        for (uint32_t i = 0; i < cnt; i++) {
            if (k->type == T_UINT_ARRAY)
                moed_sb_printf(b, "%s%u", i ? ", " : "", (unsigned)cfg_load_uint(field + 4 * i, 4));
            else
                moed_sb_printf(b, "%s%d", i ? ", " : "", cfg_load_int(field + 4 * i));
        }
        moed_sb_add(b, "]");
        return;
    }
    }
}

static void emit_json(struct moed_sbuf *b, const struct moed_cfg *c)
{
    moed_sb_add(b, "{\n");
    for (size_t s = 0; s < N_SECTIONS; s++) {
        size_t slen = strlen(cfg_sections[s]);
        moed_sb_printf(b, "  \"%s\": {", cfg_sections[s]);
        bool first = true;
        for (size_t i = 0; i < cfg_n_keys; i++) {
            if (strncmp(cfg_keys[i].path, cfg_sections[s], slen) != 0 || cfg_keys[i].path[slen] != '.')
                continue;
            moed_sb_printf(b, "%s\n    \"%s\": ", first ? "" : ",", cfg_keys[i].path + slen + 1);
            emit_value(b, &cfg_keys[i], c);
            first = false;
        }
        moed_sb_printf(b, "\n  }%s\n", s + 1 < N_SECTIONS ? "," : "");
    }
    moed_sb_add(b, "}\n");
}

char *moed_cfg_to_json(const struct moed_cfg *cfg)
{
    struct moed_sbuf b = {0};
    emit_json(&b, cfg);
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

/* "67108864 (64 MiB)" for byte counts that are whole KiB/MiB/GiB. */
static void md_bytes(struct moed_sbuf *b, uint64_t v)
{
    static const char *const units[] = {"KiB", "MiB", "GiB"};
    int u = -1;
    uint64_t x = v;
    while (u < 2 && x >= 1024 && x % 1024 == 0) {
        x /= 1024;
        u++;
    }
    if (u >= 0)
        moed_sb_printf(b, "%llu (%llu %s)", (unsigned long long)v, (unsigned long long)x, units[u]);
    else
        moed_sb_printf(b, "%llu", (unsigned long long)v);
}

static void md_cell(struct moed_sbuf *b, const char *s)
{
    for (; *s; s++) {
        if (*s == '|')
            moed_sb_add(b, "\\|");
        else
            moed_sb_addn(b, s, 1);
    }
}

static const char *type_name(const struct cfg_key *k)
{
    switch (k->type) {
    case T_STRING: return "string";
    case T_PATH: return "path";
    case T_UINT: return "unsigned integer";
    case T_MODE: return "octal mode string";
    case T_BOOL: return "boolean";
    case T_ENUM: return "enum";
    case T_UINT_ARRAY: return "array of unsigned integers";
    case T_INT_ARRAY: return "array of integers";
    case T_LOGLEVEL: return "log level";
    }
    return "?";
}

static void md_allowed(struct moed_sbuf *b, const struct cfg_key *k)
{
    switch (k->type) {
    case T_STRING:
    case T_PATH:
        if (k->min > 0)
            moed_sb_printf(b, "non-empty, at most %lld bytes", (long long)k->max);
        else
            moed_sb_printf(b, "at most %lld bytes", (long long)k->max);
        break;
    case T_UINT:
        if (k->bytes) {
            md_bytes(b, (uint64_t)k->min);
            moed_sb_add(b, " .. ");
            md_bytes(b, (uint64_t)k->max);
        } else {
            moed_sb_printf(b, "%lld .. %lld", (long long)k->min, (long long)k->max);
        }
        break;
    case T_MODE:
        moed_sb_printf(b, "`\"%04llo\"` .. `\"%04llo\"`", (unsigned long long)k->min,
                  (unsigned long long)k->max);
        break;
    case T_BOOL:
        moed_sb_add(b, "`true`, `false`");
        break;
    case T_ENUM:
    case T_LOGLEVEL:
        for (int i = 0; k->names[i]; i++)
            moed_sb_printf(b, "%s`\"%s\"`", i ? ", " : "", k->names[i]);
        break;
    case T_UINT_ARRAY:
    case T_INT_ARRAY:
        moed_sb_printf(b, "up to %zu entries, each %lld .. %lld%s", k->size / 4,
                  (long long)k->min, (long long)k->max, k->repeats ? "" : ", no repeats");
        break;
    }
    if (k->allowed) {
        moed_sb_add(b, "; ");
        md_cell(b, k->allowed);
    }
}

/* A small example file; the unit test parses it out of the reference. */
static const char example_json[] =
    "{\n"
    "  \"server\": { \"socket\": \"/run/moed/moed.sock\", \"socket_mode\": \"0660\",\n"
    "              \"socket_group\": \"moed\", \"allowed_gids\": [1001] },\n"
    "  \"model\": { \"path\": \"/models/DeepSeek-V3-NVFP4\" },\n"
    "  \"engine\": { \"backend\": \"cuda\", \"gpus\": [4, 5, 6, 7], \"sms_free\": 8 },\n"
    "  \"log\": { \"level\": \"info\" }\n"
    "}\n";

char *moed_cfg_reference_md(void)
{
    struct moed_sbuf b = {0};
    struct moed_cfg *def = malloc(sizeof *def);
    if (!def)
        return NULL;
    moed_cfg_defaults(def);

    moed_sb_add(&b,
           "# moed configuration reference\n"
           "\n"
           "<!-- Generated from the key table in config/config.c by moed_cfg_reference_md();\n"
           "     do not edit: run `make config-doc` after changing the table. -->\n"
           "\n"
           "moed reads one JSON file (at most 1 MiB): `moed --config FILE`, else the file\n"
           "named by `$MOED_CONFIG`, else `/etc/moed/moed.json` (`moed --builtin` starts on\n"
           "the defaults below without a file). The environment overrides two keys:\n"
           "`MOED_SOCKET` replaces `server.socket` and `MOED_STATUS_PORT` `status.port`.\n"
           "The top level is an object of sections (`server`, `status`, `model`, `engine`,\n"
           "`log`), each an object of keys. Every key is optional and takes its default when left\n"
           "out. Unknown keys, repeated keys, wrong types and out-of-range values are errors:\n"
           "moed reports every one, naming the key, the value and what is allowed, and does\n"
           "not start. Numbers must be exact integers (no fraction, at most 2^53).\n"
           "`moed --check-config` prints the effective configuration, every key included.\n"
           "\n"
           "| Key | Type | Default | Allowed | Description |\n"
           "|---|---|---|---|---|\n");
    for (size_t i = 0; i < cfg_n_keys; i++) {
        const struct cfg_key *k = &cfg_keys[i];
        struct moed_sbuf v = {0};
        emit_value(&v, k, def);
        moed_sb_printf(&b, "| `%s` | %s | `", k->path, type_name(k));
        md_cell(&b, v.s ? v.s : "");
        moed_sb_add(&b, "`");
        if (k->bytes && k->type == T_UINT) {
            struct moed_sbuf h = {0};
            md_bytes(&h, cfg_load_uint((const char *)def + k->off, k->size));
            const char *paren = h.s ? strchr(h.s, '(') : NULL;
            if (paren) {
                moed_sb_add(&b, " ");
                moed_sb_add(&b, paren);
            }
            b.oom |= h.oom;
            free(h.s);
        }
        moed_sb_add(&b, " | ");
        md_allowed(&b, k);
        moed_sb_add(&b, " | ");
        md_cell(&b, k->doc);
        moed_sb_add(&b, " |\n");
        b.oom |= v.oom;
        free(v.s);
    }
    moed_sb_add(&b,
           "\n"
           "## Example\n"
           "\n"
           "A daemon on four dedicated GPUs serving a real checkpoint to members of group\n"
           "`moed`:\n"
           "\n"
           "```json\n");
    moed_sb_add(&b, example_json);
    moed_sb_add(&b,
           "```\n"
           "\n"
           "## Defaults\n"
           "\n"
           "The effective configuration of an empty file `{}`:\n"
           "\n"
           "```json\n");
    emit_json(&b, def);
    moed_sb_add(&b, "```\n");
    free(def);
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}
