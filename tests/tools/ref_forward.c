/* ref_forward.c - run the CPU reference (moe_ref_forward) on one layer of a
 * checkpoint, for the Python tests.
 *
 *   ref_forward --model DIR --layer L --in IN --out OUT [--threads N]
 *
 * IN  (little-endian raw): u32 T, u32 k, x bf16 [T, H], ids int32 [T, k],
 *     w f32 [T, k];  k must equal the model's num_experts_per_tok.
 * OUT: y bf16 [T, H].
 * Exit 0 on success, 1 on failure (message on stderr), 2 on usage errors.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "moe_ref.h"
#include "moed_err.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ref_forward reads little-endian arrays directly"
#endif

#define REF_MAX_TOKENS (1u << 16)

static void usage(void)
{
    fprintf(stderr,
            "usage: ref_forward --model DIR --layer L --in IN --out OUT [--threads N]\n");
}

static int read_exact(FILE *f, void *buf, size_t n)
{
    return fread(buf, 1, n, f) == n ? 0 : -1;
}

int main(int argc, char **argv)
{
    const char *model_dir = NULL, *in_path = NULL, *out_path = NULL;
    long layer = -1, threads = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) {
            usage();
            return 2;
        }
        const char *a = argv[i], *v = argv[++i];
        char *end = NULL;
        if (strcmp(a, "--model") == 0) {
            model_dir = v;
        } else if (strcmp(a, "--in") == 0) {
            in_path = v;
        } else if (strcmp(a, "--out") == 0) {
            out_path = v;
        } else if (strcmp(a, "--layer") == 0) {
            layer = strtol(v, &end, 10);
            if (*end || layer < 0 || layer >= MOED_MAX_LAYERS) {
                fprintf(stderr, "ref_forward: --layer '%s' not in 0..%d\n", v,
                        MOED_MAX_LAYERS - 1);
                return 2;
            }
        } else if (strcmp(a, "--threads") == 0) {
            threads = strtol(v, &end, 10);
            if (*end || threads < 0 || threads > 256) {
                fprintf(stderr, "ref_forward: --threads '%s' not in 0..256\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "ref_forward: unknown option '%s'\n", a);
            usage();
            return 2;
        }
    }
    if (!model_dir || !in_path || !out_path || layer < 0) {
        usage();
        return 2;
    }

    int ret = 1, rc;
    char err[MOED_ERRLEN];
    struct moed_model *m = NULL;
    FILE *in = NULL, *out = NULL;
    uint16_t *x = NULL, *y = NULL;
    int32_t *ids = NULL;
    float *w = NULL;

    rc = moed_model_open(model_dir, 0, NULL, NULL, &m, err, sizeof err);
    if (rc) {
        fprintf(stderr, "ref_forward: %s\n", err);
        goto out;
    }
    const struct moe_layer *L = moed_model_layer(m, (uint32_t)layer);
    if (!L) {
        fprintf(stderr, "ref_forward: layer %ld is not an MoE layer of %s\n", layer, model_dir);
        goto out;
    }
    in = fopen(in_path, "rb");
    if (!in) {
        fprintf(stderr, "ref_forward: cannot open %s: %s\n", in_path, strerror(errno));
        goto out;
    }
    uint32_t hdr[2];
    if (read_exact(in, hdr, sizeof hdr)) {
        fprintf(stderr, "ref_forward: %s: short header (need u32 T, u32 k)\n", in_path);
        goto out;
    }
    const uint32_t T = hdr[0], k = hdr[1], H = L->hidden;
    if (T == 0 || T > REF_MAX_TOKENS || k != L->top_k) {
        fprintf(stderr, "ref_forward: %s: T=%u k=%u, need T in 1..%u and k == %u\n", in_path, T,
                k, REF_MAX_TOKENS, L->top_k);
        goto out;
    }
    x = malloc((size_t)T * H * sizeof *x);
    y = malloc((size_t)T * H * sizeof *y);
    ids = malloc((size_t)T * k * sizeof *ids);
    w = malloc((size_t)T * k * sizeof *w);
    if (!x || !y || !ids || !w) {
        fprintf(stderr, "ref_forward: out of memory\n");
        goto out;
    }
    char extra;
    if (read_exact(in, x, (size_t)T * H * sizeof *x) ||
        read_exact(in, ids, (size_t)T * k * sizeof *ids) ||
        read_exact(in, w, (size_t)T * k * sizeof *w) || fread(&extra, 1, 1, in) != 0) {
        fprintf(stderr, "ref_forward: %s: size is not 8 + T*H*2 + T*k*8 bytes (T=%u H=%u k=%u)\n",
                in_path, T, H, k);
        goto out;
    }
    rc = moe_ref_forward(L, T, x, ids, w, y, (int)threads);
    if (rc) {
        fprintf(stderr, "ref_forward: moe_ref_forward: %s\n", moed_strerror(rc));
        goto out;
    }
    out = fopen(out_path, "wb");
    if (!out || fwrite(y, sizeof *y, (size_t)T * H, out) != (size_t)T * H) {
        fprintf(stderr, "ref_forward: cannot write %s: %s\n", out_path, strerror(errno));
        goto out;
    }
    if (fclose(out) != 0) {
        out = NULL;
        fprintf(stderr, "ref_forward: cannot write %s: %s\n", out_path, strerror(errno));
        goto out;
    }
    out = NULL;
    ret = 0;

out:
    if (out)
        fclose(out);
    if (in)
        fclose(in);
    free(w);
    free(ids);
    free(y);
    free(x);
    moed_model_close(m);
    return ret;
}
