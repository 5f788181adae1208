"""Host time of an eager flash_attn_with_kvcache decode step with and without its launch record
(execute.LaunchRecord, kept in kvcache._kvcache_records), next to SDPA's cuDNN and flash backends, in
one process.

    python benchmarks/host_kvcache_record.py

b1, one query token, 32 query / 8 KV heads, d128, bf16, caches of 8192 and 131072 positions
(cache_seqlens one short of full), num_splits=0 (the heuristic's split: partials and the combine,
or a merge in clusters); without and with one appended token. SDPA attends to the whole cache
(enable_gqa); with a token appended it first writes it into the cache with index_copy_, as a
PyTorch decode loop over a static cache does. Microseconds to enqueue one call behind a sleeping
kernel (flashgen.bench.timing.enqueue_us), medians, variants in turn for 3 rounds.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen.bench.timing import enqueue_us
from flashgen.runtime import kvcache

ROUNDS = 3


def records(enabled: bool):
    """Records on (fresh) or off (the full path)."""
    kvcache._kvcache_records.clear()
    return contextlib.nullcontext() if enabled else kvcache._kvcache_records.off()


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    for capacity in (8192, 131072):
        q = randn(1, 1, 32, 128)
        k_cache, v_cache = randn(1, capacity, 8, 128), randn(1, capacity, 8, 128)
        k_new, v_new = randn(1, 1, 8, 128), randn(1, 1, 8, 128)
        cache_seqlens = torch.full((1,), capacity - 1, dtype=torch.int32, device="cuda")
        position = cache_seqlens.long()
        q_bhsd, k_bhsd, v_bhsd, k_new_bhsd, v_new_bhsd = (
            t.transpose(1, 2) for t in (q, k_cache, v_cache, k_new, v_new))
        for appended in (False, True):
            new_rows = dict(k=k_new, v=v_new) if appended else {}

            def flashgen_step():
                flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, num_splits=0,
                                                 **new_rows)

            def sdpa_step():
                if appended:
                    k_bhsd.index_copy_(2, position, k_new_bhsd)
                    v_bhsd.index_copy_(2, position, v_new_bhsd)
                F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, enable_gqa=True)

            rows: dict[str, list] = {}
            for _ in range(ROUNDS):
                for name, enabled in (("flashgen, record", True), ("flashgen, full path", False)):
                    with records(enabled):
                        rows.setdefault(name, []).append(enqueue_us(flashgen_step))
                for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
                                      ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
                    try:
                        with sdpa_kernel(backend):
                            rows.setdefault(name, []).append(enqueue_us(sdpa_step))
                    except RuntimeError as exc:  # a backend that refuses the shape: a note, not a number
                        rows[name] = f"skipped: {str(exc).splitlines()[0]}"
            label = "one token appended" if appended else "no append"
            print(f"b1 q1 L{capacity} h32/8 d128, {label}: us per call ({ROUNDS} rounds)")
            for name, samples in rows.items():
                if isinstance(samples, str):
                    print(f"  {name:<22} {samples}")
                else:
                    print(f"  {name:<22} {sorted(samples)[len(samples) // 2]:7.1f}   {[round(x, 1) for x in samples]}")


if __name__ == "__main__":
    main()
