"""One d128 s4096 causal sm90 backward of a tune_bwd_sm90 variant (argv[1]), for ncu:
    ncu --kernel-name regex:flash_bwd_sm90 --launch-skip 1 --launch-count 1 --section ... python ncu_one.py VARIANT"""
import sys

import torch

sys.path.insert(0, "benchmarks")
import tune_bwd_sm90 as tune  # noqa: E402
from flashgen.runtime import backward  # noqa: E402

tune.use_variant(sys.argv[1])
torch.manual_seed(0)
q, k, v, dout = (torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
import flashgen  # noqa: E402
with torch.no_grad():
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
grads = [torch.empty_like(x) for x in (q, k, v)]
for _ in range(2):
    backward.flash_bwd(dout, q, k, v, out, lse, *grads, softmax_scale=128 ** -0.5, causal=True, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, deterministic=False, dropout=None)
torch.cuda.synchronize()
