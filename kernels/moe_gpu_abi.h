/* moe_gpu_abi.h - the host-device contract of the persistent MoE kernel.
 *
 * Everything here is compiled twice, by gcc (engine/backend_cuda.c, the
 * packer kernels/moe_gpu_pack.c) and by nvcc (kernels/moe_gpu.cu, host and
 * device passes), and must mean the same bytes on both sides:
 *   - the weight stream geometry (MOE_GPU_MR, unit and sub-tile sizes) the
 *     packer writes and the kernel reads, and the stream sizes of one expert
 *     (one function, moe_gpu_gu_bytes / moe_gpu_dn_bytes, for both);
 *   - the queue in mapped host memory: the batch descriptor, the ring slot
 *     and the control block (moe_gpu_desc, moe_gpu_slot, moe_gpu_ctrl);
 *   - the launch parameters passed by value (moe_gpu_params and the structs
 *     it holds).
 * Sizes and offsets are asserted at compile time on every side
 * (MOE_GPU_STATIC_ASSERT below: gcc, and nvcc's host and device passes).
 * moe_gpu_abi_fingerprint() hashes them; the kernel module reports the value
 * it was compiled with (moe_gpu_kernel_abi) and the backend compares it with
 * the host's at open (moe_gpu_abi_check), refusing to start when they differ
 * (a header changed under a stale object, a compiler that lays a struct out
 * otherwise).
 *
 * The host side of the queue protocol (publish a slot, poll completion, stop,
 * heartbeat) is the set of inline helpers at the end; the device side is in
 * kernels/moe_gpu/kernel.cuh. One writer per word.
 */
#ifndef MOE_GPU_ABI_H
#define MOE_GPU_ABI_H

#include <stddef.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define MOE_GPU_HD __host__ __device__
#else
#define MOE_GPU_HD
#endif
#if defined(__cplusplus)
#define MOE_GPU_STATIC_ASSERT(c, msg) static_assert(c, msg)
#define MOE_GPU_CONSTEXPR constexpr
#else
#define MOE_GPU_STATIC_ASSERT(c, msg) _Static_assert(c, msg)
#define MOE_GPU_CONSTEXPR
#endif

/* Bump when the meaning of a field changes without a change of layout. */
#define MOE_GPU_ABI_VERSION 3u

/* ---- weight stream geometry (packer <-> kernel) ---- */
#define MOE_GPU_MR 2            /* 16-row sub-tiles per warp tile (H200 2026-11-29: 4 is
                                   5-7% faster at T >= 4, 24% slower at T = 1: bench/NOTES.md
                                   v11) */
#define MOE_GPU_TILE_ROWS (16 * MOE_GPU_MR)
#define MOE_GPU_UNIT_K 64       /* K per pipeline unit */
/* Activation buffers (staged x, h) end with this many spare bytes: in a row
 * shorter than 4 K units a warp without a unit of its own still loads one
 * (unused) unit of its first row, up to 4 units from the row's start, so the
 * last row's loads may reach this far past the row (H200 2026-12-01: h of
 * the tiny model at max_tokens 8192, an allocation of exactly 6 MiB, faulted
 * 128 bytes past its end). kernels/moe_gpu/config.cuh asserts the bound. */
#define MOE_GPU_ROW_TAIL_BYTES (4 * MOE_GPU_UNIT_K * 2)
#define MOE_GPU_SUB_BYTES 576   /* one 16-row x 64-K sub-tile: 512 codes + 64 scales */
#define MOE_GPU_UNIT_BYTES (MOE_GPU_MR * MOE_GPU_SUB_BYTES)
#define MOE_GPU_SCALE_BIAS 0x7000u /* block scale encoding (moe_gpu.h) */
#define MOE_GPU_CODE_LAYOUT 2u     /* code word layout (moe_gpu.h): 2 = shifts, permutes, 10 ops */

/* Bytes of one expert's gate_up stream (2I interleaved rows of K = H) and
 * down stream (H rows of K = I); an expert is stored [gate_up | down]. */
MOE_GPU_HD MOE_GPU_CONSTEXPR static inline uint64_t moe_gpu_gu_bytes(uint32_t hidden, uint32_t inter)
{
    return (uint64_t)(2 * inter / 16) * (hidden / MOE_GPU_UNIT_K) * MOE_GPU_SUB_BYTES;
}
MOE_GPU_HD MOE_GPU_CONSTEXPR static inline uint64_t moe_gpu_dn_bytes(uint32_t hidden, uint32_t inter)
{
    return (uint64_t)(hidden / 16) * (inter / MOE_GPU_UNIT_K) * MOE_GPU_SUB_BYTES;
}
MOE_GPU_HD MOE_GPU_CONSTEXPR static inline uint64_t moe_gpu_expert_bytes(uint32_t hidden, uint32_t inter)
{
    return moe_gpu_gu_bytes(hidden, inter) + moe_gpu_dn_bytes(hidden, inter);
}

/* ---- the queue (mapped host memory) ---- */
#define MOE_GPU_RING 8          /* batch descriptors in flight per GPU */

/* One batch, written by the host into ring[seq % MOE_GPU_RING] before head
 * is released. Pointers are device-visible (device memory or mapped host).
 * The kernel copies it with 16-byte loads: its size is a multiple of 16. */
struct moe_gpu_desc {
    uint64_t seq;
    uint32_t layer;     /* index into the kernel's layer table */
    uint32_t n_tokens;  /* T */
    uint64_t x;         /* bf16 [T, H] */
    uint64_t ids;       /* int32 [T, k] */
    uint64_t w;         /* fp32 [T, k] */
    uint64_t y;         /* bf16 [T, H] output */
    uint64_t stall_ns;  /* test hook: dispatcher sleeps this long first (0) */
    uint32_t inl;       /* 1: ids then w are inline in the slot (ids, w unused) */
    uint32_t flags;     /* MOE_GPU_ROUTED_ONLY, MOE_GPU_ROWS, MOE_GPU_COMBINE */
    uint64_t rows;      /* ROWS / COMBINE: fp32 [T * (k + S), H], entry t * (k + S) + j
                           (device memory of this GPU or a peer's; 0 otherwise) */
    uint32_t ep_n;      /* ROWS: devices the batch is split over (>= 1) */
    uint32_t ep_shard;  /* ROWS: this device's index (< ep_n) */
};
/* desc.flags. Empty slots need no flag: an id < 0 is one (the host
 * validated -1 only), routed to no expert; the combine reads the zero row
 * (dout row max_tokens * (k + S), never written) for it. */
#define MOE_GPU_ROUTED_ONLY 0x1u
/* Expert parallelism (engine/backend.h, MOED_BATCH_ROWS / _COMBINE). ROWS:
 * the routed entries with an id >= 0 and the shared entries of the tokens t
 * with t % ep_n == ep_shard (none with ROUTED_ONLY) are computed, and each
 * computed entry's fp32 row is stored to rows + (t * (k + S) + j) * H
 * instead of the combine (y is not written). COMBINE: no routing and no
 * tasks (x is not read): y from the rows, with the combine's arithmetic
 * (the same fmaf chain in slot order; an empty slot or, ROUTED_ONLY, a
 * shared slot adds the zero row). */
#define MOE_GPU_ROWS 0x2u
#define MOE_GPU_COMBINE 0x4u

/* A ring slot: the descriptor and, for small batches (T * top_k * 8 <=
 * MOE_GPU_INLINE_BYTES), ids (int32 [T, k]) then w (fp32 [T, k]) inline, so
 * that the kernel reads all it needs to route in one PCIe round trip (one
 * 16-byte load per thread of one CTA). */
#define MOE_GPU_INLINE_BYTES 432
struct moe_gpu_slot {
    struct moe_gpu_desc d;
    uint8_t inl[MOE_GPU_INLINE_BYTES];
};

/* Control block in mapped host memory; each word on its own 64-byte line. */
struct moe_gpu_ctrl {
    uint64_t head;      /* host: highest published seq (release) */
    uint64_t pad0[7];
    uint64_t stop;      /* host: non-zero asks the kernel to exit when idle */
    uint64_t pad1[7];
    uint64_t heartbeat; /* device: advances while the kernel runs */
    uint64_t pad2[7];
    uint64_t done_seq;  /* device: highest completed seq (release) */
    uint64_t pad3[7];
    uint64_t exited;    /* device: 1 once every CTA has left */
    uint64_t pad4[7];
    /* device: %globaltimer (ns) of the last batch's phases, for the benchmark:
     * [0] head seen, [1] batch released to CTAs, [2] x staged, [3] last
     * gate_up tile done, [4] last down tile done, [5] batch complete */
    uint64_t phase_ns[8];
    struct moe_gpu_slot ring[MOE_GPU_RING];
};

/* ---- launch parameters (passed by value) ---- */

/* Device pointers of one layer's repacked weights. */
struct moe_gpu_layer {
    const uint8_t *gu;  /* expert e's gate_up stream at gu + e * moe_gpu_expert_bytes */
    const uint8_t *dn;  /* expert e's down stream at dn + e * moe_gpu_expert_bytes */
    const float *s2;    /* [3][E+S]: gate, up, down weight_scale_2 */
};

struct moe_gpu_dims {
    uint32_t hidden, inter, n_experts, n_shared, top_k, max_tokens;
};

/* Everything the kernel needs, passed by value at launch. */
struct moe_gpu_params {
    struct moe_gpu_dims d;
    const struct moe_gpu_layer *layers; /* device array */
    struct moe_gpu_ctrl *ctrl;          /* device pointer of the mapped block */
    void *state;        /* device: counters (moe_gpu_state_bytes) */
    uint16_t *xs;       /* device: staged x [max_tokens, H] */
    int32_t *ids_s;     /* device: staged ids [max_tokens, k] */
    float *w_s;         /* device: staged w [max_tokens, k] */
    uint16_t *h;        /* device: [max_tokens*(k+S), I] bf16 */
    float *dout;        /* device: [max_tokens*(k+S) + 1, H] fp32; the last row is
                           zeros (what an empty slot adds) */
    uint64_t start_seq; /* first seq this launch processes */
    uint32_t smem_route;/* bytes of the routing part of dynamic smem */
    uint16_t *route_g;  /* device: per-CTA routing regions, moe_gpu_route_gmem_bytes each */
    /* doorbell channels (n_chans 0: none; the kernel then polls the host ring only) */
    struct moe_gpu_chan_ent *chans;     /* device: [n_chans] */
    struct moe_gpu_chanctl *chanctl;    /* device pointer of the mapped block */
    const int32_t *slot_of;             /* device: [n_slot_of] layer id -> layer slot, -1 */
    uint32_t n_chans, n_slot_of;
};

/* ---- doorbell channels (ipc/PROTOCOL.md section 10, docs/ZERO_COPY.md) ----
 * A client on the daemon's GPU (under MPS) or on a peer GPU gets a channel of
 * its own: one moe_gpu_chan in device memory that the daemon allocates and
 * exports (cudaIpcGetMemHandle; an allocation of its own, kept and reused by
 * the next channel of the same table index). The client's kernel
 * (kernels/moe_chan_client.cu, whose fatbin the daemon sends with CHAN_OPEN)
 * writes a descriptor into slot[seq % MOE_GPU_CHAN_SLOTS] and releases
 * `bell` = seq, then waits until done >= seq and reads status[seq % SLOTS].
 * The persistent kernel's dispatcher polls every active channel's bell next
 * to the host ring. The descriptor comes from untrusted GPU code: the
 * dispatcher checks it against the channel's host-written table entry
 * (moe_gpu_chan_ent: the key, the registered buffers) with
 * moe_gpu_chan_check and every expert id (moe_gpu_id_ok) before any other
 * CTA touches a byte, and answers a bad one with its MOE_GPU_CHAN_E_* code
 * (never an out-of-bounds access). One writer per word: bell and the slots
 * the client, done and status the kernel. */
#define MOE_GPU_CHAN_SLOTS 8  /* descriptors in flight per channel */
#define MOE_GPU_CHAN_BUFS 16  /* registered buffers a channel can name */
#define MOE_GPU_MAX_CHANS 16  /* table entries at most (engine.max_channels); the
                                 dispatcher keeps a pointer and a seq per entry in
                                 every CTA's static shared memory */
#define MOE_GPU_CHAN_ALLOC (2u << 20) /* bytes of a channel's allocation (one granule:
                                          its IPC handle exposes nothing else); with an
                                          arena, 4096 + its bytes rounded up to this */
#define MOE_GPU_CHAN_ARENA_OFF 4096u  /* a channel's arena (daemon memory the client
                                          copies x in / y out of, CHAN_OPEN arena_bytes)
                                          starts here in its allocation; the kernel sees
                                          it as table range 0, like any other */

enum moe_gpu_chan_status {
    MOE_GPU_CHAN_OK = 0,
    MOE_GPU_CHAN_E_TOKENS = 1,  /* T = 0 or over max_tokens */
    MOE_GPU_CHAN_E_LAYER = 2,   /* not an MoE layer of the model */
    MOE_GPU_CHAN_E_BUF = 3,     /* buffer index outside the table or not registered */
    MOE_GPU_CHAN_E_RANGE = 4,   /* range past the end of its buffer (overflow included) */
    MOE_GPU_CHAN_E_ALIGN = 5,   /* x / y not 16-aligned, ids / w not 4-aligned */
    MOE_GPU_CHAN_E_OVERLAP = 6, /* y overlaps x, ids or w */
    MOE_GPU_CHAN_E_EXPERT = 7,  /* an expert id outside [0, E) (-1 allowed with EMPTY_SLOTS) */
    MOE_GPU_CHAN_E_SEQ = 8,     /* the slot's seq is not the one rung, or the bell jumped
                                   more than MOE_GPU_CHAN_SLOTS ahead */
    MOE_GPU_CHAN_E_KEY = 9,     /* the descriptor's key is not the channel's */
    MOE_GPU_CHAN_E_FLAGS = 10,  /* unknown flag bits */
    MOE_GPU_CHAN_E_TIMEOUT = 11,/* client side only: no answer within the wait limit */
    MOE_GPU_CHAN_E_CLOSED = 12, /* client side only: the daemon closed the channel (its
                                   `closed` word) before the call was answered */
};

/* moe_gpu_chan_desc.flags (the FORWARD flags, ipc/PROTOCOL.md 3.2) */
#define MOE_GPU_CHAN_ROUTED_ONLY 0x1u /* the routed experts only, no shared ones */
#define MOE_GPU_CHAN_EMPTY_SLOTS 0x2u /* an id of -1 is an empty slot */

/* A range of a registered buffer. */
struct moe_gpu_chan_ref {
    uint32_t buf;  /* index into the channel's table (CHAN_OPEN's buffer list) */
    uint32_t pad;
    uint64_t off;  /* bytes from the start of the registered range */
};

/* One request: FORWARD_DESC's fields, the bell value and the channel's key. */
struct moe_gpu_chan_desc {
    uint32_t layer;    /* absolute layer id */
    uint32_t n_tokens; /* T */
    uint64_t seq;      /* the bell value that submits it */
    uint64_t key;      /* CHAN_OPEN's reply: refuses a stale owner of a reused channel */
    uint32_t flags;    /* MOE_GPU_CHAN_ROUTED_ONLY | MOE_GPU_CHAN_EMPTY_SLOTS */
    uint32_t pad;
    struct moe_gpu_chan_ref x, ids, w, y;
};

/* The channel (device memory of the daemon, mapped by the client). */
struct moe_gpu_chan {
    uint64_t bell;    /* client: highest submitted seq (release) */
    uint64_t closed;  /* host: 1 once the daemon closed the channel (CHAN_CLOSE, the
                         connection's close, shutdown, a failed backend); a waiting call
                         then ends with MOE_GPU_CHAN_E_CLOSED instead of its timeout */
    uint64_t pad0[6];
    uint64_t done;    /* kernel: highest answered seq (release, after status) */
    uint64_t pad1[7];
    uint64_t status[MOE_GPU_CHAN_SLOTS]; /* kernel: seq << 8 | moe_gpu_chan_status of
                                            the answer to seq, at seq % SLOTS */
    struct moe_gpu_chan_desc slot[MOE_GPU_CHAN_SLOTS];
    /* %globaltimer stamps of the call at seq % SLOTS (ns, the GPU's one
     * clock): [0] client, just before it rang; [1] kernel, the descriptor
     * taken (the start of its kernel time); [2] kernel, the answer
     * published; [3] client, the answer seen. Plain stores, one writer per
     * word, read by tools and tests after the calls (where a call's time
     * over the kernel goes: tests/gpu/test_chan_gpu.c, bench/NOTES.md). */
    uint64_t stamp[MOE_GPU_CHAN_SLOTS][4];
};

/* A registration table entry (host-written, device-read): the registered
 * range's device address in the daemon and its size (0: no buffer). */
struct moe_gpu_reg {
    uint64_t base;
    uint64_t size;
};

/* One channel of the kernel's table (device memory; the host writes an
 * entry while it is inactive, the kernel writes only `seen`). */
struct moe_gpu_chan_ent {
    uint64_t chan;     /* host: daemon-side device address of the moe_gpu_chan */
    uint64_t key;      /* host: the descriptor key of the channel's owner */
    uint32_t active;   /* host: 1 while open */
    uint32_t pad;
    uint64_t seen;     /* kernel: last seq taken (the host zeroes it at open) */
    /* kernel: the counters moe_gpu_chan_stat mirrors (kept here so that the
     * kernel never reads mapped host memory to count; the host zeroes them
     * at open) */
    uint64_t served, refused, kernel_ns, pad2;
    struct moe_gpu_reg reg[MOE_GPU_CHAN_BUFS];
};

/* Per-channel counters, kernel-written into mapped host memory. */
struct moe_gpu_chan_stat {
    uint64_t served;    /* descriptors run */
    uint64_t refused;   /* descriptors answered with an error status */
    uint64_t kernel_ns; /* sum of the served batches' kernel times (%globaltimer) */
    uint64_t last;      /* status word of the last answer */
};

/* Channel control in mapped host memory. The host changes a table entry,
 * then releases gen; the dispatcher, between batches (none in flight), sees
 * it, reads the table afresh from then on and releases ack = gen: once ack
 * >= the gen of a close, the kernel can no longer touch that channel, its
 * buffers, or run one of its batches. */
struct moe_gpu_chanctl {
    uint64_t gen;       /* host */
    uint64_t pad0[7];
    uint64_t ack;       /* device */
    uint64_t pad1[7];
    struct moe_gpu_chan_stat stat[MOE_GPU_MAX_CHANS];
};

/* Check one descriptor against its channel's entry and the model (pure;
 * host and device). On MOE_GPU_CHAN_OK, ptr[0..3] are the device addresses
 * of x, ids, w and y and *slot the kernel's layer index. slot_of maps an
 * absolute layer to the kernel's layer table (-1: not an MoE layer). The
 * expert ids lie behind ptr[1]: the caller checks them (moe_gpu_id_ok). */
MOE_GPU_HD static inline uint32_t moe_gpu_chan_check(const struct moe_gpu_chan_desc *d,
                                                     uint64_t key, const struct moe_gpu_reg *tab,
                                                     uint32_t hidden, uint32_t top_k,
                                                     uint32_t max_tokens, const int32_t *slot_of,
                                                     uint32_t n_slot_of, uint64_t ptr[4],
                                                     int32_t *slot)
{
    const uint64_t T = d->n_tokens;
    if (d->key != key)
        return MOE_GPU_CHAN_E_KEY;
    if (d->flags & ~(MOE_GPU_CHAN_ROUTED_ONLY | MOE_GPU_CHAN_EMPTY_SLOTS))
        return MOE_GPU_CHAN_E_FLAGS;
    if (T == 0 || T > max_tokens)
        return MOE_GPU_CHAN_E_TOKENS;
    if (d->layer >= n_slot_of || slot_of[d->layer] < 0)
        return MOE_GPU_CHAN_E_LAYER;
    const struct moe_gpu_chan_ref *r[4] = {&d->x, &d->ids, &d->w, &d->y};
    const uint64_t len[4] = {T * hidden * 2, T * top_k * 4, T * top_k * 4, T * hidden * 2};
    for (int i = 0; i < 4; i++) {
        if (r[i]->buf >= MOE_GPU_CHAN_BUFS || tab[r[i]->buf].size == 0)
            return MOE_GPU_CHAN_E_BUF;
        const struct moe_gpu_reg e = tab[r[i]->buf];
        if (r[i]->off > e.size || len[i] > e.size - r[i]->off)
            return MOE_GPU_CHAN_E_RANGE;
        ptr[i] = e.base + r[i]->off;
        if (ptr[i] % (i == 0 || i == 3 ? 16u : 4u) != 0)
            return MOE_GPU_CHAN_E_ALIGN;
    }
    for (int i = 0; i < 3; i++)
        if (ptr[3] < ptr[i] + len[i] && ptr[i] < ptr[3] + len[3])
            return MOE_GPU_CHAN_E_OVERLAP;
    *slot = slot_of[d->layer];
    return MOE_GPU_CHAN_OK;
}

/* One expert id: in [0, n_experts), or -1 when the descriptor has
 * MOE_GPU_CHAN_EMPTY_SLOTS (the kernel checks each id as it stages it). */
MOE_GPU_HD static inline int moe_gpu_id_ok(int32_t id, uint32_t n_experts, uint32_t flags)
{
    return (id >= 0 && (uint32_t)id < n_experts) ||
           (id == -1 && (flags & MOE_GPU_CHAN_EMPTY_SLOTS));
}

/* The status word of the answer to seq. */
MOE_GPU_HD MOE_GPU_CONSTEXPR static inline uint64_t moe_gpu_chan_word(uint64_t seq, uint32_t status)
{
    return seq << 8 | status;
}

/* ---- layout asserts (every compiler that includes this checks them) ---- */
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_desc) == 80, "desc: 80 bytes");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_desc) % 16 == 0, "desc: copied as uint4");
MOE_GPU_STATIC_ASSERT(offsetof(struct moe_gpu_desc, layer) == 8 &&
                          offsetof(struct moe_gpu_desc, n_tokens) == 12 &&
                          offsetof(struct moe_gpu_desc, x) == 16 &&
                          offsetof(struct moe_gpu_desc, ids) == 24 &&
                          offsetof(struct moe_gpu_desc, w) == 32 &&
                          offsetof(struct moe_gpu_desc, y) == 40 &&
                          offsetof(struct moe_gpu_desc, stall_ns) == 48 &&
                          offsetof(struct moe_gpu_desc, inl) == 56 &&
                          offsetof(struct moe_gpu_desc, flags) == 60 &&
                          offsetof(struct moe_gpu_desc, rows) == 64 &&
                          offsetof(struct moe_gpu_desc, ep_n) == 72 &&
                          offsetof(struct moe_gpu_desc, ep_shard) == 76,
                      "desc: field offsets");
MOE_GPU_STATIC_ASSERT(MOE_GPU_INLINE_BYTES % 16 == 0, "inline area: copied as uint4");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_slot) == 512 &&
                          offsetof(struct moe_gpu_slot, inl) == 80,
                      "slot: descriptor then inline ids/w, 512 bytes");
MOE_GPU_STATIC_ASSERT(offsetof(struct moe_gpu_ctrl, head) == 0 &&
                          offsetof(struct moe_gpu_ctrl, stop) == 64 &&
                          offsetof(struct moe_gpu_ctrl, heartbeat) == 128 &&
                          offsetof(struct moe_gpu_ctrl, done_seq) == 192 &&
                          offsetof(struct moe_gpu_ctrl, exited) == 256 &&
                          offsetof(struct moe_gpu_ctrl, phase_ns) == 320 &&
                          offsetof(struct moe_gpu_ctrl, ring) == 384,
                      "ctrl: one 64-byte line per word, ring after the phases");
MOE_GPU_STATIC_ASSERT(offsetof(struct moe_gpu_ctrl, ring) % 16 == 0, "ring: uint4 loads");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_ctrl) == 384 + MOE_GPU_RING * 512, "ctrl: size");
MOE_GPU_STATIC_ASSERT(sizeof(void *) == 8, "64-bit pointers on both sides");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_layer) == 24, "layer: three pointers");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_dims) == 24, "dims: six uint32");
MOE_GPU_STATIC_ASSERT(offsetof(struct moe_gpu_params, layers) == 24 &&
                          offsetof(struct moe_gpu_params, start_seq) == 88 &&
                          offsetof(struct moe_gpu_params, smem_route) == 96 &&
                          offsetof(struct moe_gpu_params, route_g) == 104 &&
                          offsetof(struct moe_gpu_params, chans) == 112 &&
                          offsetof(struct moe_gpu_params, chanctl) == 120 &&
                          offsetof(struct moe_gpu_params, slot_of) == 128 &&
                          offsetof(struct moe_gpu_params, n_chans) == 136 &&
                          offsetof(struct moe_gpu_params, n_slot_of) == 140 &&
                          sizeof(struct moe_gpu_params) == 144,
                      "params: layout");
MOE_GPU_STATIC_ASSERT(MOE_GPU_UNIT_BYTES % 16 == 0, "units are copied in 16-byte chunks");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_chan_ref) == 16 &&
                          offsetof(struct moe_gpu_chan_ref, off) == 8,
                      "chan ref: id, pad, offset");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_chan_desc) == 96 &&
                          offsetof(struct moe_gpu_chan_desc, seq) == 8 &&
                          offsetof(struct moe_gpu_chan_desc, key) == 16 &&
                          offsetof(struct moe_gpu_chan_desc, flags) == 24 &&
                          offsetof(struct moe_gpu_chan_desc, x) == 32 &&
                          offsetof(struct moe_gpu_chan_desc, y) == 80 &&
                          sizeof(struct moe_gpu_chan_desc) % 16 == 0,
                      "chan desc: 96 bytes, copied as uint4");
MOE_GPU_STATIC_ASSERT(offsetof(struct moe_gpu_chan, bell) == 0 &&
                          offsetof(struct moe_gpu_chan, closed) == 8 &&
                          offsetof(struct moe_gpu_chan, done) == 64 &&
                          offsetof(struct moe_gpu_chan, status) == 128 &&
                          offsetof(struct moe_gpu_chan, slot) == 128 + 8 * MOE_GPU_CHAN_SLOTS &&
                          offsetof(struct moe_gpu_chan, stamp) ==
                              128 + 8 * MOE_GPU_CHAN_SLOTS + MOE_GPU_CHAN_SLOTS * 96 &&
                          sizeof(struct moe_gpu_chan) ==
                              128 + 8 * MOE_GPU_CHAN_SLOTS + MOE_GPU_CHAN_SLOTS * (96 + 32) &&
                          sizeof(struct moe_gpu_chan) <= MOE_GPU_CHAN_ARENA_OFF &&
                          MOE_GPU_CHAN_ARENA_OFF < MOE_GPU_CHAN_ALLOC,
                      "chan: bell and done on their own lines, status words, slots");
MOE_GPU_STATIC_ASSERT(offsetof(struct moe_gpu_chan, slot) % 16 == 0, "chan slots: uint4 loads");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_chan_ent) == 64 + 16 * MOE_GPU_CHAN_BUFS &&
                          offsetof(struct moe_gpu_chan_ent, active) == 16 &&
                          offsetof(struct moe_gpu_chan_ent, seen) == 24 &&
                          offsetof(struct moe_gpu_chan_ent, served) == 32 &&
                          offsetof(struct moe_gpu_chan_ent, reg) == 64,
                      "chan entry: pointer, key, active, seen, counters, table (16-aligned)");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_chan_stat) == 32, "chan stat: four counters");
MOE_GPU_STATIC_ASSERT(offsetof(struct moe_gpu_chanctl, gen) == 0 &&
                          offsetof(struct moe_gpu_chanctl, ack) == 64 &&
                          offsetof(struct moe_gpu_chanctl, stat) == 128,
                      "chanctl: gen and ack on their own lines");
MOE_GPU_STATIC_ASSERT(sizeof(struct moe_gpu_reg) == 16, "reg: base, size");

/* FNV-1a over every size, offset and constant above: equal on both sides
 * iff they agree on the layout (the asserts pin most of it; this catches the
 * rest, e.g. a header edited on one side of a stale build). */
MOE_GPU_HD MOE_GPU_CONSTEXPR static inline uint64_t moe_gpu_abi_fingerprint(void)
{
    const uint64_t v[] = {
        MOE_GPU_ABI_VERSION, MOE_GPU_MR, MOE_GPU_UNIT_K, MOE_GPU_SUB_BYTES, MOE_GPU_SCALE_BIAS,
        MOE_GPU_CODE_LAYOUT,
        MOE_GPU_RING, MOE_GPU_INLINE_BYTES,
        sizeof(struct moe_gpu_desc), offsetof(struct moe_gpu_desc, seq),
        offsetof(struct moe_gpu_desc, layer), offsetof(struct moe_gpu_desc, n_tokens),
        offsetof(struct moe_gpu_desc, x), offsetof(struct moe_gpu_desc, ids),
        offsetof(struct moe_gpu_desc, w), offsetof(struct moe_gpu_desc, y),
        offsetof(struct moe_gpu_desc, stall_ns), offsetof(struct moe_gpu_desc, inl),
        offsetof(struct moe_gpu_desc, flags), MOE_GPU_ROUTED_ONLY,
        offsetof(struct moe_gpu_desc, rows), offsetof(struct moe_gpu_desc, ep_n),
        offsetof(struct moe_gpu_desc, ep_shard), MOE_GPU_ROWS, MOE_GPU_COMBINE,
        sizeof(struct moe_gpu_slot), offsetof(struct moe_gpu_slot, inl),
        sizeof(struct moe_gpu_ctrl), offsetof(struct moe_gpu_ctrl, head),
        offsetof(struct moe_gpu_ctrl, stop), offsetof(struct moe_gpu_ctrl, heartbeat),
        offsetof(struct moe_gpu_ctrl, done_seq), offsetof(struct moe_gpu_ctrl, exited),
        offsetof(struct moe_gpu_ctrl, phase_ns), offsetof(struct moe_gpu_ctrl, ring),
        sizeof(struct moe_gpu_layer), offsetof(struct moe_gpu_layer, gu),
        offsetof(struct moe_gpu_layer, dn), offsetof(struct moe_gpu_layer, s2),
        sizeof(struct moe_gpu_dims), offsetof(struct moe_gpu_dims, hidden),
        offsetof(struct moe_gpu_dims, inter), offsetof(struct moe_gpu_dims, n_experts),
        offsetof(struct moe_gpu_dims, n_shared), offsetof(struct moe_gpu_dims, top_k),
        offsetof(struct moe_gpu_dims, max_tokens),
        sizeof(struct moe_gpu_params), offsetof(struct moe_gpu_params, d),
        offsetof(struct moe_gpu_params, layers), offsetof(struct moe_gpu_params, ctrl),
        offsetof(struct moe_gpu_params, state), offsetof(struct moe_gpu_params, xs),
        offsetof(struct moe_gpu_params, ids_s), offsetof(struct moe_gpu_params, w_s),
        offsetof(struct moe_gpu_params, h), offsetof(struct moe_gpu_params, dout),
        offsetof(struct moe_gpu_params, start_seq), offsetof(struct moe_gpu_params, smem_route),
        offsetof(struct moe_gpu_params, route_g), offsetof(struct moe_gpu_params, chans),
        offsetof(struct moe_gpu_params, chanctl), offsetof(struct moe_gpu_params, slot_of),
        offsetof(struct moe_gpu_params, n_chans), offsetof(struct moe_gpu_params, n_slot_of),
        MOE_GPU_CHAN_SLOTS, MOE_GPU_CHAN_BUFS, MOE_GPU_MAX_CHANS, MOE_GPU_CHAN_ALLOC,
        MOE_GPU_CHAN_ROUTED_ONLY, MOE_GPU_CHAN_EMPTY_SLOTS, sizeof(struct moe_gpu_chan_desc),
        offsetof(struct moe_gpu_chan_desc, seq), offsetof(struct moe_gpu_chan_desc, key),
        offsetof(struct moe_gpu_chan_desc, flags), offsetof(struct moe_gpu_chan_desc, x),
        offsetof(struct moe_gpu_chan_desc, ids), offsetof(struct moe_gpu_chan_desc, w),
        offsetof(struct moe_gpu_chan_desc, y), sizeof(struct moe_gpu_chan),
        offsetof(struct moe_gpu_chan, done), offsetof(struct moe_gpu_chan, status),
        offsetof(struct moe_gpu_chan, closed), MOE_GPU_CHAN_E_CLOSED,
        offsetof(struct moe_gpu_chan, slot), sizeof(struct moe_gpu_reg),
        sizeof(struct moe_gpu_chan_ent), offsetof(struct moe_gpu_chan_ent, key),
        offsetof(struct moe_gpu_chan_ent, active), offsetof(struct moe_gpu_chan_ent, seen),
        offsetof(struct moe_gpu_chan_ent, served),
        offsetof(struct moe_gpu_chan_ent, reg), sizeof(struct moe_gpu_chan_stat),
        sizeof(struct moe_gpu_chanctl), offsetof(struct moe_gpu_chanctl, ack),
        offsetof(struct moe_gpu_chanctl, stat),
        /* stream sizes of a reference shape (H 7168, I 2048) */
        moe_gpu_gu_bytes(7168, 2048), moe_gpu_dn_bytes(7168, 2048)};
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        h ^= v[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* ---- host side of the queue protocol (gcc; x86: plain loads and stores
 * with compiler ordering, the kernel uses acquire/release at system scope) ---- */
#if !defined(__CUDACC__)
/* The slot batch `seq` is written into. */
static inline struct moe_gpu_slot *moe_gpu_slot_for(struct moe_gpu_ctrl *c, uint64_t seq)
{
    return &c->ring[seq % MOE_GPU_RING];
}
/* Publish every slot up to `seq` (written before this call). */
static inline void moe_gpu_publish(struct moe_gpu_ctrl *c, uint64_t seq)
{
    __atomic_store_n(&c->head, seq, __ATOMIC_RELEASE);
}
/* The highest completed seq: outputs of batches up to it are written. */
static inline uint64_t moe_gpu_poll_done(const struct moe_gpu_ctrl *c)
{
    return __atomic_load_n(&c->done_seq, __ATOMIC_ACQUIRE);
}
static inline uint64_t moe_gpu_heartbeat(const struct moe_gpu_ctrl *c)
{
    return __atomic_load_n(&c->heartbeat, __ATOMIC_RELAXED);
}
/* Phase stamp i (< 6) of the last batch (acquire: kernel_time_ns orders them). */
static inline uint64_t moe_gpu_phase(const struct moe_gpu_ctrl *c, unsigned i)
{
    return __atomic_load_n(&c->phase_ns[i], __ATOMIC_ACQUIRE);
}
/* Before a launch: no stop request, not exited. */
static inline void moe_gpu_arm(struct moe_gpu_ctrl *c)
{
    c->stop = 0;
    __atomic_store_n(&c->exited, 0, __ATOMIC_RELEASE);
}
/* Ask an idle kernel to exit; moe_gpu_exited turns 1 once every CTA left. */
static inline void moe_gpu_request_stop(struct moe_gpu_ctrl *c)
{
    __atomic_store_n(&c->stop, 1, __ATOMIC_RELEASE);
}
static inline int moe_gpu_exited(const struct moe_gpu_ctrl *c)
{
    return __atomic_load_n(&c->exited, __ATOMIC_ACQUIRE) != 0;
}
/* Channels: release a table change (entries written and visible on the
 * device before this call); the dispatcher acknowledges it between batches. */
static inline void moe_gpu_chan_publish(struct moe_gpu_chanctl *c, uint64_t gen)
{
    __atomic_store_n(&c->gen, gen, __ATOMIC_RELEASE);
}
static inline uint64_t moe_gpu_chan_acked(const struct moe_gpu_chanctl *c)
{
    return __atomic_load_n(&c->ack, __ATOMIC_ACQUIRE);
}
/* One counter of channel i's stat (i < MOE_GPU_MAX_CHANS; word 0..3). */
static inline uint64_t moe_gpu_chan_counter(const struct moe_gpu_chanctl *c, unsigned i,
                                            unsigned word)
{
    const uint64_t *w = &c->stat[i].served;
    return __atomic_load_n(w + word, __ATOMIC_RELAXED);
}
#endif

#endif
