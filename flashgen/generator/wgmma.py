"""The wgmma wrappers of the sm90 family, rendered into the header ``wgmma.cuh``.

One ``wgmma.mma_async`` of shape m64nNk16 (f32 accumulators, fp16 or bf16 operands) takes N / 2
accumulator registers, each its own inline-asm operand: the asm text and its operand list differ
per N, so they are generated here rather than written out by hand for every N the kernels use.
"""
from __future__ import annotations

from .tiles import sm90_mma_widths

HEADER = "wgmma.cuh"
N_TILES = sm90_mma_widths()  # the wgmma N of S = Q·Kᵀ (the key block) and of O += P·V (the head dim)


def _wrapper(n: int, a_from_registers: bool) -> str:
    regs = n // 2
    accumulators = ", ".join(f"%{i}" for i in range(regs))
    constraints = ",\n          ".join(
        ", ".join(f'"+f"(d[{i}])' for i in range(row, min(row + 8, regs))) for row in range(0, regs, 8)
    )
    if a_from_registers:
        kind, a_param = "rs", "const uint32_t (&a)[4]"
        a_operand = "{" + ", ".join(f"%{regs + i}" for i in range(4)) + "}"
        b_operand, predicate, trans_b = f"%{regs + 4}", f"%{regs + 5}", f"%{regs + 6}"
        immediates = f"p, 1, 1, {trans_b}"  # scale-d, imm-scale-a, imm-scale-b, imm-trans-b
        inputs = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB)'
    else:
        kind, a_param = "ss", "uint64_t desc_a"
        a_operand, b_operand, predicate, trans_b = f"%{regs}", f"%{regs + 1}", f"%{regs + 2}", f"%{regs + 3}"
        trans_a = f"%{regs + 4}"
        immediates = f"p, 1, 1, {trans_a}, {trans_b}"  # ... imm-trans-a, imm-trans-b
        inputs = '"l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB), "n"(kTransA)'
    bodies = []
    for ptx_type in ("bf16", "f16"):
        bodies.append(
            f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, {predicate}, 0;\\n"\n'
            f'                     "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} '
            f'{{{accumulators}}}, {a_operand}, {b_operand}, {immediates};\\n}}\\n"\n'
            f"          : {constraints}\n"
            f"          : {inputs});"
        )
    template_params = "typename Element, int kTransB" + (", int kTransA" if not a_from_registers else "")
    return (
        f"template <{template_params}>\n"
        f"__device__ __forceinline__ void wgmma_{kind}_m64n{n}k16(float (&d)[{regs}], {a_param}, uint64_t desc_b,\n"
        f"                                                     int accumulate) {{\n"
        f"    if constexpr (Element::kIsBf16) {{\n{bodies[0]}\n    }} else {{\n{bodies[1]}\n    }}\n}}\n"
    )


def _dispatcher(kind: str, a_param: str, a_arg: str) -> str:
    """wgmma_{kind}<Element, N, kTransB[, kTransA]>: the m64nNk16 wrapper for a compile-time N. A
    from shared memory may be MN-major (kTransA 1: the backward's dS as dQ = dS·K's A)."""
    trans = "kTransB, kTransA" if kind == "ss" else "kTransB"
    branches = "\n".join(
        f"    {'if' if i == 0 else 'else if'} constexpr (N == {n}) wgmma_{kind}_m64n{n}k16<Element, {trans}>(d, {a_arg}, desc_b, accumulate);"
        for i, n in enumerate(N_TILES)
    )
    allowed = " || ".join(f"N == {n}" for n in N_TILES)
    template_params = "typename Element, int N, int kTransB" + (", int kTransA = 0" if kind == "ss" else "")
    return (
        f"template <{template_params}>\n"
        f"__device__ __forceinline__ void wgmma_{kind}(float (&d)[N / 2], {a_param}, uint64_t desc_b, int accumulate) {{\n"
        f"    static_assert({allowed}, \"no wgmma wrapper rendered for this N (flashgen/generator/wgmma.py)\");\n"
        f"{branches}\n}}\n"
    )


def render_wgmma_header(do_not_edit: str) -> str:
    wrappers = "\n".join(_wrapper(n, a_from_registers) for n in N_TILES for a_from_registers in (False, True))
    wrappers += "\n" + _dispatcher("ss", "uint64_t desc_a", "desc_a") + "\n" + _dispatcher("rs", "const uint32_t (&a)[4]", "a")
    return f"""// {do_not_edit}
// Rendered by flashgen/generator/wgmma.py: D[64 x N] (+)= A · B with f32 accumulators (d), A from
// shared memory (wgmma_ss: desc_a) or registers (wgmma_rs: a, the m64k16 fragment), B from shared
// memory (desc_b; kTransB 1: MN-major; kTransA 1: A from shared memory MN-major). accumulate 0 overwrites D. Element: half_t or bfloat16_t.
#pragma once
#include "common.cuh"

namespace flashgen {{

{wrappers}
}}  // namespace flashgen
"""
