/* task.cuh - a gate_up or down task for the whole CTA (split-K over the
 * warps, the fixed-order reduction, the epilogues), the combine unit, the
 * tiles-per-task choice and the staging of a batch's routing inputs. Part of
 * the one translation unit moe_gpu.cu. */

/* Split-K of a task across the CTA: each tile's K units are dealt to the
 * warps round robin (warp w: units w, w + NWARPS, ...: the CTA's warps move
 * through the weights together, one contiguous window at a time), each warp
 * parks its per-tile partials in its own (drained) stage buffer, and warp
 * w < ntiles sums tile w's NWARPS partials in warp order (fixed:
 * deterministic) into out. Every thread of the CTA calls this. */
template <int NT, int NTILE>
__device__ __forceinline__ void task_splitk(const uint8_t *wtask, unsigned tile_units,
                                            unsigned ntiles, const xsrc &xs, uint8_t *sw,
                                            uint8_t *sw_cta,
                                            float (&out)[MR][NT][4])
{
    static_assert(NTILE * 32 * MR * NT * 4 * sizeof(float) <= WARP_SMEM,
                  "partials of a task must fit a warp's stage buffer");
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned nuw = tile_units > warp ? (tile_units - warp + NWARPS - 1) / NWARPS : 0;
    static_assert((NT == 1 && (NTILE == 1 || NTILE == NTILE_MAX)) ||
                      (NT == GRP_CHUNKS && NTILE == GRP_NTILE),
                  "one chunk: one tile or NTILE_MAX; a group: GRP_NTILE tiles");
    float acc[NTILE][MR][NT][4];
    if constexpr (NT > 1) { /* a chunk group: always GRP_NTILE tiles (task_decode) */
#if MOE_GPU_GRP_FULL
        if constexpr (NTILE == 2) {
            static_assert(NT == 2 && GRP_WS == 4 && GRP_XS == 2, "task_mma_grp's rings");
            task_mma_grp(wtask, warp, nuw, tile_units, xs, sw, acc);
        } else
#endif
        task_mma_il<NT, NTILE, GRP_WS, GRP_XS>(wtask, warp, nuw, NTILE, tile_units, xs, sw, acc);
    } else if constexpr (NTILE > 1) { /* tiles interleaved per K unit (v17) */
        if (ntiles == NTILE) /* constant ring offsets (v19) */
            task_mma_full<NTILE>(wtask, warp, nuw, tile_units, xs, sw, acc);
        else
            task_mma_il<1, NTILE, STAGES>(wtask, warp, nuw, ntiles, tile_units, xs, sw, acc);
    } else {
        if (tile_units % (NWARPS * STAGES) == 0) /* every warp: a multiple of STAGES units */
            task_mma_full1(wtask, warp, nuw, xs, sw, acc);
        else
            task_mma<1, 1>(wtask, warp, nuw, ntiles, tile_units, xs, sw, acc);
    }
    constexpr int PER = MR * NT * 4; /* floats per lane per tile */
#pragma unroll
    for (int j = 0; j < NTILE; j++) {
        if ((unsigned)j < ntiles) {
            float *mine = reinterpret_cast<float *>(sw) + (j * 32 + lane) * PER;
#pragma unroll
            for (int m = 0; m < MR; m++)
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        mine[(m * NT + n) * 4 + c] = acc[j][m][n][c];
        }
    }
    __syncthreads();
    zero_acc<NT>(out);
    if (warp < ntiles) {
        for (unsigned w = 0; w < NWARPS; w++) {
            const float *part = reinterpret_cast<const float *>(sw_cta + w * WARP_SMEM) +
                                (warp * 32 + lane) * PER;
#pragma unroll
            for (int m = 0; m < MR; m++)
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        out[m][n][c] += part[(m * NT + n) * 4 + c];
        }
    }
}

/* Where a task's weights and activation rows are: gate_up tiles of expert
 * e read x (the pairs' tokens), down tiles read h (the pairs' rows). */
struct task_src {
    const uint8_t *wt; /* the task's first tile */
    unsigned units;    /* K units per tile */
    xsrc xs;
};
__device__ __forceinline__ task_src gu_src(const struct moe_gpu_params &p,
                                           const struct moe_gpu_layer &L, const route &r,
                                           unsigned e, unsigned p0, unsigned cnt, unsigned rt0)
{
    const unsigned H = p.d.hidden, I = p.d.inter, units = H / MOE_GPU_UNIT_K;
    return task_src{L.gu + (size_t)e * moe_gpu_expert_bytes(H, I) +
                        (size_t)rt0 * units * MOE_GPU_UNIT_BYTES,
                    units, xsrc{p.xs, r.tok, p0, H, cnt}};
}
__device__ __forceinline__ task_src dn_src(const struct moe_gpu_params &p,
                                           const struct moe_gpu_layer &L, unsigned e, unsigned p0,
                                           unsigned cnt, unsigned rt0)
{
    const unsigned H = p.d.hidden, I = p.d.inter, units = I / MOE_GPU_UNIT_K;
    return task_src{L.dn + (size_t)e * moe_gpu_expert_bytes(H, I) +
                        (size_t)rt0 * units * MOE_GPU_UNIT_BYTES,
                    units, xsrc{p.h, nullptr, p0, I, cnt}};
}

/* gate_up epilogue of row tile rt (one warp): h = bf16(silu(gate) * up) of
 * pairs [p0, p0 + cnt) */
template <int NT>
__device__ __forceinline__ void gu_epilogue(const struct moe_gpu_params &p,
                                            const struct moe_gpu_layer &L, unsigned e,
                                            unsigned p0, unsigned cnt, unsigned rt,
                                            const float (&acc)[MR][NT][4])
{
    const unsigned I = p.d.inter, NE = p.d.n_experts + p.d.n_shared;
    const unsigned lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const float sgate = __ldg(L.s2 + e) * 256.f, sup = __ldg(L.s2 + NE + e) * 256.f;
#pragma unroll
    for (int m = 0; m < MR; m++) {
        unsigned i = (rt * MR + m) * 8 + g;
#pragma unroll
        for (int n = 0; n < NT; n++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                unsigned j = n * 8 + 2 * q + c;
                if (j < cnt) {
                    float gt = acc[m][n][c] * sgate, up = acc[m][n][2 + c] * sup;
                    float hv = gt / (1.f + expf(-gt)) * up;
                    p.h[(size_t)(p0 + j) * I + i] = __bfloat16_as_ushort(__float2bfloat16_rn(hv));
                }
            }
        }
    }
}

/* down epilogue of row tile rt (one warp): d[pair][row] = W_down h, fp32 */
template <int NT>
__device__ __forceinline__ void dn_epilogue(const struct moe_gpu_params &p,
                                            const struct moe_gpu_layer &L, unsigned e,
                                            unsigned p0, unsigned cnt, unsigned rt,
                                            const float (&acc)[MR][NT][4])
{
    const unsigned H = p.d.hidden, NE = p.d.n_experts + p.d.n_shared;
    const unsigned lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const float sd = __ldg(L.s2 + 2 * NE + e) * 256.f;
#pragma unroll
    for (int m = 0; m < MR; m++) {
        unsigned row = (rt * MR + m) * 16 + g;
#pragma unroll
        for (int n = 0; n < NT; n++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                unsigned j = n * 8 + 2 * q + c;
                if (j < cnt) {
                    float *o = p.dout + (size_t)(p0 + j) * H + row;
                    o[0] = acc[m][n][c] * sd;
                    o[8] = acc[m][n][2 + c] * sd;
                }
            }
        }
    }
}

/* A gate_up (is_gu) or down task (whole CTA): expert e, pairs [p0, p0+cnt),
 * row tiles [rt0, rt0 + ntiles) with up to NTILE tiles per pass; warp w <
 * ntiles writes tile rt0 + w. One copy of the task code serves both kinds
 * (one hot loop in the instruction cache, not two). */
template <int NT, int NTILE>
__device__ __forceinline__ void mm_task(const struct moe_gpu_params &p,
                                        const struct moe_gpu_layer &L, const route &r,
                                        bool is_gu, unsigned e, unsigned p0, unsigned cnt,
                                        unsigned rt0, unsigned ntiles, uint8_t *sw,
                                        uint8_t *sw_cta)
{
    const unsigned warp = threadIdx.x >> 5;
    const task_src ts = is_gu ? gu_src(p, L, r, e, p0, cnt, rt0) : dn_src(p, L, e, p0, cnt, rt0);
    float acc[MR][NT][4];
    task_splitk<NT, NTILE>(ts.wt, ts.units, ntiles, ts.xs, sw, sw_cta, acc);
    if (warp >= ntiles)
        return;
    if (is_gu)
        gu_epilogue<NT>(p, L, e, p0, cnt, rt0 + warp, acc);
    else
        dn_epilogue<NT>(p, L, e, p0, cnt, rt0 + warp, acc);
}

/* One gate_up or down task (whole CTA): a chunk group (two n-tiles,
 * GRP_NTILE tiles), or one chunk (one n-tile) tile by tile when nt = 1, else
 * up to NTILE_MAX tiles interleaved. Inlined: as a function of its own (own
 * registers, the persistent loop saving its live registers around the call)
 * it was 1-7% slower (H200 2026-11-30, bench/NOTES.md v20). */
__device__ __forceinline__ void run_task(const struct moe_gpu_params &p,
                                         const struct moe_gpu_layer &L, const route &r,
                                         bool is_gu, bool grp, unsigned nt, unsigned e,
                                         unsigned p0, unsigned cnt, unsigned rt0, unsigned ntiles,
                                         uint8_t *sw, uint8_t *sw_cta)
{
    if (grp)
        mm_task<GRP_CHUNKS, GRP_NTILE>(p, L, r, is_gu, e, p0, cnt, rt0, ntiles, sw, sw_cta);
    else if (nt > 1)
        mm_task<1, NTILE_MAX>(p, L, r, is_gu, e, p0, cnt, rt0, ntiles, sw, sw_cta);
    else
        mm_task<1, 1>(p, L, r, is_gu, e, p0, cnt, rt0, ntiles, sw, sw_cta);
}

/* The work split of a batch, from its tokens-per-expert histogram (issue
 * 12). Expert e has C = chs[e+1] - chs[e] chunks of <= CHUNK_TOKENS pairs.
 * With C = 1 its tasks are one chunk x nt tiles (nt: the batch's
 * ntile_for, per phase); with C >= 2 they are groups of GRP_CHUNKS chunks x
 * GRP_NTILE tiles (the last group may hold one chunk), so a crowded
 * expert's weights are streamed once per GRP_CHUNKS chunks. An expert's
 * tasks are numbered tile group major (the groups of one tile group run back
 * to back: their re-reads come from L2). tgu / tdn ([NE+1], shared memory)
 * are the exclusive prefix sums of the tasks per expert, per phase. Every
 * output element keeps its sum: the same split-K of the same tile, the same
 * MMA chain per n-tile column (a column's products do not depend on the
 * other columns), so nothing depends on the batch (batch invariance). */
struct task_plan {
    unsigned *tgu, *tdn; /* [NE+1] first task of each expert, per phase */
};

__device__ __forceinline__ bool expert_grouped(unsigned nch) { return nch >= MOE_GPU_GRP_MIN; }

/* tasks of an expert with nch chunks; tpc: tile groups of a one-chunk task */
__device__ __forceinline__ unsigned expert_tasks(unsigned nch, unsigned tpc, unsigned RT)
{
    if (expert_grouped(nch))
        return (nch + GRP_CHUNKS - 1) / GRP_CHUNKS * (RT / GRP_NTILE);
    return nch * tpc;
}

/* Warp 0 writes the two prefix sums (after build_route); every thread
 * calls it (it ends with a CTA barrier). RT_GU and RT_DN are even
 * (moe_gpu_check_dims: hidden and intermediate are multiples of 64), so a
 * group's GRP_NTILE = 2 tiles always exist. */
__device__ void plan_tasks(const route &r, unsigned NE, unsigned ntg, unsigned ntd,
                           unsigned RT_GU, unsigned RT_DN, const task_plan &tp)
{
    const unsigned lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
        const unsigned tpg = (RT_GU + ntg - 1) / ntg, tpd = (RT_DN + ntd - 1) / ntd;
        const unsigned per = (NE + 31) / 32, b = lane * per, e = min(b + per, NE);
        unsigned s1 = 0, s2 = 0;
        for (unsigned i = b; i < e; i++) {
            const unsigned c = r.chs[i + 1] - r.chs[i];
            s1 += expert_tasks(c, tpg, RT_GU);
            s2 += expert_tasks(c, tpd, RT_DN);
        }
        unsigned i1 = s1, i2 = s2;
        for (int o = 1; o < 32; o <<= 1) {
            unsigned v1 = __shfl_up_sync(0xffffffffu, i1, o), v2 = __shfl_up_sync(0xffffffffu, i2, o);
            if ((int)lane >= o) {
                i1 += v1;
                i2 += v2;
            }
        }
        unsigned x1 = i1 - s1, x2 = i2 - s2;
        for (unsigned i = b; i < e; i++) {
            const unsigned c = r.chs[i + 1] - r.chs[i];
            tp.tgu[i] = x1;
            tp.tdn[i] = x2;
            x1 += expert_tasks(c, tpg, RT_GU);
            x2 += expert_tasks(c, tpd, RT_DN);
        }
        if (lane == 31) {
            tp.tgu[NE] = i1;
            tp.tdn[NE] = i2;
        }
    }
    __syncthreads();
}

/* Task tt of a phase (tasks: its prefix sums; nt its tiles per one-chunk
 * task, RT its row tiles per expert): expert, pairs [p0, p0 + cnt), chunks
 * covered, row tiles [rt0, rt0 + ntiles), grouped or not. */
struct task_at {
    unsigned e, p0, cnt, nchunks, rt0, ntiles;
    bool grp;
};
__device__ __forceinline__ task_at task_decode(const route &r, const unsigned *tasks, unsigned NE,
                                               unsigned tt, unsigned nt, unsigned RT)
{
    task_at a;
    a.e = chunk_expert(tasks, NE, tt); /* the largest e with tasks[e] <= tt */
    const unsigned nch = r.chs[a.e + 1] - r.chs[a.e], loc = tt - tasks[a.e];
    a.grp = expert_grouped(nch);
    const unsigned gc = a.grp ? GRP_CHUNKS : 1u, ntt = a.grp ? GRP_NTILE : nt;
    const unsigned ng = (nch + gc - 1) / gc; /* groups (or chunks) of e */
    const unsigned tg = loc / ng, c = loc - tg * ng;
    a.rt0 = tg * ntt;
    a.ntiles = min(ntt, RT - a.rt0);
    a.p0 = r.off[a.e] + c * gc * CHUNK_TOKENS;
    a.cnt = min(gc * CHUNK_TOKENS, r.cnt[a.e] - c * gc * CHUNK_TOKENS);
    a.nchunks = min(gc, nch - c * gc);
    return a;
}

/* combine unit: token t, columns [256 blk, 256 blk + 256) (8 per lane).
 * Slots in fixed order (routed j = 0..k-1 weighted, then shared s = 0..S-1
 * with weight 1), fp32, one bf16 rounding: deterministic. Loads of up to 4
 * slots are issued before they are summed (L2 latency, not one slot at a
 * time). Writes y (device or mapped host memory) with 16-byte stores. */
__device__ void combine_unit(const struct moe_gpu_params &p, const route &r, unsigned t,
                             unsigned blk, uint16_t *y)
{
    const unsigned H = p.d.hidden, k = p.d.top_k, KS = k + p.d.n_shared;
    const unsigned lane = threadIdx.x & 31;
    const unsigned c = blk * 256 + lane * 8;
    constexpr int CB = 2; /* slots loaded per round (4 spilled at 128 registers) */
    if (c >= H)
        return;
    float a[8];
#pragma unroll
    for (int v = 0; v < 8; v++)
        a[v] = 0.f;
    for (unsigned j0 = 0; j0 < KS; j0 += CB) {
        float4 d[CB][2];
        float wj[CB];
#pragma unroll
        for (int u = 0; u < CB; u++) {
            unsigned j = j0 + u;
            if (j < KS) {
                const float *src = p.dout + (size_t)r.pos[t * KS + j] * H + c;
                d[u][0] = __ldcg(reinterpret_cast<const float4 *>(src));
                d[u][1] = __ldcg(reinterpret_cast<const float4 *>(src + 4));
                wj[u] = j < k ? __ldcg(p.w_s + (size_t)t * k + j) : 1.f;
            }
        }
#pragma unroll
        for (int u = 0; u < CB; u++) {
            unsigned j = j0 + u;
            if (j < KS) {
                float dv[8] = {d[u][0].x, d[u][0].y, d[u][0].z, d[u][0].w,
                               d[u][1].x, d[u][1].y, d[u][1].z, d[u][1].w};
#pragma unroll
                for (int v = 0; v < 8; v++)
                    a[v] = j < k ? fmaf(wj[u], dv[v], a[v]) : a[v] + dv[v];
            }
        }
    }
    uint4 o;
    __nv_bfloat162 b0 = __floats2bfloat162_rn(a[0], a[1]), b1 = __floats2bfloat162_rn(a[2], a[3]);
    __nv_bfloat162 b2 = __floats2bfloat162_rn(a[4], a[5]), b3 = __floats2bfloat162_rn(a[6], a[7]);
    o.x = *reinterpret_cast<uint32_t *>(&b0);
    o.y = *reinterpret_cast<uint32_t *>(&b1);
    o.z = *reinterpret_cast<uint32_t *>(&b2);
    o.w = *reinterpret_cast<uint32_t *>(&b3);
    *reinterpret_cast<uint4 *>(y + (size_t)t * H + c) = o;
}

/* Row tiles per task for a phase of `tiles` tiles on `grid` CTAs: as many as
 * NTILE_MAX while every CTA still gets NTILE_WAVES tasks. Longer
 * tasks pay the pipeline fill, the split-K barrier and the claim once per
 * NTILE tiles; small batches keep one tile per task so every SM streams. */
__device__ __forceinline__ unsigned ntile_for(unsigned tiles, unsigned grid)
{
    unsigned n = tiles / (NTILE_WAVES * grid);
    return n < 1 ? 1u : n > NTILE_MAX ? (unsigned)NTILE_MAX : n;
}

/* CTA 0 copies a batch's ids and w (n entries each) from where the host put
 * them (mapped host memory: PCIe) into device memory. Every load of a round
 * is issued before any is used: one round trip per THREADS * XR entries, not
 * per THREADS (H200: release 11.8 us at T = 64 and 39.9 at T = 256 when
 * each thread waited for its load). XR = 2: more, inlined or not, makes the
 * persistent kernel spill. */
__device__ __forceinline__ void stage_routing(unsigned n, const int32_t *ids, const float *w,
                                              int32_t *ids_s, float *w_s)
{
    constexpr unsigned XR = 2;
    for (unsigned i0 = 0; i0 < n; i0 += THREADS * XR) {
        int32_t a[XR];
        float b[XR];
#pragma unroll
        for (unsigned j = 0; j < XR; j++) {
            const unsigned i = i0 + j * THREADS + threadIdx.x;
            if (i < n) {
                a[j] = __ldcv(ids + i);
                b[j] = __ldcv(w + i);
            }
        }
#pragma unroll
        for (unsigned j = 0; j < XR; j++) {
            const unsigned i = i0 + j * THREADS + threadIdx.x;
            if (i < n) {
                ids_s[i] = a[j];
                w_s[i] = b[j];
            }
        }
    }
}


/* A batch's per-batch values, in shared memory (written by thread 0 after
 * plan_tasks, read after the task loop's barriers), so the persistent loop
 * does not hold them in registers across every task (the task code needs
 * them: at 128 registers one more live value spills). */
struct batch_plan {
    struct moe_gpu_layer L;
    uint16_t *y;
    unsigned ntg, ntd;             /* tiles per one-chunk task, per phase */
    unsigned n_gu, n_dn, total;    /* tasks: gate_up, down, all (with combine) */
    unsigned n_cu, n_cblk;         /* combine units, 256-column blocks per token */
    unsigned gu_tiles, dn_tiles;   /* chunk x tile counts (the counters' targets) */
};

/* The work split of batch (layer, T, y) once routed (every thread). Row
 * tiles per one-chunk task: up to NTILE_MAX while the batch still has
 * NTILE_WAVES tasks per CTA (small T keeps 1: every SM busy). */
__device__ __forceinline__ void plan_batch(const struct moe_gpu_params &p, const route &r,
                                           const struct moe_gpu_layer &L, unsigned T, uint16_t *y,
                                           unsigned RT_GU, unsigned RT_DN, const task_plan &tp,
                                           batch_plan &bp)
{
    const unsigned NE = p.d.n_experts + p.d.n_shared, n_ch = r.chs[NE];
    const unsigned gu_tiles = n_ch * RT_GU, dn_tiles = n_ch * RT_DN;
    const unsigned ntg = ntile_for(gu_tiles, gridDim.x), ntd = ntile_for(dn_tiles, gridDim.x);
    plan_tasks(r, NE, ntg, ntd, RT_GU, RT_DN, tp);
    if (threadIdx.x == 0) {
        const unsigned n_cblk = (p.d.hidden + 255) / 256, n_cu = T * n_cblk;
        bp.L = L;
        bp.y = y;
        bp.ntg = ntg;
        bp.ntd = ntd;
        bp.n_gu = tp.tgu[NE];
        bp.n_dn = tp.tdn[NE];
        bp.total = bp.n_gu + bp.n_dn + (n_cu + NWARPS - 1) / NWARPS;
        bp.n_cu = n_cu;
        bp.n_cblk = n_cblk;
        bp.gu_tiles = gu_tiles;
        bp.dn_tiles = dn_tiles;
    }
}
