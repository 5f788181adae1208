"""CPU tier: what `pip install flashgen` (and its cu12 / cu13 extras) brings, and a first import."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO_ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def requirements(extra: str | None = None) -> dict[str, Requirement]:
    listed = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return {r.name: r for r in map(Requirement, listed)}


def test_base_install_is_cuda13_and_leaves_cuda_bindings_open():
    base = requirements()
    assert "13.5.37" in base["nvidia-cuda-nvrtc"].specifier
    assert "12.9.86" not in base["nvidia-cuda-nvrtc"].specifier  # CUDA 12's is another wheel
    assert "nvidia-cuda-runtime" in base
    # cuda-bindings is left open above, so that the cu12 extra can narrow it to 12.x.
    assert "12.9.10" in base["cuda-bindings"].specifier and "13.5.0" in base["cuda-bindings"].specifier


@pytest.mark.parametrize(
    ("extra", "packages", "inside", "outside"),
    [
        ("cu12", ("cuda-bindings", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"), "12.9.10", "13.0.0"),
        ("cu13", ("cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime"), "13.5.0", "12.9.10"),
    ],
)
def test_cuda_extras_pin_one_major_version(extra, packages, inside, outside):
    pins = requirements(extra)
    assert set(pins) == set(packages)
    base = requirements()
    for name in packages:
        assert inside in pins[name].specifier and outside not in pins[name].specifier, pins[name]
        if name in base:  # the extra narrows the base requirement, so both can be met
            assert inside in base[name].specifier


def test_numpy_is_a_dependency():
    """torch's wheels do not require NumPy, but warn on import without it."""
    assert "numpy" in requirements()


def test_import_warns_nothing():
    """A first contact: import flashgen and its API (which imports torch) with warnings as errors,
    in a fresh interpreter.  Without NumPy, torch's import warns "Failed to initialize NumPy"."""
    code = "import flashgen; flashgen.flash_attn_func; flashgen.flash_attn_with_kvcache; import flashgen.cli"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        env=env, capture_output=True, text=True, check=False, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_license_matches_pyproject():
    assert PROJECT["license"] == "BSD-3-Clause"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (REPO_ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n")
    assert "Copyright (c) 2026, the flashgen authors" in text
    for clause in (
        "Redistributions of source code must retain the above copyright notice",
        "Redistributions in binary form must reproduce the above copyright notice",
        "Neither the name of the copyright holder nor the names of its",
        'THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS"',
    ):
        assert clause in text


def test_installed_metadata_ships_the_license():
    """Where this checkout is installed (CI's `pip install -e .`), its metadata carries LICENSE."""
    def installed_from(dist) -> str:
        return json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")

    # Not metadata.distribution(): from the checkout's root it finds the build's flashgen.egg-info.
    installed = [d for d in metadata.distributions(name="flashgen")
                 if installed_from(d) == REPO_ROOT.as_uri()]
    if not installed:
        pytest.skip("this checkout is not pip-installed")
    dist = installed[0]
    assert dist.metadata["License-Expression"] == "BSD-3-Clause"
    assert "LICENSE" in dist.metadata.get_all("License-File")
    assert dist.read_text("licenses/LICENSE") == (REPO_ROOT / "LICENSE").read_text()
