"""CPU tier: `flashgen build --shard`, its progress lines, `--archive` and `cache import`."""
from __future__ import annotations

import collections

import pytest
from click.testing import CliRunner

from flashgen import cli as cli_module
from flashgen.cli import ProgressLines, cli, shard_specs
from flashgen.generator import matrix

FWD_SM80_D64 = "sm80_hdim64_"  # a few dozen sm_80 forward instances


def run(*args: str, expect: int = 0):
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == expect, (result.output, result.exception)
    return result


# --- --shard -------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_cover_the_selection_exactly_once(count):
    specs = matrix.all_specs(archs=["sm_80", "sm_90a"])
    shards = [shard_specs(specs, index, count) for index in range(1, count + 1)]
    uris = [s.uri for part in shards for s in part]
    assert collections.Counter(uris) == collections.Counter(s.uri for s in specs)  # disjoint, complete
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    # Stable: the same shards whatever order the selection comes in.
    assert [shard_specs(list(reversed(specs)), i, count) for i in range(1, count + 1)] == shards


def test_shards_balance_the_families():
    specs = matrix.all_specs(archs=["sm_90a"])
    families = collections.Counter(s.uri.split("_")[1] for s in specs)
    for index in (1, 2):
        part = collections.Counter(s.uri.split("_")[1] for s in shard_specs(specs, index, 2))
        for family, total in families.items():
            assert abs(2 * part[family] - total) <= 2, family


def test_build_shards_through_the_cli(fake_nvrtc):
    args = ("build", "--arch", "sm_80", "--direction", "fwd", "--filter", FWD_SM80_D64, "-j", "1")
    selected = [s.uri for s in matrix.all_specs(directions=["fwd"], archs=["sm_80"]) if FWD_SM80_D64 in s.uri]
    built = []
    for index in (1, 2, 3):
        before = len(fake_nvrtc.calls)
        output = run(*args, "--shard", f"{index}/3").output
        part = fake_nvrtc.calls[before:]
        assert f"{len(part)} kernels (shard {index}/3 of {len(selected)})" in output
        built += part
    assert sorted(built) == sorted(selected)


@pytest.mark.parametrize("value", ["0/3", "4/3", "1/0", "3", "a/b", "1/2/3", "-1/2", ""])
def test_build_rejects_a_bad_shard(value):
    output = run("build", "--arch", "sm_80", "--shard", value, expect=2).output
    assert "Invalid value for '--shard'" in output and "I/N with 1 <= I <= N" in output


def test_an_empty_shard_builds_nothing(fake_nvrtc):
    output = run("build", "--arch", "sm_80", "--filter", "bwd_pre_sm80_bf16", "--shard", "2/2").output
    assert "shard 2/2 of 1 kernels is empty" in output and fake_nvrtc.calls == []


# --- Progress lines ------------------------------------------------------------------------------

def test_build_prints_progress_lines_when_not_a_terminal(fake_nvrtc):
    output = run("build", "--arch", "sm_80", "--direction", "fwd", "--filter", FWD_SM80_D64, "-j", "1").output
    total = len(fake_nvrtc.calls)
    assert total >= 20
    lines = [line for line in output.splitlines() if line.startswith("compiling: ")]
    assert 10 <= len(lines) <= 21  # about every 5%
    assert lines[0].startswith(f"compiling: {max(1, total // 20)}/{total} (")
    assert "/s, ETA " in lines[0]
    assert lines[-1].startswith(f"compiling: {total}/{total} (100%)") and "ETA" not in lines[-1]


def test_progress_lines_every_step_or_interval():
    now = [0.0]
    lines: list[str] = []
    progress = ProgressLines(1000, lines.append, interval=5.0, clock=lambda: now[0])
    for _ in range(49):  # under 5% and under 5 s: silent
        now[0] += 0.01
        progress.update()
    assert lines == []
    now[0] += 0.01
    progress.update()  # 5%
    assert lines == ["compiling: 50/1000 (5%), 100.0/s, ETA 10s, 1s elapsed"]
    now[0] += 120.0
    progress.update()  # the interval
    assert lines[-1] == "compiling: 51/1000 (5%), 0.4/s, ETA 37m22s, 2m00s elapsed"
    progress.update(949)
    assert lines[-1] == "compiling: 1000/1000 (100%), 8.3/s, 2m00s elapsed"


def test_progress_bar_on_a_terminal(fake_nvrtc, monkeypatch):
    """On a terminal the progress bar stays; no progress lines."""
    monkeypatch.setattr(cli_module, "_stdout_is_terminal", lambda: True)
    calls = []
    monkeypatch.setattr(cli_module, "ProgressLines", lambda *a, **k: calls.append(a))
    run("build", "--arch", "sm_80", "--filter", "bwd_pre_sm80_bf16")
    assert calls == []
