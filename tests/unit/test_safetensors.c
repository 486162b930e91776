/* test_safetensors.c - the safetensors reader against malformed files written
 * byte by byte, and a writer -> reader round trip. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moed_err.h"
#include "safetensors.h"
#include "check_main.h"

static char tmpdir[64];
static char fpath[128];
static char err[MOED_ERRLEN];

static void setup(void)
{
    strcpy(tmpdir, "/tmp/moed-st-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmpdir));
    snprintf(fpath, sizeof fpath, "%s/model.safetensors", tmpdir);
    err[0] = '\0';
}

static void teardown(void)
{
    char tmp[160];
    unlink(fpath);
    snprintf(tmp, sizeof tmp, "%s.tmp", fpath);
    unlink(tmp);
    rmdir(tmpdir);
}

static void write_bytes(const void *p, size_t n)
{
    FILE *f = fopen(fpath, "wb");
    ck_assert_ptr_nonnull(f);
    if (n)
        ck_assert_uint_eq(fwrite(p, 1, n, f), n);
    ck_assert_int_eq(fclose(f), 0);
}

/* Header length `hlen` (as stored), header text, then `data_len` bytes 0..255. */
static void write_st(uint64_t hlen, const char *json, size_t data_len)
{
    size_t jl = strlen(json);
    size_t total = 8 + jl + data_len;
    uint8_t *buf = malloc(total);
    ck_assert_ptr_nonnull(buf);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(hlen >> (8 * i));
    memcpy(buf + 8, json, jl);
    for (size_t i = 0; i < data_len; i++)
        buf[8 + jl + i] = (uint8_t)i;
    write_bytes(buf, total);
    free(buf);
}

static void write_json(const char *json, size_t data_len)
{
    write_st(strlen(json), json, data_len);
}

/* Open must fail with `code` and a message containing `want`. */
static void expect_fail(int code, const char *want)
{
    struct st_file *f = (struct st_file *)0x1;
    int rc = st_open(fpath, &f, err, sizeof err);
    ck_assert_msg(rc == code, "rc %d, expected %d (%s)", rc, code, err);
    ck_assert_ptr_null(f);
    ck_assert_msg(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
    ck_assert_msg(strstr(err, "model.safetensors") != NULL, "message '%s' lacks the file", err);
}

START_TEST(empty_file)
{
    write_bytes("", 0);
    expect_fail(MOED_E_FORMAT, "truncated: 0 bytes");
}
END_TEST

START_TEST(short_file)
{
    write_bytes("\x05\x00\x00", 3);
    expect_fail(MOED_E_FORMAT, "truncated: 3 bytes");
}
END_TEST

START_TEST(header_past_end)
{
    write_st(100, "{}", 0);
    expect_fail(MOED_E_FORMAT, "header length 100 past the end of the 10-byte file");
}
END_TEST

START_TEST(header_over_cap)
{
    write_st((uint64_t)ST_MAX_HEADER_BYTES + 1, "{}", 0);
    expect_fail(MOED_E_FORMAT, "header length 100000001 over the 100000000-byte cap");
}
END_TEST

START_TEST(header_huge_length)
{
    /* 2^64 - 1 must not wrap any sum. */
    write_st(UINT64_MAX, "{}", 0);
    expect_fail(MOED_E_FORMAT, "over the 100000000-byte cap");
}
END_TEST

START_TEST(malformed_json)
{
    write_json("{\"x\": {\"dtype\": \"U8\", ", 0);
    expect_fail(MOED_E_FORMAT, "malformed JSON header");
}
END_TEST

START_TEST(trailing_junk)
{
    write_json("{}  x", 0);
    expect_fail(MOED_E_FORMAT, "malformed JSON header: trailing data at byte 4");
}
END_TEST

START_TEST(not_object)
{
    write_json("[1, 2]  ", 0);
    expect_fail(MOED_E_FORMAT, "not a JSON object");
}
END_TEST

START_TEST(unknown_dtype)
{
    write_json("{\"x\": {\"dtype\": \"F4X\", \"shape\": [2], \"data_offsets\": [0, 2]}}", 2);
    expect_fail(MOED_E_FORMAT, "tensor 'x': unknown dtype 'F4X'");
}
END_TEST

START_TEST(size_mismatch)
{
    write_json("{\"x\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 10]}}", 12);
    expect_fail(MOED_E_FORMAT,
                "tensor 'x': data_offsets [0, 10] give 10 bytes but F32 [3] needs 12");
}
END_TEST

START_TEST(size_mismatch_2d)
{
    write_json("{\"w\": {\"dtype\": \"BF16\", \"shape\": [2, 3], \"data_offsets\": [0, 6]}}", 12);
    expect_fail(MOED_E_FORMAT,
                "tensor 'w': data_offsets [0, 6] give 6 bytes but BF16 [2, 3] needs 12");
}
END_TEST

START_TEST(shape_overflow)
{
    write_json("{\"w\": {\"dtype\": \"U8\", \"shape\": [4294967296, 4294967296], "
               "\"data_offsets\": [0, 1]}}",
               1);
    expect_fail(MOED_E_FORMAT, "tensor 'w': shape [4294967296, 4294967296] overflows 64 bits");
}
END_TEST

START_TEST(shape_negative)
{
    write_json("{\"w\": {\"dtype\": \"U8\", \"shape\": [-1], \"data_offsets\": [0, 0]}}", 0);
    expect_fail(MOED_E_FORMAT, "tensor 'w': shape entry 0 is not a non-negative integer");
}
END_TEST

START_TEST(shape_fraction)
{
    write_json("{\"w\": {\"dtype\": \"U8\", \"shape\": [2, 1.5], \"data_offsets\": [0, 3]}}", 3);
    expect_fail(MOED_E_FORMAT, "tensor 'w': shape entry 1 is not a non-negative integer");
}
END_TEST

START_TEST(shape_too_big)
{
    write_json("{\"w\": {\"dtype\": \"U8\", \"shape\": [1e300], \"data_offsets\": [0, 3]}}", 3);
    expect_fail(MOED_E_FORMAT, "tensor 'w': shape entry 0 is not a non-negative integer <= 2^53");
}
END_TEST

START_TEST(too_many_dims)
{
    write_json("{\"w\": {\"dtype\": \"U8\", \"shape\": [1,1,1,1,1,1,1,1,1], "
               "\"data_offsets\": [0, 1]}}",
               1);
    expect_fail(MOED_E_FORMAT, "tensor 'w': shape has 9 dims (at most 8 allowed)");
}
END_TEST

START_TEST(begin_after_end)
{
    write_json("{\"w\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [4, 2]}}", 8);
    expect_fail(MOED_E_FORMAT, "tensor 'w': data_offsets [4, 2] end before begin");
}
END_TEST

START_TEST(bad_offsets_type)
{
    write_json("{\"w\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0]}}", 8);
    expect_fail(MOED_E_FORMAT, "tensor 'w': 'data_offsets' must be [begin, end]");
}
END_TEST

START_TEST(past_data_section)
{
    write_json("{\"a\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [0, 4]},"
               " \"b\": {\"dtype\": \"U16\", \"shape\": [4], \"data_offsets\": [4, 12]}}",
               10);
    expect_fail(MOED_E_FORMAT,
                "tensor 'b': data_offsets [4, 12] past the end of the 10-byte data section");
}
END_TEST

START_TEST(overlap)
{
    write_json("{\"a\": {\"dtype\": \"U8\", \"shape\": [8], \"data_offsets\": [0, 8]},"
               " \"b\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [12, 16]},"
               " \"c\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [6, 14]}}",
               16);
    expect_fail(MOED_E_FORMAT, "tensor 'c' [6, 14] overlaps tensor 'a' [0, 8]");
}
END_TEST

START_TEST(overlap_contained)
{
    /* 'b' lies inside 'a' and ends before it: the furthest end must be kept. */
    write_json("{\"a\": {\"dtype\": \"U8\", \"shape\": [16], \"data_offsets\": [0, 16]},"
               " \"b\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [2, 4]}}",
               16);
    expect_fail(MOED_E_FORMAT, "tensor 'b' [2, 4] overlaps tensor 'a' [0, 16]");
}
END_TEST

START_TEST(duplicate_name)
{
    write_json("{\"a\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0, 2]},"
               " \"a\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [2, 4]}}",
               4);
    expect_fail(MOED_E_FORMAT, "duplicate tensor name 'a'");
}
END_TEST

START_TEST(bad_metadata)
{
    write_json("{\"__metadata__\": {\"format\": \"pt\", \"n\": 3}}", 0);
    expect_fail(MOED_E_FORMAT, "'__metadata__' must be an object of strings (key 'n'");
}
END_TEST

START_TEST(metadata_not_object)
{
    write_json("{\"__metadata__\": \"pt\"}", 0);
    expect_fail(MOED_E_FORMAT, "'__metadata__' must be an object of strings");
}
END_TEST

START_TEST(entry_not_object)
{
    write_json("{\"w\": 3}", 0);
    expect_fail(MOED_E_FORMAT, "tensor 'w': entry is not an object");
}
END_TEST

START_TEST(missing_file)
{
    struct st_file *f;
    int rc = st_open("/nonexistent/moed/model.safetensors", &f, err, sizeof err);
    ck_assert_int_eq(rc, MOED_E_IO);
    ck_assert_ptr_nonnull(strstr(err, "/nonexistent/moed/model.safetensors: cannot open"));
}
END_TEST

/* Valid hand-written file: metadata, unpadded header, unaligned offsets,
 * zero-size and 0-dim tensors, data in a different order than the header. */
START_TEST(valid_handwritten)
{
    write_json("{\"__metadata__\": {\"format\": \"pt\"},"
               " \"s\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [3, 7]},"
               " \"z\": {\"dtype\": \"BF16\", \"shape\": [0, 5], \"data_offsets\": [3, 3]},"
               " \"a\": {\"dtype\": \"U8\", \"shape\": [3], \"data_offsets\": [0, 3]}}",
               7);
    struct st_file *f;
    int rc = st_open(fpath, &f, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(st_count(f), 3);
    ck_assert_uint_eq(st_data_bytes(f), 7);
    ck_assert_str_eq(st_path(f), fpath);
    const struct st_tensor *s = st_find(f, "s"), *z = st_find(f, "z"), *a = st_find(f, "a");
    ck_assert_ptr_nonnull(s);
    ck_assert_ptr_nonnull(z);
    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_null(st_find(f, "__metadata__"));
    ck_assert_ptr_null(st_find(f, "b"));
    ck_assert_ptr_eq(st_at(f, 0), s); /* file order */
    ck_assert_ptr_eq(st_at(f, 2), a);
    ck_assert_ptr_null(st_at(f, 3));
    ck_assert_int_eq(s->dtype, ST_F32);
    ck_assert_uint_eq(s->ndim, 0);
    ck_assert_uint_eq(s->nbytes, 4);
    ck_assert_uint_eq(z->ndim, 2);
    ck_assert_uint_eq(z->shape[1], 5);
    ck_assert_uint_eq(z->nbytes, 0);
    const uint8_t *sd = s->data, *ad = a->data;
    ck_assert_uint_eq(ad[0], 0);
    ck_assert_uint_eq(ad[2], 2);
    ck_assert_uint_eq(sd[0], 3); /* write_st fills data with its offsets */
    ck_assert_uint_eq(sd[3], 6);
    st_close(f);
}
END_TEST

/* st_open_mem (the fuzz target's entry point) makes the same checks on an
 * image in memory: the same tensors with data pointing into the buffer, the
 * same errors naming the given name, nothing read past `len`. */
START_TEST(open_mem)
{
    static const char hdr[] =
        "{\"s\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [3, 7]},"
        " \"a\": {\"dtype\": \"U8\", \"shape\": [3], \"data_offsets\": [0, 3]}}";
    size_t hl = strlen(hdr), total = 8 + hl + 7;
    uint8_t *buf = malloc(total);
    ck_assert_ptr_nonnull(buf);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, hdr, hl);
    for (size_t i = 0; i < 7; i++)
        buf[8 + hl + i] = (uint8_t)(10 + i);
    struct st_file *f;
    ck_assert_msg(st_open_mem("mem.safetensors", buf, total, &f, err, sizeof err) == 0, "%s",
                  err);
    ck_assert_uint_eq(st_count(f), 2);
    ck_assert_uint_eq(st_data_bytes(f), 7);
    ck_assert_str_eq(st_path(f), "mem.safetensors");
    const struct st_tensor *a = st_find(f, "a"), *sc = st_find(f, "s");
    ck_assert_ptr_eq(a->data, buf + 8 + hl);
    ck_assert_ptr_eq(sc->data, buf + 8 + hl + 3);
    st_close(f);
    /* one byte short: the scalar runs past the data section */
    f = (struct st_file *)0x1;
    ck_assert_int_eq(st_open_mem("mem.safetensors", buf, total - 1, &f, err, sizeof err),
                     MOED_E_FORMAT);
    ck_assert_ptr_null(f);
    ck_assert_str_eq(err, "mem.safetensors: tensor 's': data_offsets [3, 7] past the end of the "
                          "6-byte data section");
    /* the header cut: malformed JSON, never read beyond */
    ck_assert_int_eq(st_open_mem("mem.safetensors", buf, 8 + hl - 1, &f, err, sizeof err),
                     MOED_E_FORMAT);
    ck_assert_msg(strstr(err, "mem.safetensors: truncated: header length") == err, "%s", err);
    ck_assert_int_eq(st_open_mem("mem.safetensors", buf, 7, &f, err, sizeof err),
                     MOED_E_FORMAT);
    ck_assert_str_eq(err, "mem.safetensors: truncated: 7 bytes, need at least 8 for the header "
                          "length");
    free(buf);
}
END_TEST

START_TEST(dtype_table)
{
    ck_assert_int_eq(st_dtype_parse("F8_E4M3"), ST_F8_E4M3);
    ck_assert_int_eq(st_dtype_parse("U8"), ST_U8);
    ck_assert_int_eq(st_dtype_parse("f32"), -1);
    ck_assert_int_eq(st_dtype_parse(NULL), -1);
    for (int i = 0; i < ST_DTYPE_COUNT; i++)
        ck_assert_int_eq(st_dtype_parse(st_dtype_name((enum st_dtype)i)), i);
    ck_assert_uint_eq(st_dtype_size(ST_BF16), 2);
    ck_assert_uint_eq(st_dtype_size(ST_F64), 8);
    ck_assert_uint_eq(st_dtype_size(ST_F8_E5M2), 1);
}
END_TEST

/* Writer -> reader: names, dtypes, shapes and bytes come back. */
START_TEST(round_trip)
{
    enum { NT = 5 };
    static const char *names[NT] = {"model.layers.0.mlp.experts.0.gate_proj.weight",
                                    "model.layers.0.mlp.experts.0.gate_proj.weight_scale",
                                    "model.layers.0.mlp.experts.0.gate_proj.weight_scale_2",
                                    "empty", "b"};
    enum st_dtype dt[NT] = {ST_U8, ST_F8_E4M3, ST_F32, ST_BF16, ST_I64};
    uint32_t nd[NT] = {2, 2, 0, 1, 3};
    uint64_t shapes[NT][3] = {{64, 32}, {64, 4}, {0}, {0}, {2, 3, 5}};
    uint8_t *bufs[NT];
    uint64_t nb[NT];
    struct st_writer *w;
    srand(7);
    ck_assert_int_eq(st_writer_new(&w), 0);
    for (int i = 0; i < NT; i++) {
        nb[i] = st_dtype_size(dt[i]);
        for (uint32_t d = 0; d < nd[i]; d++)
            nb[i] *= shapes[i][d];
        bufs[i] = malloc(nb[i] ? nb[i] : 1);
        for (uint64_t j = 0; j < nb[i]; j++)
            bufs[i][j] = (uint8_t)rand();
        ck_assert_int_eq(st_writer_add(w, names[i], dt[i], nd[i], shapes[i], bufs[i], nb[i]), 0);
    }
    /* A byte count that disagrees with the shape is refused at add time. */
    ck_assert_int_eq(st_writer_add(w, "bad", ST_F32, 1, shapes[0], bufs[0], 3), MOED_E_INVAL);
    ck_assert_int_eq(st_writer_write(w, fpath, err, sizeof err), 0);
    st_writer_free(w);
    ck_assert_int_eq(access(fpath, F_OK), 0);

    /* Header is padded to 8 with spaces; keys in insertion order. */
    FILE *fp = fopen(fpath, "rb");
    uint8_t len8[8];
    ck_assert_uint_eq(fread(len8, 1, 8, fp), 8);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | len8[i];
    ck_assert_uint_eq(hlen % 8, 0);
    char *hdr = calloc(1, hlen + 1);
    ck_assert_uint_eq(fread(hdr, 1, hlen, fp), hlen);
    fclose(fp);
    const char *p0 = strstr(hdr, names[0]), *p1 = strstr(hdr, names[1]);
    const char *pe = strstr(hdr, "\"empty\""), *pb = strstr(hdr, "\"b\"");
    ck_assert(p0 && p1 && pe && pb);
    ck_assert(p0 < p1 && p1 < pe && pe < pb);
    ck_assert_uint_eq(hdr[hlen - 1] == ' ' || hdr[hlen - 1] == '}', 1);
    free(hdr);

    struct st_file *f;
    int rc = st_open(fpath, &f, err, sizeof err);
    ck_assert_msg(rc == 0, "%s", err);
    ck_assert_uint_eq(st_count(f), NT);
    for (int i = 0; i < NT; i++) {
        const struct st_tensor *t = st_at(f, (size_t)i);
        ck_assert_str_eq(t->name, names[i]);
        ck_assert_ptr_eq(st_find(f, names[i]), t);
        ck_assert_int_eq(t->dtype, dt[i]);
        ck_assert_uint_eq(t->ndim, nd[i]);
        for (uint32_t d = 0; d < nd[i]; d++)
            ck_assert_uint_eq(t->shape[d], shapes[i][d]);
        ck_assert_uint_eq(t->nbytes, nb[i]);
        if (nb[i])
            ck_assert_int_eq(memcmp(t->data, bufs[i], nb[i]), 0);
        free(bufs[i]);
    }
    st_close(f);
}
END_TEST

START_TEST(writer_duplicate)
{
    struct st_writer *w;
    uint8_t b[2] = {1, 2};
    uint64_t sh[1] = {2};
    ck_assert_int_eq(st_writer_new(&w), 0);
    ck_assert_int_eq(st_writer_add(w, "a", ST_U8, 1, sh, b, 2), 0);
    ck_assert_int_eq(st_writer_add(w, "a", ST_U8, 1, sh, b, 2), 0);
    ck_assert_int_eq(st_writer_write(w, fpath, err, sizeof err), MOED_E_INVAL);
    ck_assert_ptr_nonnull(strstr(err, "duplicate tensor name 'a'"));
    ck_assert_int_eq(access(fpath, F_OK), -1);
    st_writer_free(w);
}
END_TEST

START_TEST(writer_empty)
{
    struct st_writer *w;
    struct st_file *f;
    ck_assert_int_eq(st_writer_new(&w), 0);
    ck_assert_int_eq(st_writer_write(w, fpath, err, sizeof err), 0);
    st_writer_free(w);
    ck_assert_int_eq(st_open(fpath, &f, err, sizeof err), 0);
    ck_assert_uint_eq(st_count(f), 0);
    ck_assert_uint_eq(st_data_bytes(f), 0);
    st_close(f);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("safetensors");
    TCase *bad = tcase_create("bad_input");
    TCase *good = tcase_create("valid");
    tcase_add_checked_fixture(bad, setup, teardown);
    tcase_add_checked_fixture(good, setup, teardown);
    tcase_add_test(bad, empty_file);
    tcase_add_test(bad, short_file);
    tcase_add_test(bad, header_past_end);
    tcase_add_test(bad, header_over_cap);
    tcase_add_test(bad, header_huge_length);
    tcase_add_test(bad, malformed_json);
    tcase_add_test(bad, trailing_junk);
    tcase_add_test(bad, not_object);
    tcase_add_test(bad, unknown_dtype);
    tcase_add_test(bad, size_mismatch);
    tcase_add_test(bad, size_mismatch_2d);
    tcase_add_test(bad, shape_overflow);
    tcase_add_test(bad, shape_negative);
    tcase_add_test(bad, shape_fraction);
    tcase_add_test(bad, shape_too_big);
    tcase_add_test(bad, too_many_dims);
    tcase_add_test(bad, begin_after_end);
    tcase_add_test(bad, bad_offsets_type);
    tcase_add_test(bad, past_data_section);
    tcase_add_test(bad, overlap);
    tcase_add_test(bad, overlap_contained);
    tcase_add_test(bad, duplicate_name);
    tcase_add_test(bad, bad_metadata);
    tcase_add_test(bad, metadata_not_object);
    tcase_add_test(bad, entry_not_object);
    tcase_add_test(bad, missing_file);
    tcase_add_test(good, valid_handwritten);
    tcase_add_test(good, dtype_table);
    tcase_add_test(good, open_mem);
    tcase_add_test(good, round_trip);
    tcase_add_test(good, writer_duplicate);
    tcase_add_test(good, writer_empty);
    suite_add_tcase(s, bad);
    suite_add_tcase(s, good);
    return moed_check_run(s);
}
