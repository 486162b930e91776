/* fuzz_model_config.c - libFuzzer target for the checkpoint's small files:
 * config.json (dims, MoE layer set, family aliases) and hf_quant_config.json
 * (moed_model_parse_config, the checks moed_model_open makes first).
 *
 * Input layout: config.json text, then optionally a NUL byte followed by the
 * hf_quant_config.json text (no NUL: the checkpoint has none, and config.json's
 * quantization_config must say NVFP4). Each part is an exact-size copy.
 * Besides the sanitizers it checks the contract on every input:
 *   - the result is 0, MOED_E_MODEL or MOED_E_NOMEM; an error has a message;
 *   - success: every dim is within the limits model.h names, the hidden and
 *     intermediate sizes are whole scale blocks and bytes as the loader
 *     promises, top_k <= routed experts, 1 <= MoE layers <= layers, and the
 *     family is a NUL-terminated string;
 *   - the parser is pure: the same bytes give the same answer.
 *
 *   make fuzz && build/fuzz/fuzz_model_config -max_total_time=60 \
 *       -dict=tests/fuzz/json.dict tests/fuzz/corpus/model_config
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moed_err.h"
#include "model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char *copy(const uint8_t *p, size_t n)
{
    char *b = malloc(n ? n : 1);
    if (b && n)
        memcpy(b, p, n);
    return b;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t clen = nul ? (size_t)(nul - data) : size;
    size_t qlen = nul ? size - clen - 1 : 0;
    char *cfg = copy(data, clen), *q = nul ? copy(nul + 1, qlen) : NULL;
    if (!cfg || (nul && !q))
        goto out;
    struct moed_dims d, d2;
    char err[512] = "", err2[512] = "";
    int rc = moed_model_parse_config(cfg, clen, q, qlen, &d, err, sizeof err);
    int rc2 = moed_model_parse_config(cfg, clen, q, qlen, &d2, err2, sizeof err2);
    if (rc != rc2 || strcmp(err, err2))
        abort();
    if (rc == 0) {
        if (memcmp(&d, &d2, sizeof d))
            abort();
        if (d.hidden == 0 || d.hidden > MOED_MAX_HIDDEN || d.hidden % 16 ||
            d.inter == 0 || d.inter > MOED_MAX_INTER || d.inter % 16 ||
            d.n_experts == 0 || d.n_experts > MOED_MAX_EXPERTS || d.top_k == 0 ||
            d.top_k > d.n_experts || d.top_k > MOED_MAX_TOPK || d.n_shared > MOED_MAX_SHARED ||
            d.n_layers == 0 || d.n_layers > MOED_MAX_LAYERS || d.n_moe_layers == 0 ||
            d.n_moe_layers > d.n_layers || !memchr(d.family, 0, sizeof d.family))
            abort();
    } else if ((rc != MOED_E_MODEL && rc != MOED_E_NOMEM) || err[0] == '\0') {
        abort();
    }
out:
    free(cfg);
    free(q);
    return 0;
}
