"""The report: a header, one table per suite with flashgen/peer ratios, the notes (what was skipped
and why), JSON and PNG plots.

It reads the results dict alone (plain JSON types, no torch), so it is tested on canned numbers.
A ratio is always flashgen's throughput over the peer's: above 1, flashgen is faster.
"""
from __future__ import annotations

import datetime
import itertools
import json
import re
from collections import defaultdict
from pathlib import Path

from .settings import FLASHGEN, GRAPH_BELOW_US, PEERS

RESULTS_ROOT = Path("benchmarks") / "results"


def prefill_label(c: dict) -> str:
    causal = " causal" if c["causal"] else ""
    return (f"{c['mode']} {c['dtype']} d{c['head_dim']} s{c['seqlen']} b{c['batch']} "
            f"h{c['nheads']}/{c['nheads_k']}{causal}")


def _keys(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def decode_label(c: dict) -> str:
    return (f"{c['dtype']} b{c['batch']} q{c['seqlen_q']} L{_keys(c['context'])} "
            f"h{c['nheads']}/{c['nheads_k']} d{c['head_dim']} {c['layout']}")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(flashgen, peer) -> str:
    return f"{flashgen / peer:.2f}" if flashgen and peer else "-"


def _impl_names(rows: list[dict]) -> list[str]:
    """Implementations in table order: flashgen, the known peers, then any other."""
    seen = {name for row in rows for name in row["impls"]}
    order = [FLASHGEN, *PEERS]
    return [n for n in order if n in seen] + sorted(seen - set(order))


def _figure(entry: dict | None, key: str, spec: str) -> str:
    if entry is None:
        return "-"  # not applicable: the implementation has no call for this suite
    return "skip" if "skipped" in entry else _fmt(entry.get(key), spec)


def _check(check: dict | None) -> str:
    return "-" if check is None else "ok" if check["ok"] else "FAIL"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(header), "-" * len(line(header)), *(line(r) for r in body)]


def prefill_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    names = _impl_names(rows)
    others = [n for n in names if n != FLASHGEN]
    body = []
    for row in rows:
        impls = row["impls"]
        fg = impls.get(FLASHGEN, {})
        body.append([
            prefill_label(row["config"]), _check(row["check"]),
            *(_figure(impls.get(n), "tflops", ".0f") for n in names),
            *(_ratio(fg.get("tflops"), impls.get(n, {}).get("tflops")) for n in others),
            _fmt(fg.get("of_matmul"), ".0%"),
        ])
    return [
        "prefill: TFLOP/s by FlashAttention's count (4*b*h*s*s*d, halved when causal, x3.5 for fwd+bwd);"
        " fg/X = flashgen TFLOP/s over X's; fg/matmul = over the dtype's measured matmul",
        *_table(["config", "check", *names, *(f"fg/{n}" for n in others), "fg/matmul"], body),
    ]


def decode_table(rows: list[dict]) -> list[str]:
    rows = [r for r in rows if "skipped" not in r]
    if not rows:
        return []
    names = _impl_names(rows)
    others = [n for n in names if n != FLASHGEN]
    body = []
    for row in rows:
        impls = row["impls"]
        fg = impls.get(FLASHGEN, {})
        body.append([
            decode_label(row["config"]), _check(row["check"]),
            _figure(impls.get(FLASHGEN), "us", ".1f"), _figure(impls.get(FLASHGEN), "us_eager", ".1f"),
            _figure(impls.get(FLASHGEN), "tbps", ".2f"), _fmt(fg.get("of_copy"), ".0%"),
            *(_figure(impls.get(n), "us", ".1f") for n in others),
            *(_ratio(fg.get("tbps"), impls.get(n, {}).get("tbps")) for n in others),
        ])
    return [
        f"decode: us per call (CUDA-graph replay when the eager call is under {GRAPH_BELOW_US:.0f} us, else eager), on K/V"
        " rotated past L2; TB/s = K+V bytes / time; fg/copy = over the measured copy TB/s;"
        " fg/X = X's time over flashgen's",
        *_table(["config", "check", "fg us", "fg eager", "fg TB/s", "fg/copy",
                 *(f"{n} us" for n in others), *(f"fg/{n}" for n in others)], body),
    ]


def compile_lines(c: dict | None) -> list[str]:
    if not c:
        return []
    cold, matrix = c["cold"], c["matrix"]
    lines = [f"compile (NVRTC {c['nvrtc']}, {c['arch']}):"]
    if cold["compiled"]:
        lines.append(f"  cold compile, {cold['compiled']} instances one at a time: median {cold['median_s']:.2f} s, "
                     f"max {cold['max_s']:.2f} s ({cold['slowest']})")
    if c.get("phases"):
        lines.append("  where a compile's time goes (NVRTC's phase timings, mean ms an instance):")
        for group, entry in c["phases"].items():
            total = sum(entry["ms"].values())
            parts = ", ".join(f"{phase} {ms:.0f} ({ms / total:.0%})" for phase, ms in entry["ms"].items())
            lines.append(f"    {group} ({entry['instances']}): {total:.0f} ms: {parts}")
    if "warm" in c and "error" in c["warm"]:
        lines.append(f"  warm cache load of {c['warm']['uri']} FAILED: {c['warm']['error']}")
    elif "warm" in c:
        w = c["warm"]
        lines.append(f"  warm cache load in a fresh process: {w['load_ms']:.1f} ms to a loaded kernel "
                     f"(median of {w['runs']}; importing torch + flashgen: {w['imports_s']:.2f} s)")
    scope = f"filter {matrix['filter']!r}" if matrix["filter"] else "the whole matrix"
    lines.append(f"  {matrix['instances']} instances ({scope}) with -j {matrix['jobs']}: "
                 f"{matrix['wall_s']:.1f} s wall, {matrix['total_s']:.1f} s of compile, {len(matrix['failed'])} failed")
    if c.get("host_overhead_us"):
        lines.append("  host time to enqueue one call (no sync, median):")
        for name, entry in c["host_overhead_us"].items():
            figure = f"{entry['us']:.1f} us" if "us" in entry else f"skipped: {entry['skipped']}"
            lines.append(f"    {name}: {figure}")
    if c.get("first_call"):
        lines.append(f"  first call of a causal bf16 forward ({c['first_call_shape']}) in fresh processes, after "
                     "imports and inputs (the first on an empty flashgen cache, the next ones warm):")
        for impl, entry in c["first_call"].items():
            if "skipped" in entry:
                lines.append(f"    {impl}: skipped: {entry['skipped']}")
            else:
                runs = ", ".join(f"{s:.3f} s" for s in entry["first_call_s"])
                lines.append(f"    {impl}: {runs} (imports {entry['imports_s']:.2f} s)")
    return lines


def header_lines(results: dict) -> list[str]:
    meta, env = results["meta"], results["meta"]["env"]
    if env["gpu"]:
        gpu = (f"{env['gpu']} (sm_{''.join(map(str, env['capability']))}, {env['sms']} SMs, "
               f"{env['l2_bytes'] / 2**20:.0f} MB L2, {env['memory_gib']} GiB), cuDNN {env['cudnn']}")
    else:
        gpu = "no CUDA GPU"
    lines = [
        f"flashgen bench, {meta['date']}: {gpu}",
        f"torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, flashgen {env['flashgen']}, "
        f"NVRTC {env['nvrtc']}",
    ]
    if meta["timer"]:
        lines.append(f"timing: {meta['timer']}")
    for when in ("before", "after"):
        if meta.get(f"nvidia_smi_{when}"):
            lines += [f"nvidia-smi {when}:", *(f"  {line}" for line in meta[f"nvidia_smi_{when}"].splitlines())]
    ceilings = results["ceilings"]
    if ceilings:
        matmul = ", ".join(f"{dtype} {tflops:.0f}" for dtype, tflops in ceilings["matmul_tflops"].items())
        lines.append(f"ceilings: matmul 8192^3 {matmul} TFLOP/s; device copy {ceilings['copy_tbps']:.2f} TB/s "
                     "(read + write)")
    return lines


def _where(labels: list[str]) -> str:
    return ", ".join(labels[:2]) + (f", ... ({len(labels)} configs)" if len(labels) > 2 else "")


def notes(results: dict) -> list[str]:
    """Why anything is missing: peers not installed, configs not run, implementations that refused
    or failed a config (grouped by reason), failed checks."""
    lines = [f"ERROR {error}" for error in results["errors"]] + results["notes"]
    for suite, label in (("prefill", prefill_label), ("decode", decode_label)):
        skipped, noted = defaultdict(list), defaultdict(list)
        for row in results[suite]:
            name = label(row["config"])
            if "skipped" in row:
                skipped[("config", row["skipped"])].append(name)
            for impl, entry in row["impls"].items():
                if "skipped" in entry:
                    skipped[(impl, entry["skipped"])].append(name)
                if "graph_skipped" in entry:
                    skipped[(f"{impl} (CUDA graph)", entry["graph_skipped"])].append(name)
                if "note" in entry:
                    noted[(impl, entry["note"])].append(name)
            check = row["check"]
            if check and not check["ok"]:
                detail = check.get("error") or (
                    f"max |err| {check['max_abs_err']:.3g}, max |ref| {check['max_abs_ref']:.3g}")
                lines.append(f"{suite} {name}: flashgen output check FAILED against {check['against']}: {detail}")
        for (who, reason), names in skipped.items():
            subject = f"{suite} config not run" if who == "config" else f"{suite}: {who} skipped"
            lines.append(f"{subject} at {_where(names)}: {reason}")
        lines += [f"{suite}: {who} at {_where(names)}: {note}" for (who, note), names in noted.items()]
    if results["meta"]["suite_seconds"]:
        lines.append("suite times: " + ", ".join(f"{k} {v:.0f} s" for k, v in results["meta"]["suite_seconds"].items()))
    return lines


def render(results: dict) -> str:
    sections = [header_lines(results), prefill_table(results["prefill"]), decode_table(results["decode"]),
                compile_lines(results["compile"]), [f"note: {n}" for n in notes(results)]]
    return "\n\n".join("\n".join(s) for s in sections if s) + "\n"


def failures(results: dict) -> list[str]:
    """What makes the run fail: a flashgen output that disagrees with its reference, a flashgen
    call that errors (a backward that does not exist yet is expected), a kernel that does not compile."""
    found = list(results["errors"])
    for suite, label in (("prefill", prefill_label), ("decode", decode_label)):
        for row in results[suite]:
            check, entry = row["check"], row["impls"].get(FLASHGEN, {})
            if check and not check["ok"]:
                found.append(f"{suite} {label(row['config'])}: output check failed")
            elif "skipped" in entry and not entry["skipped"].startswith("NotImplementedError"):
                found.append(f"{suite} {label(row['config'])}: {entry['skipped']}")
    if results["compile"]:
        for part in ("cold", "matrix"):
            found += [f"compile: {uri} failed" for uri in results["compile"][part]["failed"]]
        if "error" in results["compile"].get("warm", {}):
            found.append(f"compile: warm load failed: {results['compile']['warm']['error']}")
    return found


def default_out_dir(results: dict) -> Path:
    date = datetime.datetime.fromisoformat(results["meta"]["date"])
    gpu = re.sub(r"[^a-z0-9]+", "-", (results["meta"]["env"]["gpu"] or "cpu").lower()).strip("-")
    return RESULTS_ROOT / f"{date:%Y%m%d-%H%M}-{gpu}"


def write(results: dict, text: str, out_dir: Path, plots: bool = True) -> tuple[list[Path], list[str]]:
    """results.json, report.txt and the plots in out_dir: (paths written, notes on plots not made)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "report.txt"]
    paths[0].write_text(json.dumps(results, indent=2) + "\n")
    paths[1].write_text(text)
    if not plots or not (results["prefill"] or results["decode"]):
        return paths, []
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return paths, [f"no plots: matplotlib is not installed (pip install 'flashgen[bench]'): {exc}"]
    plot_notes = []
    for plot, args in ((plot_prefill, (results["prefill"],)), (plot_decode, (results["decode"], results["ceilings"]))):
        try:
            paths += plot(*args, out_dir, plt)
        except Exception as exc:  # the numbers are saved already; a plot must not cost the run's exit status
            plot_notes.append(f"{plot.__name__} failed: {type(exc).__name__}: {exc}")
    return paths, plot_notes


def _unique(values) -> list:
    return list(dict.fromkeys(values))


def _color(name: str) -> str:
    """One color per implementation in every plot."""
    order = [FLASHGEN, *PEERS]
    return f"C{order.index(name) if name in order else len(order)}"


def _legend_below(fig, axes) -> None:
    """One legend for every panel, below them, so no bar or line is hidden under it."""
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=min(len(handles), 6),
               fontsize="small")


def plot_prefill(rows: list[dict], out_dir: Path, plt) -> list[Path]:
    """One PNG per mode, as in the FlashAttention papers: TFLOP/s bars per seqlen, one panel per
    head dim (columns) and dtype / mask / GQA (rows)."""
    paths = []
    for mode in _unique(r["config"]["mode"] for r in rows):
        mode_rows = [r for r in rows if r["config"]["mode"] == mode]

        def panel(c):
            return c["dtype"], c["causal"], c["nheads"] // c["nheads_k"]

        panels = _unique(panel(r["config"]) for r in mode_rows)
        head_dims = sorted({r["config"]["head_dim"] for r in mode_rows})
        fig, axes = plt.subplots(len(panels), len(head_dims), figsize=(5 * len(head_dims), 3.4 * len(panels)),
                                 squeeze=False, layout="constrained")
        for (i, key), (j, head_dim) in itertools.product(enumerate(panels), enumerate(head_dims)):
            ax = axes[i][j]
            cell = {r["config"]["seqlen"]: r["impls"] for r in mode_rows
                    if panel(r["config"]) == key and r["config"]["head_dim"] == head_dim}
            seqlens = sorted(cell)
            names = [n for n in _impl_names(mode_rows) if any("tflops" in cell[s].get(n, {}) for s in seqlens)]
            width = 0.8 / max(1, len(names))
            for k, name in enumerate(names):
                heights = [cell[s].get(name, {}).get("tflops", float("nan")) for s in seqlens]
                ax.bar([x + k * width for x in range(len(seqlens))], heights, width, label=name, color=_color(name))
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(seqlens))], [_keys(s) for s in seqlens])
            dtype, causal, gqa = key
            heads = "MHA" if gqa == 1 else f"GQA {gqa}:1"
            ax.set_title(f"d{head_dim}, {'causal' if causal else 'non-causal'}, {dtype}, {heads}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
        _legend_below(fig, axes)
        fig.suptitle(f"prefill {mode.replace('_', '+')}: batch x seqlen = 16k tokens, hidden 2048")
        paths.append(out_dir / f"prefill_{mode}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def plot_decode(rows: list[dict], ceilings: dict | None, out_dir: Path, plt) -> list[Path]:
    """TB/s of K+V against the context length: one panel per batch (columns) and dtype / heads /
    head dim / query tokens (rows), a line per implementation and layout, the copy ceiling dashed."""
    rows = [r for r in rows if "skipped" not in r]
    if not rows:
        return []

    def panel(c):
        return c["dtype"], c["nheads"], c["nheads_k"], c["head_dim"], c["seqlen_q"]

    panels = _unique(panel(r["config"]) for r in rows)
    batches = sorted({r["config"]["batch"] for r in rows})
    layouts = _unique(r["config"]["layout"] for r in rows)
    fig, axes = plt.subplots(len(panels), len(batches), figsize=(5 * len(batches), 3.6 * len(panels)),
                             squeeze=False, layout="constrained")
    for (i, key), (j, batch) in itertools.product(enumerate(panels), enumerate(batches)):
        ax = axes[i][j]
        series = defaultdict(dict)  # (implementation, layout) -> {context: TB/s}
        for r in rows:
            c = r["config"]
            if panel(c) == key and c["batch"] == batch:
                for name, entry in r["impls"].items():
                    if "tbps" in entry:
                        series[name, c["layout"]][c["context"]] = entry["tbps"]
        for (name, layout), points in series.items():
            contexts = sorted(points)
            ax.plot(contexts, [points[x] for x in contexts], label=f"{name} {layout}", color=_color(name),
                    marker="osv^D"[layouts.index(layout) % 5], linestyle="-" if name == FLASHGEN else "--")
        if ceilings:
            ax.axhline(ceilings["copy_tbps"], color="gray", linestyle=":", label="copy (read + write)")
        ax.set_xscale("log", base=2)
        contexts = sorted({x for points in series.values() for x in points})
        ax.set_xticks(contexts, [_keys(x) for x in contexts])
        ax.set_ylim(bottom=0)
        dtype, nheads, nheads_k, head_dim, seqlen_q = key
        ax.set_title(f"batch {batch}, {nheads}/{nheads_k} heads, d{head_dim}, {dtype}, {seqlen_q} query token(s)")
        ax.set_xlabel("keys in the cache")
        ax.set_ylabel("TB/s of K+V")
    _legend_below(fig, axes)
    fig.suptitle("decode: flash_attn_with_kvcache, K/V rotated past L2")
    path = out_dir / "decode.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
