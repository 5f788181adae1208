"""Gradients of tune_bwd_sm90.py variants against an fp32 reference, before an A/B's winner is made
the default and the GPU tier runs on it: each variant's max error per gradient must stay within
twice the default's (plus 1e-5), over dense, causal and odd sizes (seqlen 1, 113, 777, 1023).

    python benchmarks/results/20261207-cpu-sm90-bwd-split-wait/check_bwd_variant.py \
        FLASHGEN_BWD_SM90_MEASURE_SPLIT_WAIT=1 [--head-dims 64,128,256]

Exits with 1 when a variant is outside the bound (or NaN).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for tune_bwd_sm90
from tune_bwd_sm90 import use_variant  # noqa: E402

import flashgen  # noqa: E402
from flashgen.runtime import tuning  # noqa: E402

_SIZES = ((113, 1023), (1023, 1023), (1, 300), (777, 777))


def reference(q, k, v, causal: bool) -> torch.Tensor:
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    scores = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:  # bottom-right aligned, as flash_attn
        sq, sk = scores.shape[-2:]
        seen = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril(sk - sq)
        scores = scores.masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--head-dims", default="64,128,256")
    args = parser.parse_args()
    failed = 0
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for causal in (False, True):
            for seqlen_q, seqlen_k in _SIZES:
                torch.manual_seed(head_dim * 7919 + seqlen_q)
                q = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k, v = (torch.randn(2, seqlen_k, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                        for _ in range(2))
                dout = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=torch.bfloat16)
                expected = torch.autograd.grad(reference(q, k, v, causal), (q, k, v), dout.float())
                errors = {}
                for variant in ["default", *args.variants]:
                    with tuning.use(**use_variant(variant)):  # its tuning.FIELD=VALUE items too
                        grads = torch.autograd.grad(flashgen.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
                    errors[variant] = [(g.float() - e).abs().max().item() for g, e in zip(grads, expected)]
                for variant in args.variants:
                    ok = all(err <= 2 * base + 1e-5 for base, err in zip(errors["default"], errors[variant]))
                    failed += not ok
                    print(f"d{head_dim} causal={causal} {seqlen_q}x{seqlen_k} {variant}: dq dk dv max error "
                          + " ".join(f"{e:.2e}" for e in errors[variant]) + " (default "
                          + " ".join(f"{e:.2e}" for e in errors["default"]) + ")" + ("" if ok else "  FAIL"),
                          flush=True)
    use_variant("default")
    print("all within the bound" if not failed else f"{failed} outside the bound")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
