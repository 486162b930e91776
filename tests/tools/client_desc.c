/* client_desc.c - the C client library's registered-buffer calls against the
 * daemon (tests; the daemon runs the CPU backend with MOED_TEST_CPU_SHM_IPC,
 * where an "IPC handle" is a shared memory object's name).
 *
 *   client_desc SOCKET SHM_NAME SIZE LAYER T OFF_X OFF_IDS OFF_W OFF_Y
 *
 * Registers [0, SIZE) of SHM_NAME (UUID MOED_TEST_CPU_UUID), runs
 * FORWARD_DESC on it twice (y written into the object), waiting for the
 * reply in poll() at once (moedc_set_spin_us 0) and then polling for it
 * first (the default spin), once more with its times
 * (moedc_forward_desc_times: prints "times: kernel_ns K daemon_ns D rx_ns R
 * queued_ns Q before_ns B after_ns A", B and A this process's CLOCK_MONOTONIC
 * around the call), sends one with y past the
 * end of the buffer and prints "bad range: NAME" with the daemon's error
 * name, unregisters. Exit 0 on success, 1 on any failure (stderr).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed_client.h"
#include "moed_err.h"
#include "moed_util.h"
#include "test_hooks.h"

int main(int argc, char **argv)
{
    if (argc != 10) {
        fprintf(stderr, "usage: client_desc SOCKET SHM_NAME SIZE LAYER T OFF_X OFF_IDS OFF_W "
                        "OFF_Y\n");
        return 2;
    }
    uint64_t a[7];
    for (int i = 0; i < 7; i++)
        a[i] = strtoull(argv[3 + i], NULL, 10);
    uint8_t handle[64] = {0}, uuid[16];
    snprintf((char *)handle, sizeof handle, "%s", argv[2]);
    memcpy(uuid, MOED_TEST_CPU_UUID, 16);
    char err[MOED_ERRLEN];
    struct moedc *c = NULL;
    struct moed_hello_rep rep;
    uint32_t id = 0;
    int rc = moedc_connect(argv[1], 30000, &c, err, sizeof err);
    if (!rc)
        rc = moedc_hello(c, &rep, err, sizeof err);
    if (!rc && rep.version != 2) {
        fprintf(stderr, "daemon chose version %u\n", rep.version);
        rc = MOED_E_VERSION;
    }
    if (!rc)
        rc = moedc_register_buf(c, handle, 0, a[0], uuid, &id, err, sizeof err);
    struct moedc_bufref x = {id, a[3]}, ids = {id, a[4]}, w = {id, a[5]}, y = {id, a[6]};
    for (int spin = 0; spin < 2 && !rc; spin++) {
        moedc_set_spin_us(c, spin ? MOEDC_DEFAULT_SPIN_US : 0);
        rc = moedc_forward_desc(c, (uint32_t)a[1], (uint32_t)a[2], rep.top_k, &x, &ids, &w, &y,
                                err, sizeof err);
    }
    if (!rc) {
        struct moedc_desc_times tm = {1, 0, 0, 0};
        const uint64_t t0 = moed_mono_ns();
        rc = moedc_forward_desc_times(c, (uint32_t)a[1], (uint32_t)a[2], rep.top_k, &x, &ids, &w,
                                      &y, &tm, err, sizeof err);
        const uint64_t t1 = moed_mono_ns();
        if (!rc)
            printf("times: kernel_ns %llu daemon_ns %llu rx_ns %llu queued_ns %llu "
                   "before_ns %llu after_ns %llu\n",
                   (unsigned long long)tm.kernel_ns, (unsigned long long)tm.daemon_ns,
                   (unsigned long long)tm.rx_ns, (unsigned long long)tm.queued_ns,
                   (unsigned long long)t0, (unsigned long long)t1);
    }
    if (!rc) {
        struct moedc_bufref past = {id, a[0]};
        int bad = moedc_forward_desc(c, (uint32_t)a[1], (uint32_t)a[2], rep.top_k, &x, &ids, &w,
                                     &past, err, sizeof err);
        printf("bad range: %s (%s)\n", bad < 0 ? moed_errname(bad) : "accepted", err);
        if (bad >= 0)
            rc = MOED_E_INVAL;
    }
    if (!rc)
        rc = moedc_unregister_buf(c, id, err, sizeof err);
    if (rc)
        fprintf(stderr, "client_desc: %s: %s\n", moedc_strerror(rc), err);
    moedc_close(c);
    return rc ? 1 : 0;
}
