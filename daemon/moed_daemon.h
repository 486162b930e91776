/* moed_daemon.h - what moed's main files share (private to daemon/):
 * moed_main.c (start-up, signals, shutdown, main), moed_model.c (where the
 * model comes from: a checkpoint directory or a generated synthetic one) and
 * moed_config.c (config file, environment, what this machine can honour). */
#ifndef MOED_DAEMON_H
#define MOED_DAEMON_H

#include <errno.h>
#include <ftw.h>
#include <getopt.h>
#include <pthread.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>
#include <uv.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "backend.h"
#include "config.h"
#include "engine.h"
#include "genmodel.h"
#include "http.h"
#include "model.h"
#include "moed_err.h"
#include "moed_check_uv.h"
#include "moed_log.h"
#include "server.h"

#ifndef MOED_DEFAULT_CONFIG
#define MOED_DEFAULT_CONFIG "/etc/moed/moed.json" /* used without --config / MOED_CONFIG */
#endif
#ifndef MOED_CUDA_ARCHS
#define MOED_CUDA_ARCHS "?"
#endif
#define SYNTH_MARKER ".moed-complete"        /* written last into a generated model */
#define EXTEND_TIMEOUT_US 60000000ull        /* per EXTEND_TIMEOUT_USEC during loads */
#define MALLOC_MMAP_THRESHOLD (32u << 20)    /* glibc's largest allowed value (64-bit) */
#define MALLOC_TRIM_THRESHOLD (64u << 20)

enum exit_code {
    EXIT_CLEAN = 0,
    EXIT_RUNTIME = 1,
    EXIT_USAGE = 2,
    EXIT_MODEL = 3,
    EXIT_BACKEND = 4,
};

int load_config(const char *path, int builtin, struct moed_cfg *cfg, const char **used,
                       char *err, size_t errlen);
uint64_t mem_available(void);
int resolve_synthetic(const struct moed_cfg *cfg, char *dir, size_t dirlen, char *err,
                             size_t errlen);

#endif
