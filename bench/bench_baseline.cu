/* bench_baseline.cu - baselines for bench_moe (contract in bench_baseline.h).
 *
 * Simple, correct kernels: the point of baseline (a) is the launch-per-stage
 * structure on the same NVFP4 stream, not a second tuned kernel; (b) is the
 * stock-library path (bf16 weights + cuBLAS). Both read moed's repacked
 * layout (kernels/moe_gpu.cu, LAYOUT): a 16-row x 64-K sub-tile is 576 bytes,
 * lane l = 4g+q owns 16 code bytes (rows g, g+8; k in [16q, 16q+16) of the
 * unit, word s = k 16q+4s..+3) and scale bytes 512+2l (row g), 513+2l (row
 * g+8). Inside word s, pair p = 0 (row g k+0/1), 1 (row g+8 k+0/1), 2 (row g
 * k+2/3), 3 (row g+8 k+2/3); moe_gpu_code_get (moe_gpu.h) reads a code.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

extern "C" {
#include "bench_baseline.h"
#include "moed_check_cuda.h"
#include "moed_err.h"
}

#define MR MOE_GPU_MR

/* ---------------- device helpers ---------------- */

__device__ __forceinline__ float e2m1_f(unsigned c)
{
    const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    float v = mag[c & 7];
    return (c & 8) ? -v : v;
}
/* a stream scale byte (moe_gpu.h: re-encoded E4M3, sign moved onto the codes) */
__device__ __forceinline__ float e4m3_f(unsigned b) { return moe_gpu_scale_value((uint8_t)b); }
__device__ __forceinline__ float bf2f(uint16_t u) { return __uint_as_float((uint32_t)u << 16); }
__device__ __forceinline__ uint16_t f2bf(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}
__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }

/* code of row r (0: g, 1: g+8) at k offset kk (0..3) of a word */
__device__ __forceinline__ unsigned nib_of(uint32_t word, int r, int kk)
{
    return moe_gpu_code_get(word, (unsigned)(r + 2 * (kk >> 1)), (unsigned)(kk & 1));
}

__device__ __forceinline__ const uint8_t *sub_ptr(const uint8_t *base, unsigned st, unsigned u,
                                                  unsigned units)
{
    unsigned tile = st / MR, m = st % MR;
    return base + (((size_t)tile * units + u) * MR + m) * MOE_GPU_SUB_BYTES;
}

/* ---------------- route: one block ---------------- */
/* cnt/off per expert (ascending), touched list, pair -> token, (t, slot) ->
 * pair. Pair order inside an expert is not fixed (atomics); combine sums per
 * token in slot order, so y does not depend on it. */
__global__ void bl_route(const int32_t *ids, unsigned T, unsigned k, unsigned E, unsigned S,
                         int *cnt_g, int *off_g, int *tl_g, int *ntl_g, int *pair_tok, int *pos)
{
    __shared__ int cnt[1024], off[1025], fill[1024];
    const unsigned NE = E + S, KS = k + S, tid = threadIdx.x;
    for (unsigned i = tid; i < NE; i += blockDim.x) {
        cnt[i] = 0;
        fill[i] = 0;
    }
    __syncthreads();
    for (unsigned i = tid; i < T * KS; i += blockDim.x) {
        unsigned t = i / KS, j = i % KS;
        int e = j < k ? ids[t * k + j] : (int)(E + j - k);
        atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (tid < 32) { /* warp scan: lane takes a contiguous chunk */
        unsigned chunk = (NE + 31) / 32, b0 = tid * chunk, b1 = min(NE, b0 + chunk);
        int sum = 0, nt = 0;
        for (unsigned i = b0; i < b1; i++) {
            sum += cnt[i];
            nt += cnt[i] > 0;
        }
        int incl = sum, ntin = nt;
        for (int o = 1; o < 32; o <<= 1) {
            int v = __shfl_up_sync(0xffffffffu, incl, o), w = __shfl_up_sync(0xffffffffu, ntin, o);
            if ((int)tid >= o) {
                incl += v;
                ntin += w;
            }
        }
        int run = incl - sum, tr = ntin - nt;
        for (unsigned i = b0; i < b1; i++) {
            off[i] = run;
            off_g[i] = run;
            cnt_g[i] = cnt[i];
            if (cnt[i] > 0)
                tl_g[tr++] = (int)i;
            run += cnt[i];
        }
        if (tid == 31) {
            off[NE] = incl;
            off_g[NE] = incl;
            *ntl_g = ntin;
        }
    }
    __syncthreads();
    for (unsigned i = tid; i < T * KS; i += blockDim.x) {
        unsigned t = i / KS, j = i % KS;
        int e = j < k ? ids[t * k + j] : (int)(E + j - k);
        int p = off[e] + atomicAdd(&fill[e], 1);
        pair_tok[p] = (int)t;
        pos[i] = p;
    }
}

/* ---------------- (a) NVFP4 GEMV per stage ---------------- */
/* Warp = one 16-row sub-tile column over all K, 8 pairs per pass. gate_up:
 * out[p][i] = gate, out[p][I + i] = up (fp32, weight_scale_2 applied);
 * down: out[p][r] (fp32). blockIdx.y = touched expert index. */
template <int IS_GU>
__global__ void __launch_bounds__(128) bl_gemv(struct moe_gpu_layer L, unsigned H, unsigned I,
                                               unsigned NE, const int *tl, const int *ntl,
                                               const int *cnt, const int *off,
                                               const int *pair_tok, const uint16_t *act,
                                               float *out)
{
    const unsigned te = blockIdx.y;
    if ((int)te >= *ntl)
        return;
    const unsigned warp = threadIdx.x / 32, l = threadIdx.x % 32, g = l / 4, q = l % 4;
    const unsigned K = IS_GU ? H : I, n_sub = IS_GU ? 2 * I / 16 : H / 16, units = K / 64;
    const unsigned st = blockIdx.x * 4 + warp;
    if (st >= n_sub)
        return;
    const int e = tl[te], n_e = cnt[e], p0 = off[e];
    const size_t per = (size_t)(2 * I / 16) * (H / 64) * MOE_GPU_SUB_BYTES +
                       (size_t)(H / 16) * (I / 64) * MOE_GPU_SUB_BYTES;
    const uint8_t *base = (IS_GU ? L.gu : L.dn) + (size_t)e * per;
    for (int c0 = 0; c0 < n_e; c0 += 8) {
        const int nc = min(8, n_e - c0);
        const uint16_t *rows[8];
#pragma unroll
        for (int n = 0; n < 8; n++) {
            int p = p0 + c0 + (n < nc ? n : 0);
            size_t row = IS_GU ? (size_t)pair_tok[p] : (size_t)p;
            rows[n] = act + row * K + 16 * q;
        }
        float alo[8], ahi[8];
#pragma unroll
        for (int n = 0; n < 8; n++)
            alo[n] = ahi[n] = 0.f;
        for (unsigned u = 0; u < units; u++) {
            const uint8_t *sp = sub_ptr(base, st, u, units);
            uint4 c = *(const uint4 *)(sp + l * 16);
            float sl = e4m3_f(sp[512 + 2 * l]), sh = e4m3_f(sp[513 + 2 * l]);
            uint32_t wd[4] = {c.x, c.y, c.z, c.w};
            float wl[16], wh[16];
#pragma unroll
            for (int s = 0; s < 4; s++)
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    wl[4 * s + kk] = e2m1_f(nib_of(wd[s], 0, kk)) * sl;
                    wh[4 * s + kk] = e2m1_f(nib_of(wd[s], 1, kk)) * sh;
                }
#pragma unroll
            for (int n = 0; n < 8; n++) {
                if (n < nc) {
                    const uint4 *xp = (const uint4 *)(rows[n] + (size_t)u * 64);
                    uint4 x0 = xp[0], x1 = xp[1];
                    uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        float xa = __uint_as_float(xw[j] << 16), xb = __uint_as_float(xw[j] & 0xffff0000u);
                        alo[n] += wl[2 * j] * xa + wl[2 * j + 1] * xb;
                        ahi[n] += wh[2 * j] * xa + wh[2 * j + 1] * xb;
                    }
                }
            }
        }
#pragma unroll
        for (int n = 0; n < 8; n++) {
            alo[n] += __shfl_xor_sync(0xffffffffu, alo[n], 1);
            alo[n] += __shfl_xor_sync(0xffffffffu, alo[n], 2);
            ahi[n] += __shfl_xor_sync(0xffffffffu, ahi[n], 1);
            ahi[n] += __shfl_xor_sync(0xffffffffu, ahi[n], 2);
        }
        if (q == 0) {
#pragma unroll
            for (int n = 0; n < 8; n++) {
                if (n < nc) {
                    size_t p = (size_t)(p0 + c0 + n);
                    if (IS_GU) {
                        unsigned i = 8 * st + g;
                        out[p * 2 * I + i] = alo[n] * L.s2[e];
                        out[p * 2 * I + I + i] = ahi[n] * L.s2[NE + e];
                    } else {
                        unsigned r = 16 * st + g;
                        float s2 = L.s2[2 * NE + e];
                        out[p * H + r] = alo[n] * s2;
                        out[p * H + r + 8] = ahi[n] * s2;
                    }
                }
            }
        }
    }
}

/* h[p][i] = bf16(silu(G[p][i]) * G[p][I + i]) */
__global__ void bl_act(const float *G, unsigned P, unsigned I, uint16_t *h)
{
    size_t n = (size_t)P * I;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        size_t p = idx / I, i = idx % I;
        h[idx] = f2bf(silu_f(G[p * 2 * I + i]) * G[p * 2 * I + I + i]);
    }
}

/* y[t][c] = bf16(sum_j w_j d[pos(t,j)][c] + sum_s d[pos(t,k+s)][c]) */
__global__ void bl_combine(const float *d, const int *pos, const float *w, unsigned H, unsigned k,
                           unsigned S, uint16_t *y)
{
    const unsigned t = blockIdx.x, KS = k + S;
    for (unsigned c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.f;
        for (unsigned j = 0; j < k; j++)
            acc += w[t * k + j] * d[(size_t)pos[t * KS + j] * H + c];
        for (unsigned s = 0; s < S; s++)
            acc += d[(size_t)pos[t * KS + k + s] * H + c];
        y[(size_t)t * H + c] = f2bf(acc);
    }
}

/* (b) Xg[p] = x[pair_tok[p]] */
__global__ void bl_gather(const uint16_t *x, const int *pair_tok, unsigned P, unsigned H,
                          uint16_t *xg)
{
    const unsigned p = blockIdx.x;
    if (p >= P)
        return;
    const uint4 *s = (const uint4 *)(x + (size_t)pair_tok[p] * H);
    uint4 *o = (uint4 *)(xg + (size_t)p * H);
    for (unsigned i = threadIdx.x; i < H / 8; i += blockDim.x)
        o[i] = s[i];
}

/* (b) setup: one matrix stream -> dense bf16 rows (row-major [rows, K]),
 * value * weight_scale_2 rounded to bf16. gate_up: gate rows 0..I-1, up rows
 * I..2I-1. */
__global__ void bl_dequant(const uint8_t *base, unsigned n_sub, unsigned units, int is_gu,
                           unsigned I, float s2lo, float s2hi, uint16_t *dst)
{
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)n_sub * units * 32)
        return;
    const unsigned l = idx % 32, g = l / 4, q = l % 4;
    const size_t su = idx / 32;
    const unsigned u = su % units, st = su / units, K = units * 64;
    const uint8_t *sp = sub_ptr(base, st, u, units);
    float sl = e4m3_f(sp[512 + 2 * l]) * s2lo, sh = e4m3_f(sp[513 + 2 * l]) * s2hi;
    unsigned rlo = is_gu ? 8 * st + g : 16 * st + g, rhi = is_gu ? I + 8 * st + g : 16 * st + 8 + g;
    for (int s = 0; s < 4; s++) {
        uint32_t wd = *(const uint32_t *)(sp + l * 16 + 4 * s);
        for (int kk = 0; kk < 4; kk++) {
            unsigned kc = u * 64 + 16 * q + 4 * s + kk;
            dst[(size_t)rlo * K + kc] = f2bf(e2m1_f(nib_of(wd, 0, kk)) * sl);
            dst[(size_t)rhi * K + kc] = f2bf(e2m1_f(nib_of(wd, 1, kk)) * sh);
        }
    }
}

/* ---------------- clock offset ---------------- */
__global__ void bl_pingpong(volatile uint64_t *flag, volatile uint64_t *ack, volatile uint64_t *ts,
                            int rounds)
{
    for (int i = 1; i <= rounds; i++) {
        uint64_t v;
        do {
            asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
        } while (v < (uint64_t)i);
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        ts[i - 1] = t;
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ack), "l"((uint64_t)i) : "memory");
    }
}

/* ---------------- host ---------------- */

struct bl_slot {
    uint32_t T, n_touched, P;
    uint16_t *x, *y;
    int32_t *ids;
    float *w;
    cudaGraphExec_t g[2];
};

struct bl_ctx {
    struct moe_gpu_dims d;
    uint32_t NE, KS, n_nv, n_bf16;
    struct moe_gpu_layer *nv;   /* host copy */
    uint16_t **bf;              /* [n_bf16] device: NE x (Wgu [2I,H] | Wdn [H,I]) */
    int *cnt, *off, *tl, *ntl, *pair_tok, *pos;
    float *G, *dout;
    uint16_t *h, *xg;
    void *ws;
    cublasHandle_t cub;
    cudaStream_t stream;
    struct bl_slot slot[BL_SLOTS];
};

static size_t bf_expert_elems(const struct moe_gpu_dims *d)
{
    return (size_t)3 * d->inter * d->hidden;
}

extern "C" void bl_close(struct bl_ctx *c)
{
    if (!c)
        return;
    cudaDeviceSynchronize();
    for (int s = 0; s < BL_SLOTS; s++) {
        for (int w = 0; w < 2; w++)
            if (c->slot[s].g[w])
                cudaGraphExecDestroy(c->slot[s].g[w]);
        cudaFree(c->slot[s].x);
        cudaFree(c->slot[s].y);
        cudaFree(c->slot[s].ids);
        cudaFree(c->slot[s].w);
    }
    if (c->bf)
        for (uint32_t l = 0; l < c->n_bf16; l++)
            cudaFree(c->bf[l]);
    free(c->bf);
    free(c->nv);
    cudaFree(c->cnt);
    cudaFree(c->off);
    cudaFree(c->tl);
    cudaFree(c->ntl);
    cudaFree(c->pair_tok);
    cudaFree(c->pos);
    cudaFree(c->G);
    cudaFree(c->dout);
    cudaFree(c->h);
    cudaFree(c->xg);
    cudaFree(c->ws);
    if (c->cub)
        cublasDestroy(c->cub);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c);
}

extern "C" int bl_open(const struct moe_gpu_dims *d, const struct moe_gpu_layer *nv, uint32_t n_nv,
                       uint32_t n_bf16, struct bl_ctx **out, char *err, size_t errlen)
{
    int rc = 0;
    float *s2h = NULL;
    struct bl_ctx *c = (struct bl_ctx *)calloc(1, sizeof *c);
    const uint32_t H = d->hidden, I = d->inter;
    size_t Pmax;
    if (!c || n_nv == 0 || n_bf16 == 0 || n_bf16 > n_nv) {
        free(c);
        return moed_seterr(err, errlen, MOED_E_INVAL,
                           "baseline: bad arguments (layers %u, bf16 layers %u)", n_nv, n_bf16);
    }
    c->d = *d;
    c->NE = d->n_experts + d->n_shared;
    c->KS = d->top_k + d->n_shared;
    c->n_nv = n_nv;
    c->n_bf16 = n_bf16;
    Pmax = (size_t)d->max_tokens * c->KS;
    c->nv = (struct moe_gpu_layer *)malloc(sizeof *nv * n_nv);
    c->bf = (uint16_t **)calloc(n_bf16, sizeof *c->bf);
    s2h = (float *)malloc(sizeof(float) * 3 * c->NE);
    if (!c->nv || !c->bf || !s2h) {
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "baseline: out of host memory");
        goto cleanup;
    }
    memcpy(c->nv, nv, sizeof *nv * n_nv);
    MOED_CUDA_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->cnt, sizeof(int) * c->NE));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->off, sizeof(int) * (c->NE + 1)));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->tl, sizeof(int) * c->NE));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->ntl, sizeof(int)));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->pair_tok, sizeof(int) * Pmax));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->pos, sizeof(int) * Pmax));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->G, sizeof(float) * Pmax * 2 * I));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->dout, sizeof(float) * Pmax * H));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->h, 2 * Pmax * I));
    MOED_CUDA_TRY(cudaMalloc((void **)&c->xg, 2 * Pmax * H));
    MOED_CUDA_TRY(cudaMalloc(&c->ws, 32u << 20));
    for (int s = 0; s < BL_SLOTS; s++) {
        MOED_CUDA_TRY(cudaMalloc((void **)&c->slot[s].x, 2 * (size_t)d->max_tokens * H));
        MOED_CUDA_TRY(cudaMalloc((void **)&c->slot[s].y, 2 * (size_t)d->max_tokens * H));
        MOED_CUDA_TRY(cudaMalloc((void **)&c->slot[s].ids, 4 * (size_t)d->max_tokens * d->top_k));
        MOED_CUDA_TRY(cudaMalloc((void **)&c->slot[s].w, 4 * (size_t)d->max_tokens * d->top_k));
    }
    /* bf16 copies of the first n_bf16 layers */
    for (uint32_t l = 0; l < n_bf16; l++) {
        MOED_CUDA_TRY(cudaMalloc((void **)&c->bf[l], 2 * bf_expert_elems(d) * c->NE));
        MOED_CUDA_TRY(cudaMemcpy(s2h, nv[l].s2, sizeof(float) * 3 * c->NE, cudaMemcpyDeviceToHost));
        const size_t per = moe_gpu_gu_bytes(H, I) + moe_gpu_dn_bytes(H, I);
        for (uint32_t e = 0; e < c->NE; e++) {
            uint16_t *dst = c->bf[l] + bf_expert_elems(d) * e;
            unsigned ngu = 2 * I / 16, udu = H / 64, ndn = H / 16, udn = I / 64;
            size_t th = (size_t)ngu * udu * 32;
            bl_dequant<<<(unsigned)((th + 255) / 256), 256, 0, c->stream>>>(
                nv[l].gu + per * e, ngu, udu, 1, I, s2h[e], s2h[c->NE + e], dst);
            th = (size_t)ndn * udn * 32;
            bl_dequant<<<(unsigned)((th + 255) / 256), 256, 0, c->stream>>>(
                nv[l].dn + per * e, ndn, udn, 0, I, s2h[2 * c->NE + e], s2h[2 * c->NE + e],
                dst + (size_t)2 * I * H);
        }
        MOED_CUDA_TRY(cudaGetLastError());
    }
    MOED_CUDA_TRY(cudaStreamSynchronize(c->stream));
    MOED_CUBLAS_TRY(cublasCreate(&c->cub));
    MOED_CUBLAS_TRY(cublasSetStream(c->cub, c->stream));
    MOED_CUBLAS_TRY(cublasSetWorkspace(c->cub, c->ws, 32u << 20));
    MOED_CUBLAS_TRY(cublasSetMathMode(c->cub, CUBLAS_DEFAULT_MATH));
cleanup:
    free(s2h);
    if (rc) {
        bl_close(c);
        c = NULL;
    }
    *out = c;
    return rc;
}

extern "C" int bl_set_batch(struct bl_ctx *c, uint32_t si, uint32_t T, const uint16_t *x,
                            const int32_t *ids, const float *w, char *err, size_t errlen)
{
    int rc = 0;
    const struct moe_gpu_dims *d = &c->d;
    const uint32_t H = d->hidden, I = d->inter, k = d->top_k, S = d->n_shared, NE = c->NE;
    int *cnt = (int *)calloc(NE, sizeof(int));
    cudaGraph_t graph = NULL;
    struct bl_slot *s = &c->slot[si];
    int capturing = 0;
    if (!cnt || si >= BL_SLOTS || T == 0 || T > d->max_tokens) {
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "baseline: bad batch (slot %u, T %u)", si, T);
        goto cleanup;
    }
    for (int wi = 0; wi < 2; wi++)
        if (s->g[wi]) {
            cudaGraphExecDestroy(s->g[wi]);
            s->g[wi] = NULL;
        }
    s->T = T;
    s->P = T * c->KS;
    s->n_touched = 0;
    for (uint32_t i = 0; i < T * k; i++)
        cnt[ids[i]]++;
    for (uint32_t e = d->n_experts; e < NE; e++)
        cnt[e] = (int)T;
    for (uint32_t e = 0; e < NE; e++)
        s->n_touched += cnt[e] > 0;
    MOED_CUDA_TRY(cudaMemcpy(s->x, x, 2 * (size_t)T * H, cudaMemcpyHostToDevice));
    MOED_CUDA_TRY(cudaMemcpy(s->ids, ids, 4 * (size_t)T * k, cudaMemcpyHostToDevice));
    MOED_CUDA_TRY(cudaMemcpy(s->w, w, 4 * (size_t)T * k, cudaMemcpyHostToDevice));
    for (int wi = 0; wi < 2; wi++) {
        MOED_CUDA_TRY(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
        capturing = 1;
        bl_route<<<1, 1024, 0, c->stream>>>(s->ids, T, k, d->n_experts, S, c->cnt, c->off, c->tl,
                                            c->ntl, c->pair_tok, c->pos);
        if (wi == 0) {
            const struct moe_gpu_layer L = c->nv[si % c->n_nv];
            dim3 ggu((2 * I / 16 + 3) / 4, s->n_touched), gdn((H / 16 + 3) / 4, s->n_touched);
            bl_gemv<1><<<ggu, 128, 0, c->stream>>>(L, H, I, NE, c->tl, c->ntl, c->cnt, c->off,
                                                   c->pair_tok, s->x, c->G);
            bl_act<<<(unsigned)((s->P * (size_t)I + 255) / 256 < 4096 ? (s->P * (size_t)I + 255) / 256
                                                                      : 4096),
                     256, 0, c->stream>>>(c->G, s->P, I, c->h);
            bl_gemv<0><<<gdn, 128, 0, c->stream>>>(L, H, I, NE, c->tl, c->ntl, c->cnt, c->off,
                                                   c->pair_tok, c->h, c->dout);
        } else {
            const uint16_t *B = c->bf[si % c->n_bf16];
            const float one = 1.0f, zero = 0.0f;
            bl_gather<<<s->P, 128, 0, c->stream>>>(s->x, c->pair_tok, s->P, H, c->xg);
            uint32_t p0 = 0;
            for (uint32_t e = 0; e < NE; e++) {
                if (!cnt[e])
                    continue;
                const uint16_t *wgu = B + bf_expert_elems(d) * e;
                MOED_CUBLAS_TRY(cublasGemmEx(c->cub, CUBLAS_OP_T, CUBLAS_OP_N, (int)(2 * I), cnt[e], (int)H,
                                  &one, wgu, CUDA_R_16BF, (int)H, c->xg + (size_t)p0 * H,
                                  CUDA_R_16BF, (int)H, &zero, c->G + (size_t)p0 * 2 * I,
                                  CUDA_R_32F, (int)(2 * I), CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
                p0 += (uint32_t)cnt[e];
            }
            bl_act<<<(unsigned)((s->P * (size_t)I + 255) / 256 < 4096 ? (s->P * (size_t)I + 255) / 256
                                                                      : 4096),
                     256, 0, c->stream>>>(c->G, s->P, I, c->h);
            p0 = 0;
            for (uint32_t e = 0; e < NE; e++) {
                if (!cnt[e])
                    continue;
                const uint16_t *wdn = B + bf_expert_elems(d) * e + (size_t)2 * I * H;
                MOED_CUBLAS_TRY(cublasGemmEx(c->cub, CUBLAS_OP_T, CUBLAS_OP_N, (int)H, cnt[e], (int)I, &one,
                                  wdn, CUDA_R_16BF, (int)I, c->h + (size_t)p0 * I, CUDA_R_16BF,
                                  (int)I, &zero, c->dout + (size_t)p0 * H, CUDA_R_32F, (int)H,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                p0 += (uint32_t)cnt[e];
            }
        }
        bl_combine<<<T, 256, 0, c->stream>>>(c->dout, c->pos, s->w, H, k, S, s->y);
        capturing = 0;
        MOED_CUDA_TRY(cudaStreamEndCapture(c->stream, &graph));
        MOED_CUDA_TRY(cudaGraphInstantiate(&s->g[wi], graph, 0));
        cudaGraphDestroy(graph);
        graph = NULL;
    }
cleanup:
    if (capturing) {
        cudaStreamEndCapture(c->stream, &graph);
        cudaGetLastError();
    }
    if (graph)
        cudaGraphDestroy(graph);
    free(cnt);
    return rc;
}

static double mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

extern "C" int bl_run(struct bl_ctx *c, int which, uint32_t si, uint16_t *y, double *us, char *err,
                      size_t errlen)
{
    int rc = 0;
    struct bl_slot *s = &c->slot[si % BL_SLOTS];
    double t0 = mono_us();
    MOED_CUDA_TRY(cudaGraphLaunch(s->g[which ? 1 : 0], c->stream));
    MOED_CUDA_TRY(cudaStreamSynchronize(c->stream));
    *us = mono_us() - t0;
    if (y)
        MOED_CUDA_TRY(cudaMemcpy(y, s->y, 2 * (size_t)s->T * c->d.hidden, cudaMemcpyDeviceToHost));
cleanup:
    return rc;
}

static int64_t rt_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

extern "C" int bl_clock_offset(int rounds, int64_t *off_ns, int64_t *half_rtt_ns, char *err,
                               size_t errlen)
{
    int rc = 0;
    uint64_t *hm = NULL, *hd = NULL;
    int64_t *t0 = (int64_t *)calloc((size_t)rounds, sizeof(int64_t));
    int64_t *t1 = (int64_t *)calloc((size_t)rounds, sizeof(int64_t));
    cudaStream_t st = NULL;
    int best = -1;
    if (!t0 || !t1 || rounds < 1) {
        rc = moed_seterr(err, errlen, MOED_E_BACKEND, "baseline: clock offset: bad rounds %d", rounds);
        goto cleanup;
    }
    /* flag, ack, then the kernel's timestamps: 64-byte lines apart */
    MOED_CUDA_TRY(cudaHostAlloc((void **)&hm, 128 + 8 * (size_t)rounds, cudaHostAllocMapped));
    memset(hm, 0, 128 + 8 * (size_t)rounds);
    MOED_CUDA_TRY(cudaHostGetDevicePointer((void **)&hd, hm, 0));
    MOED_CUDA_TRY(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    bl_pingpong<<<1, 1, 0, st>>>(hd, hd + 8, hd + 16, rounds);
    MOED_CUDA_TRY(cudaGetLastError());
    for (int i = 1; i <= rounds; i++) {
        t0[i - 1] = rt_ns();
        __atomic_store_n(&hm[0], (uint64_t)i, __ATOMIC_RELEASE);
        double lim = mono_us() + 1e6;
        while (__atomic_load_n(&hm[8], __ATOMIC_ACQUIRE) < (uint64_t)i)
            if (mono_us() > lim) {
                rc = moed_seterr(err, errlen, MOED_E_BACKEND, "baseline: clock offset: no answer from the GPU in 1 s");
                __atomic_store_n(&hm[0], (uint64_t)rounds, __ATOMIC_RELEASE);
                goto cleanup;
            }
        t1[i - 1] = rt_ns();
    }
    MOED_CUDA_TRY(cudaStreamSynchronize(st));
    for (int i = 0; i < rounds; i++)
        if (best < 0 || t1[i] - t0[i] < t1[best] - t0[best])
            best = i;
    *half_rtt_ns = (t1[best] - t0[best]) / 2;
    *off_ns = (int64_t)hm[16 + best] - (t0[best] + t1[best]) / 2;
cleanup:
    if (st) {
        cudaStreamSynchronize(st);
        cudaStreamDestroy(st);
    }
    if (hm)
        cudaFreeHost(hm);
    free(t0);
    free(t1);
    return rc;
}
