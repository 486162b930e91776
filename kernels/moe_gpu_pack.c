/* moe_gpu_pack.c - repack NVFP4 expert weights into the GPU kernel's stream
 * order (host side, plain C; see the layout comment in moe_gpu.cu), and the
 * host half of the layout check (moe_gpu_abi_check).
 *
 * Nothing is re-quantized: every E2M1 nibble of the checkpoint lands somewhere
 * in the output, and every E4M3 block scale is re-encoded exactly
 * (moe_gpu_scale_byte in moe_gpu.h: its sign moves onto the block's codes);
 * weight_scale_2 stays a per-matrix float applied by the kernel's epilogue
 * (gate and up each with their own). So the GPU sees exactly the values the
 * CPU reference (moe_ref.c) sees.
 */
#include <string.h>

#include "moe_gpu.h"
#include "moed_err.h"

int moe_gpu_check_dims(const struct moe_gpu_dims *d, char *err, size_t errlen)
{
    if (d->hidden == 0 || d->hidden % 64 != 0)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "cuda backend: hidden_size %u must be a positive multiple of 64 "
                           "(the kernel's weight tiles stream K in units of 64 weights: 4 "
                           "scale blocks)",
                           d->hidden);
    if (d->inter == 0 || d->inter % 64 != 0)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "cuda backend: moe_intermediate_size %u must be a positive multiple "
                           "of 64 (the kernel's weight tiles stream K in units of 64 weights: 4 "
                           "scale blocks)",
                           d->inter);
    if (d->n_experts == 0 || d->n_experts + d->n_shared > 1024 || d->top_k == 0 ||
        d->top_k > d->n_experts)
        return moed_seterr(err, errlen, MOED_E_MODEL,
                           "cuda backend: experts %u + shared %u (max 1024 total), top_k %u "
                           "not supported", d->n_experts, d->n_shared, d->top_k);
    if (d->max_tokens == 0 || (uint64_t)d->max_tokens * (d->top_k + d->n_shared) > 65535)
        return moed_seterr(err, errlen, MOED_E_CONFIG,
                           "cuda backend: max_tokens %u * (top_k %u + shared %u) must be in "
                           "[1, 65535]", d->max_tokens, d->top_k, d->n_shared);
    return 0;
}

int moe_gpu_abi_check(uint64_t kernel_fp, char *err, size_t errlen)
{
    const uint64_t host_fp = moe_gpu_abi_fingerprint();
    if (kernel_fp == host_fp)
        return 0;
    return moed_seterr(err, errlen, MOED_E_BACKEND,
                       "cuda backend: the kernel module was built with another host-device "
                       "layout (fingerprint 0x%016llx, the host's 0x%016llx): "
                       "kernels/moe_gpu_abi.h differs between the nvcc and gcc builds; rebuild "
                       "both from one tree", (unsigned long long)kernel_fp,
                       (unsigned long long)host_fp);
}

static inline uint32_t nib(const struct nvfp4_mat *m, uint32_t row, uint32_t k)
{
    uint8_t b = m->w[(uint64_t)row * (m->k / 2) + k / 2];
    return (k & 1) ? (uint32_t)(b >> 4) : (uint32_t)(b & 15); /* low nibble = even k */
}

static inline uint8_t sc(const struct nvfp4_mat *m, uint32_t row, uint32_t k)
{
    return m->scale[(uint64_t)row * (m->k / NVFP4_GROUP) + k / NVFP4_GROUP];
}

/* One 16-row x 64-K sub-tile. Rows 0-7 come from (m_lo, r_lo + 0..7), rows
 * 8-15 from (m_hi, r_hi + 0..7). Lane l = 4g + q holds rows g and g+8 and
 * physical k in [16q, 16q+16) of the unit: for mma step s its A fragment
 * slots (2q, 2q+1 | 2q+8, 2q+9) carry k = 16q+4s+(0,1 | 2,3), matching the
 * B fragment the kernel builds from 32 contiguous bytes of x. Word s of the
 * lane holds pair p = 0 (row g k+0/1), 1 (row g+8 k+0/1), 2 (row g k+2/3),
 * 3 (row g+8 k+2/3), its codes' bits where moe_gpu_code_put puts them
 * (moe_gpu.h: chosen so the kernel's dequant is 2-3 ops per pair). */
/* dep[p][h][c]: code c of (p, h) in an empty word, moe_gpu_code_put's bits
 * tabulated once per expert. moe_gpu_code_bit costs ~15 ops per bit when p
 * is not a constant; calling moe_gpu_code_put per code made the packer 2.9x
 * slower (89.8 -> 258.6 ms per DeepSeek-V3 expert); with the table: 53.5. */
typedef uint32_t code_deposit[4][2][16];

static void code_deposit_init(code_deposit dep)
{
    for (unsigned p = 0; p < 4; p++)
        for (unsigned h = 0; h < 2; h++)
            for (uint32_t c = 0; c < 16; c++)
                dep[p][h][c] = moe_gpu_code_put(0, p, h, c);
}

static void pack_sub(const code_deposit dep, const struct nvfp4_mat *m_lo, uint32_t r_lo,
                     const struct nvfp4_mat *m_hi, uint32_t r_hi, uint32_t k0, uint8_t *out)
{
    for (uint32_t l = 0; l < 32; l++) {
        uint32_t g = l / 4, q = l % 4;
        int sn_lo, sn_hi; /* the lane's two blocks: row g and g+8, k [16q, 16q+16) */
        out[512 + l * 2 + 0] = moe_gpu_scale_byte(sc(m_lo, r_lo + g, k0 + 16 * q), &sn_lo);
        out[512 + l * 2 + 1] = moe_gpu_scale_byte(sc(m_hi, r_hi + g, k0 + 16 * q), &sn_hi);
        for (uint32_t s = 0; s < 4; s++) {
            uint32_t kb = k0 + 16 * q + 4 * s;
            uint32_t lo[4], hi[4];
            lo[0] = nib(m_lo, r_lo + g, kb + 0);
            hi[0] = nib(m_lo, r_lo + g, kb + 1);
            lo[1] = nib(m_hi, r_hi + g, kb + 0);
            hi[1] = nib(m_hi, r_hi + g, kb + 1);
            lo[2] = nib(m_lo, r_lo + g, kb + 2);
            hi[2] = nib(m_lo, r_lo + g, kb + 3);
            lo[3] = nib(m_hi, r_hi + g, kb + 2);
            hi[3] = nib(m_hi, r_hi + g, kb + 3);
            uint32_t word = 0;
            for (unsigned p = 0; p < 4; p++) {
                /* pairs 0, 2: row g; 1, 3: row g+8 (its block's scale sign) */
                const int sn = (p & 1) ? sn_hi : sn_lo;
                const uint32_t a = sn == 0 ? 0 : sn < 0 ? lo[p] ^ 8u : lo[p];
                const uint32_t b = sn == 0 ? 0 : sn < 0 ? hi[p] ^ 8u : hi[p];
                word |= dep[p][0][a] | dep[p][1][b];
            }
            uint8_t *o = out + l * 16 + s * 4; /* little-endian word */
            o[0] = (uint8_t)word;
            o[1] = (uint8_t)(word >> 8);
            o[2] = (uint8_t)(word >> 16);
            o[3] = (uint8_t)(word >> 24);
        }
    }
}

void moe_gpu_repack_expert(const struct moe_expert *ex, uint32_t hidden, uint32_t inter,
                           uint8_t *gu, uint8_t *dn)
{
    const uint32_t MR = MOE_GPU_MR;
    code_deposit dep;
    code_deposit_init(dep);
    /* gate_up: K = H; sub-tile st covers intermediate rows i0 = 8 st .. +8,
     * gate in rows 0-7, up in rows 8-15. */
    uint32_t units = hidden / MOE_GPU_UNIT_K;
    uint32_t n_sub = 2 * inter / 16;
    for (uint32_t st = 0; st < n_sub; st++) {
        uint32_t tile = st / MR, m = st % MR;
        for (uint32_t u = 0; u < units; u++) {
            uint8_t *o = gu + (((uint64_t)tile * units + u) * MR + m) * MOE_GPU_SUB_BYTES;
            pack_sub(dep, &ex->gate, 8 * st, &ex->up, 8 * st, u * MOE_GPU_UNIT_K, o);
        }
    }
    /* down: K = I; sub-tile st covers output rows 16 st .. +16 */
    units = inter / MOE_GPU_UNIT_K;
    n_sub = hidden / 16;
    for (uint32_t st = 0; st < n_sub; st++) {
        uint32_t tile = st / MR, m = st % MR;
        for (uint32_t u = 0; u < units; u++) {
            uint8_t *o = dn + (((uint64_t)tile * units + u) * MR + m) * MOE_GPU_SUB_BYTES;
            pack_sub(dep, &ex->down, 16 * st, &ex->down, 16 * st + 8, u * MOE_GPU_UNIT_K, o);
        }
    }
}
