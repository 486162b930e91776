/* test_moe_gpu_pack.c - the GPU weight repacker (kernels/moe_gpu_pack.c) on
 * the CPU: every element of a repacked expert, decoded the way the kernel
 * decodes it (lane fragment order, the bf16 bit placement of E2M1 codes,
 * one E4M3 block scale per row and lane), must equal nvfp4_dequant_row of the
 * checkpoint matrix; sizes; the shape checks and their messages. Runs without
 * a GPU (CI); tests/gpu/test_moe_gpu.c checks the kernel itself. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_gpu.h"
#include "moed_err.h"
#include "nvfp4.h"
#include "check_main.h"

/* bf16 bits -> float */
static float bf16_bits(uint32_t b)
{
    uint32_t u = b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Decode a stream of n_sub 16-row sub-tiles x K exactly as moe_gpu.cu's
 * task_mma does (the shift, permute and mask formulas of moe_gpu.h, written
 * out here independently of moe_gpu_code_get): pair p of word s of lane 4g+q
 * is row g (p even) or g+8 (p odd), k = 16q + 4s + (p & 2); the result as
 * bf16 is value * 2^-126. */
static uint32_t rotl32(uint32_t w, unsigned n) { return (w << n) | (w >> (32 - n)); }
/* PTX prmt / __byte_perm: result byte j = byte (sel >> 4j) & 7 of {y, x}, x's first */
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t sel)
{
    uint64_t xy = (uint64_t)y << 32 | x;
    uint32_t r = 0;
    for (unsigned j = 0; j < 4; j++)
        r |= (uint32_t)((xy >> (8 * ((sel >> (4 * j)) & 7))) & 0xff) << (8 * j);
    return r;
}
static uint32_t dequant_bits(uint32_t w, uint32_t p)
{
    const uint32_t M = 0x81c081c0u;
    switch (p) {
    case 0: return (w << 6) & M;
    case 1: return rotl32(w, 12) & M;
    case 2: return byte_perm(w, w << 2, 0x5614) & M;
    default: return byte_perm(w, w << 1, 0x5732) & M;
    }
}
/* a stream scale byte as the kernel reads it (bf16 bits 0x7000 + (b << 4)
 * are scale * 2^118), written out independently of moe_gpu_scale_value */
static float scale_of(uint8_t b) { return bf16_bits(0x7000u + ((uint32_t)b << 4)) * ldexpf(1.0f, -118); }
static void decode_stream(const uint8_t *buf, uint32_t n_sub, uint32_t K, float *W)
{
    uint32_t units = K / MOE_GPU_UNIT_K;
    for (uint32_t st = 0; st < n_sub; st++) {
        uint32_t tile = st / MOE_GPU_MR, m = st % MOE_GPU_MR;
        for (uint32_t u = 0; u < units; u++) {
            const uint8_t *sub = buf + (((uint64_t)tile * units + u) * MOE_GPU_MR + m) * MOE_GPU_SUB_BYTES;
            for (uint32_t l = 0; l < 32; l++) {
                uint32_t g = l / 4, q = l % 4;
                float sg = scale_of(sub[512 + l * 2]);
                float sg8 = scale_of(sub[512 + l * 2 + 1]);
                for (uint32_t s = 0; s < 4; s++) {
                    uint32_t w;
                    memcpy(&w, sub + l * 16 + s * 4, 4);
                    for (uint32_t p = 0; p < 4; p++) {
                        uint32_t r = dequant_bits(w, p);
                        float lo = bf16_bits(r & 0xffff) * ldexpf(1.0f, 126);
                        float hi = bf16_bits(r >> 16) * ldexpf(1.0f, 126);
                        uint32_t row = st * 16 + ((p & 1) ? g + 8 : g);
                        float sc = (p & 1) ? sg8 : sg;
                        uint32_t k = u * MOE_GPU_UNIT_K + 16 * q + 4 * s + (p & 2);
                        W[(size_t)row * K + k] = lo * sc;
                        W[(size_t)row * K + k + 1] = hi * sc;
                    }
                }
            }
        }
    }
}

static uint64_t rng = 0x1234567;
static uint8_t rbyte(void)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint8_t)(rng >> 56);
}

static void rand_mat(struct nvfp4_mat *m, uint32_t n, uint32_t k)
{
    uint8_t *w = malloc((size_t)n * k / 2), *sc = malloc((size_t)n * k / 16);
    for (size_t i = 0; i < (size_t)n * k / 2; i++)
        w[i] = rbyte();
    for (size_t i = 0; i < (size_t)n * k / 16; i++) {
        /* every E4M3 value but NaN: negative, zero, subnormal scales included
         * (the repacker moves the sign onto the codes, clears zero blocks) */
        uint8_t b = rbyte();
        sc[i] = (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b;
        if (i % 7 == 0)
            sc[i] = (uint8_t)(b & 0x87); /* +-0 and subnormals, often */
    }
    *m = (struct nvfp4_mat){n, k, w, sc, 1.0f, 1.0f};
}

START_TEST(test_repack_every_element)
{
    const uint32_t H = 256, I = 192;
    struct moe_expert ex;
    rand_mat(&ex.gate, I, H);
    rand_mat(&ex.up, I, H);
    rand_mat(&ex.down, H, I);
    uint8_t *gu = malloc(moe_gpu_gu_bytes(H, I)), *dn = malloc(moe_gpu_dn_bytes(H, I));
    memset(gu, 0xee, moe_gpu_gu_bytes(H, I));
    memset(dn, 0xee, moe_gpu_dn_bytes(H, I));
    moe_gpu_repack_expert(&ex, H, I, gu, dn);
    float *W = calloc((size_t)2 * I * H, sizeof *W), *D = calloc((size_t)H * I, sizeof *D);
    float ref[256];
    decode_stream(gu, 2 * I / 16, H, W);
    /* gate_up: sub-tile st = rows 0-7 gate 8st.., rows 8-15 up 8st.. */
    for (uint32_t st = 0; st < 2 * I / 16; st++)
        for (uint32_t r = 0; r < 16; r++) {
            const struct nvfp4_mat *m = r < 8 ? &ex.gate : &ex.up;
            nvfp4_dequant_row(m, st * 8 + r % 8, ref, 0);
            for (uint32_t k = 0; k < H; k++)
                ck_assert_msg(W[(size_t)(st * 16 + r) * H + k] == ref[k],
                              "gate_up sub-tile %u row %u k %u: %g, want %g", st, r, k,
                              (double)W[(size_t)(st * 16 + r) * H + k], (double)ref[k]);
        }
    decode_stream(dn, H / 16, I, D);
    for (uint32_t r = 0; r < H; r++) {
        nvfp4_dequant_row(&ex.down, r, ref, 0);
        for (uint32_t k = 0; k < I; k++)
            ck_assert_msg(D[(size_t)r * I + k] == ref[k], "down row %u k %u: %g, want %g", r, k,
                          (double)D[(size_t)r * I + k], (double)ref[k]);
    }
    free((void *)ex.gate.w);
    free((void *)ex.gate.scale);
    free((void *)ex.up.w);
    free((void *)ex.up.scale);
    free((void *)ex.down.w);
    free((void *)ex.down.scale);
    free(gu);
    free(dn);
    free(W);
    free(D);
}
END_TEST

START_TEST(test_sizes)
{
    /* the stream holds exactly the checkpoint's codes and scales, no padding */
    ck_assert_uint_eq(moe_gpu_gu_bytes(7168, 2048), 2 * nvfp4_mat_bytes(2048, 7168));
    ck_assert_uint_eq(moe_gpu_dn_bytes(7168, 2048), nvfp4_mat_bytes(7168, 2048));
    ck_assert_uint_eq(moe_gpu_gu_bytes(7168, 2048) + moe_gpu_dn_bytes(7168, 2048), 24772608u);
    ck_assert_uint_eq(moe_gpu_gu_bytes(2048, 768) + moe_gpu_dn_bytes(2048, 768), 2654208u);
}
END_TEST

START_TEST(test_scale_bytes)
{
    /* every E4M3 byte: the stream byte, read the kernel's way, times the
     * sign the repacker moves onto the codes, is the E4M3 value */
    for (unsigned c = 0; c < 256; c++) {
        int sign = 2;
        uint8_t b = moe_gpu_scale_byte((uint8_t)c, &sign);
        float want = nvfp4_e4m3_decode((uint8_t)c), got = scale_of(b);
        if (isnan(want)) {
            ck_assert_msg(isnan(got), "E4M3 0x%02x is NaN, stream byte 0x%02x reads %g", c, b,
                          (double)got);
            continue;
        }
        ck_assert_float_eq(moe_gpu_scale_value(b), got);
        if (want == 0.0f) {
            ck_assert_int_eq(sign, 0);
            continue;
        }
        ck_assert_msg(sign * got == want, "E4M3 0x%02x = %g: stream byte 0x%02x sign %d reads %g",
                      c, (double)want, b, sign, (double)got);
    }
}
END_TEST

START_TEST(test_check_dims)
{
    char err[MOED_ERRLEN];
    struct moe_gpu_dims d = {7168, 2048, 256, 1, 8, 512};
    ck_assert_int_eq(moe_gpu_check_dims(&d, err, sizeof err), 0);
    d.hidden = 7200;
    ck_assert_int_eq(moe_gpu_check_dims(&d, err, sizeof err), MOED_E_MODEL);
    ck_assert_str_eq(err, "cuda backend: hidden_size 7200 must be a positive multiple of 64 "
                          "(the kernel's weight tiles stream K in units of 64 weights: 4 "
                          "scale blocks)");
    d.hidden = 7168;
    d.inter = 100;
    ck_assert_int_eq(moe_gpu_check_dims(&d, err, sizeof err), MOED_E_MODEL);
    ck_assert_ptr_nonnull(strstr(err, "moe_intermediate_size 100 must be a positive multiple of 64"));
    d.inter = 2048;
    d.n_experts = 1024;
    ck_assert_int_eq(moe_gpu_check_dims(&d, err, sizeof err), MOED_E_MODEL);
    ck_assert_ptr_nonnull(strstr(err, "experts 1024 + shared 1 (max 1024 total)"));
    d.n_experts = 256;
    d.max_tokens = 8000;
    ck_assert_int_eq(moe_gpu_check_dims(&d, err, sizeof err), MOED_E_CONFIG);
    ck_assert_ptr_nonnull(strstr(err, "max_tokens 8000 * (top_k 8 + shared 1) must be in [1, 65535]"));
}
END_TEST

/* The host-device contract (moe_gpu_abi.h): the layout check the backend
 * runs at open, and the host side of the queue protocol. */
START_TEST(test_abi)
{
    char err[MOED_ERRLEN] = "";
    const uint64_t fp = moe_gpu_abi_fingerprint();
    ck_assert_int_eq(moe_gpu_abi_check(fp, err, sizeof err), 0);
    ck_assert_int_eq(moe_gpu_abi_check(fp ^ 0x10, err, sizeof err), MOED_E_BACKEND);
    char want[64];
    snprintf(want, sizeof want, "fingerprint 0x%016llx, the host's 0x%016llx",
             (unsigned long long)(fp ^ 0x10), (unsigned long long)fp);
    ck_assert_ptr_nonnull(strstr(err, want));
    ck_assert_ptr_nonnull(strstr(err, "kernels/moe_gpu_abi.h"));
    /* the kernel copies the descriptor and a slot with 16-byte loads */
    ck_assert_uint_eq(sizeof(struct moe_gpu_desc) % 16, 0);
    ck_assert_uint_eq(sizeof(struct moe_gpu_slot) % 16, 0);
    ck_assert_uint_eq(offsetof(struct moe_gpu_ctrl, ring) % 16, 0);

    static struct moe_gpu_ctrl c;
    memset(&c, 0, sizeof c);
    ck_assert_ptr_eq(moe_gpu_slot_for(&c, 9), &c.ring[9 % MOE_GPU_RING]);
    moe_gpu_publish(&c, 9);
    ck_assert_uint_eq(c.head, 9);
    c.done_seq = 7;
    c.heartbeat = 3;
    c.phase_ns[5] = 55;
    ck_assert_uint_eq(moe_gpu_poll_done(&c), 7);
    ck_assert_uint_eq(moe_gpu_heartbeat(&c), 3);
    ck_assert_uint_eq(moe_gpu_phase(&c, 5), 55);
    moe_gpu_request_stop(&c);
    ck_assert_uint_eq(c.stop, 1);
    c.exited = 1;
    ck_assert_int_eq(moe_gpu_exited(&c), 1);
    moe_gpu_arm(&c);
    ck_assert_uint_eq(c.stop, 0);
    ck_assert_int_eq(moe_gpu_exited(&c), 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("moe_gpu_pack");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_repack_every_element);
    tcase_add_test(tc, test_sizes);
    tcase_add_test(tc, test_scale_bytes);
    tcase_add_test(tc, test_check_dims);
    tcase_add_test(tc, test_abi);
    suite_add_tcase(s, tc);
    return moed_check_run(s);
}
