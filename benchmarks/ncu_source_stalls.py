"""Where a kernel's warps wait, per kind of SASS instruction, from ncu's source page.

    ncu --section SourceCounters --import-source no -o rep ... python benchmarks/profile_bwd_once.py ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.source.csv
    python benchmarks/ncu_source_stalls.py rep.source.csv --kernel flash_bwd_sm90 [--min-executions 100000]

Prints the kernel's warp-stall samples and executed warp instructions by instruction kind (MMA
issue, MMA waits, barriers, spins, softmax arithmetic, uniform-datapath ...), for the lines executed
at least --min-executions times (the step loop's, when that is the CTAs' steps times its warps:
the producer's once-per-step lines fall below it), with the instructions per execution of the
loop's first line, and the lines that hold the most samples. Samples are shares of one kernel's
warps, so compare shares, not counts, between two kernels.
"""
import argparse
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
KINDS = (  # first match wins
    ("MMA issue", r"\bHGMMA"),
    ("MMA wait", r"WARPGROUP\.DEPBAR"),
    ("MMA fence", r"WARPGROUP\.ARRIVE"),
    ("named barrier", r"\bBAR\.(SYNC|ARV|RED)"),
    ("mbarrier", r"\bSYNCS"),
    ("branch / spin", r"\bBRA\b"),
    ("fence", r"\bFENCE|\bMEMBAR"),
    ("float (softmax)", r"\b(MUFU|FFMA|FADD|FMUL|FSEL|F2FP|FMNMX)"),
    ("uniform datapath", r"\b(U[A-Z0-9]+|R2UR|S2UR)\b"),
    ("shared memory", r"\b(STS|LDS|STSM|LDSM)"),
    ("global / bulk", r"\b(LDG|STG|UBLKRED|UTMA|RED|ATOM)"),
)


def kind_of(source: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, source):
            return kind
    return "other"


def read_kernel(path: str, kernel: str) -> list[dict]:
    """The source page's rows of the first kernel whose name contains ``kernel``."""
    rows, name, header = [], None, None
    with open(path, newline="") as f:
        for record in csv.reader(f):
            if not record:
                continue
            if record[0] == "Kernel Name":
                if rows:
                    break
                name, header = record[1], None
            elif record[0] == "Address":
                header = record
            elif header is not None and name is not None and kernel in name:
                rows.append(dict(zip(header, record)))
    if not rows:
        raise SystemExit(f"{path}: no kernel named like {kernel!r}")
    return rows


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--kernel", required=True, help="part of the kernel's name")
    parser.add_argument("--min-executions", type=float, default=100000)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    rows = read_kernel(args.csv, args.kernel)
    total = sum(number(r[SAMPLES]) for r in rows)
    loop = [r for r in rows if number(r[EXECUTED]) >= args.min_executions]
    loop_samples = sum(number(r[SAMPLES]) for r in loop)
    per_pass = number(loop[0][EXECUTED]) if loop else 1.0
    print(f"{args.csv}: {len(rows)} SASS lines, {sum(number(r[EXECUTED]) for r in rows) / 1e6:.1f} M warp "
          f"instructions; lines run >= {args.min_executions:g} times hold {100 * loop_samples / total:.1f}% "
          f"of the samples, {sum(number(r[EXECUTED]) for r in loop) / per_pass:.0f} instructions a pass")
    samples, executed = collections.Counter(), collections.Counter()
    for r in loop:
        kind = kind_of(r["Source"])
        samples[kind] += number(r[SAMPLES])
        executed[kind] += number(r[EXECUTED])
    print(f"  {'kind':18s} {'samples':>8s} {'instr/pass':>10s}")
    for kind, value in samples.most_common():
        print(f"  {kind:18s} {100 * value / loop_samples:7.1f}% {executed[kind] / per_pass:10.1f}")
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    print("  lines with the most samples (share of the loop's; main stall reasons):")
    for r in sorted(loop, key=lambda r: -number(r[SAMPLES]))[:args.top]:
        s = number(r[SAMPLES])
        top = sorted(((number(r[k]), k[len("stall_"):]) for k in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {100 * v / max(s, 1):.0f}%" for v, name in top if v)
        print(f"    {100 * s / loop_samples:5.1f}%  {r['Source'].strip()[:64]:64s} {why}")


if __name__ == "__main__":
    main()
