/* codec_dump.c - print moed's NVFP4/bf16 codecs for the Python cross-check
 * (tests/py/test_codec.py compares them with ml_dtypes).
 *
 *   codec_dump tables    one line per code:  "e2m1 C VALUE" (C = 0..15) and
 *                        "e4m3 C VALUE" (C = 0..255); VALUE as %.9g ("nan")
 *   codec_dump encode    reads one float per line from stdin (anything strtof
 *                        takes: decimal, hex, nan, inf) and prints
 *                        "E2M1 E4M3 BF16" codes as decimal integers
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nvfp4.h"

#define LINE_MAX_BYTES 256

static int dump_tables(void)
{
    for (unsigned c = 0; c < 16; c++)
        printf("e2m1 %u %.9g\n", c, (double)nvfp4_e2m1_decode((uint8_t)c));
    for (unsigned c = 0; c < 256; c++)
        printf("e4m3 %u %.9g\n", c, (double)nvfp4_e4m3_decode((uint8_t)c));
    return 0;
}

static int encode_stdin(void)
{
    char line[LINE_MAX_BYTES];
    unsigned long n = 0;
    while (fgets(line, sizeof line, stdin)) {
        n++;
        if (!strchr(line, '\n') && !feof(stdin)) {
            fprintf(stderr, "codec_dump: line %lu longer than %d bytes\n", n, LINE_MAX_BYTES - 2);
            return 1;
        }
        char *end = NULL;
        float x = strtof(line, &end);
        if (end == line) {
            fprintf(stderr, "codec_dump: line %lu: not a number: %s", n, line);
            return 1;
        }
        printf("%u %u %u\n", nvfp4_e2m1_encode(x), nvfp4_e4m3_encode(x), bf16_from_float(x));
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "tables") == 0)
        return dump_tables();
    if (argc == 2 && strcmp(argv[1], "encode") == 0)
        return encode_stdin();
    fprintf(stderr, "usage: codec_dump tables | codec_dump encode < floats.txt\n");
    return 2;
}
