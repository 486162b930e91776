/* test_config.c - the config table: defaults, round trip, every error class
 * with its exact message, the socket-path boundary, octal modes, the example
 * file and the generated reference (config/README.md). Run from the repo root.
 */
#include "config.h"
#include "moed_err.h"
#include "moed_log.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "check_main.h"

#define ERRBUF 8192

static char err[ERRBUF];

static int parse(const char *json, struct moed_cfg *c)
{
    memset(err, 0, sizeof err);
    return moed_cfg_parse(json, strlen(json), "t.json", c, err, sizeof err);
}

/* Parse must fail with MOED_E_CONFIG and report `msg` (substring). */
static void expect_err(const char *json, const char *msg)
{
    struct moed_cfg c;
    int rc = parse(json, &c);
    ck_assert_msg(rc == MOED_E_CONFIG, "rc %d for %s", rc, json);
    ck_assert_msg(strstr(err, msg) != NULL, "for %s\nexpected: %s\ngot: %s", json, msg, err);
}

static int count_lines(const char *s)
{
    int n = *s ? 1 : 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    size_t r;
    while (buf && (r = fread(buf + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) {
            char *p = realloc(buf, 2 * cap + 1);
            if (!p) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = p;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) {
        buf[n] = '\0';
        *len = n;
    }
    return buf;
}

/* Field-by-field equality (memcmp too: parse starts from zeroed defaults). */
static void assert_cfg_eq(const struct moed_cfg *a, const struct moed_cfg *b)
{
    ck_assert_str_eq(a->socket_path, b->socket_path);
    ck_assert_uint_eq(a->socket_mode, b->socket_mode);
    ck_assert_str_eq(a->socket_group, b->socket_group);
    ck_assert_uint_eq(a->n_allowed_uids, b->n_allowed_uids);
    ck_assert_uint_eq(a->n_allowed_gids, b->n_allowed_gids);
    for (uint32_t i = 0; i < a->n_allowed_uids; i++)
        ck_assert_uint_eq(a->allowed_uids[i], b->allowed_uids[i]);
    for (uint32_t i = 0; i < a->n_allowed_gids; i++)
        ck_assert_uint_eq(a->allowed_gids[i], b->allowed_gids[i]);
    ck_assert_uint_eq(a->max_clients, b->max_clients);
    ck_assert_uint_eq(a->max_pending_per_client, b->max_pending_per_client);
    ck_assert_uint_eq(a->max_frame_bytes, b->max_frame_bytes);
    ck_assert_uint_eq(a->max_client_buffer_bytes, b->max_client_buffer_bytes);
    ck_assert_uint_eq(a->frame_timeout_ms, b->frame_timeout_ms);
    ck_assert_uint_eq(a->pinned_pool_bytes, b->pinned_pool_bytes);
    ck_assert_str_eq(a->status_addr, b->status_addr);
    ck_assert_uint_eq(a->status_port, b->status_port);
    ck_assert_str_eq(a->model, b->model);
    ck_assert_str_eq(a->synthetic_dir, b->synthetic_dir);
    ck_assert_int_eq(a->backend, b->backend);
    ck_assert_uint_eq(a->n_gpus, b->n_gpus);
    for (uint32_t i = 0; i < a->n_gpus; i++)
        ck_assert_int_eq(a->gpus[i], b->gpus[i]);
    ck_assert_uint_eq(a->sms_free, b->sms_free);
    ck_assert_uint_eq(a->max_tokens, b->max_tokens);
    ck_assert_uint_eq(a->cpu_threads, b->cpu_threads);
    ck_assert_uint_eq(a->batch_deadline_ms, b->batch_deadline_ms);
    ck_assert_uint_eq(a->idle_exit_ms, b->idle_exit_ms);
    ck_assert_int_eq(a->log_level, b->log_level);
    ck_assert(memcmp(a, b, sizeof *a) == 0);
}

START_TEST(defaults_valid)
{
    static struct moed_cfg d, p;
    moed_cfg_defaults(&d);
    /* "{}" goes through the validating setters: every default is in bounds. */
    ck_assert_msg(parse("{}", &p) == 0, "%s", err);
    assert_cfg_eq(&d, &p);
    ck_assert_str_eq(d.socket_path, "/tmp/moed.sock");
    ck_assert_uint_eq(d.socket_mode, 0660);
    ck_assert_str_eq(d.socket_group, "");
    ck_assert_uint_eq(d.n_allowed_uids, 0);
    ck_assert_uint_eq(d.max_clients, 64);
    ck_assert_uint_eq(d.max_pending_per_client, 64);
    ck_assert_uint_eq(d.max_frame_bytes, 64u << 20);
    ck_assert_uint_eq(d.max_client_buffer_bytes, 256u << 20);
    ck_assert_uint_eq(d.frame_timeout_ms, 5000);
    ck_assert_uint_eq(d.pinned_pool_bytes, 256u << 20);
    ck_assert_str_eq(d.status_addr, "127.0.0.1");
    ck_assert_uint_eq(d.status_port, 9464);
    ck_assert_str_eq(d.model, "synthetic:tiny");
    ck_assert_str_eq(d.synthetic_dir, "/tmp/moed-models");
    ck_assert_int_eq(d.backend, MOED_CFG_BACKEND_AUTO);
    ck_assert_uint_eq(d.n_gpus, 0);
    ck_assert_uint_eq(d.sms_free, 0);
    ck_assert_uint_eq(d.max_tokens, 512);
    ck_assert_uint_eq(d.batch_deadline_ms, 10000);
    ck_assert_uint_eq(d.idle_exit_ms, 0);
    ck_assert_int_eq(d.log_level, MOED_LOG_INFO);
}
END_TEST

static const char full_json[] =
    "{\n"
    " \"server\": {\"socket\": \"/run/moed/x \\\"q\\\".sock\", \"socket_mode\": \"0600\",\n"
    "   \"socket_group\": \"moed\", \"allowed_uids\": [0, 1000, 4294967294],\n"
    "   \"allowed_gids\": [27], \"max_clients\": 7, \"max_pending_per_client\": 3,\n"
    "   \"max_frame_bytes\": 1048576, \"max_client_buffer_bytes\": 68719476736,\n"
    "   \"frame_timeout_ms\": 600000, \"pinned_pool_bytes\": 0},\n"
    " \"status\": {\"address\": \"0.0.0.0\", \"port\": 0},\n"
    " \"model\": {\"path\": \"synthetic:deepseek-v3:layers=3:seed=18446744073709551615\",\n"
    "   \"synthetic_dir\": \"rel/dir\"},\n"
    " \"engine\": {\"backend\": \"cpu\", \"gpus\": [3, 0, 1023], \"sms_free\": 255,\n"
    "   \"max_tokens\": 4096, \"cpu_threads\": 3, \"batch_deadline_ms\": 1,\n"
    "   \"idle_exit_ms\": 86400000},\n"
    " \"log\": {\"level\": \"debug\"}\n"
    "}\n";

START_TEST(full_round_trip)
{
    static struct moed_cfg a, b, d;
    ck_assert_msg(parse(full_json, &a) == 0, "%s", err);
    ck_assert_str_eq(a.socket_path, "/run/moed/x \"q\".sock");
    ck_assert_uint_eq(a.socket_mode, 0600);
    ck_assert_uint_eq(a.n_allowed_uids, 3);
    ck_assert_uint_eq(a.allowed_uids[2], 4294967294u);
    ck_assert_uint_eq(a.max_client_buffer_bytes, 68719476736ull);
    ck_assert_int_eq(a.backend, MOED_CFG_BACKEND_CPU);
    ck_assert_uint_eq(a.n_gpus, 3);
    ck_assert_int_eq(a.gpus[0], 3);
    ck_assert_int_eq(a.gpus[2], 1023);
    ck_assert_int_eq(a.log_level, MOED_LOG_DEBUG);
    ck_assert_uint_eq(a.pinned_pool_bytes, 0);
    ck_assert_str_eq(moed_cfg_backend_name(a.backend), "cpu");

    char *j = moed_cfg_to_json(&a);
    ck_assert_ptr_nonnull(j);
    ck_assert_msg(parse(j, &b) == 0, "%s\n%s", err, j);
    assert_cfg_eq(&a, &b);
    ck_assert_ptr_nonnull(strstr(j, "\"socket_mode\": \"0600\""));
    ck_assert_ptr_nonnull(strstr(j, "\"gpus\": [3, 0, 1023]"));
    ck_assert_ptr_nonnull(strstr(j, "\"backend\": \"cpu\""));
    free(j);

    /* Every key is present in the effective config, even at defaults. */
    moed_cfg_defaults(&d);
    j = moed_cfg_to_json(&d);
    ck_assert_ptr_nonnull(j);
    static const char *const all[] = {
        "\"server\": {", "\"socket\":", "\"socket_mode\": \"0660\"", "\"socket_group\": \"\"",
        "\"allowed_uids\": []", "\"allowed_gids\": []", "\"max_clients\": 64",
        "\"max_pending_per_client\": 64", "\"max_frame_bytes\": 67108864",
        "\"max_client_buffer_bytes\": 268435456", "\"frame_timeout_ms\": 5000",
        "\"pinned_pool_bytes\": 268435456",
        "\"status\": {", "\"address\": \"127.0.0.1\"", "\"port\": 9464", "\"model\": {",
        "\"path\": \"synthetic:tiny\"", "\"synthetic_dir\": \"/tmp/moed-models\"",
        "\"engine\": {", "\"backend\": \"auto\"", "\"gpus\": []", "\"sms_free\": 0",
        "\"max_tokens\": 512", "\"cpu_threads\": 0", "\"batch_deadline_ms\": 10000",
        "\"idle_exit_ms\": 0",
        "\"log\": {",
        "\"level\": \"info\""};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        ck_assert_msg(strstr(j, all[i]) != NULL, "missing %s in\n%s", all[i], j);
    free(j);
}
END_TEST

START_TEST(error_classes)
{
    expect_err("{\"server\": {\"sockett\": \"/x\"}}",
               "t.json: unknown key 'server.sockett' (did you mean 'server.socket'?)");
    expect_err("{\"servr\": {}}", "unknown key 'servr' (did you mean 'server'?)");
    expect_err("{\"zzz\": {}}", "t.json: unknown key 'zzz'");
    expect_err("{\"server.socket\": \"/x\"}",
               "unknown key 'server.socket' (keys are nested: write it inside the \"server\" "
               "object)");
    expect_err("{\"server\": {\"max_clients\": \"ten\"}}",
               "t.json: server.max_clients: expected an unsigned integer, got string \"ten\"");
    expect_err("{\"server\": {\"max_clients\": 10.5}}",
               "server.max_clients: expected an unsigned integer, got number 10.5");
    expect_err("{\"server\": {\"max_clients\": true}}",
               "server.max_clients: expected an unsigned integer, got true");
    expect_err("{\"server\": {\"max_clients\": null}}",
               "server.max_clients: expected an unsigned integer, got null");
    expect_err("{\"server\": {\"socket\": 5}}",
               "server.socket: expected a path string, got number 5");
    expect_err("{\"server\": 3}", "server: expected an object, got number 3");
    expect_err("{\"engine\": {\"max_tokens\": 0}}",
               "engine.max_tokens: 0 is out of range [1, 16384]");
    expect_err("{\"engine\": {\"max_tokens\": 16385}}",
               "engine.max_tokens: 16385 is out of range [1, 16384]");
    expect_err("{\"server\": {\"max_clients\": -3}}",
               "server.max_clients: -3 is out of range [1, 4096]");
    expect_err("{\"engine\": {\"backend\": \"gpu\"}}",
               "engine.backend: \"gpu\" is not one of \"auto\", \"cuda\", \"cpu\"");
    expect_err("{\"engine\": {\"backend\": 1}}",
               "engine.backend: expected one of \"auto\", \"cuda\", \"cpu\", got number 1");
    /* the test switches are environment variables (test_hooks.h), not keys */
    expect_err("{\"engine\": {\"cpu_host_alloc\": true}}", "engine.cpu_host_alloc");
    expect_err("{\"log\": {\"level\": \"verbose\"}}",
               "log.level: \"verbose\" is not one of \"error\", \"warn\", \"info\", \"debug\"");
    expect_err("{\"server\": {\"socket\": \"\"}}", "server.socket: must not be empty");
    expect_err("{\"model\": {\"path\": \"\"}}", "model.path: must not be empty");
    expect_err("{\"status\": {\"address\": \"localhost\"}}",
               "status.address: \"localhost\" is not an IPv4 address literal like "
               "\"127.0.0.1\"");
    expect_err("{\"status\": {\"address\": \"::1\"}}", "status.address: \"::1\" is not an IPv4");
    expect_err("{\"status\": {\"port\": 65536}}", "status.port: 65536 is out of range [0, 65535]");
    expect_err("{\"server\": {\"socket_group\": "
               "\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"}}",
               "server.socket_group: value is 64 bytes; at most 63 are allowed");
    expect_err("{\"server\": {\"socket\": \"/x\", \"socket\": \"/y\"}}",
               "duplicate key 'server.socket'");
    expect_err("{\"log\": {}, \"log\": {}}", "duplicate key 'log'");
    expect_err("{\"server\": {\"max_frame_bytes\": 536870912}}",
               "server.max_client_buffer_bytes: 268435456 is less than server.max_frame_bytes "
               "(536870912); a client must be able to queue at least one full frame");
}
END_TEST

START_TEST(integers_and_2p53)
{
    static struct moed_cfg c;
    /* 2^53 itself is exact: a range error, not a precision error. */
    expect_err("{\"server\": {\"max_client_buffer_bytes\": 9007199254740992}}",
               "server.max_client_buffer_bytes: 9007199254740992 is out of range [65536, "
               "68719476736]");
    expect_err("{\"server\": {\"max_client_buffer_bytes\": 9007199254740994}}",
               "server.max_client_buffer_bytes: 9007199254740994 is beyond 2^53 and cannot be "
               "an exact integer");
    expect_err("{\"engine\": {\"max_tokens\": 1e300}}",
               "engine.max_tokens: 1e+300 is beyond 2^53");
    expect_err("{\"engine\": {\"max_tokens\": -1e300}}",
               "engine.max_tokens: -1e+300 is beyond 2^53");
    /* Integral values written with an exponent or a zero fraction are integers. */
    ck_assert_msg(parse("{\"engine\": {\"max_tokens\": 1e3, \"sms_free\": 4.0}}", &c) == 0, "%s",
                  err);
    ck_assert_uint_eq(c.max_tokens, 1000);
    ck_assert_uint_eq(c.sms_free, 4);
    ck_assert_msg(parse("{\"server\": {\"max_frame_bytes\": 4294967296, "
                        "\"max_client_buffer_bytes\": 4294967296}}", &c) == 0, "%s", err);
    ck_assert_uint_eq(c.max_frame_bytes, 4294967296ull);
}
END_TEST

START_TEST(arrays)
{
    static struct moed_cfg c;
    expect_err("{\"server\": {\"allowed_uids\": [1000, 1001, \"x\"]}}",
               "server.allowed_uids[2]: expected an unsigned integer, got string \"x\"");
    expect_err("{\"server\": {\"allowed_uids\": [4294967295]}}",
               "server.allowed_uids[0]: 4294967295 is out of range [0, 4294967294]");
    expect_err("{\"server\": {\"allowed_gids\": [5, 6, 5]}}",
               "server.allowed_gids[2]: 5 is already listed at index 0");
    /* a GPU may be listed twice (expert parallelism on one GPU), an id not */
    ck_assert_msg(parse("{\"engine\": {\"gpus\": [0, 0, 1], \"placement\": \"/x/p.json\"}}",
                        &c) == 0, "%s", err);
    ck_assert_uint_eq(c.n_gpus, 3);
    ck_assert_int_eq(c.gpus[1], 0);
    ck_assert_str_eq(c.placement, "/x/p.json");
    expect_err("{\"engine\": {\"gpus\": [0, -1]}}", "engine.gpus[1]: -1 is out of range [0, 1023]");
    expect_err("{\"engine\": {\"gpus\": [0.5]}}",
               "engine.gpus[0]: expected an integer, got number 0.5");
    expect_err("{\"engine\": {\"gpus\": 0}}",
               "engine.gpus: expected an array of integers, got number 0");
    expect_err("{\"server\": {\"allowed_uids\": {}}}",
               "server.allowed_uids: expected an array of unsigned integers, got an object");

    /* 64 entries fit, 65 do not. */
    char buf[2048];
    size_t o = (size_t)snprintf(buf, sizeof buf, "{\"server\": {\"allowed_uids\": [");
    for (int i = 0; i < 64; i++)
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%d", i ? "," : "", i);
    snprintf(buf + o, sizeof buf - o, "]}}");
    ck_assert_msg(parse(buf, &c) == 0, "%s", err);
    ck_assert_uint_eq(c.n_allowed_uids, 64);
    ck_assert_uint_eq(c.allowed_uids[63], 63);
    snprintf(buf + o, sizeof buf - o, ",64]}}");
    expect_err(buf, "server.allowed_uids: 65 entries; at most 64 are allowed");
}
END_TEST

/* Found by fuzz_config (tests/fuzz): an element that failed its check left
 * its slot unset, and the repeat check of a later element compared against
 * it, so "7 is already listed at index 1" appeared or not depending on what
 * the previous parse left on the stack. Prime the stack with 7s, then parse a
 * list whose element 1 is refused: only that error may be reported. */
START_TEST(arrays_repeat_check_skips_refused)
{
    static struct moed_cfg c;
    static const char *const bad[] = {
        "{\"server\": {\"allowed_uids\": [1, 42949672960, 7]}}",
        "{\"server\": {\"allowed_uids\": [1, -3, 7]}}",
        "{\"server\": {\"allowed_uids\": [1, \"x\", 7]}}",
        "{\"engine\": {\"gpus\": [1, 5000, 7]}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        for (int r = 0; r < 3; r++) {
            ck_assert_msg(parse("{\"server\": {\"allowed_uids\": [7, 8, 9]}}", &c) == 0, "%s",
                          err);
            ck_assert_int_eq(parse("{\"server\": {\"allowed_uids\": [7, 7, 7]}}", &c),
                             MOED_E_CONFIG);
            ck_assert_int_eq(parse(bad[i], &c), MOED_E_CONFIG);
            ck_assert_msg(count_lines(err) == 1, "%s: %s", bad[i], err);
            ck_assert_msg(strstr(err, "already listed") == NULL, "%s: %s", bad[i], err);
        }
    }
}
END_TEST

START_TEST(several_errors_together)
{
    static struct moed_cfg c;
    moed_cfg_defaults(&c);
    c.max_tokens = 77; /* a failed parse leaves the caller's struct alone */
    int rc = parse("{\"server\": {\"sockett\": 1, \"max_clients\": \"ten\"},\n"
                   " \"engine\": {\"max_tokens\": 0, \"backend\": \"gpu\"},\n"
                   " \"log\": {\"level\": \"loud\"}}",
                   &c);
    ck_assert_int_eq(rc, MOED_E_CONFIG);
    ck_assert_int_eq(count_lines(err), 5);
    ck_assert_ptr_nonnull(strstr(err, "t.json: unknown key 'server.sockett'"));
    ck_assert_ptr_nonnull(strstr(err, "\nt.json: server.max_clients: expected an unsigned"));
    ck_assert_ptr_nonnull(strstr(err, "\nt.json: engine.max_tokens: 0 is out of range"));
    ck_assert_ptr_nonnull(strstr(err, "\nt.json: engine.backend: \"gpu\" is not one of"));
    ck_assert_ptr_nonnull(strstr(err, "\nt.json: log.level: \"loud\" is not one of"));
    ck_assert_uint_eq(c.max_tokens, 77);

    /* A small buffer keeps the first lines and ends in "..." */
    char small[64];
    const char *four = "{\"a\": 1, \"b\": 2, \"c\": 3, \"d\": 4}";
    rc = moed_cfg_parse(four, strlen(four), "t.json", &c, small, sizeof small);
    ck_assert_int_eq(rc, MOED_E_CONFIG);
    ck_assert_uint_eq(strlen(small), sizeof small - 1);
    ck_assert_str_eq(small + sizeof small - 4, "...");
    ck_assert(strncmp(small, "t.json: unknown key 'a'\nt.json: unknown key", 43) == 0);

    /* At most 100 lines, then a count of the rest. */
    char *many = malloc(200 * 16 + 16);
    ck_assert_ptr_nonnull(many);
    size_t o = (size_t)sprintf(many, "{");
    for (int i = 0; i < 200; i++)
        o += (size_t)sprintf(many + o, "%s\"k%d\": 0", i ? ", " : "", i);
    sprintf(many + o, "}");
    char *big = malloc(65536);
    ck_assert_ptr_nonnull(big);
    rc = moed_cfg_parse(many, strlen(many), "t.json", &c, big, 65536);
    ck_assert_int_eq(rc, MOED_E_CONFIG);
    ck_assert_int_eq(count_lines(big), 101);
    ck_assert_ptr_nonnull(
        strstr(big, "\nt.json: unknown key 'k99'\nt.json: 100 more errors not shown"));
    free(big);
    free(many);
}
END_TEST

/* engine.nccl_*: each cross-key error exactly, and a valid group config. */
START_TEST(nccl_group_keys)
{
    struct moed_cfg c;
    ck_assert_int_eq(parse("{\"engine\": {\"backend\": \"cuda\", \"nccl_ranks\": 2, "
                           "\"nccl_rank\": 1, \"sms_free\": 8, \"nccl_id_file\": "
                           "\"/run/moed/nccl.id\", \"nccl_timeout_ms\": 5000, "
                           "\"nccl_keepalive_ms\": 500}}", &c), 0);
    ck_assert_uint_eq(c.nccl_ranks, 2);
    ck_assert_uint_eq(c.nccl_rank, 1);
    ck_assert_str_eq(c.nccl_id_file, "/run/moed/nccl.id");
    ck_assert_uint_eq(c.nccl_timeout_ms, 5000);
    ck_assert_uint_eq(c.nccl_keepalive_ms, 500);
    ck_assert_int_eq(parse("{}", &c), 0);
    ck_assert_uint_eq(c.nccl_ranks, 1);
    ck_assert_uint_eq(c.nccl_timeout_ms, 60000);
    ck_assert_uint_eq(c.nccl_keepalive_ms, 1000);
    expect_err("{\"engine\": {\"nccl_ranks\": 2, \"nccl_rank\": 2}}",
               "engine.nccl_rank: 2 is not below engine.nccl_ranks (2)");
    expect_err("{\"engine\": {\"nccl_ranks\": 9}}", "engine.nccl_ranks: 9 is out of range");
    expect_err("{\"engine\": {\"nccl_timeout_ms\": 1000, \"nccl_keepalive_ms\": 1000}}",
               "engine.nccl_keepalive_ms: 1000 is not less than engine.nccl_timeout_ms (1000)");
    expect_err("{\"engine\": {\"nccl_ranks\": 2, \"sms_free\": 8}}",
               "engine.nccl_ranks: 2 ranks need engine.backend \"cuda\"");
    expect_err("{\"engine\": {\"backend\": \"cuda\", \"nccl_ranks\": 2, \"sms_free\": 8, "
               "\"gpus\": [0, 1]}}",
               "engine.nccl_ranks: 2 ranks and 2 engine.gpus entries; a rank of an NCCL group "
               "holds one GPU");
    expect_err("{\"engine\": {\"backend\": \"cuda\", \"nccl_ranks\": 2, \"sms_free\": 1}}",
               "engine.nccl_ranks: 2 ranks need engine.sms_free >= 2 (it is 1)");
}
END_TEST

START_TEST(socket_path_boundary)
{
    static struct moed_cfg c;
    char path[200], json[400];
    /* 107 bytes: fits sun_path with its NUL. */
    memset(path, 'a', sizeof path);
    path[0] = '/';
    path[107] = '\0';
    snprintf(json, sizeof json, "{\"server\": {\"socket\": \"%s\"}}", path);
    ck_assert_msg(parse(json, &c) == 0, "%s", err);
    ck_assert_uint_eq(strlen(c.socket_path), 107);
    path[107] = 'a';
    path[108] = '\0';
    snprintf(json, sizeof json, "{\"server\": {\"socket\": \"%s\"}}", path);
    expect_err(json, "server.socket: path is 108 bytes; a Unix socket path may be at most 107 "
                     "bytes");
    path[130] = '\0';
    memset(path + 108, 'b', 22);
    snprintf(json, sizeof json, "{\"server\": {\"socket\": \"%s\"}}", path);
    expect_err(json, "server.socket: path is 130 bytes; a Unix socket path may be at most 107 "
                     "bytes");
    /* Relative paths are allowed. */
    ck_assert_msg(parse("{\"server\": {\"socket\": \"moed.sock\"}}", &c) == 0, "%s", err);
    ck_assert_str_eq(c.socket_path, "moed.sock");
}
END_TEST

START_TEST(octal_modes)
{
    static struct moed_cfg c;
    static const struct {
        const char *s;
        uint32_t mode;
    } ok[] = {{"0660", 0660}, {"660", 0660}, {"0777", 0777}, {"0000", 0}, {"600", 0600},
              {"0007", 07}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        char json[128];
        snprintf(json, sizeof json, "{\"server\": {\"socket_mode\": \"%s\"}}", ok[i].s);
        ck_assert_msg(parse(json, &c) == 0, "%s: %s", ok[i].s, err);
        ck_assert_uint_eq(c.socket_mode, ok[i].mode);
        char *j = moed_cfg_to_json(&c);
        char want[64];
        snprintf(want, sizeof want, "\"socket_mode\": \"%04o\"", ok[i].mode);
        ck_assert_msg(strstr(j, want) != NULL, "%s not in %s", want, j);
        free(j);
    }
    static const char *const bad[] = {"0999", "66", "06600", "0o660", "rw-", "", " 660", "-660"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char json[128], msg[160];
        snprintf(json, sizeof json, "{\"server\": {\"socket_mode\": \"%s\"}}", bad[i]);
        snprintf(msg, sizeof msg,
                 "server.socket_mode: \"%s\" is not an octal mode; expected 3 or 4 octal digits "
                 "like \"0660\"",
                 bad[i]);
        expect_err(json, msg);
    }
    expect_err("{\"server\": {\"socket_mode\": \"4777\"}}",
               "server.socket_mode: \"4777\" is out of range [\"0000\", \"0777\"] (setuid, "
               "setgid and sticky bits are not allowed)");
    /* A JSON number would be read as decimal: refuse it. */
    expect_err("{\"server\": {\"socket_mode\": 660}}",
               "server.socket_mode: expected an octal mode string like \"0660\", got number 660");
}
END_TEST

START_TEST(model_specs)
{
    static struct moed_cfg c;
    static const char *const ok[] = {"synthetic:tiny", "synthetic:tiny:layers=2",
                                     "synthetic:qwen3-30b-a3b:seed=7:layers=1024",
                                     "/models/x", "synthetic-not-a-spec"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        char json[256];
        snprintf(json, sizeof json, "{\"model\": {\"path\": \"%s\"}}", ok[i]);
        ck_assert_msg(parse(json, &c) == 0, "%s: %s", ok[i], err);
        ck_assert_str_eq(c.model, ok[i]);
    }
    expect_err("{\"model\": {\"path\": \"synthetic:tiny:layer=2\"}}",
               "model.path: \"synthetic:tiny:layer=2\": bad option \"layer=2\"; expected "
               "synthetic:PRESET[:layers=N][:seed=S]");
    expect_err("{\"model\": {\"path\": \"synthetic:tiny:layers=0\"}}", "bad option \"layers=0\"");
    expect_err("{\"model\": {\"path\": \"synthetic:tiny:layers=1025\"}}",
               "bad option \"layers=1025\"");
    expect_err("{\"model\": {\"path\": \"synthetic:tiny:seed=18446744073709551616\"}}",
               "bad option \"seed=18446744073709551616\"");
    expect_err("{\"model\": {\"path\": \"synthetic:tiny:seed=1:seed=2\"}}",
               "bad option \"seed=2\"");
    expect_err("{\"model\": {\"path\": \"synthetic:\"}}",
               "model.path: \"synthetic:\": the preset must be a name of [a-z0-9._-]");
}
END_TEST

START_TEST(malformed_json)
{
    expect_err("{\n \"server\": {\n  \"socket\": \"/x\",,\n }\n}",
               "t.json:3:19: malformed JSON near '\"socket\": \"/x\",,'");
    expect_err("{\"a\":1} x", "t.json:1:9: malformed JSON near '{\"a\":1} x'");
    expect_err("{\"a\":", "t.json:1:6: malformed JSON: unexpected end of input");
    expect_err("[1, 2]", "t.json: expected a JSON object at the top level, got an array");
    expect_err("\"x\"", "t.json: expected a JSON object at the top level, got string \"x\"");
    expect_err("", "t.json: empty; expected a JSON object");

    static struct moed_cfg c;
    int rc = moed_cfg_parse("{}\0{}", 5, "t.json", &c, err, sizeof err);
    ck_assert_int_eq(rc, MOED_E_CONFIG);
    ck_assert_str_eq(err, "t.json: NUL byte at offset 2; a config is JSON text");
    /* Only the given length is read: the text need not be NUL-terminated. */
    rc = moed_cfg_parse("{}garbage", 2, "t.json", &c, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
}
END_TEST

START_TEST(load_files)
{
    static struct moed_cfg c;
    int rc = moed_cfg_load("/nonexistent/moed.json", &c, err, sizeof err);
    ck_assert_int_eq(rc, MOED_E_IO);
    ck_assert_str_eq(err, "config file /nonexistent/moed.json: cannot open: No such file or "
                          "directory");

    char dir[] = "/tmp/test_config.XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/big.json", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    /* Valid JSON of exactly 1 MiB + 1 byte: refused for its size alone. */
    fputc('{', f);
    for (int i = 0; i < (1 << 20) - 2; i++)
        fputc(' ', f);
    fputs("}\n", f);
    fclose(f);
    rc = moed_cfg_load(path, &c, err, sizeof err);
    ck_assert_int_eq(rc, MOED_E_CONFIG);
    char want[256];
    snprintf(want, sizeof want, "config file %s: larger than 1048576 bytes (1 MiB), the limit",
             path);
    ck_assert_str_eq(err, want);
    ck_assert_int_eq(truncate(path, 1 << 20), 0); /* now exactly 1 MiB, ends in '}' */
    rc = moed_cfg_load(path, &c, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);

    snprintf(path, sizeof path, "%s/bad.json", dir);
    f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("{\"engine\": {\"max_tokens\": 0}}", f);
    fclose(f);
    rc = moed_cfg_load(path, &c, err, sizeof err);
    ck_assert_int_eq(rc, MOED_E_CONFIG);
    snprintf(want, sizeof want, "%s: engine.max_tokens: 0 is out of range [1, 16384]", path);
    ck_assert_str_eq(err, want);
    unlink(path);
    snprintf(path, sizeof path, "%s/big.json", dir);
    unlink(path);
    rmdir(dir);
}
END_TEST

/* The limits of issue 10: defaults, values and bounds. */
START_TEST(abuse_limits)
{
    static struct moed_cfg c;
    moed_cfg_defaults(&c);
    ck_assert_uint_eq(c.idle_timeout_ms, 0);
    ck_assert_uint_eq(c.max_reply_bytes, 1ull << 30);
    ck_assert_uint_eq(c.drain_stall_ms, 10000);
    ck_assert_msg(parse("{\"server\": {\"idle_timeout_ms\": 30000, \"max_reply_bytes\": 65536},"
                        " \"engine\": {\"drain_stall_ms\": 1}}", &c) == 0, "%s", err);
    ck_assert_uint_eq(c.idle_timeout_ms, 30000);
    ck_assert_uint_eq(c.max_reply_bytes, 65536);
    ck_assert_uint_eq(c.drain_stall_ms, 1);
    expect_err("{\"engine\": {\"drain_stall_ms\": 0}}",
               "engine.drain_stall_ms: 0 is out of range [1, 600000]");
    expect_err("{\"server\": {\"max_reply_bytes\": 1024}}",
               "server.max_reply_bytes: 1024 is out of range [65536, 1099511627776]");
    expect_err("{\"server\": {\"idle_timeout_ms\": 86400001}}",
               "server.idle_timeout_ms: 86400001 is out of range [0, 86400000]");
}
END_TEST

START_TEST(example_json_parses)
{
    static struct moed_cfg c, d;
    int rc = moed_cfg_load("config/example.json", &c, err, sizeof err);
    ck_assert_msg(rc == 0, "config/example.json: %s", err);
    ck_assert_str_eq(c.socket_path, "/tmp/moed.sock");
    ck_assert_str_eq(c.model, "synthetic:tiny");
    ck_assert_int_eq(c.backend, MOED_CFG_BACKEND_AUTO);
    ck_assert_uint_eq(c.status_port, 9464);
    /* Complete: every key written out, so it reads as a full reference file. */
    size_t len;
    char *text = read_all("config/example.json", &len);
    ck_assert_ptr_nonnull(text);
    moed_cfg_defaults(&d);
    char *dj = moed_cfg_to_json(&d);
    for (char *line = strtok(dj, "\n"); line; line = strtok(NULL, "\n")) {
        char *colon = strstr(line, "\":");
        if (!colon)
            continue;
        colon[1] = '\0';
        ck_assert_msg(strstr(text, line) != NULL, "config/example.json lacks %s", line);
    }
    free(dj);
    free(text);
}
END_TEST

START_TEST(reference_md_up_to_date)
{
    char *md = moed_cfg_reference_md();
    ck_assert_ptr_nonnull(md);
    size_t len = 0;
    char *file = read_all("config/README.md", &len);
    ck_assert_msg(file != NULL, "config/README.md is missing: run `make config-doc`");
    ck_assert_msg(len == strlen(md) && memcmp(file, md, len) == 0,
                  "config/README.md differs from moed_cfg_reference_md(): run `make config-doc` "
                  "and commit the result");
    /* Every key of the table appears in its row. */
    static const char *const rows[] = {
        "| `server.socket` |",
        "| `server.socket_mode` |",
        "| `status.port` |",
        "| `engine.max_tokens` | unsigned integer | `512` | 1 .. 16384 |",
        "| `log.level` |",
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        ck_assert_msg(strstr(md, rows[i]) != NULL, "missing %s", rows[i]);
    /* Every ```json block of the reference is a valid config. */
    int blocks = 0;
    for (char *p = strstr(md, "```json\n"); p; p = strstr(p, "```json\n")) {
        p += 8;
        char *end = strstr(p, "```");
        ck_assert_ptr_nonnull(end);
        static struct moed_cfg c;
        int rc = moed_cfg_parse(p, (size_t)(end - p), "README.md", &c, err, sizeof err);
        ck_assert_msg(rc == 0, "block %d: %s", blocks, err);
        blocks++;
        p = end + 3;
    }
    ck_assert_int_eq(blocks, 2);
    free(file);
    free(md);
}
END_TEST

static Suite *config_suite(void)
{
    Suite *s = suite_create("config");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, defaults_valid);
    tcase_add_test(tc, full_round_trip);
    tcase_add_test(tc, abuse_limits);
    tcase_add_test(tc, nccl_group_keys);
    tcase_add_test(tc, error_classes);
    tcase_add_test(tc, integers_and_2p53);
    tcase_add_test(tc, arrays);
    tcase_add_test(tc, arrays_repeat_check_skips_refused);
    tcase_add_test(tc, several_errors_together);
    tcase_add_test(tc, socket_path_boundary);
    tcase_add_test(tc, octal_modes);
    tcase_add_test(tc, model_specs);
    tcase_add_test(tc, malformed_json);
    tcase_add_test(tc, load_files);
    tcase_add_test(tc, example_json_parses);
    tcase_add_test(tc, reference_md_up_to_date);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return moed_check_run(config_suite());
}
