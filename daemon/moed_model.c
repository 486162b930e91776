/* moed_model.c - where moed's model comes from: a checkpoint directory, or
 * a synthetic one generated once into model.synthetic_dir (see moed_main.c). */
#include "moed_daemon.h"

/* ---- model location ------------------------------------------------------ */

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static int rm_tree(const char *path)
{
    return nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static int file_exists(const char *dir, const char *name)
{
    char p[MOED_CFG_PATH_MAX + 64];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

/* "synthetic:PRESET[:layers=N][:seed=S]" -> generated (or reused) checkpoint
 * directory in synthetic_dir/PRESET-lN-sS. Generation goes to a temporary
 * directory renamed into place after the marker file, so a crash or a second
 * daemon never sees a half-written model. */
int resolve_synthetic(const struct moed_cfg *cfg, char *dir, size_t dirlen, char *err,
                             size_t errlen)
{
    struct moed_cfg_synth sy;
    char why[MOED_ERRLEN];
    if (moed_cfg_synthetic(cfg->model, &sy, why, sizeof why) != 1)
        return moed_seterr(err, errlen, MOED_E_CONFIG, "model.path: %s",
                           why[0] ? why : "not a synthetic:PRESET spec");
    _Static_assert(MOED_CFG_SYNTH_MAX_LAYERS <= MOED_MAX_LAYERS, "synthetic layers fit the loader");
    const char *preset = sy.preset;
    unsigned long long layers = sy.layers, seed = sy.seed;
    struct moed_dims dims;
    int rc = moed_gen_preset(preset, &dims, err, errlen);
    if (rc < 0)
        return MOED_E_CONFIG;
    int n = snprintf(dir, dirlen, "%s/%s-l%llu-s%llu", cfg->synthetic_dir, preset, layers, seed);
    if (n < 0 || (size_t)n >= dirlen - 32)
        return moed_seterr(err, errlen, MOED_E_CONFIG, "model.synthetic_dir: path too long");
    if (file_exists(dir, SYNTH_MARKER)) {
        LOG_I("using synthetic model %s", dir);
        return 0;
    }
    char tmp[MOED_CFG_PATH_MAX + 64];
    snprintf(tmp, sizeof tmp, "%s.tmp-%d", dir, (int)getpid());
    rm_tree(tmp);
    LOG_I("generating synthetic model %s (preset %s, %llu layers, seed %llu)", dir, preset, layers,
          seed);
    sd_notifyf(0, "STATUS=generating synthetic model %s\nEXTEND_TIMEOUT_USEC=%llu", dir,
               (unsigned long long)EXTEND_TIMEOUT_US * 10);
    struct moed_gen_opts go = {.preset = preset, .layers = (uint32_t)layers, .seed = seed,
                               .threads = 0};
    rc = moed_gen_model(&go, tmp, err, errlen);
    if (rc < 0) {
        rm_tree(tmp);
        return rc;
    }
    char marker[MOED_CFG_PATH_MAX + 96];
    snprintf(marker, sizeof marker, "%s/%s", tmp, SYNTH_MARKER);
    FILE *f = fopen(marker, "w");
    if (!f || fputs("complete\n", f) < 0 || fclose(f) != 0) {
        rm_tree(tmp);
        return moed_seterr(err, errlen, MOED_E_IO, "%s: %s", marker, strerror(errno));
    }
    if (rename(tmp, dir) < 0) {
        int e = errno;
        if (file_exists(dir, SYNTH_MARKER)) {
            rm_tree(tmp); /* another moed finished first: use its copy */
            return 0;
        }
        /* An incomplete leftover (no marker): replace it. */
        if ((e == EEXIST || e == ENOTEMPTY) && rm_tree(dir) == 0 && rename(tmp, dir) == 0)
            return 0;
        rm_tree(tmp);
        return moed_seterr(err, errlen, MOED_E_IO, "rename %s -> %s: %s", tmp, dir, strerror(e));
    }
    return 0;
}

/* MemAvailable from /proc/meminfo in bytes (0 if unknown = no limit). */
uint64_t mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return 0;
    char line[256];
    uint64_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %" SCNu64 " kB", &kb) == 1)
            break;
    fclose(f);
    return kb * 1024;
}

