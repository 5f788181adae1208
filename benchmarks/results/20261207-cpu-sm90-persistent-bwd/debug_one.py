"""One sm90 backward case (argv: name [faulthandler seconds]), checked against an fp32 reference;
prints the errors, and under -DFLASHGEN_MBAR_WATCHDOG_MS (FLASHGEN_NVRTC_EXTRA_OPTIONS) the waits
that gave up (sm90_common.cuh's flashgen_mbar_watchdog)."""
import faulthandler, os, sys, time
import torch, flashgen

CASES = {  # name: batch, seqlen, nheads, nheads_k, d, causal, deterministic
    "d64_one": (2, 255, 4, 4, 64, False, False),
    "d64_many": (4, 2048, 8, 8, 64, False, False),
    "d64_causal": (4, 2048, 8, 8, 64, True, False),
    "d128_many": (4, 2048, 8, 8, 128, False, False),
    "d128_causal": (4, 2048, 8, 2, 128, True, False),
    "d256_many": (2, 2048, 8, 8, 256, False, False),
    "d192_causal": (2, 1023, 6, 3, 192, True, False),
    "d128_det_causal": (2, 2048, 8, 8, 128, True, True),
}
name = sys.argv[1]
faulthandler.dump_traceback_later(float(sys.argv[2]) if len(sys.argv) > 2 else 50, exit=True)
b, s, h, hk, d, causal, det = CASES[name]
torch.manual_seed(0)
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
out = flashgen.flash_attn_func(q, k, v, causal=causal, deterministic=det)
torch.cuda.synchronize()
t = time.time()
dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
torch.cuda.synchronize()
t = time.time() - t
def ref(dtype):
    qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    kr, vr = kk.repeat_interleave(h // hk, 2), vv.repeat_interleave(h // hk, 2)
    o = torch.nn.functional.scaled_dot_product_attention(qq.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2),
                                                         is_causal=causal).transpose(1, 2)
    return torch.autograd.grad(o, (qq, kk, vv), dout.to(dtype))
r32 = ref(torch.float32)
r16 = ref(torch.bfloat16)
errs = []
for n, g, a, l in zip("qkv", (dq, dk, dv), r32, r16):
    e, el = (g.float() - a).abs().max().item(), (l.float() - a).abs().max().item()
    errs.append(f"d{n} {e:.3g} (torch bf16 {el:.3g})")
ok = all((g.float() - a).abs().max().item() <= 3 * (l.float() - a).abs().max().item() + 1e-5 for g, a, l in zip((dq, dk, dv), r32, r16))
print(f"{name}: {'OK' if ok else 'BAD'} backward {t*1e3:.1f} ms (first call) " + ", ".join(errs), flush=True)


def watchdog_report(limit=48):
    """The waits that outlasted the watchdog's deadline, per sm90 backward kernel loaded (read
    with the timeline script's reader of a module's __device__ buffer)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # benchmarks/
    from bwd_cta_timeline import read_timeline
    from flashgen.runtime import launch
    roles = {0: "producer", 1: "lse/d", 2: "dq", 3: "keep bits"}
    for spec, kernel in list(launch._loaded.items()):
        if spec.direction != "bwd" or spec.family != "sm90":
            continue
        words = read_timeline(kernel, b"flashgen_mbar_watchdog", slots=1).view(-1)
        count = int(words[0])
        print(f"watchdog {spec}: {count} waits gave up", flush=True)
        entries = words[1:1 + 4 * min(count, limit)].view(-1, 4).tolist()
        for block_thread, bar, parity, state in entries:
            block, thread = block_thread >> 32, block_thread & 0xFFFFFFFF
            warp = thread // 32
            role = roles.get(warp, f"consumer {(warp - 4) // 4}")
            print(f"  block {block} warp {warp} ({role}) bar 0x{bar:x} parity {parity} state 0x{state & (2**64 - 1):016x}")


if "FLASHGEN_MBAR_WATCHDOG_MS" in os.environ.get("FLASHGEN_NVRTC_EXTRA_OPTIONS", ""):
    watchdog_report()
