/* moed_file.h - read a small file whole (a config, a JSON map), bounded. */
#ifndef MOED_FILE_H
#define MOED_FILE_H

#include <stddef.h>

/* The whole regular file at path, at most cap bytes, into *out (malloc'd,
 * NUL-terminated; *len its bytes when len != NULL). Errors name `label`:
 * MOED_E_IO (cannot open, not a regular file, read failed), over_code
 * (larger than cap), MOED_E_NOMEM. With missing != NULL a file that does
 * not exist sets *missing and returns 0 with *out NULL. */
int moed_file_read_small(const char *path, const char *label, size_t cap, int over_code,
                         char **out, size_t *len, int *missing, char *err, size_t errlen);

#endif
