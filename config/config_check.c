/* config_check.c - the config's string checks (config_int.h): an IPv4
 * literal for status.address, and model.path's synthetic spec, whose one
 * parser (moed_cfg_synthetic, config.h) the daemon uses too. */
#include "config.h"
#include "config_int.h"

#include <arpa/inet.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "moed_err.h"

/* ------------------------------------------------------------------------ */
/* Extra string checks. */

bool cfg_check_ipv4(const char *s, char *why, size_t whylen)
{
    struct in_addr a;
    if (inet_pton(AF_INET, s, &a) == 1)
        return true;
    char q[CFG_SHOW_BUF];
    cfg_show_str(s, q, sizeof q);
    snprintf(why, whylen, "%s is not an IPv4 address literal like \"127.0.0.1\"", q);
    return false;
}

/* Decimal digits only, no sign, value <= max. */
bool cfg_parse_dec(const char *s, size_t n, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    if (n == 0 || n > 20)
        return false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return false;
        unsigned d = (unsigned)(s[i] - '0');
        if (v > (max - d) / 10)
            return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

/* A checkpoint path, or synthetic:PRESET[:layers=N][:seed=S] (preset names
 * are checked when the model is generated: the list lives in genmodel.c). */
bool cfg_check_model(const char *s, char *why, size_t whylen)
{
    struct moed_cfg_synth sy;
    return moed_cfg_synthetic(s, &sy, why, whylen) >= 0;
}

int moed_cfg_synthetic(const char *s, struct moed_cfg_synth *out, char *why, size_t whylen)
{
    static const char prefix[] = "synthetic:";
    if (strncmp(s, prefix, sizeof prefix - 1) != 0)
        return 0;
    char q[CFG_SHOW_BUF];
    cfg_show_str(s, q, sizeof q);
    const char *p = s + sizeof prefix - 1;
    size_t plen = strcspn(p, ":");
    for (size_t i = 0; i < plen; i++) {
        char c = p[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
              c == '.')) {
            plen = 0;
            break;
        }
    }
    if (plen == 0) {
        snprintf(why, whylen,
                 "%s: the preset must be a name of [a-z0-9._-]; expected "
                 "synthetic:PRESET[:layers=N][:seed=S]",
                 q);
        return MOED_E_CONFIG;
    }
    if (plen >= sizeof out->preset) {
        snprintf(why, whylen, "%s: the preset name is over %zu bytes", q, sizeof out->preset - 1);
        return MOED_E_CONFIG;
    }
    memcpy(out->preset, p, plen);
    out->preset[plen] = '\0';
    out->layers = MOED_CFG_SYNTH_DEFAULT_LAYERS;
    out->seed = MOED_CFG_SYNTH_DEFAULT_SEED;
    bool seen_layers = false, seen_seed = false;
    for (p += plen; *p == ':';) {
        p++;
        size_t n = strcspn(p, ":");
        uint64_t v;
        bool ok;
        if (n > 7 && strncmp(p, "layers=", 7) == 0 && !seen_layers) {
            ok = cfg_parse_dec(p + 7, n - 7, MOED_CFG_SYNTH_MAX_LAYERS, &v) && v >= 1;
            if (ok)
                out->layers = (uint32_t)v;
            seen_layers = true;
        } else if (n > 5 && strncmp(p, "seed=", 5) == 0 && !seen_seed) {
            ok = cfg_parse_dec(p + 5, n - 5, UINT64_MAX, &v);
            if (ok)
                out->seed = v;
            seen_seed = true;
        } else {
            ok = false;
        }
        if (!ok) {
            char opt[CFG_SHOW_MAX + 1];
            snprintf(opt, sizeof opt, "%.*s", (int)(n < CFG_SHOW_MAX ? n : CFG_SHOW_MAX), p);
            char qo[CFG_SHOW_BUF];
            cfg_show_str(opt, qo, sizeof qo);
            snprintf(why, whylen,
                     "%s: bad option %s; expected synthetic:PRESET[:layers=N][:seed=S] with "
                     "N in [1, 1024] and S a 64-bit unsigned integer, each at most once",
                     q, qo);
            return MOED_E_CONFIG;
        }
        p += n;
    }
    return 1;
}

