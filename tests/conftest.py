"""Markers and cache isolation shared by every test tier.

Markers:
  gpu     needs a CUDA GPU; skipped when torch.cuda.is_available() is False.
  matrix  NVRTC compile of the whole kernel matrix (minutes); deselect with -m "not matrix".
  multigpu  NCCL runs over >= 2 GPUs, one process each: scripts/run_multigpu_tests.sh (torchrun).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from flashgen.generator import cache, nvrtc


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "matrix: compiles the whole kernel matrix with NVRTC (slow)")
    config.addinivalue_line("markers", "large: 64-bit indexing tests with tensors past 2**31 elements (tens of GB)")
    config.addinivalue_line("markers", "multigpu: needs >= 2 GPUs, one process each (scripts/run_multigpu_tests.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return  # no torch import (and no CUDA probing) for CPU-only runs
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in gpu_items:
            item.add_marker(skip)
        return
    if torch.cuda.device_count() < 2:
        skip = pytest.mark.skip(reason=f"needs >= 2 GPUs ({torch.cuda.device_count()} visible)")
        for item in gpu_items:
            if item.get_closest_marker("multigpu"):
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def session_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """Keep tests out of the user's cache, with one cache per session so each kernel compiles once
    per run.  An explicit FLASHGEN_CACHE_DIR (e.g. a cache carried to the GPU machine) is kept."""
    if os.environ.get("FLASHGEN_CACHE_DIR"):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path_factory.mktemp("flashgen-cache")))
        yield


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache dir and an empty in-process memo, for tests of the cache's own behaviour."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(directory))
    monkeypatch.setattr(cache, "_cubins", {})
    return directory


@pytest.fixture
def temp_root(monkeypatch, tmp_path) -> Path:
    """tempfile's folder (where the fallback cache goes) in tmp_path, and no cache folder decided."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.setattr(cache, "_read_dirs", {})
    monkeypatch.setattr(cache, "_write_dirs", {})
    return root


class FakeNvrtc:
    """Stands in for nvrtc.compile_with_log (the cache's compile) in tests of the cache and CLI:
    records each compile; ``log`` is the NVRTC log each compile reports."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.log = ""

    @staticmethod
    def cubin(name: str) -> bytes:
        return b"\x7fELF" + name.encode() * 3

    def compile_with_log(self, source, name, arch, headers, options, source_path=None) -> tuple[bytes, str]:
        self.calls.append(name)
        return self.cubin(name), self.log


@pytest.fixture
def fake_nvrtc(monkeypatch, fresh_cache) -> FakeNvrtc:
    fake = FakeNvrtc()
    monkeypatch.setattr(nvrtc, "compile_with_log", fake.compile_with_log)
    return fake
