"""One forward and two backward passes of one implementation (--direction fwd: two forwards), for a
profiler to pick a kernel from.

    ncu --clock-control none -k regex:flash_bwd_sm90 -s 1 -c 1 --set full -o bwd \
        python benchmarks/profile_bwd_once.py --impl flashgen --head-dim 128 --seqlen 4096

--impl fa4 runs FlashAttention-4 (flash_attn.cute); bf16, 16k tokens, hidden 2048. --profile-range
brackets the second pass with the CUDA profiler's start and stop, so that
`ncu --profile-from-start off` profiles exactly its kernels, whatever an implementation names them.
"""
import argparse

import torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--impl", choices=("flashgen", "fa4"), default="flashgen")
parser.add_argument("--direction", choices=("bwd", "fwd"), default="bwd")
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--seqlen", type=int, default=4096)
parser.add_argument("--gqa", type=int, default=1)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--deterministic", action="store_true")
parser.add_argument("--profile-range", action="store_true", help="profile only the second pass's kernels")
args = parser.parse_args()
batch, nheads = 16384 // args.seqlen, 2048 // args.head_dim
q = torch.randn(batch, args.seqlen, nheads, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(batch, args.seqlen, nheads // args.gqa, args.head_dim, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True) for _ in range(2))
if args.impl == "fa4":
    from flash_attn.cute import flash_attn_func as fa4_func

    def forward():
        return fa4_func(q, k, v, causal=args.causal, deterministic=args.deterministic)[0]
else:
    import flashgen

    def forward():
        return flashgen.flash_attn_func(q, k, v, causal=args.causal, deterministic=args.deterministic)

out = forward()
dout = torch.randn_like(out)
if args.direction == "fwd":
    def step():
        with torch.no_grad():
            forward()
else:
    def step():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
step()
torch.cuda.synchronize()
if args.profile_range:
    torch.cuda.profiler.start()
step()
torch.cuda.synchronize()
if args.profile_range:
    torch.cuda.profiler.stop()
