"""The ``flashgen`` command: list the matrix, emit generated/, build the cache, diagnose, demo, bench.

torch and the runtime are imported only inside the commands that need them (doctor, demo, bench,
and build without --arch).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import click

from . import config
from .bench import settings as bench_settings
from .generator import cache, matrix, nvrtc, render
from .generator.spec import DIRECTIONS, KernelSpec

MANIFEST = "manifest.json"
MANIFEST_DIGEST_CHARS = 16  # of each instance's sha256: enough to see any change
# What `flashgen demo` compiles without a GPU: the instances most calls use, for the two targets
# CI compiles (sm_80: Ampere, sm_90a: Hopper).
DEMO_ARCHS = ("sm_80", "sm_90a")
DEMO_HEAD_DIMS = (64, 128)
DEMO_MASKS = ("none", "causal")
FAILURE_LOG_LINES = 8


def _split_archs(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    archs = [a.strip() for a in value.split(",") if a.strip()]
    unknown = [a for a in archs if a not in matrix.ALL_ARCHS]
    if unknown or not archs:
        raise click.BadParameter(
            f"{value!r} is not a comma-separated list of {', '.join(matrix.ALL_ARCHS)}"
        )
    return archs


_arch_option = click.option(
    "--arch", callback=_split_archs, help=f"Comma-separated targets: {', '.join(matrix.ALL_ARCHS)}."
)
_direction_option = click.option("--direction", type=click.Choice(DIRECTIONS))


def _directions(direction: str | None) -> list[str] | None:
    return [direction] if direction else None


def _version() -> str:
    """The installed distribution's version; the package's own when run from a source tree."""
    try:
        return importlib.metadata.version("flashgen")
    except importlib.metadata.PackageNotFoundError:
        from . import __version__

        return __version__


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"flashgen {_version()}")
        ctx.exit()


@click.group()
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and exit.")
@click.option("-v", "--verbose", count=True, help="Show flashgen's log (-v: info, -vv: debug).")
def cli(verbose: int) -> None:
    """flashgen: FlashAttention kernels generated from templates and compiled with NVRTC."""
    # The CLI is an application, so it may configure logging; the library never does.
    if verbose:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("flashgen").setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


@cli.command("list")
@_direction_option
@_arch_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def list_command(direction: str | None, arch: list[str] | None, as_json: bool) -> None:
    """List the kernel matrix: each instance's URI and fields, and cubin_arch: the arch whose cubin
    of the same instance serves it (lower than its own where the two compile the same)."""
    specs = matrix.all_specs(directions=_directions(direction), archs=arch)
    rows = [_row(s) for s in specs]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if rows:
        columns = list(rows[0])
        widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
        click.echo("  ".join(c.ljust(widths[c]) for c in columns).rstrip())
        for r in rows:
            click.echo("  ".join(str(r[c]).ljust(widths[c]) for c in columns).rstrip())
    click.echo(f"{len(rows)} kernel instances, {len(matrix.compile_targets(specs))} cubins")


def _row(spec: KernelSpec) -> dict:
    return {"uri": spec.uri, **spec.to_dict(), "cubin_arch": matrix.compile_target(spec).arch}


def example_specs(specs: list[KernelSpec]) -> list[KernelSpec]:
    """The instances whose text generated/ keeps: per (direction, family) the plainest one (bf16,
    head dim 128 where the family has it, causal where it has masks, no other switch, the family's
    own arch). The others differ from it only in the switch values the manifest lists."""
    groups: dict[tuple[str, str], list[KernelSpec]] = {}
    for spec in specs:
        groups.setdefault((spec.direction, spec.family), []).append(spec)

    def plainness(spec: KernelSpec) -> tuple:
        own_arch = spec.arch.replace("_", "").startswith(spec.family)
        return (spec.dtype != "bf16", spec.head_dim not in (0, 128), spec.mask != "causal", spec.softcap,
                spec.pack_gqa, spec.paged, spec.decode, spec.dropout, spec.split, spec.gather, not own_arch, spec.uri)

    return sorted(min(group, key=plainness) for group in groups.values())


def _expected_files(uri_filter: str | None = None) -> dict[str, str]:
    """Everything `emit` writes, by file name: the manifest (every instance's URI, switches, cubin
    arch and the digest of its rendered source), the rendered headers (Params, wgmma wrappers), the
    example instances' sources, and those of the instances whose URI contains ``uri_filter``."""
    specs = matrix.all_specs()
    sources = {spec: render.render_instance(spec) for spec in specs}
    shown = set(example_specs(specs)) | {spec for spec in specs if uri_filter and uri_filter in spec.uri}
    files = {render.instance_filename(spec): sources[spec] for spec in sorted(shown)}
    files[render.PARAMS_HEADER] = render.render_params_header()
    files[render.wgmma.HEADER] = render.render_wgmma_header()
    manifest = sorted(
        ({**_row(spec), "file": render.instance_filename(spec),
          "digest": hashlib.sha256(sources[spec].encode()).hexdigest()[:MANIFEST_DIGEST_CHARS]} for spec in specs),
        key=lambda entry: entry["uri"],
    )
    files[MANIFEST] = json.dumps(manifest, indent=2) + "\n"
    return files


@cli.command()
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("generated"),
    show_default=True,
    help="Folder to write (it holds generated files only).",
)
@click.option("--filter", "uri_filter", default=None, metavar="TEXT",
              help="Also write the full source of every instance whose URI contains TEXT.")
@click.option("--check", is_flag=True, help="Write nothing; fail if OUT differs from what emit writes.")
@click.pass_context
def emit(ctx: click.Context, out: Path, uri_filter: str | None, check: bool) -> None:
    """Render the matrix for reading and reviewing into OUT: the manifest (every instance, its
    switches and the digest of its source, so that any instance's change shows in its diff), the
    Params and wgmma headers, one example instance per direction and family, and with --filter the
    sources of the instances it matches."""
    expected = _expected_files(uri_filter)
    present = {p.name for p in out.iterdir() if p.is_file()} if out.is_dir() else set()
    drifted = sorted(
        n for n in expected.keys() & present if (out / n).read_bytes() != expected[n].encode()
    )
    missing = sorted(expected.keys() - present)
    extra = sorted(present - expected.keys())
    if check:
        for label, names in (("drifted", drifted), ("missing", missing), ("extra", extra)):
            for name in names:
                click.echo(f"{label}: {out / name}")
        if drifted or missing or extra:
            click.echo(f"{out} is out of date; run `flashgen emit --out {out}`", err=True)
            ctx.exit(1)
        click.echo(f"{out}: {len(expected)} files up to date")
        return
    out.mkdir(parents=True, exist_ok=True)
    for name in drifted + missing:
        (out / name).write_bytes(expected[name].encode())
    # Instances that left the matrix (or what an earlier --filter wrote); anything else in OUT is
    # not ours to delete.
    stale = [n for n in extra if n.endswith((".cu", ".cuh"))]
    for name in stale:
        (out / name).unlink()
    written = len(drifted) + len(missing)
    click.echo(f"{out}: {len(expected)} files, {written} written, {len(stale)} stale removed")
    for name in sorted(set(extra) - set(stale)):
        click.echo(f"not generated by flashgen (left alone): {out / name}")


def _gpu_target_arch() -> str | None:
    """The NVRTC target of the current GPU, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return matrix.target_arch(*torch.cuda.get_device_capability())
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


def shard_specs(specs: list[KernelSpec], index: int, count: int) -> list[KernelSpec]:
    """Shard ``index`` (1-based) of ``count``: round-robin over the specs sorted by URI, so the
    shards are disjoint, cover ``specs`` between them, hold each family in near-equal parts, and do
    not depend on the order the matrix lists them in."""
    return sorted(specs, key=lambda s: s.uri)[index - 1::count]


def _parse_shard(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    index, slash, count = value.partition("/")
    if not (slash and index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise click.BadParameter(f"{value!r} is not I/N with 1 <= I <= N (e.g. 1/4 ... 4/4)")
    return int(index), int(count)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class ProgressLines:
    """Progress of a long build as plain lines (for logs and pipes, where a progress bar prints
    nothing until the end): a line when another ``step`` of the total is done or ``interval``
    seconds have passed, and one at the end.  ``write`` gets each line."""

    def __init__(self, total: int, write, label: str = "compiling", interval: float = 5.0,
                 step: float = 0.05, clock=time.monotonic):
        self.total, self.write, self.label = total, write, label
        self.interval, self.clock = interval, clock
        self.every = max(1, int(total * step))
        self.done = 0
        self.start = self.last_time = clock()
        self.last_done = 0

    def update(self, count: int = 1) -> None:
        self.done += count
        now = self.clock()
        if (self.done == self.total or self.done - self.last_done >= self.every
                or now - self.last_time >= self.interval):
            self.last_time, self.last_done = now, self.done
            self.write(self.line(now))

    def line(self, now: float) -> str:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        text = f"{self.label}: {self.done}/{self.total} ({100 * self.done // max(self.total, 1)}%), {rate:.1f}/s"
        if self.done < self.total:
            text += f", ETA {_duration((self.total - self.done) / rate)}" if rate > 0 else ", ETA ?"
        return f"{text}, {_duration(elapsed)} elapsed"


def _stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def _run_build(specs: list[KernelSpec], jobs: int, label: str) -> list[cache.BuildResult]:
    results = []
    if not _stdout_is_terminal():
        progress = ProgressLines(len(specs), lambda line: click.echo(line) or sys.stdout.flush(), label)
        for result in cache.build(specs, jobs):
            results.append(result)
            progress.update()
        return results
    with click.progressbar(
        length=len(specs),
        label=label,
        item_show_func=lambda r: r.spec.uri if r is not None else None,
    ) as bar:
        for result in cache.build(specs, jobs):
            results.append(result)
            bar.update(1, result)
    return results


def _report_failures(results: list[cache.BuildResult]) -> None:
    for r in results:
        if r.error is not None:
            click.echo(f"FAILED {r.spec.uri}", err=True)
            for line in r.error.splitlines()[:FAILURE_LOG_LINES]:
                click.echo(f"    {line}", err=True)


@cli.command("build")
@_arch_option
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default=True)
@click.option("--filter", "uri_filter", metavar="TEXT", help="Only URIs containing TEXT.")
@_direction_option
@click.option("--shard", callback=_parse_shard, metavar="I/N",
              help="Build only shard I of N (1-based): N jobs with 1/N ... N/N build the selection "
                   "exactly once between them.")
@click.option("--archive", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Then write the built kernels to FILE (a .tar.gz with a manifest) for `flashgen "
                   "cache import` on machines without NVRTC.")
@click.pass_context
def build_command(
    ctx: click.Context, arch: list[str] | None, jobs: int, uri_filter: str | None, direction: str | None,
    shard: tuple[int, int] | None, archive: Path | None,
) -> None:
    """Compile kernels into the cache (default: for this GPU, or for every target without one)."""
    if arch is None:
        gpu_arch = _gpu_target_arch()
        arch = [gpu_arch] if gpu_arch is not None else list(matrix.ALL_ARCHS)
    instances = [
        s for s in matrix.all_specs(directions=_directions(direction), archs=arch)
        if uri_filter is None or uri_filter in s.uri
    ]
    if not instances:
        raise click.UsageError(f"no instance for {', '.join(arch)} matches filter {uri_filter!r}")
    specs = matrix.compile_targets(instances)  # what is compiled: each cubin once
    shared = sum(matrix.compile_target(s) != s for s in instances)
    if shared:
        click.echo(f"{shared} of the {len(instances)} instances run the cubin of the same instance for a "
                   f"lower arch (cubin_arch in `flashgen list`): {len(specs)} cubins serve them all")
    shard_text = ""
    if shard is not None:
        selected = len(specs)
        specs = shard_specs(specs, *shard)
        shard_text = f" (shard {shard[0]}/{shard[1]} of {selected})"
        if not specs:
            click.echo(f"shard {shard[0]}/{shard[1]} of {selected} kernels is empty: nothing to build")
            return
    click.echo(f"{len(specs)} kernels{shard_text} for {', '.join(arch)}, {jobs} jobs, cache {config.cache_dir()}")
    start = time.perf_counter()
    results = _run_build(specs, jobs, "compiling")
    wall = time.perf_counter() - start

    compiled = [r for r in results if not r.cached and r.error is None]
    failed = [r for r in results if r.error is not None]
    click.echo(
        f"{len(results)} kernels: {len(results) - len(compiled) - len(failed)} cached, "
        f"{len(compiled)} compiled, {len(failed)} failed in {wall:.1f} s"
    )
    if compiled:
        slowest = sorted(compiled, key=lambda r: r.seconds, reverse=True)[:3]
        click.echo(
            f"compile time {sum(r.seconds for r in compiled):.1f} s in all; slowest: "
            + ", ".join(f"{r.spec.uri} {r.seconds:.1f} s" for r in slowest)
        )
    # Kernels that work but that ptxas made slower than their code asks (e.g. every wgmma
    # serialized for want of registers): reported, not failed; the matrix test fails on them.
    for r in results:
        for loss in r.performance_losses:
            click.echo(f"SLOWER CODE {r.spec.uri}: {loss}", err=True)
    configured = config.cache_dir()
    elsewhere: dict[Path, int] = {}
    for r in results:
        if r.error is None and r.cache_dir != configured:
            elsewhere[r.cache_dir] = elsewhere.get(r.cache_dir, 0) + 1
    for directory, count in elsewhere.items():
        # The fallback's warning above says why; a deployment copying `configured` would miss them.
        click.echo(f"{count} kernels are not in the cache {configured} but in {directory}: set "
                   f"FLASHGEN_CACHE_DIR to a folder you can write", err=True)
    if failed:
        _report_failures(failed)
    if failed or elsewhere:
        if archive is not None:
            click.echo(f"no archive written: not every kernel is in the cache {configured}", err=True)
        ctx.exit(1)
    if archive is not None:
        built = set(specs)
        try:
            written = cache.export_archive([s for s in instances if matrix.compile_target(s) in built], archive)
        except (OSError, cache.ArchiveError) as exc:
            raise click.ClickException(f"could not write the archive {archive}: {exc}") from None
        click.echo(f"wrote {archive}: {written} kernels, {archive.stat().st_size / 2**20:.1f} MiB")


@cli.group("cache")
def cache_group() -> None:
    """Inspect or clear the cubin cache (FLASHGEN_CACHE_DIR)."""


@cache_group.command("info")
def cache_info_command() -> None:
    """Show the cache folder, its entries and size."""
    info = cache.cache_info()
    click.echo(f"directory: {info.directory}")
    click.echo(f"entries:   {info.entries}")
    click.echo(f"size:      {info.bytes / 2**20:.1f} MiB")
    # Where would a compile write a new kernel?
    refused = cache.untrusted_reason(info.directory)
    reason = refused or cache.unwritable_reason(info.directory)
    if reason is not None:
        fallback = cache.fallback_cache_dir()
        there = cache.cache_info(fallback)
        what = ("reads and writes", "not used") if refused else ("writes", "not writable")
        click.echo(f"{what[0] + ':':<11}{fallback} (the directory above is {what[1]}: {reason}; "
                   f"{there.entries} entries, {there.bytes / 2**20:.1f} MiB there)")


@cache_group.command("clear")
@click.pass_context
def cache_clear_command(ctx: click.Context) -> None:
    """Remove every cached kernel (never following links)."""
    result = cache.clear_cache()
    click.echo(f"removed {result.removed} entries from {config.cache_dir()}")
    for path, reason in result.failed:
        click.echo(f"could not remove {path}: {reason}", err=True)
    if result.failed:
        ctx.exit(1)


@cache_group.command("import")
@click.argument("archive", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.pass_context
def cache_import_command(ctx: click.Context, archive: Path) -> None:
    """Load the kernels of an archive written by `flashgen build --archive` into the cache, checking
    each cubin's digest and frame; with FLASHGEN_DISABLE_JIT=1 they then load without NVRTC."""
    try:
        result = cache.import_archive(archive)
    except (OSError, cache.ArchiveError) as exc:
        raise click.ClickException(f"could not import {archive}: {exc}") from None
    click.echo(f"imported {result.entries} kernels from {archive} into {result.directory}")
    configured = config.cache_dir()
    if result.directory != configured:
        click.echo(f"the cache {configured} is not writable, so they are in {result.directory}: set "
                   f"FLASHGEN_CACHE_DIR to a folder you can write", err=True)
        ctx.exit(1)


def _driver_status() -> tuple[str, tuple[int, int] | None, str | None]:
    """(what to show, driver CUDA version, how to fix) from the CUDA driver API."""
    version = nvrtc.driver_cuda_version()
    if version is None:
        return "no NVIDIA driver found", None, "install the NVIDIA driver to run kernels (compiling needs none)"
    from cuda.bindings import driver

    supports = "supports CUDA {}.{}".format(*version)
    (err,) = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"{supports}, but cuInit failed: {err.name}", version, "check the driver install and CUDA_VISIBLE_DEVICES"
    return supports, version, None


def _cuda_major_fix(nvrtc_major: int, driver_version: tuple[int, int]) -> str | None:
    """How to fix an NVRTC or cuda-bindings of a newer CUDA major version than the driver's, None
    when neither is.  Only majors count: by CUDA's minor-version compatibility a cubin of NVRTC 13.5
    loads on a CUDA 13.0 driver."""
    driver_major = driver_version[0]
    bindings_major = nvrtc.bindings_major()
    newer = [
        f"{name} {major}" for name, major in (("NVRTC", nvrtc_major), ("cuda-bindings", bindings_major))
        if major is not None and major > driver_major
    ]
    if not newer:
        return None
    verb = "is" if len(newer) == 1 else "are"
    problem = f"{' and '.join(newer)} {verb} newer than the driver's CUDA {driver_major}.{driver_version[1]}"
    install = nvrtc.install_for_driver(driver_major)
    if install is None:
        return f"{problem}: update the NVIDIA driver (flashgen needs CUDA 12.0 or newer, R525+)"
    requested = config.nvrtc_major()
    if (requested is not None and requested > driver_major and driver_major in nvrtc.nvrtc_libraries()
            and (bindings_major is None or bindings_major <= driver_major)):
        return (f"{problem}: unset FLASHGEN_NVRTC={requested} (NVRTC {driver_major} is installed), "
                "or update the NVIDIA driver")
    return f"{problem}: {install}, or update the NVIDIA driver"


def _nvrtc_libraries_text() -> str:
    libraries = nvrtc.nvrtc_libraries()
    if not libraries:
        return "none from the nvidia wheels (cuda.bindings searches the library path)"
    return ", ".join(f"{major} ({path})" for major, path in sorted(libraries.items(), reverse=True))


@cli.command()
@click.pass_context
def doctor(ctx: click.Context) -> None:
    """Check what flashgen needs, and say how to fix what is missing (exit status 1 then)."""
    fixes: list[str] = []

    def row(name: str, value: str) -> None:
        click.echo(f"{name + ':':<16}{value}")

    row("python", f"{platform.python_version()} ({sys.executable})")
    try:
        import torch
    except ImportError:
        row("torch", "not installed")
        fixes.append("install PyTorch with CUDA: https://pytorch.org/get-started/locally/")
    else:
        built_for = torch.version.cuda or "none: CPU-only build"
        row("torch", f"{torch.__version__} (built for CUDA {built_for})")
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            try:
                target = matrix.target_arch(major, minor)
            except RuntimeError as exc:
                target = "unsupported"
                fixes.append(str(exc))
            row("gpu", f"{torch.cuda.get_device_name()} "
                       f"(compute capability {major}.{minor}, target {target})")
        else:
            row("gpu", "none visible to torch")
            fixes.append("kernels run only on an NVIDIA GPU with a CUDA build of torch; without one, "
                         "flashgen can still compile (`flashgen build`)")

    driver_text, driver_version, driver_fix = _driver_status()
    row("driver", driver_text)
    if driver_fix:
        fixes.append(driver_fix)

    try:
        nvrtc_version = nvrtc.nvrtc_version()
    except ValueError:  # FLASHGEN_NVRTC is invalid: the settings row says so, with its fix
        row("nvrtc", "not loaded (FLASHGEN_NVRTC is invalid)")
    except Exception as exc:  # libnvrtc missing: cuda.pathfinder raises its own error types
        cause = exc.cause if isinstance(exc, nvrtc.NvrtcNotFoundError) else exc
        row("nvrtc", f"not usable ({type(cause).__name__}: {cause})")
        fixes.append(nvrtc.INSTALL_NVRTC_HINT)
    else:
        row("nvrtc", "{}.{}".format(*nvrtc_version))
        fix = None if driver_version is None else _cuda_major_fix(nvrtc_version[0], driver_version)
        if fix is not None:
            fixes.append(fix)
        include_dir = nvrtc.cuda_include_dir()
        row("cuda headers", str(include_dir) if include_dir else "not found")
        if include_dir is None:
            fixes.append(nvrtc.INSTALL_HEADERS_HINT)
    row("nvrtc wheels", _nvrtc_libraries_text())

    directory = config.cache_dir()
    refused = cache.untrusted_reason(directory)
    problem = None if refused else cache.unwritable_reason(directory)
    if refused:
        row("cache", f"{directory} (not used: {refused})")
        fixes.append(f"set FLASHGEN_CACHE_DIR to a folder only you (or root) can write (until then "
                     f"kernels are read from and cached in {cache.fallback_cache_dir()})")
    else:
        row("cache", f"{directory} ({'writable' if problem is None else 'not writable: ' + problem})")
    if problem is not None:
        fixes.append(f"set FLASHGEN_CACHE_DIR to a writable folder (until then new kernels are "
                     f"cached in {cache.fallback_cache_dir()})")

    try:
        row("settings", f"FLASHGEN_FAMILY={_or_auto(config.forced_family())}, "
                        f"FLASHGEN_CHECK_INPUTS={int(config.check_inputs())}, "
                        f"FLASHGEN_DISABLE_JIT={int(config.disable_jit())}, "
                        f"FLASHGEN_NVRTC={_or_auto(config.nvrtc_major())}, "
                        f"NVRTC options: {' '.join(cache.compile_options())}")
    except ValueError as exc:
        row("settings", "invalid")
        fixes.append(str(exc))
    else:
        if config.disable_jit() and cache.cache_info().entries == 0:
            fixes.append(f"FLASHGEN_DISABLE_JIT=1 but the cache {directory} is empty, so every "
                         f"kernel call will fail: prebuild the kernels with `flashgen build`")

    if fixes:
        click.echo("\nto fix:")
        for fix in fixes:
            click.echo(f"  - {fix}")
        ctx.exit(1)
    click.echo("\neverything flashgen needs was found")


def _or_auto(value) -> str:
    return "(auto)" if value is None else str(value)


def _demo_specs() -> list[KernelSpec]:
    return [
        s for s in matrix.all_specs(directions=["fwd"], archs=DEMO_ARCHS)
        if s.dtype == "bf16" and s.head_dim in DEMO_HEAD_DIMS and s.mask in DEMO_MASKS
        and not s.softcap and not s.pack_gqa and not s.paged and not s.decode and not s.dropout and not s.split
    ]


def _median_ms(fn, warmup: int = 3, runs: int = 10) -> float:
    """Median of CUDA-event timings after warm-up: robust to a stray slow run."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _demo_gpu(ctx: click.Context) -> None:
    import torch
    import torch.nn.functional as F

    import flashgen
    from flashgen.testing import assert_close_fa_rule, attention_ref

    batch, seqlen, nheads, head_dim = 4, 4096, 32, 128
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3)
    )
    # SDPA takes (batch, heads, seqlen, dim); transpose outside the timed region.
    q_t, k_t, v_t = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    click.echo(
        f"{torch.cuda.get_device_name()}: forward, bf16, batch {batch}, seqlen {seqlen}, "
        f"{nheads} heads, head dim {head_dim}"
    )
    click.echo(f"{'mask':<8}{'flashgen ms':>12}{'TFLOP/s':>9}{'SDPA ms':>10}{'TFLOP/s':>9}"
               f"{'max err':>10}{'bf16 err':>10}")
    failures = []
    for causal in (False, True):
        mask = "causal" if causal else "none"
        start = time.perf_counter()
        out = flashgen.flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        first_call = time.perf_counter() - start
        # References for batch 0 only: the whole batch would need ~30 GB of scores.
        ref, _ = attention_ref(q[:1], k[:1], v[:1], causal=causal)
        ref_bf16, _ = attention_ref(q[:1], k[:1], v[:1], causal=causal, upcast=False)
        err = (out[:1].float() - ref.float()).abs().max().item()
        bf16_err = (ref_bf16.float() - ref.float()).abs().max().item()
        try:
            assert_close_fa_rule(out[:1], ref, ref_bf16)
        except AssertionError as exc:
            failures.append(f"{mask}: {exc}")

        flashgen_ms = _median_ms(lambda: flashgen.flash_attn_func(q, k, v, causal=causal))
        sdpa_ms = _median_ms(lambda: F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=causal))
        flops = 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
        click.echo(
            f"{mask:<8}{flashgen_ms:>12.3f}{flops / flashgen_ms / 1e9:>9.0f}"
            f"{sdpa_ms:>10.3f}{flops / sdpa_ms / 1e9:>9.0f}{err:>10.2e}{bf16_err:>10.2e}"
            f"   (first call {first_call:.1f} s, compile or cache load included)"
        )
    click.echo("max err: flashgen vs a float32 reference; bf16 err: PyTorch in bf16 vs the same "
               "reference (FlashAttention's rule: max err <= 2 x bf16 err)")
    if failures:
        for failure in failures:
            click.echo(f"MISMATCH {failure}", err=True)
        ctx.exit(1)


@cli.command()
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default=True)
@click.pass_context
def demo(ctx: click.Context, jobs: int) -> None:
    """On a GPU: run flashgen next to PyTorch SDPA and check it.  Without one: compile a
    representative set of kernels for sm_80 and sm_90a."""
    import torch

    if torch.cuda.is_available():
        _demo_gpu(ctx)
        return
    specs = _demo_specs()
    click.echo(f"compiling {len(specs)} representative kernels with NVRTC into {config.cache_dir()}")
    results = []
    for result in cache.build(specs, jobs):
        results.append(result)
        status = "FAILED" if result.error else "cached" if result.cached else f"{result.seconds:6.1f} s"
        click.echo(f"  {result.spec.uri:<48} {status}")
    if any(r.error for r in results):
        _report_failures(results)
        ctx.exit(1)
    click.echo("No NVIDIA GPU found (torch.cuda.is_available() is False): "
               "kernels were compiled, none was run.")


def _list_option(name: str, parse, help_text: str, metavar: str = "LIST"):
    """A comma-separated option; ``parse`` turns each item into its value or raises ValueError."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None):
        if value is None:
            return None
        try:
            items = tuple(parse(item.strip()) for item in value.split(",") if item.strip())
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        if not items:
            raise click.BadParameter("give at least one value")
        return items

    return click.option(name, callback=callback, metavar=metavar, help=help_text)


def _choice(choices):
    def parse(item: str) -> str:
        if item not in choices:
            raise ValueError(f"{item!r} is not one of {', '.join(choices)}")
        return item

    return parse


def _positive_int(item: str) -> int:
    if not item.isdigit() or int(item) < 1:
        raise ValueError(f"{item!r} is not a positive integer")
    return int(item)


def _layout(item: str) -> str:
    bench_settings.parse_layout(item)
    return item


def _defaults(field: str) -> str:
    """The full and --quick defaults of a list option, for its help."""
    def text(value):
        if not isinstance(value, tuple):
            return str(value)
        return ",".join("/".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)

    full, quick = text(bench_settings.FULL[field]), text(bench_settings.QUICK[field])
    return f" [default: {full}]" if full == quick else f" [default: {full}; --quick: {quick}]"


@cli.command("bench")
@click.argument("suites", nargs=-1, type=click.Choice(bench_settings.SUITES))
@click.option("--quick", is_flag=True, help="A small representative subset of every suite.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Results folder [default: benchmarks/results/<date>-<gpu>].")
@_list_option("--peers", _choice(bench_settings.PEERS),
              f"Peers to run next to flashgen [default: {','.join(bench_settings.PEERS)}].")
@_list_option("--dtypes", _choice(bench_settings.DTYPES), "prefill, decode: bf16, fp16." + _defaults("dtypes"))
@_list_option("--modes", _choice(bench_settings.MODES), "prefill: fwd, bwd (the backward alone), fwd_bwd." + _defaults("modes"))
@_list_option("--head-dims", _positive_int, "prefill: head dims." + _defaults("head_dims"))
@_list_option("--seqlens", _positive_int, "prefill: sequence lengths." + _defaults("seqlens"))
@_list_option("--masks", _choice(bench_settings.MASKS), "prefill: none, causal." + _defaults("masks"))
@_list_option("--gqa", _positive_int, "prefill: query heads per KV head, 1 is MHA." + _defaults("gqa"))
@click.option("--tokens", type=click.IntRange(min=1),
              help=f"prefill: batch x seqlen [default: {bench_settings.TOKENS}].")
@click.option("--hidden", type=click.IntRange(min=1),
              help=f"prefill: nheads x head dim [default: {bench_settings.HIDDEN}].")
@click.option("--flex-static", "flex_dynamic", flag_value=False, default=None,
              help="prefill: compile FlexAttention for each shape instead of once with dynamic shapes.")
@_list_option("--query-lens", _positive_int, "decode: new tokens per sequence." + _defaults("query_lens"))
@_list_option("--contexts", _positive_int, "decode: keys in the cache." + _defaults("contexts"))
@_list_option("--batches", _positive_int, "decode: batch sizes." + _defaults("batches"))
@_list_option("--layouts", _layout,
              "decode: contiguous, hnd (heads-first memory, SDPA's), pagedN (N keys per page)." + _defaults("layouts"))
@_list_option("--heads", bench_settings.parse_heads, "decode: query/KV heads." + _defaults("heads"), metavar="Q/KV,...")
@_list_option("--decode-head-dims", _positive_int, "decode: head dims." + _defaults("decode_head_dims"))
@click.option("--max-kv-gib", type=click.FloatRange(min=0),
              help=f"decode: skip configs whose K+V cache is larger [default: {bench_settings.Settings.max_kv_gib:g}].")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default=True,
              help="compile: processes for the matrix build.")
@click.option("--cold-count", type=click.IntRange(min=1), help="compile: instances compiled cold, one at a time."
              + _defaults("cold_count"))
@click.option("--warm-runs", type=click.IntRange(min=1),
              help=f"compile: fresh processes for the warm load [default: {bench_settings.Settings.warm_runs}].")
@click.option("--matrix-filter", metavar="TEXT",
              help="compile: build only URIs containing TEXT ('' for all) [default: all; --quick: hdim128_bf16].")
@click.option("--no-plots", is_flag=True, help="Write no PNG plots.")
@click.pass_context
def bench_command(ctx: click.Context, suites: tuple[str, ...], quick: bool, out: Path | None, no_plots: bool,
                  **options) -> None:
    """Benchmark flashgen next to PyTorch SDPA (FA2, cuDNN and efficient backends) and FlexAttention,
    plus flash-attn and FlashInfer when they are installed, in one run.

    \b
    SUITES (default: all):
      prefill  forward and forward+backward TFLOP/s on FlashAttention's shapes
               (batch x seqlen = 16k tokens, hidden 2048), causal or not, MHA or GQA
      decode   flash_attn_with_kvcache: new tokens against a long cache, contiguous
               or paged; us per call (eager, and CUDA-graph replays of short calls)
               and TB/s of K+V read against the measured copy bandwidth
      compile  cold NVRTC compile per instance, NVRTC's phase timings per family
               (front end, optimizer, ptxas), warm cache load in a fresh process,
               the matrix with -j N, host time per call next to SDPA's, a d128
               forward's first call in a fresh process next to FA4's

    Every flashgen output is checked once per config against a reference before it is timed; a
    peer that is missing or refuses a config is skipped with the reason.  The header gives the
    GPU, its clocks and the measured matmul and copy ceilings.  report.txt, results.json and PNG
    plots (with the 'bench' extra, matplotlib) go to --out.  The defaults take a few minutes on
    an H200; list options (comma-separated) widen any axis.  Exits with 1 when a flashgen check or
    compile fails.
    """
    from .bench import report
    from .bench import suites as bench_suites

    settings = bench_settings.resolve(quick, suites=suites or None, **options)
    results = bench_suites.run(settings, progress=lambda message: click.echo(message, err=True))
    text = report.render(results)
    click.echo(text, nl=False)
    paths, plot_notes = report.write(results, text, out or report.default_out_dir(results), plots=not no_plots)
    for note in plot_notes:
        click.echo(f"note: {note}")
    click.echo(f"wrote {', '.join(map(str, paths))}")
    failed = report.failures(results)
    for failure in failed:
        click.echo(f"FAILED {failure}", err=True)
    if failed:
        ctx.exit(1)


def main() -> None:
    cli(prog_name="flashgen")
