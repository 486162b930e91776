/* moectl_gen.c - `moectl gen-model`: write a synthetic NVFP4 checkpoint. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "genmodel.h"
#include "model.h"
#include "moectl.h"
#include "moed_err.h"

static void gen_usage(FILE *f)
{
    fprintf(f,
            "usage: moectl gen-model --out DIR [--preset P] [--layers N] [--seed S] "
            "[--threads N]\n"
            "\n"
            "Write a deterministic synthetic NVFP4 (ModelOpt layout) checkpoint: config.json,\n"
            "hf_quant_config.json and one safetensors shard per MoE layer.\n"
            "\n"
            "  --out DIR      output directory (created with parents)          required\n"
            "  --preset P     tiny (H=256 I=128 E=8 k=2 S=1),\n"
            "                 qwen3-30b-a3b (H=2048 I=768 E=128 k=8 S=0),\n"
            "                 deepseek-v3 (H=7168 I=2048 E=256 k=8 S=1)     default tiny\n"
            "  --layers N     MoE layers to write, 1..%d                       default 1\n"
            "  --seed S       PRNG seed (same seed -> identical files)         default 0\n"
            "  --threads N    worker threads, 0 = all cores                    default 0\n",
            MOED_MAX_LAYERS);
}

/* Whole-string unsigned parse with an upper bound. */
static int parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    if (!s || !*s || *s == '-' || *s == '+')
        return -1;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        return -1;
    *out = v;
    return 0;
}

int moectl_gen_main(int argc, char **argv)
{
    struct moed_gen_opts o = {.preset = "tiny", .layers = 1, .seed = 0, .threads = 0};
    const char *out = NULL;
    static const struct {
        const char *name;
        uint64_t max;
    } num_opts[] = {{"--layers", MOED_MAX_LAYERS}, {"--seed", UINT64_MAX}, {"--threads", 256}};

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            gen_usage(stdout);
            return 0;
        }
        /* Accept both "--opt VALUE" and "--opt=VALUE". */
        char name[32];
        const char *val = NULL;
        const char *eq = strchr(a, '=');
        if (eq && (size_t)(eq - a) < sizeof name) {
            memcpy(name, a, (size_t)(eq - a));
            name[eq - a] = '\0';
            val = eq + 1;
        } else {
            snprintf(name, sizeof name, "%s", a);
        }
        int known = strcmp(name, "--out") == 0 || strcmp(name, "--preset") == 0;
        for (size_t n = 0; n < sizeof num_opts / sizeof num_opts[0]; n++)
            known |= strcmp(name, num_opts[n].name) == 0;
        if (!known || strlen(a) >= sizeof name + 4096) {
            fprintf(stderr, "moectl gen-model: unknown option '%s'\n", a);
            gen_usage(stderr);
            return 2;
        }
        if (!val) {
            if (i + 1 >= argc) {
                fprintf(stderr, "moectl gen-model: option %s needs a value\n", name);
                return 2;
            }
            val = argv[++i];
        }
        if (strcmp(name, "--out") == 0) {
            out = val;
            continue;
        }
        if (strcmp(name, "--preset") == 0) {
            o.preset = val;
            continue;
        }
        for (size_t n = 0; n < sizeof num_opts / sizeof num_opts[0]; n++) {
            if (strcmp(name, num_opts[n].name) != 0)
                continue;
            uint64_t v;
            uint64_t lo = strcmp(name, "--layers") == 0 ? 1 : 0;
            if (parse_u64(val, num_opts[n].max, &v) != 0 || v < lo) {
                fprintf(stderr, "moectl gen-model: %s '%s' is not an integer in %llu..%llu\n",
                        name, val, (unsigned long long)lo, (unsigned long long)num_opts[n].max);
                return 2;
            }
            if (strcmp(name, "--layers") == 0)
                o.layers = (uint32_t)v;
            else if (strcmp(name, "--seed") == 0)
                o.seed = v;
            else
                o.threads = (uint32_t)v;
        }
    }
    if (!out || !*out) {
        fprintf(stderr, "moectl gen-model: missing --out DIR\n");
        gen_usage(stderr);
        return 2;
    }
    char err[MOED_ERRLEN];
    struct moed_dims dims;
    if (moed_gen_preset(o.preset, &dims, err, sizeof err) != 0) {
        fprintf(stderr, "moectl gen-model: %s\n", err);
        return 2;
    }
    if (moed_gen_model(&o, out, err, sizeof err) != 0) {
        fprintf(stderr, "moectl gen-model: %s\n", err);
        return 1;
    }
    return 0;
}
