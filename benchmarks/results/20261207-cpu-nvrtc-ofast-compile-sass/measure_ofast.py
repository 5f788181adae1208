"""CPU seconds and SASS of compile targets under the options in FLASHGEN_NVRTC_EXTRA_OPTIONS, one
compile each, serially in this process (the cache folder should be empty: FLASHGEN_CACHE_DIR).

    FLASHGEN_CACHE_DIR=$(mktemp -d) FLASHGEN_NVRTC_EXTRA_OPTIONS=--Ofast-compile=mid \
        NVDISASM=/path/to/nvdisasm python measure_ofast.py uris.txt

nvdisasm comes with the nvidia-cuda-nvdisasm wheel (pip download, then unzip).
"""
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

from flashgen.generator import cache, matrix

_OPCODE = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")

uris = [line.strip() for line in open(sys.argv[1]) if line.strip()]
specs = {spec.uri: spec for spec in matrix.all_specs(archs=("sm_80", "sm_90a"))}
for uri in uris:
    target = matrix.compile_target(specs[uri])
    cpu, wall = time.process_time(), time.time()
    cubin = cache.get_cubin(target)
    cpu, wall = time.process_time() - cpu, time.time() - wall
    framed = cache._unframe(cubin)
    if framed is not None:
        cubin = next(part for part in framed if part[:4] == b"\x7fELF")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([os.environ.get("NVDISASM", "nvdisasm"), "-c", file.name],
                              capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0] for m in map(_OPCODE.match, sass.splitlines()) if m)
    print(f"{uri} cpu {cpu:.2f} wall {wall:.2f} instr {sum(ops.values())} STL {ops['STL']} LDL {ops['LDL']}", flush=True)
