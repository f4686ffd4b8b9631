"""EP_* knobs: parsing, validation with clear errors, and the -D mapping (set knobs only)."""

from __future__ import annotations

import pytest

from lck_ep.knobs import INT_KNOBS, EpKnobs, KnobError, read_knobs

NAMES = [k.name for k in INT_KNOBS]
# (variable, a valid non-default value, the header default)
VALID = {
    "EP_NUM_SUB_PARTS": (1, 2),
    "EP_MIN_SUB_TOKENS": (8, 1),
    "EP_SM100_MIN_SUB_TOKENS": (32, 15),
    "EP_NUM_TOPK_IDX_BITS": (32, 64),
}


def test_unset_means_no_defines_and_defaults() -> None:
    knobs = read_knobs({})
    assert knobs == EpKnobs()
    assert knobs.defines() == {}
    assert knobs.hybrid_kernel == "unordered"
    for name, (_, default) in VALID.items():
        assert knobs.value(name) == default


def test_empty_value_counts_as_unset() -> None:
    assert read_knobs({name: "" for name in NAMES} | {"EP_HYBRID_KERNEL": ""}) == EpKnobs()
    assert read_knobs({"EP_NUM_SUB_PARTS": "  "}).defines() == {}


@pytest.mark.parametrize("name", NAMES)
def test_each_knob_maps_to_exactly_its_define(name: str) -> None:
    value, _ = VALID[name]
    knobs = read_knobs({name: f" {value} "})
    assert knobs.defines() == {name: value}
    assert knobs.value(name) == value


def test_all_knobs_together_in_table_order() -> None:
    env = {name: str(v) for name, (v, _) in VALID.items()}
    assert list(read_knobs(env).defines().items()) == [(n, VALID[n][0]) for n in NAMES]


# Per knob: (raw value, fragment the error must contain).
BAD = {
    "EP_NUM_SUB_PARTS": [
        ("0", "out of range"), ("17", "[1, 16]"), ("-2", "out of range"),
        ("two", "not an integer"), ("2.0", "not an integer"), ("0x2", "not an integer"),
    ],
    "EP_MIN_SUB_TOKENS": [("0", "[1, 65536]"), ("65537", "out of range")],
    "EP_SM100_MIN_SUB_TOKENS": [("0", "out of range"), ("1e3", "not an integer")],
    "EP_NUM_TOPK_IDX_BITS": [("24", "one of 8, 16, 32, 64"), ("0", "one of 8, 16, 32, 64")],
}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "raw", "fragment"), [(name, raw, frag) for name, cases in BAD.items() for raw, frag in cases]
)
def test_bad_values_are_refused_naming_the_variable(name: str, raw: str, fragment: str) -> None:
    with pytest.raises(KnobError) as info:
        read_knobs({name: raw})
    msg = str(info.value)
    assert name in msg and fragment in msg, msg
    assert isinstance(info.value, ValueError)


def test_hybrid_kernel_variants() -> None:
    assert read_knobs({"EP_HYBRID_KERNEL": "ordered"}).hybrid_kernel == "ordered"
    assert read_knobs({"EP_HYBRID_KERNEL": "unordered"}) == read_knobs({})
    with pytest.raises(KnobError, match=r"EP_HYBRID_KERNEL='Ordered'.*unordered, ordered"):
        read_knobs({"EP_HYBRID_KERNEL": "Ordered"})
    # The variant is not a -D: it changes the generated source instead.
    assert read_knobs({"EP_HYBRID_KERNEL": "ordered"}).defines() == {}


def test_extra_flags_values_are_validated_and_not_duplicated() -> None:
    knobs = read_knobs({"EP_JIT_EXTRA_FLAGS": "-DEP_NUM_SUB_PARTS=4 -DOTHER=7"})
    assert knobs.value("EP_NUM_SUB_PARTS") == 4
    # The JIT appends extra flags itself; our defines leave the knob out so it is not passed twice.
    assert knobs.defines() == {}
    # Agreeing with the dedicated variable is fine; the define comes from the variable.
    same = read_knobs({"EP_NUM_SUB_PARTS": "4", "EP_JIT_EXTRA_FLAGS": "-DEP_NUM_SUB_PARTS=4"})
    assert same.defines() == {"EP_NUM_SUB_PARTS": 4}
    with pytest.raises(KnobError, match=r"EP_JIT_EXTRA_FLAGS.*EP_NUM_SUB_PARTS=99.*\[1, 16\]"):
        read_knobs({"EP_JIT_EXTRA_FLAGS": "-DEP_NUM_SUB_PARTS=99"})
    with pytest.raises(KnobError, match=r"EP_NUM_SUB_PARTS=3 contradicts -DEP_NUM_SUB_PARTS=4"):
        read_knobs({"EP_NUM_SUB_PARTS": "3", "EP_JIT_EXTRA_FLAGS": "-DEP_NUM_SUB_PARTS=4"})
    with pytest.raises(KnobError, match="defined twice"):
        read_knobs({"EP_JIT_EXTRA_FLAGS": "-DEP_MIN_SUB_TOKENS=2 -DEP_MIN_SUB_TOKENS=3"})


def test_topk_idx_bits_must_hold_the_expert_indices() -> None:
    read_knobs({"EP_NUM_TOPK_IDX_BITS": "8"}).check_problem(num_experts=128, num_topk=8)
    with pytest.raises(KnobError, match=r"EP_NUM_TOPK_IDX_BITS=8.*num_experts=129.*16 bits"):
        read_knobs({"EP_NUM_TOPK_IDX_BITS": "8"}).check_problem(num_experts=129, num_topk=8)
    read_knobs({}).check_problem(num_experts=1 << 20, num_topk=8)


def test_direct_construction_is_validated() -> None:
    assert EpKnobs(num_sub_parts=16).defines() == {"EP_NUM_SUB_PARTS": 16}
    with pytest.raises(KnobError, match="EP_NUM_SUB_PARTS=0"):
        EpKnobs(num_sub_parts=0)
    with pytest.raises(KnobError, match="num_sub_parts must be an int"):
        EpKnobs(num_sub_parts=True)  # type: ignore[arg-type]
    with pytest.raises(KnobError, match="hybrid_kernel"):
        EpKnobs(hybrid_kernel="fast")


@pytest.mark.usefixtures("no_ep_knobs")
def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EP_MIN_SUB_TOKENS", "5")
    assert read_knobs().defines() == {"EP_MIN_SUB_TOKENS": 5}
