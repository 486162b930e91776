/* client_chan.c - the C client library's doorbell channel calls against the
 * daemon (tests; the daemon runs the CPU backend with MOED_TEST_CPU_SHM_IPC
 * and MOED_TEST_CPU_CHANNELS: fake channels, an "IPC handle" is a shared
 * memory object's name).
 *
 *   client_chan SOCKET SHM_NAME
 *
 * Registers two ranges of SHM_NAME (UUID MOED_TEST_CPU_UUID), opens a
 * channel over them and prints its info, and one with an arena alone (its
 * "arena: BYTES at OFFSET"), then "NAME: code (message)" for what must be
 * refused: unregistering a buffer the channel names, a channel over an
 * unknown id, one of 17 buffers and one of an arena and 16 (refused
 * locally), an arena over the daemon's limit, a second close.
 * Exit 0 when every call did what it should, 1 otherwise (stderr).
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "moed_client.h"
#include "moed_err.h"
#include "test_hooks.h"

static int refused(const char *what, int rc, const char *err)
{
    printf("%s: %s (%s)\n", what, rc < 0 ? moed_errname(rc) : "accepted", rc < 0 ? err : "");
    return rc < 0 ? 0 : MOED_E_INVAL;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: client_chan SOCKET SHM_NAME\n");
        return 2;
    }
    uint8_t handle[64] = {0}, uuid[16];
    snprintf((char *)handle, sizeof handle, "%s", argv[2]);
    memcpy(uuid, MOED_TEST_CPU_UUID, 16);
    char err[MOED_ERRLEN] = "";
    struct moedc *c = NULL;
    struct moedc_chan_info info = {0}, arena = {0}, none = {0};
    uint32_t ids[17] = {0};
    int rc = moedc_connect(argv[1], 30000, &c, err, sizeof err);
    for (int i = 0; i < 2 && !rc; i++)
        rc = moedc_register_buf(c, handle, 4096u * i, 4096, uuid, &ids[i], err, sizeof err);
    if (!rc)
        rc = moedc_chan_open(c, ids, 2, 0, uuid, &info, err, sizeof err);
    if (!rc) {
        printf("chan_id: %" PRIu32 "\nslots: %" PRIu32 "\nkey: %" PRIu64 "\nsize: %" PRIu64
               "\nabi: %" PRIu32 "\nkernel: %.*s\n",
               info.chan_id, info.slots, info.key, info.size, info.abi_version,
               (int)info.kernel_bytes, (const char *)info.kernel);
        rc = refused("unregister named", moedc_unregister_buf(c, ids[1], err, sizeof err), err);
    }
    if (!rc)
        rc = moedc_chan_open(c, NULL, 0, 4096, uuid, &arena, err, sizeof err);
    if (!rc)
        printf("arena: %" PRIu64 " at %" PRIu64 "\n", arena.arena_bytes, arena.arena_off);
    if (!rc)
        rc = refused("arena and 16",
                     moedc_chan_open(c, ids, 16, 4096, uuid, &none, err, sizeof err), err);
    if (!rc)
        rc = refused("arena over", moedc_chan_open(c, ids, 1, 1ull << 40, uuid, &none, err,
                                                   sizeof err), err);
    if (!rc)
        rc = moedc_chan_close(c, arena.chan_id, err, sizeof err);
    uint32_t bad[1] = {999};
    if (!rc)
        rc = refused("unknown id", moedc_chan_open(c, bad, 1, 0, uuid, &none, err, sizeof err), err);
    if (!rc)
        rc = refused("n_bufs 17", moedc_chan_open(c, ids, 17, 0, uuid, &none, err, sizeof err), err);
    if (!rc && none.kernel) {
        fprintf(stderr, "a refused open left a kernel copy\n");
        rc = MOED_E_INVAL;
    }
    if (!rc)
        rc = moedc_chan_close(c, info.chan_id, err, sizeof err);
    if (!rc)
        rc = refused("close again", moedc_chan_close(c, info.chan_id, err, sizeof err), err);
    for (int i = 0; i < 2 && !rc; i++)
        rc = moedc_unregister_buf(c, ids[i], err, sizeof err);
    if (rc)
        fprintf(stderr, "client_chan: %s: %s\n", moedc_strerror(rc), err);
    moedc_chan_info_free(&info);
    moedc_chan_info_free(&info); /* twice is fine */
    moedc_chan_info_free(&arena);
    moedc_close(c);
    return rc ? 1 : 0;
}
