/* route.cuh - routing, built by every CTA for itself or, for a batch of
 * SPLIT_T tokens or more, once by CTA 0 (kernel.cuh copies its tables to the
 * other CTAs): the batch's expert histogram (shared memory), the (token,
 * slot) -> pair position map and the pair -> token list (device memory), and
 * the expert owning a chunk. Part of the one translation unit moe_gpu.cu. */

struct route {
    unsigned *cnt;     /* [NE] pairs per expert */
    unsigned *off;     /* [NE+1] first pair of each expert */
    unsigned *chs;     /* [NE+1] first chunk of each expert */
    uint16_t *ctab;    /* [CTAB] expert of each chunk below CTAB */
    uint16_t *pos;     /* [T*KS] pair position of entry (t, j) */
    uint16_t *tok;     /* [T*KS] token of pair */
};

/* The routing's tables in shared memory (cnt, off, chs, ctab: the route
 * below), a multiple of 128 bytes (the stages after them 128-byte aligned);
 * a CTA's region of device memory (moe_gpu_route_gmem_bytes): its pos and
 * tok, then room for a copy of those tables (16-byte aligned). */
__host__ __device__ inline size_t moe_route_smem(const struct moe_gpu_dims &d)
{
    const size_t ne = d.n_experts + d.n_shared;
    const size_t b = sizeof(unsigned) * (ne + 2 * (ne + 1)) + sizeof(uint16_t) * CTAB;
    return (b + 127) & ~(size_t)127;
}
__host__ __device__ inline size_t moe_route_tables_off(const struct moe_gpu_dims &d)
{
    return (2 * sizeof(uint16_t) * (size_t)d.max_tokens * (d.top_k + d.n_shared) + 15) &
           ~(size_t)15;
}
__host__ __device__ inline size_t moe_route_region(const struct moe_gpu_dims &d)
{
    return moe_route_tables_off(d) + moe_route_smem(d);
}

/* Pairs per chunk of an expert with n pairs: CHUNK_TOKENS (one n-tile) for
 * an expert with at most that many, else SPLITM_TOKENS (a crowded chunk: a
 * split-M task streams the expert's weights once for up to 32 pairs,
 * run_task). Per expert, from its count alone: the task numbering stays one
 * prefix sum (chs). */
__device__ __forceinline__ unsigned chunk_size(unsigned n)
{
    return n > (unsigned)CHUNK_TOKENS ? (unsigned)SPLITM_TOKENS : (unsigned)CHUNK_TOKENS;
}
__device__ __forceinline__ unsigned chunk_count(unsigned n)
{
    const unsigned c = chunk_size(n);
    return (n + c - 1) / c;
}

/* An entry routed to no expert: an empty slot (id -1) or, in a routed-only
 * batch, a shared slot. It makes no pair; its pos is the zero row of dout. */
#define ROUTE_NONE 0xffffffffu

/* The expert of entry (t, j) whose id slot holds v (j < k; v unread for a
 * shared slot j >= k) */
__device__ __forceinline__ unsigned expert_of_v(int v, unsigned t, unsigned j, unsigned k,
                                                unsigned E, unsigned flags, unsigned ep_n,
                                                unsigned ep_shard)
{
    if (j < k) {
        /* socket requests: validated on the host (-1 only with EMPTY_SLOTS);
         * FORWARD_DESC ids come from client GPU memory: any negative id is
         * an empty slot and one of E or more reads expert 0 (PROTOCOL.md 9) */
        if (v < 0)
            return ROUTE_NONE;
        return (unsigned)v < E ? (unsigned)v : 0u;
    }
    /* ROWS: the shared slots of token t are computed by device t % ep_n */
    if ((flags & MOE_GPU_ROUTED_ONLY) || ((flags & MOE_GPU_ROWS) && t % ep_n != ep_shard))
        return ROUTE_NONE;
    return E + (j - k);
}
__device__ __forceinline__ unsigned expert_of(const int32_t *ids, unsigned i, unsigned k,
                                              unsigned ks, unsigned E, unsigned flags,
                                              unsigned ep_n, unsigned ep_shard)
{
    const unsigned t = i / ks, j = i - t * ks;
    return expert_of_v(j < k ? __ldcg(ids + (size_t)t * k + j) : 0, t, j, k, E, flags, ep_n,
                       ep_shard);
}

/* The routing's scratch in the CTA's stage buffers (free between batches):
 * run [NE] u32, wc [NWARPS][NE] u16, then a window of er u32 (expert | rank
 * << 16) per entry; ROUTE_CAP entries per window at NE = 1024 (the most
 * moe_gpu_check_dims allows), a multiple of NWARPS * 32 */
constexpr unsigned ROUTE_CAP =
    (NWARPS * WARP_SMEM - 1024 * (4 + 2 * NWARPS)) / 4 / (NWARPS * 32) * (NWARPS * 32);
static_assert(ROUTE_CAP >= NWARPS * 32, "a routing window of one round per warp at least");
/* entries of a batch routed as one window with its ids in shared memory
 * beside it (at most one id per entry: 4 bytes each, 16-byte aligned) */
constexpr unsigned ROUTE_ONE =
    (NWARPS * WARP_SMEM - 1024 * (4 + 2 * NWARPS) - 16) / 8 / (NWARPS * 32) * (NWARPS * 32);
static_assert(ROUTE_ONE <= ROUTE_CAP, "one window");
/* entries an expert_of pass keeps in flight per thread (independent loads) */
constexpr int ROUTE_LD = 4;
/* a batch of at most 32 ROUTE_SMALL entries is routed by warp 0 alone (its
 * ids loaded at once, its ranks in registers): no window and one barrier
 * fewer (H200 2026-12-04: T <= 16 measured within 1 us of the old walk with
 * it and without it, bench/NOTES.md) */
constexpr int ROUTE_SMALL = 4;

/* The batch's routing, built by a CTA from the staged ids into its shared
 * memory (the tables) and r.pos, r.tok: pair positions grouped by expert, in
 * entry order within an expert. Every load is independent of the others (H200
 * 2026-12-04: the walk by one warp over the ids in device memory, one L2
 * round trip per 32 entries, then a second pass reading them and pos back,
 * took 20-50 us of every CTA at T = 256 before its first task):
 * (1) the histogram, shared-memory atomics; (2) the scans (off, chs);
 * (3) per window of ROUTE_CAP entries: each entry's expert into shared
 * memory, each warp's rank walk over its quarter (match_any), the warps'
 * bases per expert, then pos and tok; a batch of at most 32 ROUTE_SMALL
 * entries (T <= 16 at top-8) takes warp 0's rounds instead of (1) and (3).
 * scratch: the stage buffers. */
__device__ void build_route(const struct moe_gpu_dims &d, unsigned T, const int32_t *ids,
                            const route &r, unsigned flags, unsigned ep_n, unsigned ep_shard,
                            unsigned *x_done, uint8_t *scratch)
{
    const unsigned NE = d.n_experts + d.n_shared, KS = d.top_k + d.n_shared;
    const unsigned n_ent = T * KS;
    const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (flags & MOE_GPU_COMBINE) {
        /* no pairs (chs[NE] = 0: no gate_up or down tasks); entry (t, j)
         * reads dout row t * KS + j, where the x staging copied the batch's
         * rows, or the zero row for an empty slot and (ROUTED_ONLY) a shared
         * slot, as below; once every CTA's share of the rows is in dout
         * (x_done), the combine units sum them with the plain batch's code */
        const unsigned k = d.top_k, zero = d.max_tokens * KS;
        for (unsigned i = tid; i < n_ent; i += THREADS) {
            const unsigned t = i / KS, j = i - t * KS;
            const bool in = j < k ? __ldcg(ids + (size_t)t * k + j) >= 0
                                  : !(flags & MOE_GPU_ROUTED_ONLY);
            r.pos[i] = (uint16_t)(in ? i : zero);
        }
        if (tid == 0) {
            r.chs[NE] = 0;
            while (ld_acquire_gpu32(x_done) < gridDim.x)
                __nanosleep(32);
        }
        __syncthreads();
        return;
    }
    unsigned *const run = reinterpret_cast<unsigned *>(scratch);
    uint16_t *const wc = reinterpret_cast<uint16_t *>(run + 1024);
    unsigned *const er = reinterpret_cast<unsigned *>(wc + NWARPS * 1024);
    /* entries [i0, i1) by this thread, ROUTE_LD loads in flight at a time */
    auto experts = [&](unsigned i0, unsigned i1, auto &&use) {
        for (unsigned b = i0 + tid; b < i1; b += ROUTE_LD * THREADS) {
            unsigned ex[ROUTE_LD];
#pragma unroll
            for (int u = 0; u < ROUTE_LD; u++) {
                const unsigned i = b + u * THREADS;
                ex[u] = i < i1 ? expert_of(ids, i, d.top_k, KS, d.n_experts, flags, ep_n, ep_shard)
                               : ROUTE_NONE;
            }
#pragma unroll
            for (int u = 0; u < ROUTE_LD; u++)
                if (b + u * THREADS < i1)
                    use(b + u * THREADS, ex[u]);
        }
    };
    for (unsigned i = tid; i < NE; i += THREADS) {
        r.cnt[i] = 0;
        run[i] = 0;
    }
    __syncthreads();
    /* (1) pairs per expert (the counts do not depend on the order); a batch
     * of at most 32 ROUTE_SMALL entries: warp 0's rounds count and rank
     * them, every id loaded at once; a batch of one window whose ids fit
     * beside it (ROUTE_ONE): every id copied into shared memory at once
     * (16-byte cp.async, one round trip) and each entry's expert put in its
     * window slot here, where two passes of ROUTE_LD loads per thread at a
     * time took 2 x 4 round trips (H100 2026-12-06: 11 of Qwen3 T = 256's 20
     * us of routing, bench/NOTES.md stop 38) */
    const bool small = n_ent <= 32 * ROUTE_SMALL;
    const unsigned n_id = T * d.top_k;
    const bool one = !small && n_ent <= ROUTE_ONE && (reinterpret_cast<uintptr_t>(ids) & 15) == 0;
    unsigned exs[ROUTE_SMALL], rks[ROUTE_SMALL];
    if (small) {
        if (warp == 0) {
#pragma unroll
            for (int u = 0; u < ROUTE_SMALL; u++) {
                const unsigned i = 32 * u + lane;
                exs[u] = i < n_ent ? expert_of(ids, i, d.top_k, KS, d.n_experts, flags, ep_n,
                                               ep_shard)
                                   : ROUTE_NONE;
            }
#pragma unroll
            for (int u = 0; u < ROUTE_SMALL; u++) {
                const bool act = exs[u] != ROUTE_NONE;
                const unsigned m =
                    __match_any_sync(0xffffffffu, act ? exs[u] : 0x80000000u | lane);
                const unsigned c = act ? r.cnt[exs[u]] : 0u;
                __syncwarp();
                rks[u] = c + __popc(m & ((1u << lane) - 1u));
                if (act && (m >> lane) == 1u) /* highest lane of the group */
                    r.cnt[exs[u]] = c + __popc(m);
                __syncwarp();
            }
        }
    } else if (one) {
        int32_t *const raw = reinterpret_cast<int32_t *>(er + (n_ent + 3) / 4 * 4);
        for (unsigned c = tid; c < n_id / 4; c += THREADS)
            cp_async16(raw + 4 * c, ids + 4 * c);
        cp_async_commit();
        for (unsigned i = n_id / 4 * 4 + tid; i < n_id; i += THREADS)
            raw[i] = __ldcg(ids + i);
        cp_async_wait<0>();
        __syncthreads();
        for (unsigned i = tid; i < n_ent; i += THREADS) {
            const unsigned t = i / KS, j = i - t * KS;
            const unsigned ex = expert_of_v(j < d.top_k ? raw[t * d.top_k + j] : 0, t, j, d.top_k,
                                            d.n_experts, flags, ep_n, ep_shard);
            er[i] = ex;
            if (ex != ROUTE_NONE)
                atomicAdd(&r.cnt[ex], 1u);
        }
        __syncthreads();
    } else {
        experts(0, n_ent, [&](unsigned, unsigned ex) {
            if (ex != ROUTE_NONE)
                atomicAdd(&r.cnt[ex], 1u);
        });
        __syncthreads();
    }
    /* (2) exclusive scans: pairs -> off, chunks -> chs (warp 0) */
    if (warp == 0) {
        unsigned per = (NE + 31) / 32, b = lane * per, e = min(b + per, NE);
        unsigned s1 = 0, s2 = 0;
        for (unsigned i = b; i < e; i++) {
            s1 += r.cnt[i];
            s2 += chunk_count(r.cnt[i]);
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
            r.off[i] = x1;
            r.chs[i] = x2;
            x1 += r.cnt[i];
            x2 += chunk_count(r.cnt[i]);
        }
        if (lane == 31) {
            r.off[NE] = i1;
            r.chs[NE] = i2;
        }
    }
    __syncthreads();
    /* (3) positions: warp 0's rounds, or window by window (one window up to
     * ROUTE_CAP entries) */
    if (small && warp == 0) {
#pragma unroll
        for (int u = 0; u < ROUTE_SMALL; u++) {
            const unsigned i = 32 * u + lane;
            if (i >= n_ent)
                continue;
            if (exs[u] == ROUTE_NONE) {
                r.pos[i] = (uint16_t)(d.max_tokens * KS); /* the zero row */
            } else {
                const unsigned p = r.off[exs[u]] + rks[u];
                r.pos[i] = (uint16_t)p;
                r.tok[p] = (uint16_t)(i / KS);
            }
        }
    }
    for (unsigned w0 = 0; !small && w0 < n_ent; w0 += ROUTE_CAP) {
        const unsigned w1 = min(w0 + ROUTE_CAP, n_ent);
        /* each warp's quarter: whole rounds of 32 */
        const unsigned q = ((w1 - w0 + NWARPS * 32 - 1) / (NWARPS * 32)) * 32;
        for (unsigned i = tid; i < NWARPS * NE; i += THREADS)
            wc[(i / NE) * 1024 + i % NE] = 0;
        if (!one) /* (one: every entry's expert is in er) */
            experts(w0, w1, [&](unsigned i, unsigned ex) { er[i - w0] = ex; });
        __syncthreads();
        /* rank of each entry among the earlier entries of its expert in this
         * warp's quarter */
        const unsigned a0 = w0 + warp * q, a1 = min(a0 + q, w1);
        uint16_t *const mine = wc + warp * 1024;
        for (unsigned base = a0; base < a1; base += 32) {
            const unsigned i = base + lane;
            unsigned ex = i < a1 ? er[i - w0] : ROUTE_NONE;
            const bool act = ex != ROUTE_NONE;
            if (!act)
                ex = 0x80000000u | lane;
            const unsigned m = __match_any_sync(0xffffffffu, ex);
            const unsigned c = act ? mine[ex] : 0u;
            __syncwarp();
            if (act) {
                er[i - w0] = ex | (c + __popc(m & ((1u << lane) - 1u))) << 16;
                if ((m >> lane) == 1u) /* highest lane of the group */
                    mine[ex] = (uint16_t)(c + __popc(m));
            }
            __syncwarp();
        }
        __syncthreads();
        /* each warp's base per expert: the window's earlier warps and windows */
        for (unsigned e = tid; e < NE; e += THREADS) {
            unsigned b = run[e];
#pragma unroll
            for (unsigned w = 0; w < NWARPS; w++) {
                const unsigned c = wc[w * 1024 + e];
                wc[w * 1024 + e] = (uint16_t)b;
                b += c;
            }
            run[e] = b;
        }
        __syncthreads();
        for (unsigned i = w0 + tid; i < w1; i += THREADS) {
            const unsigned v = er[i - w0];
            if (v == ROUTE_NONE) {
                r.pos[i] = (uint16_t)(d.max_tokens * KS); /* the zero row */
                continue;
            }
            const unsigned ex = v & 0xffffu, p = r.off[ex] + wc[((i - w0) / q) * 1024 + ex] + (v >> 16);
            r.pos[i] = (uint16_t)p;
            r.tok[p] = (uint16_t)(i / KS);
        }
        __syncthreads(); /* er, wc are the next window's */
    }
    /* the chunk -> expert table: one shared-memory load per task decode */
    for (unsigned e = tid; e < NE; e += THREADS)
        for (unsigned c = r.chs[e], c1 = min(r.chs[e + 1], (unsigned)CTAB); c < c1; c++)
            r.ctab[c] = (uint16_t)e;
    __syncthreads();
}

/* expert owning global chunk cg: the largest e with chs[e] <= cg (from the
 * table below CTAB; a binary search over chs, 8 dependent shared-memory
 * loads at NE = 257, past it) */
__device__ __forceinline__ unsigned chunk_expert(const route &r, unsigned NE, unsigned cg)
{
    if (cg < (unsigned)CTAB)
        return r.ctab[cg];
    const unsigned *chs = r.chs;
    unsigned lo = 0, hi = NE;
    while (hi - lo > 1) {
        unsigned mid = (lo + hi) >> 1;
        if (chs[mid] <= cg)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

