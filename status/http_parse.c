/* http_parse.c - the status port's request parser (moed_http_parse_request,
 * http.h): request line and headers of one GET / HEAD, every field bounded
 * (see http.c for the listener). Pure: no I/O, fuzzed by fuzz_http. */
#include "http.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moed_err.h"

/* ------------------------------------------------------------- parser */

static int perr(struct moed_http_req *req, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int perr(struct moed_http_req *req, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(req->why, sizeof req->why, fmt, ap);
    va_end(ap);
    return status;
}

/* RFC 9110 tchar. */
static int is_tchar(unsigned char c)
{
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
        return 1;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* Scan one line from buf[pos] up to lim. Returns 1 with *eol at the CR of
 * its CRLF, 0 if the line is not finished within lim, or an error status.
 * Allowed bytes: printable ASCII and SP, plus HTAB in header lines. */
static int scan_line(const char *buf, size_t pos, size_t lim, int allow_tab, size_t *eol,
                     struct moed_http_req *req)
{
    for (size_t i = pos; i < lim; i++) {
        unsigned char c = (unsigned char)buf[i];
        if (c == '\r') {
            if (i + 1 == lim)
                return 0;
            if (buf[i + 1] != '\n')
                return perr(req, MOED_HTTP_BAD_REQUEST, "CR not followed by LF at offset %zu", i);
            *eol = i;
            return 1;
        }
        if (c == '\n')
            return perr(req, MOED_HTTP_BAD_REQUEST,
                        "bare LF at offset %zu (lines must end in CRLF)", i);
        if ((c < 0x20 || c > 0x7e) && !(allow_tab && c == '\t'))
            return perr(req, MOED_HTTP_BAD_REQUEST,
                        "byte 0x%02x at offset %zu is not printable ASCII", c, i);
    }
    return 0;
}

static enum moed_http_route route_of(const char *path)
{
    size_t n = strcspn(path, "?"); /* a query string does not change the route */
    if (n == 7 && !memcmp(path, "/status", 7))
        return MOED_HTTP_ROUTE_STATUS;
    if (n == 8 && !memcmp(path, "/metrics", 8))
        return MOED_HTTP_ROUTE_METRICS;
    if (n == 8 && !memcmp(path, "/healthz", 8))
        return MOED_HTTP_ROUTE_HEALTHZ;
    return MOED_HTTP_ROUTE_NONE;
}

/* The request line buf[0..n); `done` says whether its CRLF was seen (else
 * only the prefix can be judged). Returns 0 when fine so far. */
static int parse_request_line(const char *buf, size_t n, int done, struct moed_http_req *req)
{
    const char *sp1 = memchr(buf, ' ', n);
    size_t mlen = sp1 ? (size_t)(sp1 - buf) : n;
    if (mlen > MOED_HTTP_MAX_METHOD)
        return perr(req, MOED_HTTP_BAD_REQUEST, "method longer than %d bytes",
                    MOED_HTTP_MAX_METHOD);
    for (size_t i = 0; i < mlen; i++)
        if (!is_tchar((unsigned char)buf[i]))
            return perr(req, MOED_HTTP_BAD_REQUEST, "method has byte 0x%02x at offset %zu",
                        (unsigned char)buf[i], i);
    if (!sp1) {
        if (done)
            return perr(req, MOED_HTTP_BAD_REQUEST,
                        "request line is not \"METHOD SP PATH SP HTTP/1.x\"");
        return 0;
    }
    if (mlen == 0)
        return perr(req, MOED_HTTP_BAD_REQUEST, "request line starts with a space");

    const char *tgt = sp1 + 1;
    size_t rest = n - (size_t)(tgt - buf);
    const char *sp2 = memchr(tgt, ' ', rest);
    size_t tlen = sp2 ? (size_t)(sp2 - tgt) : rest;
    if (tlen > MOED_HTTP_MAX_PATH)
        return perr(req, MOED_HTTP_URI_TOO_LONG, "path longer than %d bytes",
                    MOED_HTTP_MAX_PATH);
    if (!sp2) {
        if (done)
            return perr(req, MOED_HTTP_BAD_REQUEST, "request line has no HTTP version");
        return 0;
    }
    if (tlen == 0)
        return perr(req, MOED_HTTP_BAD_REQUEST, "empty request target");

    const char *ver = sp2 + 1;
    size_t vlen = n - (size_t)(ver - buf);
    if (vlen > 8 || memcmp(ver, "HTTP/1.1", vlen < 5 ? vlen : 5) != 0)
        return perr(req, MOED_HTTP_BAD_REQUEST,
                    "version must be \"HTTP/1.0\" or \"HTTP/1.1\" after the path");
    if (!done)
        return 0;
    if (vlen != 8 || ver[5] < '0' || ver[5] > '9' || ver[6] != '.' || ver[7] < '0' ||
        ver[7] > '9')
        return perr(req, MOED_HTTP_BAD_REQUEST, "malformed version \"%.*s\"", (int)vlen, ver);
    if (ver[5] != '1' || (ver[7] != '0' && ver[7] != '1'))
        return perr(req, MOED_HTTP_BAD_VERSION,
                    "version \"%.8s\" not supported (HTTP/1.0, HTTP/1.1)", ver);
    req->minor = ver[7] - '0';

    req->head = mlen == 4 && !memcmp(buf, "HEAD", 4);
    if (!req->head && !(mlen == 3 && !memcmp(buf, "GET", 3)))
        return perr(req, MOED_HTTP_BAD_METHOD, "method \"%.*s\" not allowed (GET, HEAD)",
                    (int)mlen, buf);

    memcpy(req->path, tgt, tlen);
    req->path[tlen] = '\0';
    if (tgt[0] != '/')
        return perr(req, MOED_HTTP_BAD_REQUEST,
                    "request target \"%s\" is not an absolute path (origin-form)", req->path);
    req->route = route_of(req->path);
    if (req->route == MOED_HTTP_ROUTE_NONE)
        return perr(req, MOED_HTTP_NOT_FOUND, "no such path \"%s\" (/status, /metrics, /healthz)",
                    req->path);
    return 0;
}

static int parse_header_line(const char *line, size_t n, size_t off, struct moed_http_req *req)
{
    if (line[0] == ' ' || line[0] == '\t')
        return perr(req, MOED_HTTP_BAD_REQUEST,
                    "header line at offset %zu starts with whitespace (folding not allowed)", off);
    const char *colon = memchr(line, ':', n);
    if (!colon || colon == line)
        return perr(req, MOED_HTTP_BAD_REQUEST, "header line at offset %zu has no \"name:\"",
                    off);
    for (const char *p = line; p < colon; p++)
        if (!is_tchar((unsigned char)*p))
            return perr(req, MOED_HTTP_BAD_REQUEST,
                        "header name at offset %zu has byte 0x%02x", off, (unsigned char)*p);
    return 0;
}

int moed_http_parse_request(const char *buf, size_t len, struct moed_http_req *req)
{
    memset(req, 0, sizeof *req);
    size_t lim = len < MOED_HTTP_MAX_REQUEST ? len : MOED_HTTP_MAX_REQUEST;
    size_t eol = 0;

    int rc = scan_line(buf, 0, lim, 0, &eol, req);
    if (rc > 1)
        return rc;
    int done = rc == 1;
    size_t n = done ? eol : lim;
    if (!done && n && buf[n - 1] == '\r') /* a CR waiting for its LF is not line content */
        n--;
    rc = parse_request_line(buf, n, done, req);
    if (rc)
        return rc;
    if (!done)
        goto incomplete;

    for (size_t pos = eol + 2;;) {
        rc = scan_line(buf, pos, lim, 1, &eol, req);
        if (rc > 1)
            return rc;
        if (rc == 0)
            break;
        if (eol == pos) { /* empty line: end of the head */
            req->consumed = pos + 2;
            return MOED_HTTP_COMPLETE;
        }
        rc = parse_header_line(buf + pos, eol - pos, pos, req);
        if (rc)
            return rc;
        pos = eol + 2;
    }
incomplete:
    if (len >= MOED_HTTP_MAX_REQUEST)
        return perr(req, MOED_HTTP_HEAD_TOO_LARGE, "request head over %d bytes",
                    MOED_HTTP_MAX_REQUEST);
    return MOED_HTTP_NEED_MORE;
}

