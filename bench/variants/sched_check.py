#!/usr/bin/env python3
"""The batch's task order of bench/variants/parts3.patch (make_sched and pick_task
in kernels/moe_gpu/task.cuh, up to NPARTS down parts), ported to Python and
checked over shapes, batch sizes, chunk counts and grids: every claim index maps
to exactly one task; the gate_up, each part's down and the combine tasks are
each covered once; a combine task waits for the parts whose rows cover its
column blocks; the parts' tiles add up; and with one boundary at 5 / 8 the order
is the merged kernel's (475ac44's make_sched / pick_task) task for task.

  python3 bench/variants/sched_check.py
"""
import itertools
def make_sched(n_ch, TPC_GU, TPC_DN, NTD, RT_DN, T, n_cblk, n_cb, combine, grid, SPLIT_AT, SPLIT_T=128, NWARPS=4):
    NPARTS = len(SPLIT_AT) + 1
    s = dict(n_gu=n_ch*TPC_GU, np=1, tg=[0]*(NPARTS+1), reg=[0]*(NPARTS+1), ce=[0]*NPARTS, tiles=[0]*NPARTS, lag=[0]*NPARTS)
    if combine and n_cblk > 1 and T >= SPLIT_T:
        for b in range(NPARTS-1):
            q = TPC_DN*SPLIT_AT[b]//8
            while q > s['tg'][s['np']-1]:
                if q*NTD % 8 == 0:
                    s['tg'][s['np']] = q; s['np'] += 1; break
                q -= 1
    np_ = s['np']; s['tg'][np_] = TPC_DN
    at = ce = 0
    for p in range(np_):
        nd = n_ch*(s['tg'][p+1]-s['tg'][p])
        rows = s['tg'][p+1]*NTD if p+1 < np_ else RT_DN
        ce1 = rows//8*T//NWARPS if p+1 < np_ else n_cb
        s['tiles'][p] = n_ch*(min(rows, RT_DN)-min(s['tg'][p]*NTD, RT_DN))
        s['reg'][p] = at
        s['lag'][p] = min(nd, grid)
        at += nd + ((s['ce'][p-1] - (s['ce'][p-2] if p > 1 else 0)) if p else 0)
        s['ce'][p] = max(ce1, ce); ce = s['ce'][p]
    s['reg'][np_] = at
    return s
def pick(s, t):
    if t < s['n_gu']: return (0, t, 0)
    t -= s['n_gu']; np_ = s['np']
    if t >= s['reg'][np_]: return (2, (s['ce'][np_-2] if np_ > 1 else 0) + t - s['reg'][np_], np_-1)
    r = 0
    while t >= s['reg'][r+1]: r += 1
    m = t - s['reg'][r]
    if r == 0 or m < s['lag'][r]: return (1, m, r)
    c0 = s['ce'][r-2] if r > 1 else 0; nc = s['ce'][r-1]-c0
    if nc == 0: return (1, m, r)
    mm = m - s['lag'][r]; tot = s['reg'][r+1]-s['reg'][r]-s['lag'][r]
    k0 = mm*nc//tot; k1 = (mm+1)*nc//tot
    return (2, c0+k0, r-1) if k1 > k0 else (1, s['lag'][r]+mm-k1, r)
def check(H, I, T, n_ch, grid, SPLIT_AT, combine=True):
    RT_GU = I//16//2*2; RT_DN = H//32
    ntile = lambda tiles: max(1, min(4, tiles // (2*grid)))
    NTG = ntile(n_ch*RT_GU); NTD = ntile(n_ch*RT_DN)
    TPC_GU = -(-RT_GU//NTG); TPC_DN = -(-RT_DN//NTD)
    n_cblk = -(-H//256); n_cu = T*n_cblk; n_cb = -(-n_cu//4)
    s = make_sched(n_ch, TPC_GU, TPC_DN, NTD, RT_DN, T, n_cblk, n_cb, combine, grid, SPLIT_AT)
    total = n_ch*TPC_GU + n_ch*TPC_DN + (n_cb if combine else 0)
    seen = set(); cparts = {}
    for t in range(total):
        k = pick(s, t)
        assert k not in seen, (t, k); seen.add(k)
        if k[0] == 2:
            ci = k[1]; part = k[2]
            # units' blocks must all be in parts <= part
            for w in range(4):
                u = ci*4+w
                if u < n_cu:
                    blk = u // T
                    rows_end = (s['tg'][part+1]*NTD if part+1 < s['np'] else RT_DN)
                    assert blk*8 + 8 <= rows_end or blk*8 < RT_DN and part == s['np']-1 or (blk+1)*8 <= rows_end, (ci, blk, part)
    gu = {k[1] for k in seen if k[0] == 0}; assert gu == set(range(n_ch*TPC_GU))
    for p in range(s['np']):
        d = {k[1] for k in seen if k[0] == 1 and k[2] == p}
        assert d == set(range(n_ch*(s['tg'][p+1]-s['tg'][p]))), p
    c = {k[1] for k in seen if k[0] == 2}; assert c == (set(range(n_cb)) if combine else set())
    assert sum(s['tiles'][:s['np']]) == n_ch*RT_DN
    return s['np'], s['tg'][:s['np']+1], s['ce'][:s['np']]
for SPLIT_AT in ([5], [4, 7], [3, 5, 7]):  # NPARTS 2, 3, 4
    for (H, I) in ((2048, 768), (7168, 2048), (320, 192), (1024, 320)):
        for T in (1, 4, 64, 127, 128, 200, 256, 512):
            for n_ch in (1, 8, 64, 128, 300):
                for grid in (396, 1, 3):
                    for comb in (True, False):
                        r = check(H, I, T, n_ch, grid, SPLIT_AT, comb)
    print(SPLIT_AT, "ok", check(2048, 768, 256, 128, 396, SPLIT_AT), check(7168, 2048, 256, 240, 396, SPLIT_AT))
def head_sched(n_ch, TPC_GU, TPC_DN, NTD, T, n_cblk, combine, grid, E=5, SPLIT_T=128):
    dp0 = 0
    if combine and n_cblk > 1 and T >= SPLIT_T:
        for q in range(TPC_DN*E//8, 0, -1):
            if q*NTD % 8 == 0: dp0 = q; break
    n_dn0 = n_ch*dp0; n_dn1 = n_ch*(TPC_DN-dp0); n_c0 = dp0*NTD//8*T//4
    return dict(n_gu=n_ch*TPC_GU, n_dn0=n_dn0, n_dn1=n_dn1, n_c0=n_c0, lag=min(n_dn1, grid), dp0=dp0)
def head_pick(s, t):
    if t < s['n_gu']: return (0, t, 0)
    t -= s['n_gu']
    if t < s['n_dn0']: return (1, t, 0)
    t -= s['n_dn0']
    if t >= s['n_dn1'] + s['n_c0']: return (2, t - s['n_dn1'], 'c')
    if t < s['lag'] or s['n_c0'] == 0: return (1, t, 1)
    m = t - s['lag']; tot = s['n_dn1'] - s['lag'] + s['n_c0']
    k0 = m*s['n_c0']//tot; k1 = (m+1)*s['n_c0']//tot
    return (2, k0, 'c') if k1 > k0 else (1, s['lag']+m-k1, 1)
for (H, I, n_ch) in ((2048, 768, 128), (7168, 2048, 240), (2048, 768, 40)):
    for T in (64, 128, 256, 512):
        grid = 396
        RT_GU = I//16//2*2; RT_DN = H//32
        ntile = lambda tiles: max(1, min(4, tiles // (2*grid)))
        NTG = ntile(n_ch*RT_GU); NTD = ntile(n_ch*RT_DN)
        TPC_GU = -(-RT_GU//NTG); TPC_DN = -(-RT_DN//NTD)
        n_cblk = -(-H//256); n_cb = -(-T*n_cblk//4)
        a = make_sched(n_ch, TPC_GU, TPC_DN, NTD, RT_DN, T, n_cblk, n_cb, True, grid, [5])
        b = head_sched(n_ch, TPC_GU, TPC_DN, NTD, T, n_cblk, True, grid)
        total = n_ch*TPC_GU + n_ch*TPC_DN + n_cb
        for t in range(total):
            x = pick(a, t); y = head_pick(b, t)
            assert x[0] == y[0] and x[1] == y[1] and (x[0] != 1 or b['dp0'] == 0 or x[2] == y[2]), (H, T, t, x, y)
print("N-part [5] == merged 2-part order")
