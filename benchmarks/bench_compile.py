"""Cold NVRTC compile of forward instances and a warm cache hit in a fresh process.

    python benchmarks/bench_compile.py [--count 8]

Cold: compile into an empty cache directory (median and max over instances). Warm: a fresh Python
process that imports flashgen and loads one cached instance (time to a loaded kernel, without the
interpreter's and torch's import time, which are reported separately).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

WARM_SNIPPET = r"""
import time
t0 = time.perf_counter()
import torch, flashgen
from flashgen.generator.cache import get_cubin
from flashgen.generator.spec import KernelSpec
from flashgen.runtime import launch
if torch.cuda.is_available():
    torch.cuda.init()  # context creation is not the cache's cost
t1 = time.perf_counter()
spec = KernelSpec.from_dict({spec!r})
cubin = get_cubin(spec)
if torch.cuda.is_available():
    launch.LoadedKernel(spec, cubin, 0, 128)
t2 = time.perf_counter()
print(f"{{t1 - t0:.4f}} {{t2 - t1:.4f}}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=8, help="instances to compile cold")
    parser.add_argument("--arch", default=None, help="NVRTC target (default: this GPU's, else sm_90a)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["FLASHGEN_CACHE_DIR"] = cache_dir
        from flashgen.generator import cache, matrix, nvrtc

        arch = args.arch
        if arch is None:
            import torch

            arch = matrix.target_arch(*torch.cuda.get_device_capability()) if torch.cuda.is_available() else "sm_90a"
        specs = [s for s in matrix.all_specs(archs=[arch]) if s.dtype == "bf16" and not s.pack_gqa][: args.count]
        times = []
        for spec in specs:
            start = time.perf_counter()
            cache.get_cubin(spec)
            times.append(time.perf_counter() - start)
        print(f"NVRTC {nvrtc.nvrtc_version()}, arch {arch}: cold compile of {len(times)} instances: "
              f"median {statistics.median(times):.2f} s, max {max(times):.2f} s")
        warm = []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", WARM_SNIPPET.format(spec=specs[0].to_dict())],
                                 capture_output=True, text=True, check=True, env=dict(os.environ))
            imports, load = (float(x) for x in out.stdout.split())
            warm.append((imports, load))
        print(f"warm cache hit in a fresh process: {statistics.median(w[1] for w in warm) * 1e3:.1f} ms to a loaded "
              f"kernel (imports of torch + flashgen: {statistics.median(w[0] for w in warm):.2f} s)")


if __name__ == "__main__":
    main()
