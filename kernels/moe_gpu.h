/* moe_gpu.h - the persistent fused NVFP4 MoE kernel: code layout, repack, launch.
 *
 * C interface between the host backend (engine/backend_cuda.c) and the CUDA
 * code (kernels/moe_gpu.cu; the host-device contract itself, layouts checked
 * on both sides, is kernels/moe_gpu_abi.h), plus the host-side weight repacker
 * (kernels/moe_gpu_pack.c, plain C, built in every configuration so that it
 * can be unit-tested without a GPU).
 *
 * Weight stream layout ("tiles"): see the block comment in moe_gpu.cu. In
 * short, every matrix is cut into warp tiles of MOE_GPU_MR * 16 rows; a tile
 * is a contiguous run of K/64 "units", each unit MOE_GPU_MR sub-tiles of 576
 * bytes (512 bytes of E2M1 codes in mma fragment order, then 64 bytes of block
 * scales, re-encoded below), so a warp streams one tile with 16-byte loads from start to
 * end. gate and up rows are interleaved 8 + 8 per 16-row sub-tile so the
 * SiLU(gate)*up product is formed in registers.
 *
 * Queue: a ring of MOE_GPU_RING batch descriptors in pinned, device-mapped
 * host memory (struct moe_gpu_ctrl). Host writes descriptors and `head`;
 * the kernel writes `done_seq`, `heartbeat` and `exited`. One writer per word.
 */
#ifndef MOE_GPU_H
#define MOE_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "moe_gpu_abi.h"
#include "moe_ref.h"

/* Code word layout. Lane l = 4g + q of a sub-tile owns four 32-bit words (one
 * per mma step s); word s holds 8 E2M1 codes as 4 pairs: pair p = 0 (row g,
 * k 16q+4s+0/1), 1 (row g+8, same k), 2 (row g, k +2/3), 3 (row g+8, k +2/3);
 * element h = 0 the lower k, 1 the upper. Code bit i of (p, h) (i = 0 m, 1
 * e0, 2 e1, 3 the sign) is word bit moe_gpu_code_bit(p, h, i), placed so that
 * the kernel turns pair p into the bf16x2 bits of (value * 2^-126) (the
 * magnitude to bits 6-8 / 22-24, the sign to bit 15 / 31) with 2 or 3 integer
 * ops, 10 per word:
 *   p0: (w << 6) & M                  p1: rotl(w, 12) & M
 *   p2: prmt(w, w << 2, 0x5614) & M   p3: prmt(w, w << 1, 0x5732) & M
 * with M = 0x81c081c0 and prmt the byte permute (result byte j = byte number
 * nibble j of the selector, 0-3 w's bytes, 4-7 the shifted word's). The 32
 * bits of the word are each used once (bench/NOTES.md stop 42,
 * bench/probe/decode_search.py). */
MOE_GPU_HD static inline unsigned moe_gpu_code_bit(unsigned p, unsigned h, unsigned i)
{
    const unsigned o = 16u * h + (i < 3u ? 6u + i : 15u); /* its bit in the bf16x2 */
    if (p == 0)
        return o - 6u;
    if (p == 1)
        return (o + 20u) & 31u;
    const unsigned sel = ((p == 2 ? 0x5614u : 0x5732u) >> (4u * (o >> 3))) & 7u;
    return sel < 4u ? 8u * sel + (o & 7u) : 8u * (sel - 4u) + (o & 7u) - (p == 2 ? 2u : 1u);
}
/* the 4-bit E2M1 code of (p, h) in word w */
MOE_GPU_HD static inline uint32_t moe_gpu_code_get(uint32_t w, unsigned p, unsigned h)
{
    uint32_t c = 0;
    for (unsigned i = 0; i < 4; i++)
        c |= ((w >> moe_gpu_code_bit(p, h, i)) & 1u) << i;
    return c;
}
/* word w with the code of (p, h) set to c (its bits must be clear) */
MOE_GPU_HD static inline uint32_t moe_gpu_code_put(uint32_t w, unsigned p, unsigned h, uint32_t c)
{
    for (unsigned i = 0; i < 4; i++)
        w |= ((c >> i) & 1u) << moe_gpu_code_bit(p, h, i);
    return w;
}

/* Block scale byte layout. The checkpoint's E4M3 block scale is stored as
 * one byte b chosen so that the bf16 bits of |scale| * 2^118 are
 * MOE_GPU_SCALE_BIAS + (b << 4): b = (bf16 exponent - 224) << 3 | 3-bit
 * mantissa. Every E4M3 value fits exactly (normals: b = (e + 14) << 3 | m;
 * subnormals are normalized; NaN -> 0xff, whose bf16 is a NaN), so the kernel
 * turns two scale bytes into two bf16x2 broadcasts with a byte permute and a
 * multiply-add each (bench/NOTES.md v16). The sign is not stored: the packer
 * flips the signs of the block's 16 codes for a negative scale, and clears
 * them for a zero scale (value 0 either way), so every product is exactly the
 * checkpoint's code * scale. */
/* E4M3 byte -> stream scale byte; *sign = 1, -1 (flip the block's code
 * signs) or 0 (clear the block's codes: the scale is +-0) */
MOE_GPU_HD static inline uint8_t moe_gpu_scale_byte(uint8_t e4m3, int *sign)
{
    const unsigned e = (e4m3 >> 3) & 15u, m = e4m3 & 7u;
    *sign = (e4m3 & 0x80u) ? -1 : 1;
    if (e == 15 && m == 7)
        return 0xff; /* NaN */
    if (e > 0)
        return (uint8_t)(((e + 14u) << 3) | m);
    if (m == 0) {
        *sign = 0;
        return 0;
    }
    const unsigned n = m >= 4 ? 2u : m >= 2 ? 1u : 0u; /* m * 2^-9 = 2^(n-9) * 1.f */
    return (uint8_t)(((n + 12u) << 3) | ((m << (3 - n)) & 7u));
}
/* the scale a stream byte stands for (|E4M3 value|; NaN for 0xff) */
MOE_GPU_HD static inline float moe_gpu_scale_value(uint8_t b)
{
    union {
        uint32_t u;
        float f;
    } v = {(MOE_GPU_SCALE_BIAS + ((uint32_t)b << 4)) << 16};
    return v.f * 0x1p-118f; /* exact */
}

struct moe_gpu_launch {
    int grid, block, smem_bytes, ctas_per_sm, sms;
};

/* ---- host repack (kernels/moe_gpu_pack.c) ---- */

/* 0, or MOED_E_MODEL with a message if H/I do not fit the tiling. */
int moe_gpu_check_dims(const struct moe_gpu_dims *d, char *err, size_t errlen);
/* 0 if `kernel_fp` (moe_gpu_kernel_abi: the layout fingerprint the kernel
 * module was compiled with) equals the host's
 * moe_gpu_abi_fingerprint(); else MOED_E_BACKEND with a message naming both. */
int moe_gpu_abi_check(uint64_t kernel_fp, char *err, size_t errlen);
/* Repack one expert into gu[moe_gpu_gu_bytes] and dn[moe_gpu_dn_bytes]
 * (caller owns both). Nibble values and scale bytes are copied unchanged; only
 * their order changes. */
void moe_gpu_repack_expert(const struct moe_expert *ex, uint32_t hidden, uint32_t inter,
                           uint8_t *gu, uint8_t *dn);

/* ---- device side (kernels/moe_gpu.cu): 0 or a MOED_E_* code (MOED_E_BACKEND
 * for a CUDA error) with the failing call, file and line in err ---- */

/* Bytes of the device counter block for these dims. */
size_t moe_gpu_state_bytes(const struct moe_gpu_dims *d);
/* Dynamic shared memory: routing tables + per-warp stages. */
uint32_t moe_gpu_smem_route_bytes(const struct moe_gpu_dims *d);
/* Device memory for the routing of one CTA (the grid: this many each). */
uint32_t moe_gpu_route_gmem_bytes(const struct moe_gpu_dims *d);
/* Total dynamic shared memory per CTA (routing + stages). */
uint32_t moe_gpu_smem_bytes(const struct moe_gpu_dims *d);
/* The layout fingerprint the kernel module (kernels/moe_gpu.cu, nvcc) was
 * compiled with: moe_gpu_abi_fingerprint() of its translation unit. */
uint64_t moe_gpu_kernel_abi(void);
/* The doorbell client kernel's fatbin (kernels/chan_client/moe_chan_client.cu,
 * embedded by kernels/moe_chan_fatbin_cuda.c): [begin, end). CUDA builds. */
extern const unsigned char moe_chan_client_fatbin[];
extern const unsigned char moe_chan_client_fatbin_end[];

/* Grid from the occupancy API on `device`, leaving sms_free SMs idle. */
int moe_gpu_plan(int device, const struct moe_gpu_dims *d, int sms_free,
                 struct moe_gpu_launch *out, char *err, size_t errlen);
/* Launch the persistent kernel on `stream` (a cudaStream_t). */
int moe_gpu_start(const struct moe_gpu_params *p, const struct moe_gpu_launch *l, void *stream,
                  char *err, size_t errlen);
/* Expert parallelism across ranks (engine/nccl_group.h): copy rows
 * entries[0..n) (device memory) of src into dst, `hidden` floats each
 * (hidden % 4 == 0), on `stream` (a cudaStream_t). */
int moe_gpu_rows_merge(float *dst, const float *src, const uint32_t *entries, uint32_t n,
                       uint32_t hidden, void *stream, char *err, size_t errlen);
/* Fill a weight stream (bytes % 576 == 0) with random valid NVFP4 (benchmark). */
int moe_gpu_fill_random(void *buf, uint64_t bytes, uint64_t seed, char *err, size_t errlen);
/* The doorbell take's %globaltimer stamps per channel slot (bell seen, slot
 * and table entry loaded, descriptor checked, ids and w staged) of a kernel
 * built with MOE_GPU_TAKE_STAMPS=1 (bench/NOTES.md); MOED_E_UNSUPPORTED
 * otherwise. */
int moe_gpu_take_stamps(uint64_t (*out)[4], char *err, size_t errlen);
/* The task log of a kernel built with MOE_GPU_TASK_LOG=1 (bench/NOTES.md;
 * scripts/tasklog.py reads it): each CTA's timeline of the last batch it ran.
 * hdr[MOE_GPU_TLOG_CTAS][8] per CTA: %globaltimer at go, clock64 at go, clock64
 * routed, clock64 at the task loop's end, %globaltimer there, entries, clock64
 * once its slice of x is staged, the batch's seq. ents[MOE_GPU_TLOG_CTAS][MOE_GPU_TLOG_N][8]
 * per task, clock64: claim seen, decoded, ready (the last task's tiles
 * released, then x staged / the expert's gate_up tiles done / every down
 * tile done), every warp's K loop done,
 * reduced, epilogue done (warp 0), end; then kind (0 gate_up, 1 down, 2
 * combine) | ntiles << 4 | cnt << 8 | task << 32 (a combine task: decoded =
 * claim seen, the K loop to the epilogue 0). CTAs past MOE_GPU_TLOG_CTAS and
 * tasks past MOE_GPU_TLOG_N are not logged. MOED_E_UNSUPPORTED without the
 * switch. */
#define MOE_GPU_TLOG_CTAS 1024
#define MOE_GPU_TLOG_N 256
int moe_gpu_task_log(uint64_t *hdr, uint64_t *ents, char *err, size_t errlen);
/* Streaming-read bandwidth probe for the benchmark: reads `bytes` from buf
 * `reps` times; returns elapsed ms through *ms. */
int moe_gpu_read_bw(const void *buf, uint64_t bytes, int reps, float *ms, char *err,
                    size_t errlen);

#endif
