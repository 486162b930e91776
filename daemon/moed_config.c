/* moed_config.c - moed's config: the file, the environment over it, and
 * what this machine can honour (see moed_main.c). */
#include "moed_daemon.h"

/* ---- config: file, environment, what this machine can honour ------------- */

/* MOED_SOCKET and MOED_STATUS_PORT over the file's values, bounded like the
 * keys they replace. */
static int apply_env(struct moed_cfg *cfg, char *err, size_t errlen)
{
    const char *v = getenv("MOED_SOCKET");
    if (v && *v) {
        if (strlen(v) > MOED_SOCKET_PATH_MAX)
            return moed_seterr(err, errlen, MOED_E_CONFIG,
                               "MOED_SOCKET: a Unix socket path may be at most %d bytes",
                               MOED_SOCKET_PATH_MAX);
        snprintf(cfg->socket_path, sizeof cfg->socket_path, "%s", v);
    }
    v = getenv("MOED_STATUS_PORT");
    if (v && *v) {
        char *end;
        errno = 0;
        unsigned long p = strtoul(v, &end, 10);
        if (errno || end == v || *end || v[0] == '-' || p > 65535)
            return moed_seterr(err, errlen, MOED_E_CONFIG,
                               "MOED_STATUS_PORT \"%s\": not a port number in 0 .. 65535", v);
        cfg->status_port = (uint32_t)p;
    }
    return 0;
}

/* A config the file parser accepts but this machine cannot serve: found
 * before anything is loaded, by --check-config and at start (exit 2, which
 * the unit does not restart). */
static int check_runtime(const struct moed_cfg *cfg, char *err, size_t errlen)
{
    int want_cuda = cfg->backend == MOED_CFG_BACKEND_CUDA || cfg->n_gpus > 0;
    if (!want_cuda)
        return 0;
    const char *what = cfg->n_gpus > 0 ? "engine.gpus names GPUs" : "engine.backend is \"cuda\"";
#ifndef MOED_HAVE_CUDA
    return moed_seterr(err, errlen, MOED_E_CONFIG,
                       "%s but this moed was built without CUDA (CUDA=0); rebuild with nvcc "
                       "installed, or use engine.backend \"cpu\" and engine.gpus []", what);
#else
    if (cfg->backend == MOED_CFG_BACKEND_CPU && cfg->n_gpus > 0)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "engine.gpus names GPUs but engine.backend is \"cpu\"; empty "
                           "engine.gpus or use backend \"auto\" or \"cuda\"");
    int n = moed_backend_cuda_device_count();
    if (n == 0)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "%s but no CUDA GPU is visible (driver loaded? /dev/nvidia* "
                           "reachable, e.g. DeviceAllow= in the unit? CUDA_VISIBLE_DEVICES?)",
                           what);
    for (uint32_t i = 0; i < cfg->n_gpus; i++)
        if (cfg->gpus[i] < 0 || cfg->gpus[i] >= n)
            return moed_seterr(err, errlen, MOED_E_CONFIG,
                               "engine.gpus[%u] = %d but %d CUDA device%s visible (0 .. %d)", i,
                               (int)cfg->gpus[i], n, n == 1 ? " is" : "s are", n - 1);
    return 0;
#endif
}

/* The config: FILE, or $MOED_CONFIG, or MOED_DEFAULT_CONFIG, or (--builtin)
 * the defaults; then the environment and the runtime check. */
int load_config(const char *path, int builtin, struct moed_cfg *cfg, const char **used,
                       char *err, size_t errlen)
{
    int rc;
    *used = "built-in defaults";
    if (builtin) {
        moed_cfg_defaults(cfg);
    } else {
        const char *env = getenv("MOED_CONFIG");
        if (!path && env && *env)
            path = env;
        if (!path) {
            path = MOED_DEFAULT_CONFIG;
            if (access(path, F_OK) != 0)
                return moed_seterr(err, errlen, MOED_E_CONFIG,
                                   "no config file: %s does not exist (%s); give one with "
                                   "--config FILE or MOED_CONFIG, or start the built-in tiny "
                                   "synthetic model with --builtin (`make run` uses "
                                   "config/example.json)", path, strerror(errno));
        }
        rc = moed_cfg_load(path, cfg, err, errlen);
        if (rc < 0)
            return rc;
        *used = path;
    }
    rc = apply_env(cfg, err, errlen);
    if (rc < 0)
        return rc;
    return check_runtime(cfg, err, errlen);
}

