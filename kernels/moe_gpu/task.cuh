/* task.cuh - a gate_up or down task for the whole CTA (split-K over the
 * warps, the fixed-order reduction, the epilogues), the combine unit, the
 * tiles-per-task choice and the staging of a batch's routing inputs. Part of
 * the one translation unit moe_gpu.cu. */

/* Split-K of a task across the CTA: each tile's K units are dealt to the
 * warps round robin (warp w: units w, w + NWARPS, ...: the CTA's warps move
 * through the weights together, one contiguous window at a time), each warp
 * parks its per-tile partials in its own (drained) stage buffer, and warp
 * w < ntiles sums tile w's NWARPS partials in warp order (fixed:
 * deterministic) into out. Thread 0 claims the CTA's next task from *ctr
 * into next as the K loop ends. Every thread of the CTA calls this. */
template <int NT, int NTILE>
__device__ __forceinline__ void task_splitk(const uint8_t *wtask, unsigned tile_units,
                                            unsigned ntiles, const xsrc &xs, uint8_t *sw,
                                            uint8_t *sw_cta,
                                            float (&out)[MR][NT][4], unsigned *ctr,
                                            unsigned &next)
{
    static_assert(NTILE * 32 * MR * NT * 4 * sizeof(float) <= WARP_SMEM,
                  "partials of a task must fit a warp's stage buffer");
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned nuw = tile_units > warp ? (tile_units - warp + NWARPS - 1) / NWARPS : 0;
    static_assert(NT == 1 && (NTILE == 1 || NTILE == NTILE_MAX),
                  "a narrow chunk: one tile or NTILE_MAX");
    float acc[NTILE][MR][NT][4];
    if constexpr (NTILE > 1) { /* tiles interleaved per K unit (v17) */
        if (ntiles == NTILE) /* constant ring offsets (v19) */
            task_mma_full<NTILE, 1, NTILE>(wtask, warp, nuw, tile_units, xs, sw, acc);
        else
            task_mma_il<1, NTILE, STAGES>(wtask, warp, nuw, ntiles, tile_units, xs, sw, acc);
    } else {
        if (tile_units % (NWARPS * STAGES) == 0) /* every warp: a multiple of STAGES units */
            task_mma_full1(wtask, warp, nuw, xs, sw, acc);
        else
            task_mma<1, 1>(wtask, warp, nuw, ntiles, tile_units, xs, sw, acc);
    }
    /* the CTA's next task, claimed as its K loop ends: the claim's round
     * trip runs beside the reduction and the epilogue */
    if (threadIdx.x == 0 && ctr)
        next = atomicAdd(ctr, 1u);
    /* tile j's partials: float4 (m, n) of lane l at [j][m * NT + n][l] (each
     * 8-lane phase of a 16-byte access one contiguous 128 bytes: no bank
     * conflicts) */
    constexpr int Q = MR * NT; /* float4 per lane per tile */
#pragma unroll
    for (int j = 0; j < NTILE; j++) {
        if ((unsigned)j < ntiles) {
            float4 *mine = reinterpret_cast<float4 *>(sw) + j * Q * 32 + lane;
#pragma unroll
            for (int m = 0; m < MR; m++)
#pragma unroll
                for (int n = 0; n < NT; n++)
                    mine[(m * NT + n) * 32] = make_float4(acc[j][m][n][0], acc[j][m][n][1],
                                                          acc[j][m][n][2], acc[j][m][n][3]);
        }
    }
    __syncthreads();
    TLOG_STAMP(3); /* every warp's K loop done */
    zero_acc<NT>(out);
    if (warp < ntiles) {
        /* in rounds of R float4 per lane per warp (all of a narrow task's at
         * once; a wide task's per sub-tile: its registers) */
        constexpr int R = NT == 1 ? Q : NT;
#pragma unroll
        for (int q0 = 0; q0 < Q; q0 += R) {
            float4 part[NWARPS][R];
#pragma unroll
            for (unsigned w = 0; w < NWARPS; w++)
#pragma unroll
                for (int q = 0; q < R; q++)
                    part[w][q] = reinterpret_cast<const float4 *>(sw_cta + w * WARP_SMEM)[
                        (warp * Q + q0 + q) * 32 + lane];
#pragma unroll
            for (unsigned w = 0; w < NWARPS; w++)
#pragma unroll
                for (int q = 0; q < R; q++) {
                    const float4 v = part[w][q];
                    float *o = out[(q0 + q) / NT][(q0 + q) % NT];
                    o[0] += v.x;
                    o[1] += v.y;
                    o[2] += v.z;
                    o[3] += v.w;
                }
        }
    }
}

/* task_splitm (below) for NT <= 2 (9-16 pairs): the units in K order, 0, 1, 2, ...,
 * unit v into ring slot v % STAGES and its MMAs into residue v % NWARPS's
 * own chain, cur[v % NWARPS], from zero; the NWARPS chains added to the sums
 * at the end in task_splitk's order. Each chain sees its units in the order
 * split-K's warp r does (r, r + 4, ...), so the sums are the residue order's
 * and split-K's, bit for bit. With STAGES == NWARPS the unrolled group of
 * NWARPS units has constant ring slots, chains and offsets, and the tile's
 * units stream from one running pointer (no residue wrap): the accumulators
 * are NWARPS x MR x NT x 4 (64 floats at NT 2; at NT 4 they would not fit).
 * 166.5 instructions per unit against the residue loop's 181 (sm_90a), no
 * spills added; H100 2026-12-07: DeepSeek-V3 T = 256 -0.65 %, Qwen3 T = 128
 * -0.6 %, the rest within 0.5 % (bench/NOTES.md stop 50). */
template <int NT>
__device__ __forceinline__ void task_splitm_nat(const uint8_t *wtask, unsigned tile_units,
                                                const xsrc &xs, uint8_t *sw_cta,
                                                float (&out)[MR][NT][4], unsigned *ctr,
                                                unsigned &next)
{
    constexpr unsigned UB = MOE_GPU_UNIT_BYTES, N = NT * 8, XB = N * X_ROW_BYTES, WS = STAGES;
    static_assert(WS == NWARPS, "unit v: ring slot v % STAGES and chain v % NWARPS, the same");
    static_assert(WS * (NWARPS * UB + XB) <= NWARPS * WARP_SMEM, "rings fit the stage buffers");
    static_assert(N * 8 % THREADS == 0, "every thread copies as many row chunks");
    static_assert(UL >= 16, "lanes >= UL repeat a lane below UL");
    constexpr int XR = N * 8 / THREADS;
    const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned xring = (unsigned)__cvta_generic_to_shared(sw_cta); /* WS x XB */
    const unsigned lw = (lane < UL ? lane : lane - (32 - UL)) * 16; /* lanes >= UL repeat */
    const unsigned wdst = xring + WS * XB + warp * WS * UB + lw;     /* this warp's WS x UB */
    const uint8_t *const wring = sw_cta + WS * XB + warp * WS * UB;
    const uint8_t *wsrc = wtask + (size_t)warp * tile_units * UB + lw; /* unit g of the group */
    const uint16_t *xrow[XR];
    unsigned xdst[XR];
    bool xon[XR];
    x_rows_cta(xs, xring, xrow, xdst, xon);
    /* unit g + d into ring slot s */
    auto copy = [&](unsigned d, unsigned s, unsigned xoff) {
#pragma unroll
        for (unsigned k = 0; k < UC / UL; k++)
            cp_async16_s(wdst + s * UB + k * UL * 16, wsrc + d * UB + k * UL * 16);
#pragma unroll
        for (int i = 0; i < XR; i++)
            cp_async16_if(xdst[i] + s * XB, xrow[i] + xoff + d * MOE_GPU_UNIT_K, xon[i]);
    };
    float cur[NWARPS][MR][NT][4];
#pragma unroll
    for (unsigned r = 0; r < NWARPS; r++)
        zero_acc<NT>(cur[r]);
    /* (tile_units is a multiple of NWARPS, so of WS: at least WS units) */
#pragma unroll
    for (unsigned j = 0; j + 1 < WS; j++) {
        copy(j, j, 0);
        cp_async_commit();
    }
    x_pad_zero<N>(sw_cta, XB, WS, xs.cnt, tid, THREADS);
    unsigned xoff = 0; /* elements: g units */
#pragma unroll 1
    for (unsigned g = 0; g < tile_units; g += WS) {
        const bool more = g + WS < tile_units;
#pragma unroll
        for (unsigned j = 0; j < WS; j++) {
            cp_async_wait<WS - 2>();
            __syncthreads(); /* unit g + j in, for every warp; every warp past the last */
            /* issue unit g + j + WS - 1 into slot (j + WS - 1) % WS */
            if (j == 0 || more)
                copy(j + WS - 1, (j + WS - 1) % WS, xoff);
            cp_async_commit();
            uint4 xb[NT][2];
            load_b<NT>(sw_cta + j * XB, xb);
            unit_mma<NT>(wring + j * UB, xb, cur[j]);
        }
        wsrc += WS * UB;
        xoff += WS * MOE_GPU_UNIT_K;
    }
    if (tid == 0 && ctr)
        next = atomicAdd(ctr, 1u);
    zero_acc<NT>(out);
#pragma unroll
    for (unsigned r = 0; r < NWARPS; r++)
        acc_fold<NT>(out, cur[r]); /* warp r's partial, in task_splitk's order */
    cp_async_wait<0>();
    __syncthreads(); /* the rings are the next task's */
    TLOG_STAMP(3); /* (no partials: the K loop's end) */
}

/* Split-M of a crowded chunk's task (9 to SPLITM_TOKENS pairs, NTILE_MAX
 * tiles, tile_units % NWARPS == 0): warp w owns tile w over the whole K,
 * its weights through its own STAGES-deep cp.async ring; the task's rows of
 * a K unit are copied once by the CTA into a shared ring of as many stages
 * (the CTA's stage buffers hold both), one CTA barrier per K unit. At NT 4
 * the units are streamed in split-K's residue order (0, 4, 8, ..., then 1, 5, 9, ...),
 * each residue's chain from zero and added to out at its end, in the order
 * task_splitk's reduction adds the warps' partials: the same floats in the
 * same order as the split-K task, so a token's result does not depend on
 * which kind its chunk took (batch invariance). The dequant is done once
 * per weight unit for all the chunk's pairs (bench/NOTES.md stop 37,
 * splitm_probe). Thread 0 claims the CTA's next task into next as the K loop
 * ends. Every thread of the CTA calls this. */
template <int NT>
__device__ __forceinline__ void task_splitm(const uint8_t *wtask, unsigned tile_units,
                                            const xsrc &xs, uint8_t *sw_cta,
                                            float (&out)[MR][NT][4], unsigned *ctr,
                                            unsigned &next)
{
    if constexpr (NT <= 2) { /* the residues' chains side by side (below) */
        task_splitm_nat<NT>(wtask, tile_units, xs, sw_cta, out, ctr, next);
        return;
    }
    constexpr unsigned UB = MOE_GPU_UNIT_BYTES, N = NT * 8, XB = N * X_ROW_BYTES, WS = STAGES;
    static_assert(WS * (NWARPS * UB + XB) <= NWARPS * WARP_SMEM, "rings fit the stage buffers");
    static_assert(N * 8 % THREADS == 0, "every thread copies as many row chunks");
    constexpr int XR = N * 8 / THREADS;
    const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint8_t *const xring = sw_cta;                            /* WS x XB */
    uint8_t *const wring = sw_cta + WS * XB + warp * WS * UB; /* this warp's WS x UB */
    const unsigned lw = (lane < UL ? lane : lane - (32 - UL)) * 16; /* lanes >= UL repeat */
    const uint8_t *const wt = wtask + (size_t)warp * tile_units * UB + lw;
    const unsigned wring_s = (unsigned)__cvta_generic_to_shared(wring) + lw;
    const uint16_t *xrow[XR];
    unsigned xdst[XR];
    bool xon[XR];
    x_rows_cta(xs, (unsigned)__cvta_generic_to_shared(xring), xrow, xdst, xon);
    const unsigned q4 = tile_units / NWARPS; /* units per residue */
    float cur[MR][NT][4];
    zero_acc<NT>(out);
    zero_acc<NT>(cur);
    /* unit j of the stream goes through ring slot j % WS; the next unit to
     * issue is iu (residue iu % NWARPS), the (ni)th */
    static_assert((WS & (WS - 1)) == 0, "the ring's slot is a mask of the unit's count");
    unsigned iu = 0, ni = 0;
    auto issue = [&]() {
        /* past the last unit: no copies (predicated, no branch around them) */
        const bool live = ni < tile_units;
        const unsigned is = ni & (WS - 1);
#pragma unroll
        for (unsigned k = 0; k < UC / UL; k++)
            cp_async16_if(wring_s + is * UB + k * UL * 16, wt + (size_t)iu * UB + k * UL * 16,
                          live);
#pragma unroll
        for (int i = 0; i < XR; i++)
            cp_async16_if(xdst[i] + is * XB, xrow[i] + (size_t)iu * MOE_GPU_UNIT_K,
                          xon[i] && live);
        iu += NWARPS;
        if (iu >= tile_units)
            iu -= tile_units - 1; /* the next residue's first unit */
        ni++;
        cp_async_commit();
    };
#pragma unroll
    for (unsigned s = 0; s + 1 < WS; s++)
        issue();
    x_pad_zero<N>(xring, XB, WS, xs.cnt, tid, THREADS);
    unsigned j = 0; /* units consumed */
#pragma unroll 1
    for (unsigned r = 0; r < NWARPS; r++) {
#pragma unroll 1
        for (unsigned i = 0; i < q4; i++) {
            cp_async_wait<WS - 2>();
            __syncthreads(); /* this unit in, for every warp; every warp past the last */
            issue();
            const unsigned s = j & (WS - 1);
            uint4 xb[NT][2];
            load_b<NT>(xring + s * XB, xb);
            unit_mma<NT>(wring + s * UB, xb, cur);
            j++;
        }
        acc_fold<NT>(out, cur); /* residue r's chain done: added as warp r's partial */
    }
    if (tid == 0 && ctr)
        next = atomicAdd(ctr, 1u);
    cp_async_wait<0>();
    __syncthreads(); /* the rings are the next task's */
    TLOG_STAMP(3); /* (no partials: the K loop's end) */
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
                                        uint8_t *sw_cta, unsigned *ctr, unsigned &next)
{
    const unsigned warp = threadIdx.x >> 5;
    const task_src ts = is_gu ? gu_src(p, L, r, e, p0, cnt, rt0) : dn_src(p, L, e, p0, cnt, rt0);
    float acc[MR][NT][4];
    task_splitk<NT, NTILE>(ts.wt, ts.units, ntiles, ts.xs, sw, sw_cta, acc, ctr, next);
    TLOG_STAMP(4); /* reduced (warp 0's tile) */
    if (warp >= ntiles)
        return;
    if (is_gu)
        gu_epilogue<NT>(p, L, e, p0, cnt, rt0 + warp, acc);
    else
        dn_epilogue<NT>(p, L, e, p0, cnt, rt0 + warp, acc);
    TLOG_STAMP(5); /* warp 0's epilogue issued */
}

/* A crowded chunk's task (whole CTA, task_splitm): warp w's tile rt0 + w,
 * its epilogue. */
template <int NT>
__device__ __forceinline__ void mm_task_splitm(const struct moe_gpu_params &p,
                                               const struct moe_gpu_layer &L, const route &r,
                                               bool is_gu, unsigned e, unsigned p0, unsigned cnt,
                                               unsigned rt0, uint8_t *sw_cta, unsigned *ctr,
                                               unsigned &next)
{
    const unsigned warp = threadIdx.x >> 5;
    const task_src ts = is_gu ? gu_src(p, L, r, e, p0, cnt, rt0) : dn_src(p, L, e, p0, cnt, rt0);
    float acc[MR][NT][4];
    task_splitm<NT>(ts.wt, ts.units, ts.xs, sw_cta, acc, ctr, next);
    TLOG_STAMP(4);
    if (is_gu)
        gu_epilogue<NT>(p, L, e, p0, cnt, rt0 + warp, acc);
    else
        dn_epilogue<NT>(p, L, e, p0, cnt, rt0 + warp, acc);
    TLOG_STAMP(5);
}

/* One gate_up or down task (whole CTA): a narrow chunk (one n-tile) tile by
 * tile when nt = 1, else up to NTILE_MAX tiles interleaved (split-K); a
 * crowded chunk (9 to SPLITM_TOKENS pairs) in a task of NTILE_MAX tiles as a
 * split-M task. Inlined: as a function of its
 * own (own registers, the persistent loop saving its live registers around
 * the call) it was 1-7% slower (H200 2026-11-30, bench/NOTES.md v20). */
__device__ __forceinline__ void run_task(const struct moe_gpu_params &p,
                                         const struct moe_gpu_layer &L, const route &r,
                                         bool is_gu, unsigned nt, unsigned e, unsigned p0,
                                         unsigned cnt, unsigned rt0, unsigned ntiles, uint8_t *sw,
                                         uint8_t *sw_cta, unsigned *ctr, unsigned &next)
{
    const unsigned units = (is_gu ? p.d.hidden : p.d.inter) / MOE_GPU_UNIT_K;
    if (cnt > CHUNK_TOKENS && ntiles == NTILE_MAX && units % NWARPS == 0) { /* crowded: split-M */
        if (cnt <= 2 * CHUNK_TOKENS)
            mm_task_splitm<2>(p, L, r, is_gu, e, p0, cnt, rt0, sw_cta, ctr, next);
        else
            mm_task_splitm<SPLITM_NT>(p, L, r, is_gu, e, p0, cnt, rt0, sw_cta, ctr, next);
        return;
    }
    /* a narrow chunk; or a crowded one in a shorter task (an expert's last
     * tile group, a batch of one-tile tasks) or of a shape whose K units do
     * not divide among the warps, as narrow passes of up to 8 pairs one
     * after another (the same sums per column), the next task claimed in
     * the last */
    for (unsigned c0 = 0;;) {
        const unsigned n = min(cnt - c0, (unsigned)CHUNK_TOKENS);
        const bool last = c0 + n == cnt;
        if (nt > 1)
            mm_task<1, NTILE_MAX>(p, L, r, is_gu, e, p0 + c0, n, rt0, ntiles, sw, sw_cta,
                                  last ? ctr : nullptr, next);
        else
            mm_task<1, 1>(p, L, r, is_gu, e, p0 + c0, n, rt0, ntiles, sw, sw_cta,
                          last ? ctr : nullptr, next);
        if (last)
            return;
        c0 += n;
        __syncthreads(); /* every warp has read the partials: the stages are free */
    }
}

/* combine unit: token t, columns [256 blk, 256 blk + 256) (8 per lane).
 * Slots in fixed order (routed j = 0..k-1 weighted, then shared s = 0..S-1
 * with weight 1), fp32, one bf16 rounding: deterministic. Every slot's rows
 * are copied at once (cp.async, up to CMB_SLOTS per round) into the warp's
 * stage buffer sw, free in a combine task, then summed: two round trips
 * (pos, then the rows) per round, where loading 2 slots at a time into
 * registers took KS / 2 (H200 2026-12-04: Qwen3 T = 1's combine task ran 2.9
 * us). Writes y (device or mapped host memory) with 16-byte stores. */
constexpr unsigned CMB_SLOTS = WARP_SMEM / (32 * 32); /* 32 bytes per lane per slot */
__device__ void combine_unit(const struct moe_gpu_params &p, const route &r, unsigned t,
                             unsigned blk, uint16_t *y, uint8_t *sw)
{
    const unsigned H = p.d.hidden, k = p.d.top_k, KS = k + p.d.n_shared;
    const unsigned lane = threadIdx.x & 31;
    const unsigned c = blk * 256 + lane * 8;
    const bool in = c < H;
    /* token t's routing weights, lane j holding slot j's (j < k <= 32 is
     * not assumed: a slot past 32 reloads it) */
    const float wl = lane < k ? __ldcg(p.w_s + (size_t)t * k + lane) : 1.f;
    float a[8];
#pragma unroll
    for (int v = 0; v < 8; v++)
        a[v] = 0.f;
    for (unsigned j0 = 0; j0 < KS; j0 += CMB_SLOTS) {
        const unsigned n = min(CMB_SLOTS, KS - j0);
        if (in)
            for (unsigned u = 0; u < n; u++) {
                const float *src = p.dout + (size_t)r.pos[t * KS + j0 + u] * H + c;
                cp_async16(sw + ((2 * u) * 32 + lane) * 16, src);
                cp_async16(sw + ((2 * u + 1) * 32 + lane) * 16, src + 4);
            }
        cp_async_commit();
        cp_async_wait<0>();
        __syncwarp();
        for (unsigned u = 0; u < n; u++) {
            const unsigned j = j0 + u;
            const float wsl = __shfl_sync(0xffffffffu, wl, j & 31);
            const float wj = j < k ? (j < 32 ? wsl : __ldcg(p.w_s + (size_t)t * k + j)) : 1.f;
            const float4 d0 = *reinterpret_cast<const float4 *>(sw + ((2 * u) * 32 + lane) * 16);
            const float4 d1 =
                *reinterpret_cast<const float4 *>(sw + ((2 * u + 1) * 32 + lane) * 16);
            const float dv[8] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
#pragma unroll
            for (int v = 0; v < 8; v++)
                a[v] = j < k ? fmaf(wj, dv[v], a[v]) : a[v] + dv[v];
        }
        __syncwarp(); /* the next round's copies overwrite sw */
    }
    if (!in)
        return;
    uint4 o;
    __nv_bfloat162 b0 = __floats2bfloat162_rn(a[0], a[1]), b1 = __floats2bfloat162_rn(a[2], a[3]);
    __nv_bfloat162 b2 = __floats2bfloat162_rn(a[4], a[5]), b3 = __floats2bfloat162_rn(a[6], a[7]);
    o.x = *reinterpret_cast<uint32_t *>(&b0);
    o.y = *reinterpret_cast<uint32_t *>(&b1);
    o.z = *reinterpret_cast<uint32_t *>(&b2);
    o.w = *reinterpret_cast<uint32_t *>(&b3);
    *reinterpret_cast<uint4 *>(y + (size_t)t * H + c) = o;
}

/* ROWS (expert parallelism), after every down tile of the batch: this
 * CTA's share of the computed entries' rows (pos not the zero row) copied
 * from dout to rows + (t * KS + j) * H, 8 floats per lane, one (entry, 256
 * columns) unit per warp, the units dealt over every warp of the grid (not
 * in the task loop: a COMBINE batch, likewise, is the plain combine over
 * rows the x staging copied into dout, build_route; no second copy of the
 * combine's code, which cost 8 spill bytes on sm_90a and ~300 on sm_120a,
 * some of them in the task loop). Plain stores (rows may be a peer GPU's
 * memory, mapped): the caller's system-scope fence, then the batch's
 * release of done_seq, publish them. */
__device__ __forceinline__ void ep_rows_copy(const struct moe_gpu_params &p, const route &r,
                                             unsigned T, float *rows)
{
    const unsigned H = p.d.hidden, KS = p.d.top_k + p.d.n_shared;
    const unsigned zero = p.d.max_tokens * KS, n_cblk = (H + 255) / 256;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned n_u = T * KS * n_cblk;
    for (unsigned u = blockIdx.x * NWARPS + warp; u < n_u; u += gridDim.x * NWARPS) {
        const unsigned i = u / n_cblk, c = (u - i * n_cblk) * 256 + lane * 8;
        const unsigned pos = r.pos[i];
        if (pos == zero || c >= H)
            continue;
        const float4 *src = reinterpret_cast<const float4 *>(p.dout + (size_t)pos * H + c);
        float4 *dst = reinterpret_cast<float4 *>(rows + (size_t)i * H + c);
        const float4 a = __ldcg(src), b = __ldcg(src + 1);
        dst[0] = a;
        dst[1] = b;
    }
}

/* The batch's task order. n_gu gate_up tasks; the down tasks of part 0 (tile
 * groups [0, dp0) of every chunk, dp0 at most SPLIT_EIGHTHS eighths of them
 * and ending on a column block: the rows of y's first dp0 NTD / 8 column
 * blocks of 256); then part 1's (tile groups [dp0, TPC_DN)) with the n_c0
 * combine tasks of part 0's column blocks mixed in evenly after `lag` down
 * tasks (one per CTA, while part 0's last ones finish); then the other
 * combine tasks. So most of y is summed and written (over PCIe, where y is
 * host memory) while part 1's weights stream, not after the last down tile:
 * with y in device memory instead, Qwen3 T = 256 took 6.7 % less (H100
 * 2026-12-06, bench/NOTES.md stop 39). Each part's tasks are expert-major,
 * tile group, then chunk (a crowded expert's chunks back to back: its tile
 * group re-read from L2). Combine units are column-block major (unit u:
 * block u / T, token u % T). dp0 = 0 (one part, the down tasks in one
 * expert-major order) when y has one column block, the batch has no combine
 * or fewer than SPLIT_T tokens. */
struct sched {
    unsigned n_gu, n_dn0, n_dn1, n_c0, lag, dp0, tiles0;
};
__device__ __forceinline__ sched make_sched(unsigned n_ch, unsigned TPC_GU, unsigned TPC_DN,
                                            unsigned NTD, unsigned T, unsigned n_cblk,
                                            bool combine)
{
    sched s;
    s.dp0 = 0;
    if (combine && n_cblk > 1 && T >= SPLIT_T)
        for (unsigned q = TPC_DN * SPLIT_EIGHTHS / 8; q > 0; q--)
            if (q * NTD % 8 == 0) { /* part 0 ends on a column block */
                s.dp0 = q;
                break;
            }
    s.n_gu = n_ch * TPC_GU;
    s.n_dn0 = n_ch * s.dp0;
    s.n_dn1 = n_ch * (TPC_DN - s.dp0);
    s.n_c0 = s.dp0 * NTD / 8 * T / NWARPS; /* whole tasks of part 0's blocks */
    s.lag = min(s.n_dn1, gridDim.x);
    s.tiles0 = s.n_dn0 * NTD;
    return s;
}
/* Task t's kind (0 gate_up, 1 down of part 0, 2 down of part 1, 3 combine)
 * and its index among its kind's tasks in order */
struct pick {
    unsigned kind, i;
};
__device__ __forceinline__ pick pick_task(const sched &s, unsigned t)
{
    if (t < s.n_gu)
        return {0, t};
    t -= s.n_gu;
    if (t < s.n_dn0)
        return {1, t};
    t -= s.n_dn0;
    if (t >= s.n_dn1 + s.n_c0)
        return {3, t - s.n_dn1};
    if (t < s.lag || s.n_c0 == 0)
        return {2, t};
    /* slot m of the mix: a combine task where the running share of them
     * steps up (k1 > k0) */
    const unsigned m = t - s.lag, tot = s.n_dn1 - s.lag + s.n_c0;
    const unsigned k0 = (unsigned)((unsigned long long)m * s.n_c0 / tot);
    const unsigned k1 = (unsigned)((unsigned long long)(m + 1) * s.n_c0 / tot);
    return k1 > k0 ? pick{3, k0} : pick{2, s.lag + m - k1};
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

/* CTA 0 copies a batch's ids and w (n entries each) from where the client
 * or the host put them (client GPU memory, or mapped host memory: PCIe) into
 * device memory, through its own stage buffers (buf: free between batches):
 * the 16-byte blocks that hold them are copied with cp.async.cg (L2, never
 * a stale L1 line of the last batch), all in flight at once, so a pass costs
 * one round trip whatever n (H200: register loads two per thread cost one
 * round trip per 256 entries, 8 at T = 256 and k = 8, +4 us in the doorbell's
 * take; more loads per thread in registers made the persistent kernel
 * spill). A block can start before ids or end after w + n: it never crosses
 * a page, and those bytes are not used. With check (a doorbell descriptor's
 * ids, from client GPU memory) every id is checked as it is staged
 * (moe_gpu_id_ok) and a bad one staged as -1; returns whether this thread saw
 * a bad one. Every thread of CTA 0 calls this. */
__device__ __forceinline__ bool stage_routing(unsigned n, const int32_t *ids, const float *w,
                                              int32_t *ids_s, float *w_s, uint8_t *buf,
                                              bool check = false, unsigned n_experts = 0,
                                              unsigned flags = 0)
{
    /* entries per pass: each array's blocks in half of the CTA's stage buffers */
    constexpr unsigned HALF = NWARPS * WARP_SMEM / 2, CAP = (HALF - 16) / 4;
    bool bad = false;
    for (unsigned i0 = 0; i0 < n; i0 += CAP) {
        const unsigned m = min(CAP, n - i0);
        const uintptr_t a0 = (uintptr_t)(ids + i0), b0 = (uintptr_t)(w + i0);
        const uintptr_t a16 = a0 & ~(uintptr_t)15, b16 = b0 & ~(uintptr_t)15;
        const unsigned na = (unsigned)((a0 + 4 * m + 15 - a16) / 16);
        const unsigned nb = (unsigned)((b0 + 4 * m + 15 - b16) / 16);
        for (unsigned c = threadIdx.x; c < na + nb; c += THREADS) {
            if (c < na)
                cp_async16(buf + 16 * c, (const void *)(a16 + 16 * c));
            else
                cp_async16(buf + HALF + 16 * (c - na), (const void *)(b16 + 16 * (c - na)));
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        const int32_t *sa = reinterpret_cast<const int32_t *>(buf + (a0 - a16));
        const float *sb = reinterpret_cast<const float *>(buf + HALF + (b0 - b16));
        for (unsigned i = threadIdx.x; i < m; i += THREADS) {
            int32_t a = sa[i];
            if (check && !moe_gpu_id_ok(a, n_experts, flags)) {
                bad = true;
                a = -1; /* never routed: the batch is not released */
            }
            ids_s[i0 + i] = a;
            w_s[i0 + i] = sb[i];
        }
        __syncthreads(); /* buf is the next pass's */
    }
    return bad;
}
