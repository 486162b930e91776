/* moed_file.c - read a small file whole (moed_file.h). */
#include "moed_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moed_err.h"

int moed_file_read_small(const char *path, const char *label, size_t cap, int over_code,
                         char **out, size_t *len_out, int *missing, char *err, size_t errlen)
{
    int rc = 0, fd;
    struct stat sb;
    char *buf = NULL;
    *out = NULL;
    if (missing)
        *missing = 0;
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT && missing) {
            *missing = 1;
            return 0;
        }
        return moed_seterr(err, errlen, MOED_E_IO, "%s: cannot open %s: %s", label, path,
                           strerror(errno));
    }
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        rc = moed_seterr(err, errlen, MOED_E_IO, "%s: not a readable regular file", label);
        goto out;
    }
    if ((uint64_t)sb.st_size > cap) {
        rc = moed_seterr(err, errlen, over_code, "%s: %lld bytes, over the %zu-byte cap",
                         label, (long long)sb.st_size, cap);
        goto out;
    }
    size_t len = (size_t)sb.st_size, got = 0;
    buf = malloc(len + 1);
    if (!buf) {
        rc = moed_seterr(err, errlen, MOED_E_NOMEM, "%s: out of memory", label);
        goto out;
    }
    while (got < len) {
        ssize_t r = read(fd, buf + got, len - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            rc = moed_seterr(err, errlen, MOED_E_IO, "%s: read failed: %s", label,
                             r < 0 ? strerror(errno) : "file shrank");
            goto out;
        }
        got += (size_t)r;
    }
    buf[len] = '\0';
    *out = buf;
    if (len_out)
        *len_out = len;
    buf = NULL;
out:
    free(buf);
    close(fd);
    return rc;
}
