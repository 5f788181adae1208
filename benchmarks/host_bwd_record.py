"""Host time of an eager backward with and without its launch record (execute.LaunchRecord, kept in
backward._bwd_records), next to SDPA's cuDNN and flash backends, in one process.

    python benchmarks/host_bwd_record.py

bf16, MHA; tiny shapes (their kernels are shorter than the host's work: b1 s128 h16, d64 causal and
d128 full) and a mid one (b4 s1024 h16 d128 causal). Each variant's forward runs once; what is
timed is torch.autograd.grad of its output (retain_graph, so the graph serves every call; no
.grad accumulation), as a training step's backward pays it: the autograd engine, flashgen's
backward (or SDPA's) and the dq/dk/dv allocations. Two more rows time flashgen's backward body
(backward.flash_bwd into preallocated gradients) alone. Microseconds to enqueue one call behind a
sleeping kernel (flashgen.bench.timing.enqueue_us), medians, variants in turn for 3 rounds.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen.bench.timing import enqueue_us
from flashgen.runtime import backward

ROUNDS = 3
# A backward is three launches (SDPA's up to four, with the engine's): fewer calls than enqueue_us's
# default keep them within the launch queue.
CALLS = 100
SHAPES = (  # (batch, seqlen, heads, head dim, causal)
    (1, 128, 16, 64, True),
    (1, 128, 16, 128, False),
    (4, 1024, 16, 128, True),
)


def records(enabled: bool):
    """Records on (fresh) or off (the full path)."""
    backward._bwd_records.clear()
    return contextlib.nullcontext() if enabled else backward._bwd_records.off()


def randn(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)


def variants(batch: int, seqlen: int, heads: int, head_dim: int, causal: bool) -> dict:
    """{row name: (one backward call, whether it should take a record (None: not flashgen's), the
    SDPA backend to run it under or None)}."""
    q, k, v = (randn(batch, seqlen, heads, head_dim, grad=True) for _ in range(3))
    dout = randn(batch, seqlen, heads, head_dim)
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)

    def flashgen_grad():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    grads = [torch.empty_like(x) for x in (q, k, v)]
    detached = [x.detach() for x in (q, k, v, out)]

    def flashgen_body():
        backward.flash_bwd(dout, *detached[:3], detached[3], lse, *grads, softmax_scale=head_dim ** -0.5,
                           causal=causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False)

    rows = {
        "flashgen, record": (flashgen_grad, True, None),
        "flashgen, full path": (flashgen_grad, False, None),
        "flash_bwd alone, record": (flashgen_body, True, None),
        "flash_bwd alone, full path": (flashgen_body, False, None),
    }
    q_t, k_t, v_t = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dout_t = dout.transpose(1, 2)
    for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                out_t = F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=causal)
        except RuntimeError as exc:  # a backend that refuses the shape: a note, not a number
            rows[name] = (f"skipped: {str(exc).splitlines()[0]}", None, None)
            continue

        def sdpa_grad(out_t=out_t):
            torch.autograd.grad(out_t, (q_t, k_t, v_t), dout_t, retain_graph=True)

        rows[name] = (sdpa_grad, None, backend)
    return rows


def time_row(call, recorded: bool | None, backend) -> float | str:
    """enqueue_us of one row's call, under its records setting or SDPA backend."""
    if recorded is None:
        try:
            with sdpa_kernel(backend):
                return enqueue_us(call, calls=CALLS)
        except RuntimeError as exc:
            return f"skipped: {str(exc).splitlines()[0]}"
    with records(recorded):
        us = enqueue_us(call, calls=CALLS)
        if recorded and not backward._bwd_records:
            return f"no record made ({us:.1f} us on the full path)"
    return us


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    for shape in SHAPES:
        batch, seqlen, heads, head_dim, causal = shape
        rows = variants(*shape)
        samples: dict[str, list | str] = {}
        for _ in range(ROUNDS):
            for name, (call, recorded, backend) in rows.items():
                if isinstance(samples.get(name), str):  # skipped in an earlier round: its note stands
                    continue
                result = call if isinstance(call, str) else time_row(call, recorded, backend)
                if isinstance(result, str):
                    samples[name] = result
                else:
                    samples.setdefault(name, []).append(result)
        medians = {name: sorted(s)[len(s) // 2] for name, s in samples.items() if not isinstance(s, str)}
        reference = medians.get("SDPA cuDNN") or medians.get("SDPA flash")
        label = "cuDNN" if "SDPA cuDNN" in medians else "flash"
        print(f"b{batch} s{seqlen} h{heads} d{head_dim} {'causal' if causal else 'full'}, backward: "
              f"us per call ({ROUNDS} rounds)" + (f", x SDPA {label}" if reference else ""))
        for name, s in samples.items():
            if isinstance(s, str):
                print(f"  {name:<28} {s}")
                continue
            ratio = f"  {medians[name] / reference:5.2f}x" if reference else ""
            print(f"  {name:<28} {medians[name]:7.1f}{ratio}   {[round(x, 1) for x in s]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
