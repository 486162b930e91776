/* nvfp4.h - the NVFP4 weight format and bf16, in plain C.
 *
 * Shared by the checkpoint generator, the CPU reference and the GPU repacker.
 * Conventions follow NVIDIA ModelOpt's export (modelopt/torch/quantization/
 * qtensor/nvfp4_tensor.py), the format vLLM and SGLang read:
 *
 *   weight        U8      [N, K/2]   two E2M1 codes per byte, element 2j in the
 *                                    LOW nibble, element 2j+1 in the high nibble
 *   weight_scale  F8_E4M3 [N, K/16]  one block scale per 16 consecutive K
 *   weight_scale_2 F32    []         per-tensor scale = amax(W) / (6 * 448)
 *
 *   value[n][k] = e2m1(code) * e4m3(weight_scale[n][k/16]) * weight_scale_2
 *
 * weight_scale_2 MULTIPLIES (checkpoint direction). Kernels in vLLM/SGLang take
 * its reciprocal as "global scale"; moed never does: the name scale_2 always
 * means the checkpoint's multiplier.
 *
 * E2M1: bit 3 sign, bits 0-2 index into {0, .5, 1, 1.5, 2, 3, 4, 6}.
 * E4M3 (float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa, no inf,
 * S.1111.111 is NaN, max finite 448, subnormals 2^-6 * m/8.
 */
#ifndef NVFP4_H
#define NVFP4_H

#include <stddef.h>
#include <stdint.h>

#define NVFP4_GROUP 16      /* K elements per block scale */
#define NVFP4_E2M1_MAX 6.0f
#define NVFP4_E4M3_MAX 448.0f

/* One NVFP4 matrix [n, k] as stored in the checkpoint (pointers borrowed, not
 * owned: usually into an mmap of a safetensors file). k % 16 == 0 so rows are
 * whole bytes and whole scale blocks. */
struct nvfp4_mat {
    uint32_t n, k;
    const uint8_t *w;      /* [n, k/2] packed E2M1 */
    const uint8_t *scale;  /* [n, k/16] E4M3 */
    float scale_2;         /* weight_scale_2 (multiplier) */
    float input_scale;     /* input_scale, carried for completeness; unused by W4A16 */
};

/* Decode one 4-bit E2M1 code (only the low 4 bits of `code` are used). */
float nvfp4_e2m1_decode(uint8_t code);
/* Decode one E4M3 (float8_e4m3fn) byte; 0x7f/0xff give NaN. */
float nvfp4_e4m3_decode(uint8_t code);

/* Index of the first NaN E4M3 byte (0x7f or 0xff) in s[0..n), or n if there
 * is none. Reads 8 bytes at a time: a checkpoint's block scales are 1/8 of its
 * weights, scanned once at load. */
size_t nvfp4_e4m3_find_nan(const uint8_t *s, size_t n);

/* Round to nearest E2M1 code, ties to the even code (ModelOpt/vLLM rounding:
 * thresholds .25 .75 1.25 1.75 2.5 3.5 5; |x| > 6 saturates to 6). */
uint8_t nvfp4_e2m1_encode(float x);
/* Round to nearest E4M3, ties to even, saturating to +-448 (satfinite); NaN
 * maps to 0x7f. */
uint8_t nvfp4_e4m3_encode(float x);

/* bf16 <-> float. bf16_from_float rounds to nearest even; NaN stays NaN. */
uint16_t bf16_from_float(float x);
float bf16_to_float(uint16_t h);

/* Relative L2 error ||y - ref|| / ||ref|| of two bf16 arrays, in double
 * (the absolute L2 norm when ref is all zero); NaN if either holds NaN. */
double bf16_rel_l2(const uint16_t *y, const uint16_t *ref, size_t n);

/* Quantize a float matrix w[n][k] (k % 16 == 0) as ModelOpt does:
 *   scale_2 = amax(w) / (6*448)   (1.0 when amax == 0 is avoided: then 1/(6*448))
 *   block scale = e4m3(amax(block) / (6 * scale_2)), an all-zero block gets 1.0
 *   code = e2m1(w / (block_scale * scale_2))
 * Writes packed[n*k/2], scales[n*k/16] and *scale_2. Caller owns all buffers. */
void nvfp4_quantize(const float *w, uint32_t n, uint32_t k, uint8_t *packed,
                    uint8_t *scales, float *scale_2);

/* Dequantize row `r` of m into out[m->k] (float, exact: e2m1*e4m3 products are
 * representable). Multiplies scale_2 in only if `with_scale_2` is non-zero. */
void nvfp4_dequant_row(const struct nvfp4_mat *m, uint32_t r, float *out, int with_scale_2);

/* Bytes of weights + block scales of an [n, k] NVFP4 matrix (no scalars). */
static inline uint64_t nvfp4_mat_bytes(uint64_t n, uint64_t k)
{
    return n * (k / 2) + n * (k / NVFP4_GROUP);
}

#endif
