/* safetensors.h - read-only, validating safetensors reader (mmap).
 *
 * File layout: u64 little-endian header length N, N bytes of JSON header
 * {"name": {"dtype": "U8", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {...}}, then the data section. Offsets are relative to the
 * start of the data section and carry no alignment promise.
 *
 * Every check named here returns MOED_E_FORMAT with a message naming the file
 * and tensor: header length past the end of the file or over
 * ST_MAX_HEADER_BYTES, malformed JSON, unknown dtype, shape/dtype/offset byte
 * count mismatch, offsets outside the data section, overlapping tensors,
 * duplicate tensor names. Sizes are computed with overflow-checked u64 math.
 */
#ifndef MOED_SAFETENSORS_H
#define MOED_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define ST_MAX_HEADER_BYTES (100u * 1000u * 1000u) /* 100 MB header cap */
#define ST_MAX_DIMS 8

enum st_dtype {
    ST_BOOL, ST_U8, ST_I8, ST_F8_E4M3, ST_F8_E5M2, ST_I16, ST_U16, ST_F16, ST_BF16,
    ST_I32, ST_U32, ST_F32, ST_I64, ST_U64, ST_F64, ST_DTYPE_COUNT
};

struct st_tensor {
    const char *name;      /* owned by the st_file */
    enum st_dtype dtype;
    uint32_t ndim;
    uint64_t shape[ST_MAX_DIMS];
    uint64_t nbytes;
    const void *data;      /* inside the mmap; valid until st_close */
};

struct st_file; /* opaque */

/* Open and validate. On error returns a negative code and writes a message. */
int st_open(const char *path, struct st_file **out, char *err, size_t errlen);
/* The same checks on a file image in memory, buf[0..len) (borrowed: tensor
 * data points into it, so it must outlive the st_file); `name` stands for the
 * path in messages. For tests and the fuzz target. */
int st_open_mem(const char *name, const void *buf, size_t len, struct st_file **out, char *err,
                size_t errlen);
void st_close(struct st_file *f);

size_t st_count(const struct st_file *f);
const struct st_tensor *st_at(const struct st_file *f, size_t i);
/* NULL if absent. */
const struct st_tensor *st_find(const struct st_file *f, const char *name);
const char *st_path(const struct st_file *f);
/* Header-only: bytes of the data section (what reading all tensors costs). */
uint64_t st_data_bytes(const struct st_file *f);

const char *st_dtype_name(enum st_dtype t);
/* Returns -1 for an unknown name. */
int st_dtype_parse(const char *name);
size_t st_dtype_size(enum st_dtype t);

/* --- writer (used by the checkpoint generator and tests) --- */
struct st_writer; /* opaque; collects tensors then writes one file */
int st_writer_new(struct st_writer **out);
/* Copies `name`; `data` is borrowed until st_writer_write returns. */
int st_writer_add(struct st_writer *w, const char *name, enum st_dtype dtype, uint32_t ndim,
                  const uint64_t *shape, const void *data, uint64_t nbytes);
int st_writer_write(struct st_writer *w, const char *path, char *err, size_t errlen);
void st_writer_free(struct st_writer *w);

#endif
