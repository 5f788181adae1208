"""Where NVRTC's compile time goes, per kernel family, and what each option does to it (issue 34).

For one representative instance of each family it compiles, serially and in process, with the
options the cache uses plus one variant at a time, and reads NVRTC's own phase timer (``--time``):
CUDA C++ front end (parse + template instantiation), NVVM optimizer (LLVM IR -> optimized IR ->
PTX) and PTX translation (ptxas, PTX -> SASS).  For each variant it says whether the machine code
is unchanged: the bytes of every ``.text.*`` section of the cubin against the baseline's.

    PYTHONPATH=. python benchmarks/compile_profile.py --out benchmarks/results/<run>/profile.json

CPU only (NVRTC needs no GPU).  It runs one compile at a time; on the 2-core machines keep it that
way, so that the other engineer's work does not skew the numbers.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import platform
import random
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cuda.bindings import nvrtc as N

from flashgen.generator import cache, matrix, render
from flashgen.generator import nvrtc as fg_nvrtc


@dataclass(frozen=True)
class Representative:
    family: str
    direction: str
    arch: str
    spec_family: str
    flags: tuple[tuple[str, object], ...] = ()


# Head dim 128, bf16, causal where the family has it; one variant flag at a time.
REPRESENTATIVES = [
    Representative("fwd sm80", "fwd", "sm_80", "sm80"),
    Representative("fwd sm80 (sm_86)", "fwd", "sm_86", "sm80"),
    Representative("fwd sm80 (sm_90a)", "fwd", "sm_90a", "sm80"),
    Representative("fwd sm80 decode", "fwd", "sm_80", "sm80", (("decode", True),)),
    Representative("fwd sm80 paged", "fwd", "sm_80", "sm80", (("paged", True), ("decode", False))),
    Representative("fwd sm80 dropout", "fwd", "sm_80", "sm80", (("dropout", True),)),
    Representative("fwd sm90", "fwd", "sm_90a", "sm90"),
    Representative("fwd sm90 paged split", "fwd", "sm_90a", "sm90", (("paged", True), ("split", True))),
    Representative("bwd sm80", "bwd", "sm_80", "sm80"),
    Representative("bwd sm90", "bwd", "sm_90a", "sm90"),
    Representative("combine", "combine", "sm_80", "sm80"),
    Representative("append", "append", "sm_80", "sm80"),
    Representative("bwd_pre", "bwd_pre", "sm_80", "sm80"),
    Representative("bwd_post", "bwd_post", "sm_80", "sm80"),
]

REPEATS = 2

# Variants: (label, options to drop from the cache's options, options to add).
VARIANTS = [
    ("baseline", (), ()),
    ("no -lineinfo", ("-lineinfo",), ()),
    ("-Xptxas -O1", (), ("--ptxas-options=-O1",)),
    ("-Xptxas -O2", (), ("--ptxas-options=-O2",)),
    ("--extra-device-vectorization", (), ("--extra-device-vectorization",)),
    ("-Ofast-compile=min", (), ("--Ofast-compile=min",)),
    ("-Ofast-compile=mid", (), ("--Ofast-compile=mid",)),
    ("-Ofast-compile=max", (), ("--Ofast-compile=max",)),
    # Splits NVVM's optimizer over threads: wall time of one compile, not CPU.
    ("--split-compile=2", (), ("--split-compile=2",)),
]

# The matrix's groups for the whole-matrix estimate: (label, directions, archs, spec family).
GROUPS = [
    ("fwd sm80 family", ("fwd",), ("sm_80", "sm_86", "sm_90a"), "sm80"),
    ("fwd sm90 family", ("fwd",), ("sm_90a",), "sm90"),
    ("bwd sm80 family", ("bwd",), ("sm_80", "sm_86", "sm_90a"), "sm80"),
    ("bwd sm90 family", ("bwd",), ("sm_90a",), "sm90"),
    ("combine/append/bwd_pre/bwd_post", ("combine", "append", "bwd_pre", "bwd_post"),
     ("sm_80", "sm_86", "sm_90a"), "sm80"),
]
SAMPLE_VARIANTS = ("baseline", "-Ofast-compile=max")


def pick(rep: Representative):
    specs = [s for s in matrix.all_specs(directions=[rep.direction], archs=[rep.arch])
             if s.family == rep.spec_family and all(getattr(s, k) == v for k, v in rep.flags)]
    defaults = dict(decode=False, paged=False, dropout=False, split=False, gather=False, softcap=False,
                    pack_gqa=False)
    for key, _ in rep.flags:
        defaults.pop(key, None)

    def score(s):
        return (s.head_dim != 128, s.dtype != "bf16", s.mask != "causal",
                sum(getattr(s, k) != v for k, v in defaults.items()))

    return min(specs, key=score)


def text_digest(cubin: bytes) -> str:
    """sha256 over the names and bytes of the ELF's .text.* sections (the machine code only)."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = sections[shstrndx][4]
    digest = hashlib.sha256()
    for name_off, _type, _flags, _addr, offset, size, *_ in sections:
        name = cubin[strtab_off + name_off:cubin.index(b"\0", strtab_off + name_off)]
        if name.startswith(b".text."):
            digest.update(name + b"\0" + cubin[offset:offset + size])
    return digest.hexdigest()


def compile_timed(source: str, headers: dict[str, str], arch: str, options: list[str],
                  repeats: int = REPEATS) -> dict:
    """The fastest of ``repeats`` compiles (the machine is shared: the minimum is the least
    disturbed): wall and CPU seconds and NVRTC's phase times, each its minimum."""
    runs = [compile_once(source, headers, arch, options) for _ in range(repeats)]
    best = dict(runs[0])
    best["wall_s"] = min(r["wall_s"] for r in runs)
    best["cpu_s"] = min(r["cpu_s"] for r in runs)
    best["phases"] = {k: min(r["phases"][k] for r in runs) for k in runs[0]["phases"]}
    return best


def compile_once(source: str, headers: dict[str, str], arch: str, options: list[str]) -> dict:
    """One NVRTC compile: wall and CPU seconds, NVRTC's phase times (s, wall clock per phase),
    digests of the cubin and of its machine code."""
    with tempfile.TemporaryDirectory() as tmp:
        time_file = Path(tmp) / "time.csv"
        all_options = [f"--gpu-architecture={arch}", "-std=c++17",
                       f"-I{fg_nvrtc.cuda_include_dir()}", *options, f"--time={time_file}"]
        names = list(headers)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        err, program = N.nvrtcCreateProgram(source.encode(), b"instance.cu", len(names),
                                            [headers[n].encode() for n in names],
                                            [n.encode() for n in names])
        (err,) = N.nvrtcCompileProgram(program, len(all_options), [o.encode() for o in all_options])
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        _, size = N.nvrtcGetProgramLogSize(program)
        log = bytearray(size)
        N.nvrtcGetProgramLog(program, log)
        if err != N.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{all_options}: {err}\n{log.decode(errors='replace')}")
        result = dict(wall_s=wall, cpu_s=cpu, log=log.rstrip(b"\0").decode(errors="replace"))
        if arch.startswith("sm_"):
            _, size = N.nvrtcGetCUBINSize(program)
            cubin = bytearray(size)
            N.nvrtcGetCUBIN(program, cubin)
            result.update(cubin_sha=hashlib.sha256(cubin).hexdigest(), text_sha=text_digest(bytes(cubin)),
                          cubin_bytes=len(cubin))
        N.nvrtcDestroyProgram(program)
        phases = {}
        with time_file.open() as f:
            for row in csv.reader(f, skipinitialspace=True):
                if len(row) == 4 and row[3] == "ms":
                    phases[row[1]] = phases.get(row[1], 0.0) + float(row[2]) / 1000
        result["phases"] = phases
    return result


def profile_families(headers, base_options, variants) -> list[dict]:
    rows = []
    for rep in REPRESENTATIVES:
        spec = pick(rep)
        source = render.render_instance(spec)
        baseline = None
        for label, drop, add in variants:
            options = [o for o in base_options if o not in drop] + list(add)
            r = compile_timed(source, headers, spec.arch, options)
            baseline = baseline or r
            r.update(family=rep.family, uri=spec.uri, arch=spec.arch, variant=label,
                     same_text=r["text_sha"] == baseline["text_sha"],
                     same_cubin=r["cubin_sha"] == baseline["cubin_sha"])
            r.pop("log")
            rows.append(r)
            print(f"{rep.family:24} {label:30} wall {r['wall_s']:5.2f} cpu {r['cpu_s']:5.2f} "
                  f"{ {k: round(v, 2) for k, v in r['phases'].items()} } same .text {r['same_text']}",
                  flush=True)
        # PTX only (virtual arch): the front end and NVVM without ptxas.
        virtual = "compute_" + spec.arch.removeprefix("sm_")
        r = compile_timed(source, headers, virtual, base_options)
        r.pop("log")
        r.update(family=rep.family, uri=spec.uri, arch=virtual, variant="PTX only")
        rows.append(r)
        print(f"{rep.family:24} {'PTX only (' + virtual + ')':30} wall {r['wall_s']:5.2f} cpu {r['cpu_s']:5.2f}",
              flush=True)
    return rows


def profile_pch(headers, base_options, count: int) -> list[dict]:
    """Automatic PCH (-pch) over ``count`` fwd sm80 instances that share their headers: the first
    creates the PCH, the others may use it.  Also says whether NVRTC takes headers in memory."""
    specs = [s for s in matrix.all_specs(directions=["fwd"], archs=["sm_80"]) if s.head_dim == 128][:count]
    rows = []
    with tempfile.TemporaryDirectory() as pch_dir:
        for mode, extra in (("no pch", []),
                            ("-pch", ["-pch", f"--pch-dir={pch_dir}", "--pch-verbose=true"])):
            for spec in specs:
                # Once each: a repeat would find the PCH its first run created.
                r = compile_once(render.render_instance(spec), headers, spec.arch, base_options + extra)
                r.update(mode=mode, uri=spec.uri, pch_files=sorted(p.name for p in Path(pch_dir).iterdir()))
                rows.append(r)
                print(f"PCH {mode:8} {spec.uri:50} wall {r['wall_s']:5.2f} cpu {r['cpu_s']:5.2f} "
                      f"{ {k: round(v, 2) for k, v in r['phases'].items()} } log: {r['log'][:300]!r}",
                      flush=True)
    return rows


FRONT, NVVM, PTXAS = "CUDA C++ Frontend", "NVVM Optimizer", "PTX Translation"


def tables(result: dict) -> str:
    """The README's tables, in Markdown, from a saved result."""
    rows = result["families"]
    out = ["| family | instance | CPU s | wall s | front end s | NVVM s | ptxas s | PTX only CPU s |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    by_family: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_family.setdefault(r["family"], {})[r["variant"]] = r
    for family, variants in by_family.items():
        b, ptx = variants["baseline"], variants.get("PTX only")
        p = b["phases"]
        out.append(f"| {family} | `{b['uri']}` | {b['cpu_s']:.2f} | {b['wall_s']:.2f} | {p[FRONT]:.2f} | "
                   f"{p[NVVM]:.2f} | {p[PTXAS]:.2f} | {ptx['cpu_s']:.2f} |" if ptx else "")
    labels = [v for v in next(iter(by_family.values())) if v not in ("baseline", "PTX only")]
    out += ["", "CPU seconds per option (ratio to baseline; `=` machine code (.text) unchanged, "
            "`≠` changed):", "",
            "| family | baseline | " + " | ".join(labels) + " |",
            "|---|---:|" + "---:|" * len(labels)]
    for family, variants in by_family.items():
        base = variants["baseline"]["cpu_s"]
        cells = [f"{variants[v]['cpu_s']:.2f} ({variants[v]['cpu_s'] / base:.2f}) "
                 f"{'=' if variants[v]['same_text'] else '≠'}" for v in labels]
        if "--split-compile=2" in variants:  # its point is wall time
            cells[labels.index("--split-compile=2")] += f", wall {variants['--split-compile=2']['wall_s']:.2f}"
        out.append(f"| {family} | {base:.2f} | " + " | ".join(cells) + " |")
    out += ["", "Automatic PCH (`-pch`), headers in memory, instances compiled in a row:", "",
            "| mode | instance | CPU s | front end s | NVRTC log |", "|---|---|---:|---:|---|"]
    for r in result["pch"]:
        log = r["log"].strip().replace("\n", " ").replace("|", "/")[:90]
        out.append(f"| {r['mode']} | `{r['uri']}` | {r['cpu_s']:.2f} | {r['phases'][FRONT]:.2f} | {log} |")
    if result.get("sample"):
        out += ["", "Whole-matrix estimate (seeded random sample per group; CPU s, one compile each):", "",
                "| group | instances | sampled | mean CPU s | group CPU min | mean CPU s, -Ofast-compile=max | "
                "group CPU min, -Ofast-compile=max |", "|---|---:|---:|---:|---:|---:|---:|"]
        totals = dict.fromkeys(SAMPLE_VARIANTS, 0.0)
        count = 0
        for label, *_ in GROUPS:
            group = [r for r in result["sample"] if r["group"] == label]
            if not group:
                continue
            size = group[0]["group_size"]
            count += size
            cells = []
            for variant in SAMPLE_VARIANTS:
                cpu = [r["cpu_s"] for r in group if r["variant"] == variant]
                mean = sum(cpu) / len(cpu)
                totals[variant] += mean * size
                cells += [f"{mean:.2f}", f"{mean * size / 60:.1f}"]
            out.append(f"| {label} | {size} | {len(group) // len(SAMPLE_VARIANTS)} | " + " | ".join(cells) + " |")
        base, fast = totals.values()
        out.append(f"| **matrix** | {count} | | {base / count:.2f} | {base / 60:.1f} | {fast / count:.2f} | "
                   f"{fast / 60:.1f} |")
        out += ["", f"On 2 cores with 2 compiles at a time: about {base / 120:.0f} min today, "
                f"{fast / 120:.0f} min with -Ofast-compile=max."]
    return "\n".join(out)


def profile_sample(headers, base_options, per_group: int, seed: int = 34) -> list[dict]:
    """A seeded random sample of each matrix group, compiled once per SAMPLE_VARIANTS, for an
    estimate of the whole matrix: group size x the group's mean CPU seconds."""
    rng = random.Random(seed)
    variants = [v for v in VARIANTS if v[0] in SAMPLE_VARIANTS]
    rows = []
    for label, directions, archs, family in GROUPS:
        specs = [s for s in matrix.all_specs(directions=directions, archs=archs) if s.family == family]
        for spec in rng.sample(specs, min(per_group, len(specs))):
            source = render.render_instance(spec)
            for variant, drop, add in variants:
                options = [o for o in base_options if o not in drop] + list(add)
                r = compile_once(source, headers, spec.arch, options)
                r.pop("log")
                r.update(group=label, group_size=len(specs), uri=spec.uri, variant=variant)
                rows.append(r)
                print(f"sample {label:32} {spec.uri:60} {variant:20} cpu {r['cpu_s']:5.2f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tables", action="store_true", help="print the tables of a saved --out")
    parser.add_argument("--pch-instances", type=int, default=4)
    parser.add_argument("--sample-per-group", type=int, default=5)
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS),
                        help="comma-separated variant labels")
    args = parser.parse_args()
    if args.tables:
        print(tables(json.loads(args.out.read_text())))
        return
    headers = render.header_sources()
    base_options = cache.compile_options()
    wanted = set(args.variants.split(","))
    variants = [v for v in VARIANTS if v[0] in wanted]
    # Warm-up: the first compile in a process loads NVRTC's builtins.
    spec = pick(REPRESENTATIVES[-1])
    compile_once(render.render_instance(spec), headers, spec.arch, base_options)
    result = dict(
        nvrtc=".".join(map(str, fg_nvrtc.nvrtc_version())),
        python=sys.version.split()[0], machine=platform.processor() or platform.machine(),
        base_options=base_options,
        families=profile_families(headers, base_options, variants),
        pch=profile_pch(headers, base_options, args.pch_instances),
        sample=profile_sample(headers, base_options, args.sample_per_group),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(tables(result))


if __name__ == "__main__":
    main()
