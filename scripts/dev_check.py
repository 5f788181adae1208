"""Quick device smoke check used while developing kernels (not a test; see tests/gpu)."""
import sys
import time

import torch

import flashgen


def ref(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = scale or d ** -0.5
    k = k.repeat_interleave(h // hk, dim=2).float()
    v = v.repeat_interleave(h // hk, dim=2).float()
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    if alibi is not None:
        sl = alibi.view(-1 if alibi.dim() == 2 else 1, h, 1, 1) if alibi.dim() == 2 else alibi.view(1, h, 1, 1)
        if alibi.dim() == 2:
            sl = alibi.view(b, h, 1, 1)
        s = s - sl * (i + sk - sq - j).abs()
    wl, wr = window
    if causal:
        wr = 0
    mask = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if wr >= 0:
        mask |= j > i + sk - sq + wr
    if wl >= 0:
        mask |= j < i + sk - sq - wl
    s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return o, lse


def check(b, sq, sk, h, hk, d, dtype, **kw):
    torch.manual_seed(sq * 7 + sk + d)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    alibi = kw.pop("alibi", None)
    pack = kw.pop("pack_gqa", None)
    out, lse, _ = flashgen.flash_attn_func(q, k, v, return_attn_probs=True, alibi_slopes=alibi, pack_gqa=pack,
                                           causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                                           softcap=kw.get("softcap", 0.0))
    torch.cuda.synchronize()
    o_ref, lse_ref = ref(q, k, v, alibi=alibi, **kw)
    o_pt, _ = ref(q.to(dtype), k, v, alibi=alibi, **kw)
    err = (out.float() - o_ref).abs().max().item()
    lse_fin = torch.isfinite(lse_ref)
    lse_err = (lse[lse_fin] - lse_ref[lse_fin]).abs().max().item() if lse_fin.any() else 0.0
    lse_inf_ok = bool((torch.isinf(lse) == ~lse_fin).all())
    nan = bool(out.isnan().any())
    ok = err < (2e-2 if dtype == torch.bfloat16 else 4e-3) and lse_err < 1e-2 and lse_inf_ok and not nan
    print(f"{'OK ' if ok else 'BAD'} b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {dtype} {kw} alibi={alibi is not None} pack={pack}: "
          f"err {err:.2e} lse_err {lse_err:.2e} inf_ok {lse_inf_ok} nan {nan}")
    return ok


def bench(d, causal, seqlen=4096):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import triton.testing
    b = 16384 // seqlen
    h = 2048 // d
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
    t_fg = triton.testing.do_bench(lambda: flashgen.flash_attn_func(q, k, v, causal=causal), return_mode="median")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    res = {}
    for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                res[name] = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), return_mode="median")
        except Exception as e:
            res[name] = float("nan")
    tf = lambda ms: flops / ms / 1e9
    print(f"d{d} s{seqlen} causal={causal}: flashgen {tf(t_fg):.0f} TF/s, FA2 {tf(res['fa2']):.0f}, cuDNN {tf(res['cudnn']):.0f}; ratio vs FA2 {res['fa2']/t_fg:.2f}")


def check_kvcache(b, sq, hq, hk, d, page_size=None, new=0, rot=0, causal=False, splits=0, leftpad=False, dtype=torch.bfloat16):
    """Dense reference of flash_attn_with_kvcache on one call (gather valid keys per batch)."""
    torch.manual_seed(b * 100 + sq + d + new)
    cap = 1000
    lens = torch.randint(0, cap - new + 1, (b,), dtype=torch.int32, device="cuda")
    kc = torch.randn(b, cap, hk, d, device="cuda", dtype=dtype)
    vc = torch.randn(b, cap, hk, d, device="cuda", dtype=dtype)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    kn = torch.randn(b, new, hk, d, device="cuda", dtype=dtype) if new else None
    vn = torch.randn(b, new, hk, d, device="cuda", dtype=dtype) if new else None
    lp = (torch.randint(0, 50, (b,), dtype=torch.int32, device="cuda").minimum(lens)) if leftpad else None
    cos = sin = None
    if rot:
        ang = torch.rand(cap, rot // 2, device="cuda") * 6
        cos, sin = ang.cos(), ang.sin()
    # expected cache after append and rotated q/k
    def rotate(x, pos):
        if not rot:
            return x
        xf = x.float()
        c, s = cos[pos], sin[pos]  # (..., rot/2)
        x1, x2 = xf[..., : rot // 2], xf[..., rot // 2: rot]
        out = xf.clone()
        out[..., : rot // 2] = x1 * c[:, None, :] - x2 * s[:, None, :]
        out[..., rot // 2: rot] = x1 * s[:, None, :] + x2 * c[:, None, :]
        return out.to(x.dtype)
    kc_exp, vc_exp = kc.clone(), vc.clone()
    for i in range(b):
        L = int(lens[i])
        if new:
            pos = torch.arange(L, L + new, device="cuda")
            kc_exp[i, L:L + new] = rotate(kn[i], pos)
            vc_exp[i, L:L + new] = vn[i]
    if page_size:
        npages = -(-cap // page_size)
        perm = torch.randperm(b * npages, device="cuda").int().view(b, npages)
        kp = torch.zeros(b * npages, page_size, hk, d, device="cuda", dtype=dtype)
        vp = torch.zeros_like(kp)
        for i in range(b):
            for pg in range(npages):
                rows = slice(pg * page_size, min(cap, (pg + 1) * page_size))
                n = rows.stop - rows.start
                kp[perm[i, pg], :n] = kc[i, rows]
                vp[perm[i, pg], :n] = vc[i, rows]
        kc_in, vc_in, bt = kp, vp, perm
    else:
        kc_in, vc_in, bt = kc, vc, None
    out = flashgen.flash_attn_with_kvcache(q, kc_in, vc_in, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                           cache_leftpad=lp, block_table=bt, causal=causal, num_splits=splits,
                                           rotary_interleaved=False)
    torch.cuda.synchronize()
    worst = 0.0
    for i in range(b):
        L = int(lens[i]) + new
        p0 = int(lp[i]) if lp is not None else 0
        qpos = int(lens[i]) + (torch.arange(sq, device="cuda") if causal else torch.zeros(sq, dtype=torch.long, device="cuda"))
        qi = rotate(q[i], qpos) if rot else q[i]
        o_ref, _ = ref(qi[None], kc_exp[i, p0:L][None], vc_exp[i, p0:L][None], causal=causal)
        worst = max(worst, (out[i].float() - o_ref[0]).abs().max().item())
    cache_err = 0.0
    if page_size is None:
        cache_err = (kc_in.float() - kc_exp.float()).abs().max().item()
    ok = worst < 3e-2 and cache_err < 1e-2 and not out.isnan().any()
    print(f"{'OK ' if ok else 'BAD'} kvcache b{b} sq{sq} h{hq}/{hk} d{d} page{page_size} new{new} rot{rot} causal{causal} "
          f"splits{splits} leftpad{leftpad}: err {worst:.2e} cache_err {cache_err:.2e}")
    return ok


def kvcache_suite():
    res = [
        check_kvcache(3, 1, 32, 8, 128),
        check_kvcache(3, 1, 32, 8, 128, splits=3),
        check_kvcache(3, 1, 32, 8, 128, page_size=16),
        check_kvcache(3, 4, 8, 8, 64, page_size=17, new=4, causal=True),
        check_kvcache(2, 5, 16, 2, 128, new=5, rot=64, causal=True),
        check_kvcache(2, 1, 16, 2, 128, new=1, rot=128, leftpad=True, splits=4),
        check_kvcache(2, 100, 8, 1, 256, page_size=1, new=3, causal=True, splits=2),
        check_kvcache(2, 1, 32, 8, 96, page_size=256),
    ]
    # split-KV on the dense path
    torch.manual_seed(0)
    q = torch.randn(1, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2000, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2000, 2, 128, device="cuda", dtype=torch.bfloat16)
    o1, l1, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    o3, l3, _ = flashgen.flash_attn_func(q, k, v, causal=True, num_splits=3, return_attn_probs=True)
    e = (o1.float() - o3.float()).abs().max().item(); el = (l1 - l3).abs().max().item()
    print(f"{'OK ' if e < 1e-2 and el < 1e-3 else 'BAD'} dense split 3 vs 1: {e:.2e} lse {el:.2e}")
    res.append(e < 1e-2)
    print(f"kvcache: {sum(res)}/{len(res)} ok")


def check_bwd(b, sq, sk, h, hk, d, dtype=torch.bfloat16, deterministic=False, **kw):
    torch.manual_seed(sq + sk + d + h)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    alibi = kw.pop("alibi", None)
    out = flashgen.flash_attn_func(q, k, v, causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                                   softcap=kw.get("softcap", 0.0), alibi_slopes=alibi, deterministic=deterministic)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    o_ref, _ = ref(qf, kf, vf, alibi=alibi, **kw)
    dq_r, dk_r, dv_r = torch.autograd.grad(o_ref, (qf, kf, vf), dout.float())
    qp, kp, vp = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o_pt, _ = ref(qp, kp, vp, alibi=alibi, **kw)
    dq_p, dk_p, dv_p = torch.autograd.grad(o_pt, (qp, kp, vp), dout.float())
    errs = []
    for name, g, r, pt in (("dq", dq, dq_r, dq_p), ("dk", dk, dk_r, dk_p), ("dv", dv, dv_r, dv_p)):
        e = (g.float() - r).abs().max().item()
        scale = r.abs().max().item() + 1e-6
        errs.append(f"{name} {e / scale:.1e}")
        if not (e / scale < 3e-2) or g.isnan().any():
            ok = False
            break
    else:
        ok = True
    if deterministic:
        for _ in range(3):
            out2 = flashgen.flash_attn_func(q, k, v, causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                                            softcap=kw.get("softcap", 0.0), alibi_slopes=alibi, deterministic=True)
            dq2, dk2, dv2 = torch.autograd.grad(out2, (q, k, v), dout)
            ok &= bool(torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2))
    print(f"{'OK ' if ok else 'BAD'} bwd b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {dtype} {kw} det={deterministic}: {', '.join(errs)}")
    return ok


def bwd_suite():
    res = [
        check_bwd(2, 128, 128, 4, 4, 64),
        check_bwd(2, 113, 255, 4, 4, 128, causal=True),
        check_bwd(2, 255, 113, 8, 2, 96, causal=True),
        check_bwd(1, 300, 300, 8, 1, 192, window=(33, 7)),
        check_bwd(1, 200, 333, 4, 2, 256, torch.float16, softcap=5.0),
        check_bwd(1, 200, 333, 4, 4, 72, alibi=torch.rand(4, device="cuda"), causal=True),
        check_bwd(2, 257, 511, 8, 2, 128, deterministic=True, causal=True),
        check_bwd(1, 300, 700, 4, 2, 64, deterministic=True, window=(100, 20)),
    ]
    print(f"bwd: {sum(res)}/{len(res)} ok")


def bench_bwd(d, causal, seqlen=4096):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import triton.testing
    b, h = 16384 // seqlen, 2048 // d
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    out = flashgen.flash_attn_func(q, k, v, causal=causal)
    flops = 2.5 * 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
    t_fg = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), return_mode="median")
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    res = {}
    for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                res[name] = triton.testing.do_bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True), return_mode="median")
        except Exception:
            res[name] = float("nan")
    tf = lambda ms: flops / ms / 1e9
    print(f"bwd d{d} s{seqlen} causal={causal}: flashgen {tf(t_fg):.0f} TF/s, FA2 {tf(res['fa2']):.0f}, cuDNN {tf(res['cudnn']):.0f}; ratio vs FA2 {res['fa2']/t_fg:.2f}")


if __name__ == "__main__":
    from cuda.bindings import driver
    import cuda.bindings
    print("torch", torch.__version__, "cuda-bindings", cuda.bindings.__version__, torch.cuda.get_device_name())
    t = time.time()
    dt = torch.bfloat16
    results = [
        check(2, 128, 128, 4, 4, 128, dt),
        check(2, 113, 1023, 4, 4, 128, dt),
        check(1, 1, 1, 2, 2, 64, torch.float16),
        check(2, 257, 300, 8, 2, 64, torch.float16, causal=True),
        check(2, 300, 257, 8, 2, 96, dt, causal=True),
        check(2, 300, 257, 8, 2, 96, dt, causal=True, pack_gqa=True),
        check(2, 255, 511, 8, 1, 192, dt, window=(33, 7)),
        check(2, 255, 511, 8, 1, 256, dt, window=(33, 7), pack_gqa=True),
        check(1, 200, 200, 4, 4, 72, torch.float16, softcap=5.0),
        check(2, 200, 333, 4, 2, 128, dt, alibi=torch.rand(4, device="cuda")),
        check(2, 200, 333, 4, 2, 136, torch.float16, causal=True, alibi=torch.rand(2, 4, device="cuda"), pack_gqa=True),
        check(1, 1000, 10, 2, 1, 64, dt, causal=True),
        check(1, 17, 0, 2, 1, 64, dt),
    ]
    print(f"{sum(results)}/{len(results)} ok, {time.time() - t:.1f}s")
    if "--kvcache" in sys.argv:
        kvcache_suite()
    if "--bwd" in sys.argv:
        bwd_suite()
        for d in (64, 128):
            for causal in (False, True):
                bench_bwd(d, causal)
    if "--bench" in sys.argv:
        for d in (64, 128, 256):
            for causal in (False, True):
                bench(d, causal)

