/* route.cuh - routing, built by every CTA for itself: the batch's expert
 * histogram (shared memory), the (token, slot) -> pair position map and the
 * pair -> token list (the CTA's own region of device memory), and the
 * expert owning a chunk. Part of the one translation unit moe_gpu.cu. */

struct route {
    unsigned *cnt;     /* [NE] pairs per expert */
    unsigned *off;     /* [NE+1] first pair of each expert */
    unsigned *chs;     /* [NE+1] first chunk of each expert */
    uint16_t *ctab;    /* [CTAB] expert of each chunk below CTAB */
    uint16_t *pos;     /* [T*KS] pair position of entry (t, j) */
    uint16_t *tok;     /* [T*KS] token of pair */
};

/* An entry routed to no expert: an empty slot (id -1) or, in a routed-only
 * batch, a shared slot. It makes no pair; its pos is the zero row of dout. */
#define ROUTE_NONE 0xffffffffu

__device__ __forceinline__ unsigned expert_of(const int32_t *ids, unsigned i, unsigned k,
                                              unsigned ks, unsigned E, unsigned flags,
                                              unsigned ep_n, unsigned ep_shard)
{
    unsigned t = i / ks, j = i - t * ks;
    if (j < k) {
        int v = __ldcg(ids + (size_t)t * k + j);
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

__device__ void build_route(const struct moe_gpu_dims &d, unsigned T, const int32_t *ids,
                            const route &r, unsigned flags, unsigned ep_n, unsigned ep_shard,
                            unsigned *x_done)
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
    for (unsigned i = tid; i < NE; i += THREADS)
        r.cnt[i] = 0;
    __syncthreads();
    if (warp == 0) {
        /* rank of each entry among earlier entries of the same expert */
        for (unsigned base = 0; base < n_ent; base += 32) {
            unsigned i = base + lane;
            unsigned ex = i < n_ent ? expert_of(ids, i, d.top_k, KS, d.n_experts, flags, ep_n,
                                                ep_shard)
                                    : ROUTE_NONE;
            bool act = ex != ROUTE_NONE;
            if (!act)
                ex = 0x80000000u | lane;
            unsigned m = __match_any_sync(0xffffffffu, ex);
            unsigned lt = m & ((1u << lane) - 1u);
            unsigned c = act ? r.cnt[ex] : 0u;
            __syncwarp();
            if (act) {
                r.pos[i] = (uint16_t)(c + __popc(lt));
                if ((m >> lane) == 1u) /* highest lane of the group */
                    r.cnt[ex] = c + __popc(m);
            }
            __syncwarp();
        }
        /* exclusive scans: pairs -> off, chunks -> chs */
        unsigned per = (NE + 31) / 32, b = lane * per, e = min(b + per, NE);
        unsigned s1 = 0, s2 = 0;
        for (unsigned i = b; i < e; i++) {
            s1 += r.cnt[i];
            s2 += (r.cnt[i] + CHUNK_TOKENS - 1) / CHUNK_TOKENS;
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
            x2 += (r.cnt[i] + CHUNK_TOKENS - 1) / CHUNK_TOKENS;
        }
        if (lane == 31) {
            r.off[NE] = i1;
            r.chs[NE] = i2;
        }
    }
    __syncthreads();
    for (unsigned i = tid; i < n_ent; i += THREADS) {
        unsigned ex = expert_of(ids, i, d.top_k, KS, d.n_experts, flags, ep_n, ep_shard);
        if (ex == ROUTE_NONE) {
            r.pos[i] = (uint16_t)(d.max_tokens * KS); /* the zero row */
            continue;
        }
        unsigned p = r.off[ex] + r.pos[i];
        r.pos[i] = (uint16_t)p;
        r.tok[p] = (uint16_t)(i / KS);
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

