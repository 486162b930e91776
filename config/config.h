/* config.h - moed's configuration: one JSON file, one table of keys.
 *
 * Every key has a path ("server.socket"), a type, bounds, a default and a
 * one-line doc in the table in config.c; the same table validates a file,
 * prints the effective config (moed --check-config) and generates
 * config/README.md (a test checks the file matches the table).
 *
 * Errors name the key, the value and what is allowed; unknown keys are errors.
 */
#ifndef MOED_CONFIG_H
#define MOED_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moed_proto.h" /* MOED_SOCKET_PATH_MAX */

#define MOED_CFG_MAX_IDS 64   /* allowed uids/gids, GPUs */
#define MOED_CFG_PATH_MAX 4096

enum moed_cfg_backend { MOED_CFG_BACKEND_AUTO = 0, MOED_CFG_BACKEND_CUDA, MOED_CFG_BACKEND_CPU };

struct moed_cfg {
    /* server */
    char socket_path[MOED_CFG_PATH_MAX];
    uint32_t socket_mode;             /* e.g. 0660 */
    char socket_group[64];            /* "" = leave as is */
    uint32_t allowed_uids[MOED_CFG_MAX_IDS]; uint32_t n_allowed_uids; /* empty: own uid + root */
    uint32_t allowed_gids[MOED_CFG_MAX_IDS]; uint32_t n_allowed_gids;
    uint32_t max_clients;
    uint32_t max_pending_per_client;
    uint64_t max_frame_bytes;
    uint64_t max_client_buffer_bytes; /* queued reply bytes before reading stops */
    uint32_t frame_timeout_ms;        /* header received -> body must complete */
    uint64_t read_buffer_keep_bytes;  /* read buffer a connection keeps between frames */
    uint64_t socket_buffer_bytes;     /* SO_SNDBUF of client sockets; 0 = kernel default */
    uint64_t pinned_pool_bytes;       /* cap on buffers from the backend's host allocator */
    uint32_t max_registered_buffers;  /* REGISTER_BUF per connection; 0 = off */
    uint32_t max_channels_per_client; /* doorbell channels open per connection */
    uint32_t idle_timeout_ms;         /* close a client idle this long; 0 = never */
    uint64_t max_reply_bytes;         /* reply memory queued for all clients together */
    /* status */
    char status_addr[64];             /* "127.0.0.1" */
    uint32_t status_port;             /* 0 = off */
    uint32_t status_header_timeout_ms; /* accept -> whole request head, else 408 */
    uint32_t status_max_conns_per_addr; /* status connections from one address */
    /* model */
    char model[MOED_CFG_PATH_MAX];    /* checkpoint dir, or "synthetic:PRESET[:layers=N][:seed=S]" */
    char synthetic_dir[MOED_CFG_PATH_MAX]; /* where synthetic models are generated */
    /* engine */
    enum moed_cfg_backend backend;
    int gpus[MOED_CFG_MAX_IDS]; uint32_t n_gpus; /* empty: GPU 0; repeats allowed */
    char placement[MOED_CFG_PATH_MAX]; /* expert parallelism: map file, "" balanced */
    uint32_t sms_free;
    uint32_t mps_sms_free_percent;    /* under MPS with sms_free 0: SMs left free, % */
    uint32_t max_tokens;              /* per batch */
    uint32_t cpu_threads;             /* 0 = all cores */
    uint32_t batch_deadline_ms;
    uint32_t idle_exit_ms;
    uint32_t loop_spin_us;            /* the loop polls without sleeping around GPU batches */
    uint32_t max_channels;            /* doorbell channels at once; 0 = off */
    uint32_t drain_stall_ms;          /* drain gives up after batch_deadline_ms + this without progress */
    uint32_t nccl_ranks, nccl_rank;   /* NCCL group across processes or hosts: 1 = none */
    char nccl_id_file[MOED_CFG_PATH_MAX]; /* the group's unique id; "" = NCCL_COMM_ID */
    uint32_t nccl_timeout_ms;         /* group forming, an exchange, a silent peer */
    uint32_t nccl_keepalive_ms;       /* rank 0 pings an idle peer this often */
    /* log */
    int log_level;                    /* enum moed_log_level */
};

/* model.path "synthetic:PRESET[:layers=N][:seed=S]", the one parser of it
 * (the config check and the daemon's generator use it): 1 with *out filled
 * when `path` is one, 0 when it is not synthetic, MOED_E_CONFIG with the
 * reason in why when it is malformed (preset of [a-z0-9._-], N in
 * [1, MOED_CFG_SYNTH_MAX_LAYERS], S a 64-bit unsigned, each at most once). */
#define MOED_CFG_SYNTH_DEFAULT_LAYERS 2u
#define MOED_CFG_SYNTH_DEFAULT_SEED 1u
#define MOED_CFG_SYNTH_MAX_LAYERS 1024u
struct moed_cfg_synth {
    char preset[64];
    uint32_t layers;
    uint64_t seed;
};
int moed_cfg_synthetic(const char *path, struct moed_cfg_synth *out, char *why, size_t whylen);

/* Defaults for every key. */
void moed_cfg_defaults(struct moed_cfg *cfg);

/* Parse JSON text (from `origin`, used in messages). Collects every error, one
 * per line, into err (truncated at errlen); returns 0 or MOED_E_CONFIG. */
int moed_cfg_parse(const char *json, size_t len, const char *origin, struct moed_cfg *cfg,
                   char *err, size_t errlen);
/* Read and parse a file (size capped at 1 MiB). */
int moed_cfg_load(const char *path, struct moed_cfg *cfg, char *err, size_t errlen);

/* Effective config as pretty JSON (malloc'd, caller frees). */
char *moed_cfg_to_json(const struct moed_cfg *cfg);
/* Markdown reference of every key (malloc'd, caller frees). */
char *moed_cfg_reference_md(void);

const char *moed_cfg_backend_name(enum moed_cfg_backend b);

#endif
