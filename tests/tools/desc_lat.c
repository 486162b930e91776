/* desc_lat.c - FORWARD_DESC's time over the kernel as a C client sees it
 * (bench/zero_copy.py runs it on the arena it registered and filled, so that
 * the same batches are timed from Python and from C: whatever differs is the
 * Python client's).
 *
 *   desc_lat SOCKET HANDLE_HEX OFFSET SIZE UUID_HEX LAYER T OFF_X OFF_IDS OFF_W OFF_Y ITERS
 *
 * HANDLE_HEX: the 64-byte CUDA IPC handle of the allocation (128 hex digits),
 * OFFSET and SIZE the range of it to register, UUID_HEX the device's 16-byte
 * UUID (32 hex digits); the OFF_* are offsets inside that range. Registers
 * it, runs ITERS / 10 warm-up calls and then ITERS FORWARD_DESC calls with
 * flag times (the client's default spin), unregisters, and prints one line:
 *
 *   desc_lat T t iters n lat_us L over_us O client_us C to_us A back_us B
 *            probe_us P idle_probe_us I
 *
 * p50s over the calls of: the latency (CLOCK_MONOTONIC around the call),
 * the latency less the call's own kernel time, less its time in the daemon,
 * the way there (the call's start -> the daemon's first read, rx_ns) and
 * back (the reply queued, queued_ns -> the call's return); and of a fixed
 * piece of CPU work (a dependent chain of integer steps) timed right after
 * each call returns (P) and back to back before the calls (I): how much
 * slower this CPU runs right after a wait. Exit 0 on success, 1 on a failure
 * (stderr), 2 on bad arguments.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed_client.h"
#include "moed_util.h"

#define MAX_ITERS 1000000u
#define PROBE_STEPS 2048
#define IDLE_PROBES 101

/* The fixed CPU work: its ns. */
static int64_t probe(void)
{
    static volatile uint64_t sink;
    uint64_t x = sink;
    const uint64_t t0 = moed_mono_ns();
    for (int i = 0; i < PROBE_STEPS; i++)
        x = x * 6364136223846793005ull + 1442695040888963407ull;
    const uint64_t t1 = moed_mono_ns();
    sink = x;
    return (int64_t)(t1 - t0);
}

static int hex_bytes(const char *s, uint8_t *out, size_t n)
{
    if (strlen(s) != 2 * n)
        return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1)
            return -1;
        out[i] = (uint8_t)v;
    }
    return 0;
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

static int cmp_i64(const void *a, const void *b)
{
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static double p50_us(int64_t *v, uint32_t n)
{
    qsort(v, n, sizeof *v, cmp_i64);
    return (n % 2 ? (double)v[n / 2] : 0.5 * ((double)v[n / 2 - 1] + (double)v[n / 2])) / 1e3;
}

int main(int argc, char **argv)
{
    static const char *names[] = {"OFFSET", "SIZE",    "LAYER", "T",    "OFF_X",
                                  "OFF_IDS", "OFF_W", "OFF_Y", "ITERS"};
    uint8_t handle[64], uuid[16];
    uint64_t a[9];
    if (argc != 13) {
        fprintf(stderr, "usage: desc_lat SOCKET HANDLE_HEX OFFSET SIZE UUID_HEX LAYER T OFF_X "
                        "OFF_IDS OFF_W OFF_Y ITERS\n");
        return 2;
    }
    if (hex_bytes(argv[2], handle, sizeof handle) || hex_bytes(argv[5], uuid, sizeof uuid)) {
        fprintf(stderr, "desc_lat: HANDLE_HEX must be 128 and UUID_HEX 32 hex digits\n");
        return 2;
    }
    for (int i = 0, j = 3; i < 9; i++, j += j == 4 ? 2 : 1) {
        if (parse_u64(argv[j], &a[i])) {
            fprintf(stderr, "desc_lat: %s is not an unsigned integer: '%s'\n", names[i], argv[j]);
            return 2;
        }
    }
    const uint64_t iters = a[8];
    if (iters < 1 || iters > MAX_ITERS || a[2] > UINT32_MAX || a[3] > UINT32_MAX) {
        fprintf(stderr, "desc_lat: ITERS must be 1..%u, LAYER and T u32\n", MAX_ITERS);
        return 2;
    }
    int64_t *v = calloc(6 * iters + IDLE_PROBES, sizeof *v);
    if (!v) {
        fprintf(stderr, "desc_lat: out of memory for %llu calls\n", (unsigned long long)iters);
        return 1;
    }
    char err[512];
    struct moedc *c = NULL;
    struct moed_hello_rep rep;
    uint32_t id = 0;
    int rc = moedc_connect(argv[1], 120000, &c, err, sizeof err);
    if (!rc)
        rc = moedc_hello(c, &rep, err, sizeof err);
    if (!rc)
        rc = moedc_register_buf(c, handle, a[0], a[1], uuid, &id, err, sizeof err);
    const struct moedc_bufref x = {id, a[4]}, ids = {id, a[5]}, w = {id, a[6]}, y = {id, a[7]};
    const uint64_t warm = iters / 10 > 5 ? iters / 10 : 5;
    for (int i = 0; i < IDLE_PROBES; i++)
        v[6 * iters + i] = probe();
    for (uint64_t i = 0; i < warm + iters && !rc; i++) {
        struct moedc_desc_times tm;
        const uint64_t t0 = moed_mono_ns();
        rc = moedc_forward_desc_times(c, (uint32_t)a[2], (uint32_t)a[3], rep.top_k, &x, &ids, &w,
                                      &y, &tm, err, sizeof err);
        const uint64_t t1 = moed_mono_ns();
        if (rc || i < warm)
            continue;
        const uint64_t k = i - warm;
        const int64_t lat = (int64_t)(t1 - t0);
        v[k] = lat;
        v[iters + k] = lat - (int64_t)tm.kernel_ns;
        v[2 * iters + k] = lat - (int64_t)tm.daemon_ns;
        v[3 * iters + k] = (int64_t)(tm.rx_ns - t0);
        v[4 * iters + k] = (int64_t)(t1 - tm.queued_ns);
        v[5 * iters + k] = probe();
    }
    if (!rc && id)
        rc = moedc_unregister_buf(c, id, err, sizeof err);
    if (!rc) {
        const uint32_t n = (uint32_t)iters;
        printf("desc_lat T %llu iters %u lat_us %.2f over_us %.2f client_us %.2f to_us %.2f "
               "back_us %.2f probe_us %.3f idle_probe_us %.3f\n",
               (unsigned long long)a[3], n, p50_us(v, n), p50_us(v + n, n), p50_us(v + 2 * n, n),
               p50_us(v + 3 * n, n), p50_us(v + 4 * n, n), p50_us(v + 5 * n, n),
               p50_us(v + 6 * n, IDLE_PROBES));
    } else {
        fprintf(stderr, "desc_lat: %s: %s\n", moedc_strerror(rc), err);
    }
    moedc_close(c);
    free(v);
    return rc ? 1 : 0;
}
