"""Generated kernel source: byte-identical without knobs, variant-tagged by EP_HYBRID_KERNEL."""

from __future__ import annotations

import re

import pytest

from lck_ep.codegen import CSRC_DIR, LAYOUT_KERNEL, layout_source, layout_spec
from lck_ep.knobs import EpKnobs, read_knobs


def test_unset_knobs_give_the_same_bytes_every_time() -> None:
    a = layout_spec(read_knobs({}))
    b = layout_spec(EpKnobs())
    assert a.source.encode() == b.source.encode()
    assert a.defines == b.defines == {}
    assert a.kernel == LAYOUT_KERNEL == "ep_layout_kernel"
    assert 'extern "C" __global__' in a.source and f"{LAYOUT_KERNEL}(" in a.source


def test_integer_knobs_never_touch_the_source() -> None:
    plain = layout_spec(EpKnobs())
    tuned = layout_spec(
        EpKnobs(num_sub_parts=1, min_sub_tokens=4, sm100_min_sub_tokens=30, num_topk_idx_bits=32)
    )
    assert tuned.source == plain.source
    assert tuned.defines == {
        "EP_NUM_SUB_PARTS": 1,
        "EP_MIN_SUB_TOKENS": 4,
        "EP_SM100_MIN_SUB_TOKENS": 30,
        "EP_NUM_TOPK_IDX_BITS": 32,
    }


def test_hybrid_variant_is_tagged_in_the_source() -> None:
    unordered = layout_source("unordered")
    ordered = layout_source("ordered")
    assert unordered != ordered
    assert layout_spec(read_knobs({"EP_HYBRID_KERNEL": "unordered"})).source == unordered
    assert layout_spec(read_knobs({"EP_HYBRID_KERNEL": "ordered"})).source == ordered
    for text, variant in ((unordered, "unordered"), (ordered, "ordered")):
        assert f"hybrid variant: {variant}." in text.splitlines()[0]
        assert f'#define LCK_EP_HYBRID_VARIANT "{variant}"' in text
    # Only the tag lines differ.
    diff = [(a, b) for a, b in zip(unordered.splitlines(), ordered.splitlines()) if a != b]
    assert len(diff) == 2
    with pytest.raises(ValueError, match="hybrid_kernel"):
        layout_source("sideways")


def test_headers_exist_and_cover_every_include() -> None:
    spec = layout_spec(EpKnobs())
    includes = set(re.findall(r'#include "([^"]+)"', spec.source))
    for h in spec.headers:
        assert h.is_file(), h
        includes |= set(re.findall(r'#include "([^"]+)"', h.read_text()))
    assert {h.name for h in spec.headers} == includes
    assert spec.include_dirs == (CSRC_DIR,)
    kw = spec.build_kwargs()
    assert set(kw) == {"name", "source", "kernel", "defines", "headers", "include_dirs"}
    assert kw["name"] == "ep_layout"


def test_config_header_defaults_match_the_knob_table() -> None:
    text = (CSRC_DIR / "ep_config.cuh").read_text()
    knobs = EpKnobs()
    for name in ("EP_NUM_SUB_PARTS", "EP_MIN_SUB_TOKENS", "EP_SM100_MIN_SUB_TOKENS", "EP_NUM_TOPK_IDX_BITS"):
        m = re.search(rf"#ifndef {name}\n#define {name} (\d+)\n#endif", text)
        assert m is not None, name
        assert int(m.group(1)) == knobs.value(name), name


def test_param_kinds_follow_the_c_signature() -> None:
    """The kinds every kernel is bound with come from its C parameter list: a pointer is a Ptr, each scalar
    its own kind; a type without a launch kind is refused, naming the parameter."""
    from lck_ep.codegen import LAYOUT_KINDS, NATIVE_KERNELS, NATIVE_KINDS, native_source, param_kinds
    from lck_ep.hybrid_codegen import HYBRID_KINDS, hybrid_source
    from lck_runtime.jit import F32, I32, I64, U64, Ptr

    params = (
        "const uint8_t* x, long long n, int k,\n    unsigned long long t, float s, void *p, const bool* m"
    )
    assert param_kinds(params) == (Ptr, I64, I32, U64, F32, Ptr, Ptr)
    with pytest.raises(ValueError, match="'short n'"):
        param_kinds("int a, short n")
    assert LAYOUT_KINDS == (Ptr, I32, I32, I32, I32, Ptr, Ptr, Ptr)
    assert set(NATIVE_KINDS) == set(NATIVE_KERNELS) and set(HYBRID_KINDS) == {"dispatch", "combine"}
    # as many kinds as the generated kernel has parameters
    sources = [(native_source(k), NATIVE_KINDS[k]) for k in NATIVE_KERNELS]
    sources += [(hybrid_source(r), HYBRID_KINDS[r]) for r in HYBRID_KINDS]
    sources.append((layout_source(), LAYOUT_KINDS))
    for text, kinds in sources:
        signature = re.search(r"\n\w+\(([^)]*)\) \{", text)
        assert signature is not None
        assert len(kinds) == signature.group(1).count(",") + 1
