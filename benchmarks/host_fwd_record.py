"""Host time of an eager dense forward with and without its launch record (execute.LaunchRecord),
next to SDPA's cuDNN and flash backends, in one process.

    python benchmarks/host_fwd_record.py

Tiny shapes (their kernels are shorter than the host's work), bf16; microseconds to enqueue one
call behind a sleeping kernel (flashgen.bench.timing.enqueue_us), medians, variants in turn for
3 rounds.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen.bench.timing import enqueue_us
from flashgen.runtime import interface


def records(enabled: bool):
    """Records on (fresh) or off (the full path)."""
    interface._fwd_records.clear()
    return contextlib.nullcontext() if enabled else interface._fwd_records.off()


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    for head_dim, causal in ((128, False), (64, True)):
        q, k, v = (torch.randn(1, 128, 16, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        bhsd = [x.transpose(1, 2) for x in (q, k, v)]
        rows = {}
        for _ in range(3):
            for name, enabled in (("flashgen, record", True), ("flashgen, full path", False)):
                with records(enabled):
                    rows.setdefault(name, []).append(enqueue_us(lambda: flashgen.flash_attn_func(q, k, v, causal=causal)))
            for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel(backend):
                    rows.setdefault(name, []).append(enqueue_us(lambda: F.scaled_dot_product_attention(*bhsd, is_causal=causal)))
        print(f"b1 s128 h16 d{head_dim} {'causal' if causal else 'full'}: us per call (3 rounds)")
        for name, samples in rows.items():
            print(f"  {name:<22} {sorted(samples)[1]:7.1f}   {[round(x, 1) for x in samples]}")


if __name__ == "__main__":
    main()
