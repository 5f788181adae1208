"""CPU tier: rendering of instances and headers."""
from __future__ import annotations

import json

import jinja2
import pytest

from flashgen.generator import matrix, render
from flashgen.generator.spec import KernelSpec
from flashgen.generator.params import LAYOUTS

SPEC = KernelSpec("fwd", "sm80", "sm_90a", "bf16", 128, "causal", softcap=True)


def test_strict_undefined_catches_a_missing_variable():
    template = render._env().get_template("fwd_instance.cu.j2")
    with pytest.raises(jinja2.UndefinedError):
        template.render(do_not_edit=render.DO_NOT_EDIT)  # every other variable missing
    with pytest.raises(jinja2.UndefinedError, match="kernel_nmae"):
        render._env().from_string("void {{ kernel_nmae }}();").render(kernel_name="k")


def test_instance_is_short_and_says_what_it_is():
    source = render.render_instance(SPEC)
    lines = source.splitlines()
    assert len(lines) < 40
    assert lines[0] == f"// {render.DO_NOT_EDIT}"
    # The spec is recorded in the file, so a generated file explains itself.
    spec_line = next(line for line in lines if line.startswith("// spec: "))
    assert KernelSpec.from_dict(json.loads(spec_line.removeprefix("// spec: "))) == SPEC
    assert source.count('extern "C" __global__') == 1
    assert f"{SPEC.kernel_name}(" in source


def test_every_matrix_instance_renders_distinctly():
    sources = {render.render_instance(s) for s in matrix.all_specs()}
    assert len(sources) == len(matrix.all_specs())


def test_params_header_has_a_static_assert_per_field():
    headers = render.header_sources()
    params = headers[render.PARAMS_HEADER]
    assert params.startswith(f"// {render.DO_NOT_EDIT}")
    for name, layout in LAYOUTS.items():
        assert f"struct {name} {{" in params
        for field in layout.fields:
            assert f'static_assert(__builtin_offsetof({name}, {field.name})' in params
    # One per field plus one for the size, per struct.
    assert params.count("static_assert(") == sum(len(layout.fields) + 1 for layout in LAYOUTS.values())
    # Every .cuh of templates/ is offered to NVRTC (and digested by the cache key).
    assert {p.name for p in render.TEMPLATES_DIR.glob("*.cuh")} <= headers.keys()


def test_instance_filename_is_the_uri():
    assert render.instance_filename(SPEC) == f"{SPEC.uri}.cu"
