#!/usr/bin/env python3
"""Search for a cheaper E2M1 decode layout (bench/NOTES.md stop 42).

dequant.cuh turns one 32-bit code word (8 E2M1 codes) into four bf16x2 A
registers whose set bits may only be P = {6,7,8,15, 22,23,24,31} (a code's
magnitude on the bf16 low exponent bits and top mantissa bit, its sign on the
sign bit; the block scale's multiply fixes the exponent bias). The packer
(kernels/moe_gpu_pack.c) may put the 32 code bits anywhere in the word, so a
decode is four "moves" of the word whose preimages of P partition its 32 bits,
each followed by one mask (LOP3); a move of 0 needs only the mask.

Moves searched: a rotation by k (SHF.L.W, or IMAD.SHL on the FMA pipe where
no bit wraps), and a byte permute PRMT(w, rot(w, k), sel) choosing each output
byte from w's or the rotated word's bytes; a rotated word is computed once and
shared. Cost = 4 masks + one op per PRMT + one per distinct rotation. The
rotations alone cannot do better than dequant.cuh's 11 (no 4 rotations of P
tile the word, 2026-12-03); this prints every cheaper decode found, cheapest
last. Pure Python, ~4 minutes.
"""
import itertools

P = [6, 7, 8, 15, 22, 23, 24, 31]
# P's bit offsets inside each output byte
O = [[p - 8 * d for p in P if p // 8 == d] for d in range(4)]


def candidates():
    """(preimage mask, extra ops, rotation needed or None, description)"""
    out = {}

    def add(mask, extra, k, desc):
        if bin(mask).count("1") == 8:
            out.setdefault((mask, extra, k), (mask, extra, k, desc))

    add(sum(1 << p for p in P), 0, None, "w & M")
    for k in range(1, 32):
        add(sum(1 << ((p - k) % 32) for p in P), 0, k, "rot(w,%d) & M" % k)
    for k in range(32):
        for sel in itertools.product(range(8), repeat=4):
            if k == 0 and any(b >= 4 for b in sel):
                continue
            m, ok = 0, True
            for d in range(4):
                b = sel[d]
                for o in O[d]:
                    pos = 8 * b + o if b < 4 else (8 * (b - 4) + o - k) % 32
                    ok = ok and not m >> pos & 1
                    m |= 1 << pos
            if ok:
                uses = k if k and any(b >= 4 for b in sel) else None
                add(m, 1, uses, "prmt(w, rot(w,%d), sel %s) & M" % (k, sel))
    return list(out.values())


def main():
    cands = candidates()
    bybit = {}
    for c in cands:
        for b in range(32):
            if c[0] >> b & 1:
                bybit.setdefault(b, []).append(c)
    best = [11]  # dequant.cuh today

    def rec(cov, chosen):
        if cov == 0xFFFFFFFF:
            rots = {c[2] for c in chosen if c[2] is not None}
            cost = 4 + sum(c[1] for c in chosen) + len(rots)
            if cost < best[0]:
                best[0] = cost
                print(cost, "ops:", "; ".join(c[3] for c in chosen), flush=True)
            return
        if len(chosen) == 4:
            return
        free = ~cov & 0xFFFFFFFF
        b = (free & -free).bit_length() - 1
        for c in bybit.get(b, []):
            if not c[0] & cov:
                chosen.append(c)
                rec(cov | c[0], chosen)
                chosen.pop()

    rec(0, [])
    print("cheapest:", best[0], "ops per 8 codes (dequant.cuh: 11)")


if __name__ == "__main__":
    main()
