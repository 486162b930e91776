/* moectl_int.h - what moectl's client commands share (private to
 * tools/moectl/): moectl_client.c (options, status, experts, ping, forward)
 * moectl_bench.c (bench and its payload-echo floor) and moectl_place.c
 * (placement). */
#ifndef MOECTL_INT_H
#define MOECTL_INT_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "moed_client.h"
#include "moed_proto.h"

#define DEFAULT_SOCKET "/tmp/moed.sock"
#define DEFAULT_TIMEOUT_MS 30000
#define MAX_CONNECTIONS 1024
#define MAX_INFLIGHT 1024
#define MAX_DURATION_S 86400
#define MAX_PING_COUNT 1000000
/* Latency samples kept by bench (beyond this, requests are still counted). */
#define MAX_SAMPLES (64u << 20)
/* Failing rel-L2 of `forward --check`: bf16 output rounding is ~4e-3. */
#define CHECK_REL_L2 1e-2
/* bench's floor: round trips of the payload echoed through a socketpair (the
 * first ECHO_WARMUP not counted), with the send buffer the C client and the
 * daemon ask for (MOEDC's 1 MiB, server.socket_buffer_bytes' default) */
#define ECHO_ROUNDS 200
#define ECHO_WARMUP 20
#define ECHO_SNDBUF (1 << 20)
/* What the daemon may add over that echo (end to end, per request). */
#define ADDED_BUDGET_US 30.0

struct opts {
    const char *cmd;
    const char *socket;
    const char *model;
    int json, check;
    uint64_t count, layer, tokens, seed, connections, duration, inflight, timeout_ms;
    uint64_t gpus, max_replicas, hot_percent; /* placement */
    int have_layer;
};


struct batch {
    uint32_t T, H, k;
    uint16_t *x;
    int32_t *ids;
    float *w;
};

void batch_free(struct batch *b);
int batch_make(struct batch *b, uint32_t T, const struct moed_hello_rep *h, uint64_t seed);
int cmd_bench(const struct opts *o);
int cmd_placement(const struct opts *o); /* moectl_place.c */
/* The daemon's STATUS document, parsed; NULL (message printed) on failure;
 * *raw (if raw) the text. */
cJSON *fetch_status(const struct opts *o, struct moedc *c, char **raw);
int connect_hello(const struct opts *o, struct moedc **c, struct moed_hello_rep *h);
int pick_layer(const struct opts *o, const struct moed_hello_rep *h, uint32_t *layer);

#endif
