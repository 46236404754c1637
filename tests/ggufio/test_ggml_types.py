"""llamacli's copy of ggml's type tables (ggufio/ggml_types.py) against the installed `gguf` package's."""

from __future__ import annotations

import gguf

from llamacli.ggufio import ggml_types as ours


def test_tensor_types_are_ggufs():
    """Every type the installed gguf knows, by the same name and number, and none that it lacks (a newer gguf
    with a new type fails here: add it to ggml_types.py)."""
    assert {t.name: t.value for t in ours.GGMLQuantizationType} == {
        t.name: t.value for t in gguf.GGMLQuantizationType
    }


def test_block_sizes_are_ggufs():
    assert {t.name: v for t, v in ours.GGML_QUANT_SIZES.items()} == {
        t.name: v for t, v in gguf.GGML_QUANT_SIZES.items()
    }


def test_value_types_are_ggufs():
    assert {t.name: t.value for t in ours.GGUFValueType} == {t.name: t.value for t in gguf.GGUFValueType}


def test_members_stand_for_ggufs_in_lookups():
    """A table keyed by one package's members answers the other's (IntEnums hash and compare as numbers):
    gguf.quants' own tables, and ours read with gguf's members by the tests' file writers."""
    assert gguf.GGML_QUANT_SIZES[ours.GGMLQuantizationType.Q4_K] == ours.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    assert ours.GGMLQuantizationType.Q6_K == gguf.GGMLQuantizationType.Q6_K
    assert {ours.GGMLQuantizationType.F16} == {gguf.GGMLQuantizationType.F16}
