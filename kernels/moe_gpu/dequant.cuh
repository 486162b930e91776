/* dequant.cuh - NVFP4 in registers: E2M1 code pairs and E4M3 block scales
 * (stream encodings: moe_gpu.h) to bf16x2, and the MMAs of one weight unit.
 * Part of the one translation unit moe_gpu.cu. */

/* bf16x2 a*b exactly (products here are exact), as fma with -0 so a zero stays +0. */
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b)
{
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

/* Pair P of code word w (layout: moe_gpu.h) -> bf16x2 bits of value * 2^-126:
 * the sign lands on bit 15/31 and the magnitude (e1 e0 m) on bits 6-8/22-24,
 * where the bf16 low exponent bits and top mantissa bit give E2M1's meaning
 * exactly (its subnormal 0.5 lands on the bf16 subnormal with the same
 * scale). 2 (P = 0, 1) or 3 (P = 2, 3) integer ops, 10 per word: the left
 * shifts may issue on the FMA pipe (IMAD.SHL), off the integer ALU pipe, the
 * busiest (bench/NOTES.md v12); the rotations-only layout before it took 11
 * (bench/NOTES.md stop 42). */
template <int P> __device__ __forceinline__ uint32_t e2m1x2_bits(uint32_t w)
{
    constexpr uint32_t M = 0x81c081c0u;
    if (P == 0)
        return (w << 6) & M;
    if (P == 1)
        return __funnelshift_l(w, w, 12) & M;
    if (P == 2)
        return __byte_perm(w, w << 2, 0x5614) & M;
    return __byte_perm(w, w << 1, 0x5732) & M;
}

/* Two stream scale bytes (low byte row g, high byte row g+8; moe_gpu.h) ->
 * bf16x2 broadcasts of scale * 2^118: a byte permute and a multiply-add each
 * (the E4M3 -> f16 -> f32 -> bf16 path it replaces took ~7 instructions). */
__device__ __forceinline__ void scales_to_bf16(uint32_t s2, uint32_t &sg, uint32_t &sg8)
{
    constexpr uint32_t B = MOE_GPU_SCALE_BIAS * 0x10001u;
    sg = __byte_perm(s2, 0, 0x4040) * 16u + B;
    sg8 = __byte_perm(s2, 0, 0x4141) * 16u + B;
}

/* The MMAs of one weight unit (MR sub-tiles in shared memory at wunit)
 * against the B fragments xb, accumulated into c: dequant in registers
 * (moe_gpu.h: code word layout, scale bytes), one bf16 mma per 16 K. */
template <int NT>
__device__ __forceinline__ void unit_mma(const uint8_t *wunit, const uint4 (&xb)[NT][2],
                                         float (&cur)[MR][NT][4])
{
    const unsigned lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < MR; m++) {
        const uint8_t *sub = wunit + m * MOE_GPU_SUB_BYTES;
        uint4 wq = *reinterpret_cast<const uint4 *>(sub + lane * 16);
        uint32_t s2 = *reinterpret_cast<const uint16_t *>(sub + 512 + lane * 2);
        uint32_t sg, sg8;
        scales_to_bf16(s2, sg, sg8);
        uint32_t words[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
        for (int s = 0; s < 4; s++) {
            uint32_t a[4];
            a[0] = bf16x2_mul(e2m1x2_bits<0>(words[s]), sg);
            a[1] = bf16x2_mul(e2m1x2_bits<1>(words[s]), sg8);
            a[2] = bf16x2_mul(e2m1x2_bits<2>(words[s]), sg);
            a[3] = bf16x2_mul(e2m1x2_bits<3>(words[s]), sg8);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const uint4 &v = xb[n][s >> 1];
                uint32_t b0 = (s & 1) ? v.z : v.x, b1 = (s & 1) ? v.w : v.y;
                mma_bf16(cur[m][n], a, b0, b1);
            }
        }
    }
}

