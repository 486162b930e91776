/* pipeline.cuh - one warp's share of a task: the cp.async stage rings that
 * stream a task's weight units and activation rows through shared memory,
 * and the MMA chains over them (one general version, task_mma; the
 * tile-interleaved one, task_mma_il; the two steady states with constant
 * ring offsets, task_mma_full and task_mma_full1: the same sums in the same
 * order, bench/NOTES.md v17, v19). Part of the one translation unit
 * moe_gpu.cu. */

/* Activation rows of a task: row r at base + (tok ? tok[p0 + r] : p0 + r) * ld. */
struct xsrc {
    const uint16_t *base;
    const uint16_t *tok;
    unsigned p0, ld, cnt;
};

/* The activation chunks thread th of nth copies into a stage: chunk c = th
 * + nth i is row c / 8 of the task's rows, 16-byte part c % 8; xrow[i]
 * points at it plus off elements, or is null for a row at or past cnt. A
 * warp's own stages: th = lane, nth = 32 (the default); the CTA's shared
 * ring (task_splitm): th = threadIdx.x, nth = THREADS. */
template <int XR>
__device__ __forceinline__ void x_rows(const xsrc &xs, size_t off, const uint16_t *(&xrow)[XR],
                                       unsigned th = threadIdx.x & 31, unsigned nth = 32)
{
#pragma unroll
    for (int i = 0; i < XR; i++) {
        const unsigned c = th + nth * i, row = c >> 3;
        xrow[i] = row < xs.cnt
                      ? xs.base + (size_t)(xs.tok ? xs.tok[xs.p0 + row] : xs.p0 + row) * xs.ld +
                            (c & 7) * 8 + off
                      : nullptr;
    }
}

/* x_rows for the CTA's shared ring of a split-M task (th = threadIdx.x, nth
 * = THREADS), with each chunk's shared-space address in a slot at xring and
 * whether it is copied: a row at or past cnt is not (cp_async16_if: its slot
 * keeps the zeros of x_pad_zero, read only by the columns of no pair) */
template <int XR>
__device__ __forceinline__ void x_rows_cta(const xsrc &xs, unsigned xring,
                                           const uint16_t *(&xrow)[XR], unsigned (&xdst)[XR],
                                           bool (&xon)[XR])
{
    x_rows(xs, 0, xrow, threadIdx.x, THREADS);
#pragma unroll
    for (int i = 0; i < XR; i++) {
        const unsigned c = threadIdx.x + THREADS * i;
        xdst[i] = xring + (c >> 3) * X_ROW_BYTES + (c & 7) * 16;
        xon[i] = xrow[i] != nullptr;
    }
}

/* Zero the rows at or past cnt (up to N, where an MMA's n-tiles end) of
 * nslots activation slots, slot s at x0 + s * stride, by thread th of nth.
 * No copy writes those rows during a task, and their columns of the MMA
 * results reach no output (load_b), so what they hold does not change a
 * sum; but rows left over from an earlier use of the stage memory (weight
 * codes, other tokens' rows) keep the tensor cores switching on data that is
 * thrown away, and at the power cap that energy is clock (bench/NOTES.md
 * stop 51, zpad). Once per task, after its first copies are issued (no copy
 * writes these rows); the barrier or __syncwarp before the first load_b
 * orders the stores before the reads. */
template <int N>
__device__ __forceinline__ void x_pad_zero(uint8_t *x0, unsigned stride, unsigned nslots,
                                           unsigned cnt, unsigned th = threadIdx.x & 31,
                                           unsigned nth = 32)
{
    if (cnt >= (unsigned)N)
        return;
    const unsigned nc = ((unsigned)N - cnt) * 8; /* 16-byte chunks per slot */
    /* both loops kept rolled: unrolled over the slots, they cost the
     * persistent kernel 4 more bytes of spills (bench/NOTES.md stop 52) */
#pragma unroll 1
    for (unsigned c = th; c < nc; c += nth) {
        uint8_t *d = x0 + (cnt + (c >> 3)) * X_ROW_BYTES + (c & 7) * 16;
#pragma unroll 1
        for (unsigned s = 0; s < nslots; s++)
            *reinterpret_cast<uint4 *>(d + s * stride) = make_uint4(0, 0, 0, 0);
    }
}

/* Zero a warp's accumulators: one tile's [MR][NT][4], or NTILE tiles' (unrolled,
 * constant indices: they stay in registers). */
template <int NT>
__device__ __forceinline__ void zero_acc(float (&a)[MR][NT][4])
{
#pragma unroll
    for (int m = 0; m < MR; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                a[m][n][c] = 0.f;
}
template <int NTILE, int NT>
__device__ __forceinline__ void zero_acc(float (&a)[NTILE][MR][NT][4])
{
#pragma unroll
    for (int j = 0; j < NTILE; j++)
        zero_acc<NT>(a[j]);
}

/* to += from, from = 0: a residue's chain added to the sums in the order
 * task_splitk's reduction adds the warps' partials (task_splitm) */
template <int NT>
__device__ __forceinline__ void acc_fold(float (&to)[MR][NT][4], float (&from)[MR][NT][4])
{
#pragma unroll
    for (int m = 0; m < MR; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                to[m][n][c] += from[m][n][c];
                from[m][n][c] = 0.f;
            }
}

/* acc[j] = src when j == i (i uniform across the warp; unrolled, so the
 * arrays stay in registers). */
template <int NTILE, int NT>
__device__ __forceinline__ void acc_store(float (&acc)[NTILE][MR][NT][4], unsigned i,
                                          float (&src)[MR][NT][4])
{
#pragma unroll
    for (int j = 0; j < NTILE; j++)
        if ((unsigned)j == i)
#pragma unroll
            for (int m = 0; m < MR; m++)
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        acc[j][m][n][c] = src[m][n][c];
}

/* B fragments (NT n-tiles of 8 tokens) of one K unit of activation rows at
 * xslot (X_ROW_BYTES apart). Rows at or past the task's count hold the
 * zeros of x_pad_zero: column n of an MMA's result depends on column n of B
 * alone, and the epilogues store only the columns of the task's pairs, so
 * those rows never reach an output (zeroing the fragments here instead took
 * 2 CS2R per n-tile and a compare per unit in the split-M loop). */
template <int NT>
__device__ __forceinline__ void load_b(const uint8_t *xslot, uint4 (&xb)[NT][2])
{
    const unsigned lane = threadIdx.x & 31, q = lane & 3, g = lane >> 2;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        const uint8_t *xp = xslot + (n * 8 + g) * X_ROW_BYTES + q * 32;
        xb[n][0] = *reinterpret_cast<const uint4 *>(xp);
        xb[n][1] = *reinterpret_cast<const uint4 *>(xp + 16);
    }
}

/* One warp's share of a task. The task's weights are ntiles consecutive row
 * tiles of tile_units K units each, stored back to back. In every tile this
 * warp takes K units w, w + NWARPS, ... (nuw of them): the same units it
 * would take of a one-tile task, so a tile's sum does not depend on how many
 * tiles its task has (batch invariance). It streams them tile after tile in
 * one STAGES-deep cp.async pipeline that does not drain between tiles; each
 * stage holds one weight unit and the same K unit of the task's activation
 * rows (only the cnt rows in use, 144-byte padded rows for conflict-free
 * fragment reads). Partial sums of tile j end in acc[j]. */
template <int NT, int NTILE>
__device__ __forceinline__ void task_mma(const uint8_t *__restrict__ wtask, unsigned w,
                                         unsigned nuw, unsigned ntiles, unsigned tile_units,
                                         const xsrc &xs, uint8_t *sw,
                                         float (&acc)[NTILE][MR][NT][4])
{
    constexpr unsigned SB = MOE_GPU_UNIT_BYTES + NT * 8 * X_ROW_BYTES; /* stage bytes */
    static_assert(STAGES * SB <= WARP_SMEM, "stages fit the warp's region");
    const unsigned nu = nuw * ntiles;
    const unsigned lane = threadIdx.x & 31;
    float cur[MR][NT][4];
    zero_acc<NT>(cur);
    zero_acc<NTILE, NT>(acc);
    const uint16_t *xrow[NT * 8 * 8 / 32];
    x_rows(xs, 0, xrow);

    /* position of the next unit to issue: tile ij, K unit iu of that tile,
     * ring slot is (no divisions per unit) */
    unsigned ij = 0, iu = w, is = 0;
    auto issue = [&](unsigned i) {
        if (i < nu) {
            const unsigned ux = iu;
            const uint8_t *src = wtask + ((size_t)ij * tile_units + ux) * MOE_GPU_UNIT_BYTES;
            uint8_t *dst = sw + is * SB;
            iu += NWARPS;
            if (iu >= tile_units) {
                iu = w;
                ij++;
            }
            is = is + 1 == STAGES ? 0 : is + 1;
            /* the unit's UC 16-byte chunks: lane l < UL copies chunks l, l + UL, ...
             * (each instruction one contiguous UL * 16 bytes; the offsets are
             * immediates, so one address per lane per unit) */
            if (lane < UL) {
#pragma unroll
                for (unsigned k = 0; k < UC / UL; k++)
                    cp_async16(dst + lane * 16 + k * UL * 16, src + lane * 16 + k * UL * 16);
            }
            uint8_t *xd = dst + MOE_GPU_UNIT_BYTES;
#pragma unroll
            for (int j = 0; j < NT * 8 * 8 / 32; j++)
                if (xrow[j])
                    cp_async16(xd + ((lane + 32 * j) >> 3) * X_ROW_BYTES + (lane & 7) * 16,
                               xrow[j] + (size_t)ux * MOE_GPU_UNIT_K);
        }
        cp_async_commit();
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        issue(s);
    x_pad_zero<NT * 8>(sw + MOE_GPU_UNIT_BYTES, SB, STAGES, xs.cnt);
    unsigned ti_cur = 0, left = nuw, cs = 0; /* units left in this tile, ring slot */
    for (unsigned i = 0; i < nu; i++) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();
        issue(i + STAGES - 1);
        if (NTILE > 1) {
            if (left == 0) { /* crossed into the next tile: park this one's sum */
                const unsigned ti = ti_cur + 1;
                left = nuw;
                acc_store<NTILE, NT>(acc, ti_cur, cur);
                zero_acc<NT>(cur);
                ti_cur = ti;
            }
            left--;
        }
        const uint8_t *slot = sw + cs * SB;
        cs = cs + 1 == STAGES ? 0 : cs + 1;
        uint4 xb[NT][2];
        load_b<NT>(slot + MOE_GPU_UNIT_BYTES, xb);
        unit_mma<NT>(slot, xb, cur);
    }
    if (nu)
        acc_store<NTILE, NT>(acc, ti_cur, cur);
    cp_async_wait<0>();
    __syncwarp();
}

/* Multi-tile tasks with one n-tile (bench/NOTES.md v17): the warp walks
 * its K units v = w, w + NWARPS, ... once and, at each, takes that K unit of
 * every tile j < ntiles (weight units (j, v), in this order, through the
 * STAGES-deep weight ring). The unit's activation rows are copied and their
 * B fragments read once for all ntiles weight units: a second ring of
 * STAGES activation slots fills the rest of the warp's stage memory. Tile
 * j's MMA chain still sees its K units in the one-tile order, from zero:
 * the same sums (batch invariance). */
template <int NT, int NTILE, int WS>
__device__ __forceinline__ void task_mma_il(const uint8_t *__restrict__ wtask, unsigned w,
                                            unsigned nuw, unsigned ntiles, unsigned tile_units,
                                            const xsrc &xs, uint8_t *sw,
                                            float (&acc)[NTILE][MR][NT][4])
{
    constexpr unsigned XB = NT * 8 * X_ROW_BYTES; /* one activation slot */
    static_assert(WS * (MOE_GPU_UNIT_BYTES + XB) <= WARP_SMEM, "rings fit the warp's region");
    /* WS activation slots: K step v's slot is refilled when unit (v + WS, 0)
     * is issued, WS - 1 units ahead of its use, so after the last use of
     * step v (WS - 1 < WS * ntiles - ntiles + 1 for any ntiles >= 1) */
    static_assert(WS >= 2, "two stages at least");
    const unsigned nu = nuw * ntiles;
    const unsigned lane = threadIdx.x & 31;
    uint8_t *const xring = sw + WS * MOE_GPU_UNIT_BYTES;
    zero_acc<NTILE, NT>(acc);
    constexpr int XR = NT * 8 * 8 / 32;
    const uint16_t *xrow[XR];
    x_rows(xs, 0, xrow);
    /* issue position: K unit ux of tile ij, weight slot is, activation slot ixs */
    unsigned ux = w, ij = 0, is = 0, ixs = 0;
    auto issue = [&](unsigned i) {
        if (i < nu) {
            const uint8_t *src = wtask + ((size_t)ij * tile_units + ux) * MOE_GPU_UNIT_BYTES;
            uint8_t *dst = sw + is * MOE_GPU_UNIT_BYTES;
            is = is + 1 == WS ? 0 : is + 1;
            if (lane < UL) {
#pragma unroll
                for (unsigned k = 0; k < UC / UL; k++)
                    cp_async16(dst + lane * 16 + k * UL * 16, src + lane * 16 + k * UL * 16);
            }
            if (ij == 0) {
                uint8_t *xd = xring + ixs * XB;
                ixs = ixs + 1 == WS ? 0 : ixs + 1;
#pragma unroll
                for (int j = 0; j < XR; j++)
                    if (xrow[j])
                        cp_async16(xd + ((lane + 32 * j) >> 3) * X_ROW_BYTES + (lane & 7) * 16,
                                   xrow[j] + (size_t)ux * MOE_GPU_UNIT_K);
            }
            if (++ij == ntiles) {
                ij = 0;
                ux += NWARPS;
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < WS - 1; s++)
        issue(s);
    x_pad_zero<NT * 8>(xring, XB, WS, xs.cnt);
    unsigned i = 0, cs = 0, cx = 0;
    for (unsigned v = 0; v < nuw; v++) {
        uint4 xb[NT][2];
#pragma unroll
        for (int j = 0; j < NTILE; j++) {
            if ((unsigned)j < ntiles) {
                cp_async_wait<WS - 2>();
                __syncwarp();
                issue(i + WS - 1);
                i++;
                if (j == 0) {
                    load_b<NT>(xring + cx * XB, xb);
                    cx = cx + 1 == WS ? 0 : cx + 1;
                }
                unit_mma<NT>(sw + cs * MOE_GPU_UNIT_BYTES, xb, acc[j]);
                cs = cs + 1 == WS ? 0 : cs + 1;
            }
        }
    }
    cp_async_wait<0>();
    __syncwarp();
}

/* task_mma_il's steady state for the common case: the task has all NTILE
 * tiles and the weight ring NTILE stages (4 and 4). Unit (v, j) lives in
 * weight slot j and K step v's activation rows (NT n-tiles of 8) in slot v %
 * XS, so ring indices and shared-memory offsets are constants; the next K
 * step's weights are four fixed strides from one running pointer; all 32
 * lanes copy (lanes 24-31 repeat lanes 16-23's chunks: the same bytes to the
 * same place), so no copy needs a branch. Same order, same sums as
 * task_mma_il. A narrow task (NT 1) keeps XS = NTILE activation slots; XS = 2
 * would suffice for NT n-tiles (K step v + 1's rows are copied at unit (v, 1),
 * after step v - 1's slot was read at (v - 1, 0)): the wide split-K tasks of
 * 99d2ba3 .. 4ba5c87 (16 pairs, NT 2) ran so, before split-M tasks took the
 * crowded chunks. n-tiles do not mix columns: every column gets the sums of a
 * narrow task (batch invariance). */
template <int NTILE, int NT, unsigned XS>
__device__ __forceinline__ void task_mma_full(const uint8_t *__restrict__ wtask, unsigned w,
                                              unsigned nuw, unsigned tile_units, const xsrc &xs,
                                              uint8_t *sw, float (&acc)[NTILE][MR][NT][4])
{
    constexpr unsigned WS = NTILE, XB = NT * 8 * X_ROW_BYTES;
    static_assert(WS >= 2 && XS >= 2 && WS * MOE_GPU_UNIT_BYTES + XS * XB <= WARP_SMEM,
                  "rings fit");
    static_assert(UL >= 16, "lanes >= UL repeat a lane below UL");
    const unsigned lane = threadIdx.x & 31;
    uint8_t *const xring = sw + WS * MOE_GPU_UNIT_BYTES;
    zero_acc<NTILE, NT>(acc);
    /* weights: this lane copies chunks l, l + UL, ... of every unit */
    const unsigned lw = (lane < UL ? lane : lane - (32 - UL)) * 16;
    const uint8_t *wsrc = wtask + (size_t)w * MOE_GPU_UNIT_BYTES + lw; /* unit (v, 0) */
    const unsigned tstride = tile_units * MOE_GPU_UNIT_BYTES;
    uint8_t *const wdst = sw + lw;
    auto copy_w = [&](const uint8_t *src, unsigned slot) {
#pragma unroll
        for (unsigned k = 0; k < UC / UL; k++)
            cp_async16(wdst + slot * MOE_GPU_UNIT_BYTES + k * UL * 16, src + k * UL * 16);
    };
    constexpr int XR = NT * 8 * 8 / 32;
    const uint16_t *xrow[XR];
    x_rows(xs, (size_t)w * MOE_GPU_UNIT_K, xrow);
    uint8_t *const xdst = xring + (lane >> 3) * X_ROW_BYTES + (lane & 7) * 16;
    auto copy_x = [&](unsigned slot, unsigned off) {
#pragma unroll
        for (int i = 0; i < XR; i++)
            if (xrow[i])
                cp_async16(xdst + slot * XB + 4 * i * X_ROW_BYTES, xrow[i] + off);
    };
    /* prologue: units (0, 0 .. WS-2) and K step 0's rows */
    copy_x(0, 0);
#pragma unroll
    for (unsigned j = 0; j + 1 < WS; j++) {
        copy_w(wsrc + j * tstride, j);
        cp_async_commit();
    }
    x_pad_zero<NT * 8>(xring, XB, XS, xs.cnt);
    unsigned xoff = 0; /* elements past K unit w of this lane's rows */
    unsigned xcur = 0;
    for (unsigned v = 0; v < nuw; v++) {
        const bool more = v + 1 < nuw;
        const unsigned xnext = XS == 2 ? xcur ^ 1u : xcur + 1 == XS ? 0 : xcur + 1;
        uint4 xb[NT][2];
#pragma unroll
        for (unsigned j = 0; j < NTILE; j++) {
            cp_async_wait<WS - 2>();
            __syncwarp();
            /* issue unit (v, j) + WS - 1: (v, WS - 1) or (v + 1, j - 1) */
            if (j == 0) {
                copy_w(wsrc + (WS - 1) * tstride, WS - 1);
            } else if (more) {
                if (j == 1)
                    copy_x(xnext, xoff + NWARPS * MOE_GPU_UNIT_K);
                copy_w(wsrc + NWARPS * MOE_GPU_UNIT_BYTES + (j - 1) * tstride, j - 1);
            }
            cp_async_commit();
            if (j == 0)
                load_b<NT>(xring + xcur * XB, xb);
            unit_mma<NT>(sw + j * MOE_GPU_UNIT_BYTES, xb, acc[j]);
        }
        wsrc += NWARPS * MOE_GPU_UNIT_BYTES;
        xoff += NWARPS * MOE_GPU_UNIT_K;
        xcur = xnext;
    }
    cp_async_wait<0>();
    __syncwarp();
}

/* The one-tile steady state (small batches: T = 1 takes only these), when
 * the warp's nuw K units are a multiple of STAGES: unit 4g + j (of the warp's
 * units w, w + NWARPS, ...) lives in stage j with its activation rows, so,
 * as in task_mma_full, ring indices and offsets are constants and the copies
 * need no branch. Same order, same sums as task_mma<1, 1>. */
__device__ __forceinline__ void task_mma_full1(const uint8_t *__restrict__ wtask, unsigned w,
                                               unsigned nuw, const xsrc &xs, uint8_t *sw,
                                               float (&acc)[1][MR][1][4])
{
    constexpr unsigned WS = STAGES;
    static_assert(WS >= 2 && WS * STAGE_BYTES <= WARP_SMEM, "stages fit");
    static_assert(UL >= 16, "lanes >= UL repeat a lane below UL");
    constexpr unsigned USTEP = NWARPS * MOE_GPU_UNIT_BYTES; /* next unit of this warp */
    const unsigned lane = threadIdx.x & 31;
    zero_acc<1, 1>(acc);
    const unsigned lw = (lane < UL ? lane : lane - (32 - UL)) * 16;
    const uint8_t *wsrc = wtask + (size_t)w * MOE_GPU_UNIT_BYTES + lw; /* unit 4g */
    uint8_t *const wdst = sw + lw;
    constexpr int XR = 8 * 8 / 32;
    const uint16_t *xrow[XR];
    x_rows(xs, (size_t)w * MOE_GPU_UNIT_K, xrow);
    uint8_t *const xdst =
        sw + MOE_GPU_UNIT_BYTES + (lane >> 3) * X_ROW_BYTES + (lane & 7) * 16;
    /* unit 4g + d (d < 2 WS) into stage s: weights and activation rows */
    auto copy = [&](unsigned d, unsigned slot, unsigned xoff) {
#pragma unroll
        for (unsigned k = 0; k < UC / UL; k++)
            cp_async16(wdst + slot * STAGE_BYTES + k * UL * 16, wsrc + d * USTEP + k * UL * 16);
#pragma unroll
        for (int i = 0; i < XR; i++)
            if (xrow[i])
                cp_async16(xdst + slot * STAGE_BYTES + 4 * i * X_ROW_BYTES,
                           xrow[i] + xoff + d * NWARPS * MOE_GPU_UNIT_K);
    };
#pragma unroll
    for (unsigned j = 0; j + 1 < WS; j++) {
        copy(j, j, 0);
        cp_async_commit();
    }
    x_pad_zero<8>(sw + MOE_GPU_UNIT_BYTES, STAGE_BYTES, WS, xs.cnt);
    unsigned xoff = 0; /* elements: 4g units of this warp */
    for (unsigned g = 0; g < nuw; g += WS) {
        const bool more = g + WS < nuw;
#pragma unroll
        for (unsigned j = 0; j < WS; j++) {
            cp_async_wait<WS - 2>();
            __syncwarp();
            /* issue unit 4g + j + WS - 1 into stage (j + WS - 1) % WS */
            if (j == 0 || more)
                copy(j + WS - 1, (j + WS - 1) % WS, xoff);
            cp_async_commit();
            uint4 xb[1][2];
            load_b<1>(sw + j * STAGE_BYTES + MOE_GPU_UNIT_BYTES, xb);
            unit_mma<1>(sw + j * STAGE_BYTES, xb, acc[0]);
        }
        wsrc += WS * USTEP;
        xoff += WS * NWARPS * MOE_GPU_UNIT_K;
    }
    cp_async_wait<0>();
    __syncwarp();
}

