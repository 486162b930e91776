/* fuzz_http.c - libFuzzer target for moed_http_parse_request.
 *
 * Beyond "no crash, no out-of-bounds read" (ASan/UBSan), it checks the
 * parser's contract on every input:
 *   - the result is COMPLETE, NEED_MORE or one of the listed statuses;
 *   - COMPLETE: the head ends in CRLFCRLF at `consumed` <= min(len, cap), the
 *     route is set and the path starts with '/' and fits the limit;
 *   - NEED_MORE only below the cap; every error comes with a reason;
 *   - a request that is COMPLETE is NEED_MORE on its prefixes, so a client
 *     that sends it in fragments is never refused half-way;
 *   - the parser is pure: the same bytes give the same answer.
 *
 *   make fuzz && build/fuzz/fuzz_http -max_total_time=60 -max_len=9000
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int valid_result(int rc)
{
    switch (rc) {
    case MOED_HTTP_COMPLETE:
    case MOED_HTTP_NEED_MORE:
    case MOED_HTTP_BAD_REQUEST:
    case MOED_HTTP_NOT_FOUND:
    case MOED_HTTP_BAD_METHOD:
    case MOED_HTTP_URI_TOO_LONG:
    case MOED_HTTP_HEAD_TOO_LARGE:
    case MOED_HTTP_BAD_VERSION:
        return 1;
    default:
        return 0;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an exact-size copy so any read past `size` is an ASan error */
    char *buf = malloc(size ? size : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    struct moed_http_req req, again;
    int rc = moed_http_parse_request(buf, size, &req);
    if (!valid_result(rc))
        abort();
    if (moed_http_parse_request(buf, size, &again) != rc || strcmp(req.why, again.why))
        abort();
    if (rc == MOED_HTTP_COMPLETE) {
        size_t c = req.consumed;
        if (c < 4 || c > size || c > MOED_HTTP_MAX_REQUEST || memcmp(buf + c - 4, "\r\n\r\n", 4))
            abort();
        if (req.route == MOED_HTTP_ROUTE_NONE || req.path[0] != '/' ||
            strlen(req.path) > MOED_HTTP_MAX_PATH)
            abort();
        size_t cuts[3] = {c - 1, c / 2, (size * 7919u) % c};
        for (int i = 0; i < 3; i++)
            if (moed_http_parse_request(buf, cuts[i], &again) != MOED_HTTP_NEED_MORE)
                abort();
    } else if (rc == MOED_HTTP_NEED_MORE) {
        if (size >= MOED_HTTP_MAX_REQUEST)
            abort();
    } else if (req.why[0] == '\0') {
        abort();
    }
    free(buf);
    return 0;
}
