/* client_forward.c - drive the daemon through the C client library (tests).
 *
 *   client_forward SOCKET LAYER T IN OUT [REPEAT [FLAGS]]
 *
 * IN holds one FORWARD's arrays back to back: x bf16 [T,H], ids int32 [T,k],
 * w fp32 [T,k] (H and k from HELLO). The request is sent REPEAT times
 * (default 1) pipelined on one connection with ids 1..REPEAT; every reply
 * must be bit-identical to the first; the first is written to OUT (bf16
 * [T,H]). FLAGS (default 0) are the FORWARD flags (moedc_forward_flags,
 * moedc_send_forward_flags); T may be 0 (IN and OUT are then empty files).
 * Exit 0 on success, 1 on any failure (message on stderr).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed_client.h"
#include "moed_err.h"

static int read_file(const char *path, uint8_t *buf, size_t len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, len, f);
    int extra = fgetc(f) != EOF;
    fclose(f);
    return (n == len && !extra) ? 0 : -1;
}

int main(int argc, char **argv)
{
    if (argc < 6 || argc > 8) {
        fprintf(stderr, "usage: client_forward SOCKET LAYER T IN OUT [REPEAT [FLAGS]]\n");
        return 2;
    }
    const char *sock = argv[1];
    uint32_t layer = (uint32_t)strtoul(argv[2], NULL, 10);
    uint32_t T = (uint32_t)strtoul(argv[3], NULL, 10);
    uint32_t repeat = argc >= 7 ? (uint32_t)strtoul(argv[6], NULL, 10) : 1;
    uint32_t flags = argc == 8 ? (uint32_t)strtoul(argv[7], NULL, 0) : 0;
    char err[MOED_ERRLEN];
    struct moedc *c = NULL;
    struct moed_hello_rep h;
    uint8_t *in = NULL;
    uint16_t *y0 = NULL;
    int ret = 1;
    if (moedc_connect(sock, 30000, &c, err, sizeof err) < 0 || moedc_hello(c, &h, err, sizeof err) < 0) {
        fprintf(stderr, "client_forward: %s\n", err);
        goto out;
    }
    size_t xb = (size_t)T * h.hidden * 2, ib = (size_t)T * h.top_k * 4;
    in = malloc(xb + 2 * ib + 1);
    y0 = malloc(xb + 1);
    if (!in || !y0 || read_file(argv[4], in, xb + 2 * ib) < 0) {
        fprintf(stderr, "client_forward: %s: expected %zu bytes\n", argv[4], xb + 2 * ib);
        goto out;
    }
    const uint16_t *x = (const uint16_t *)in;
    const int32_t *ids = (const int32_t *)(in + xb);
    const float *w = (const float *)(in + xb + ib);
    if (repeat <= 1) {
        if (moedc_forward_flags(c, layer, T, h.top_k, x, ids, w, flags, y0, err, sizeof err) <
            0) {
            fprintf(stderr, "client_forward: forward: %s\n", err);
            goto out;
        }
    } else {
        /* Send in windows so neither side's socket buffer can deadlock us. */
        uint32_t sent = 0, got = 0, window = 8;
        int have0 = 0;
        while (got < repeat) {
            while (sent < repeat && sent - got < window) {
                if (moedc_send_forward_flags(c, sent + 1, layer, T, h.top_k, x, ids, w, flags, err,
                                             sizeof err) < 0) {
                    fprintf(stderr, "client_forward: send %u: %s\n", sent + 1, err);
                    goto out;
                }
                sent++;
            }
            struct moedc_reply rep;
            if (moedc_recv(c, &rep, err, sizeof err) < 0) {
                fprintf(stderr, "client_forward: recv: %s\n", err);
                goto out;
            }
            if (rep.n_tokens != T || rep.hidden != h.hidden) {
                fprintf(stderr, "client_forward: reply %llu has T=%u H=%u\n",
                        (unsigned long long)rep.request_id, rep.n_tokens, rep.hidden);
                goto out;
            }
            if (!have0) {
                if (xb)
                    memcpy(y0, rep.y, xb);
                have0 = 1;
            } else if (xb && memcmp(y0, rep.y, xb) != 0) {
                fprintf(stderr, "client_forward: reply %llu differs from the first\n",
                        (unsigned long long)rep.request_id);
                goto out;
            }
            got++;
        }
    }
    FILE *f = fopen(argv[5], "wb");
    if (!f || fwrite(y0, 1, xb, f) != xb || fclose(f) != 0) {
        fprintf(stderr, "client_forward: cannot write %s\n", argv[5]);
        goto out;
    }
    ret = 0;
out:
    free(in);
    free(y0);
    moedc_close(c);
    return ret;
}
