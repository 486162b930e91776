/* fuzz_config.c - libFuzzer target for the daemon's config parser
 * (moed_cfg_parse: the one table of keys, every error collected).
 *
 * Besides the sanitizers it checks the contract on every input:
 *   - the result is 0, MOED_E_CONFIG or MOED_E_NOMEM; an error comes with at
 *     least one line that names the origin, and the message is NUL-terminated
 *     within the buffer;
 *   - success: the effective config (moed_cfg_to_json) parses again to the same
 *     config (the same effective JSON), so --check-config output is itself a
 *     valid config;
 *   - the parser is pure: the same bytes give the same answer.
 *
 *   make fuzz && build/fuzz/fuzz_config -max_total_time=60 \
 *       -dict=tests/fuzz/json.dict tests/fuzz/corpus/config
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "moed_err.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an exact-size copy so any read past `size` is an ASan error */
    char *buf = malloc(size ? size : 1);
    struct moed_cfg *cfg = malloc(sizeof *cfg), *again = malloc(sizeof *again);
    char *json = NULL, *json2 = NULL;
    static char err[8192], err2[8192];
    if (!buf || !cfg || !again)
        goto out;
    memcpy(buf, data, size);
    err[0] = err2[0] = '\0'; /* a success leaves err as it was */
    int rc = moed_cfg_parse(buf, size, "fuzz.json", cfg, err, sizeof err);
    int rc2 = moed_cfg_parse(buf, size, "fuzz.json", again, err2, sizeof err2);
    if (rc != rc2 || strcmp(err, err2))
        abort();
    if (rc == 0) {
        json = moed_cfg_to_json(cfg);
        if (!json)
            goto out;
        if (moed_cfg_parse(json, strlen(json), "effective", again, err2, sizeof err2) != 0)
            abort();
        json2 = moed_cfg_to_json(again);
        if (json2 && strcmp(json, json2))
            abort();
    } else if (rc == MOED_E_CONFIG) {
        if (!memchr(err, 0, sizeof err) || strncmp(err, "fuzz.json", 9) != 0)
            abort();
    } else if (rc != MOED_E_NOMEM) {
        abort();
    }
out:
    free(json);
    free(json2);
    free(buf);
    free(cfg);
    free(again);
    return 0;
}
