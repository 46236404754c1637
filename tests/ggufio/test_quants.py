"""Dequantization and row gathers, for every type gguf.quants knows, on random blocks read back from files."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, quants as gq

from llamacli.ggufio.file import open_gguf
from llamacli.ggufio.quants import can_dequantize, dequantize, gather_rows
from llamacli.testing import ModelSpec, act8, random_quant_rows, write_model

ALL_TYPES = [t for t in QT if t in GGML_QUANT_SIZES and can_dequantize(t) and t not in (QT.F64,)]


def test_every_listed_type_is_covered():
    names = {t.name for t in ALL_TYPES}
    for required in ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                     "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]:
        assert required in names


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_and_gather_match_gguf_quants(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype) + 1000)
    block = GGML_QUANT_SIZES[qtype][0]
    cols = block * (3 if block > 1 else 40) if block < 256 else 512
    # The writer stores the rows in a file; we read them back from it.
    spec = ModelSpec("llama", 1, cols, 4, 4, cols, vocab_size=0)
    path = write_model(tmp_path / "m.gguf", spec, qtype, seed=int(qtype), tensor_types={"token_embd.weight": qtype})
    g = open_gguf(path)
    raw = g.raw("token_embd.weight")
    info = g.tensors["token_embd.weight"]
    # reference: gguf.quants straight on the bytes (plain types: a cast)
    ref = raw.astype(np.float32) if qtype in (QT.F32, QT.F16) else gq.dequantize(np.asarray(raw), qtype)
    ours = g.dequantize("token_embd.weight")
    assert ours.shape == info.shape and ours.dtype == np.float32
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, ref.reshape(info.shape))
    ids = rng.integers(0, info.shape[0], size=17)
    ids[:3] = [0, info.shape[0] - 1, ids[3]]  # ends and a repeat
    np.testing.assert_array_equal(g.rows("token_embd.weight", ids), ours[ids])
    assert g.rows("token_embd.weight", []).shape == (0, info.shape[1])


def test_gather_rows_checks_bounds():
    rng = np.random.default_rng(0)
    data = random_quant_rows(QT.Q8_0, 4, 64, rng)
    with pytest.raises(IndexError):
        gather_rows(data, QT.Q8_0, [4], 64)
    with pytest.raises(IndexError):
        gather_rows(data, QT.Q8_0, [-1], 64)


def test_random_blocks_have_requested_scale():
    rng = np.random.default_rng(1)
    for qtype in (QT.Q4_K, QT.Q6_K, QT.IQ4_XS, QT.Q2_K, QT.Q8_0):
        x = dequantize(random_quant_rows(qtype, 32, 512, rng, std=0.05), qtype)
        assert 0.02 < float(np.sqrt(np.mean(x**2))) < 0.1, qtype


def test_act8_reference_rounds_like_the_kernel() -> None:
    """act8 itself: values within half a step of x, the unit's largest |x| exactly 127 steps, ties to even,
    a zero unit all zero, a ragged tail padded with zeros."""
    ties = np.zeros(32, np.float32)
    ties[:5] = [127.0, 2.5, 3.5, -2.5, 0.4]  # step 1: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, 0.4 -> 0
    x = np.concatenate([np.linspace(-3, 5, 32), ties, np.zeros(32), [1.0, -0.5, 0.25]]).astype(np.float32)
    got, xd = act8(x)
    assert got.shape == (99,) and xd.shape == (4,)
    assert np.all(np.abs(got - x) <= np.repeat(xd.astype(np.float64) / 2, 32)[:99] * (1 + 1e-6))
    assert abs(got[31] - 5.0) < 1e-6 and xd[1] == 1.0
    assert list(got[32:37]) == [127.0, 2.0, 4.0, -2.0, 0.0]
    assert not got[64:96].any() and xd[2] == 0
    assert abs(got[96] - 1.0) < 1e-6 and abs(got[97] + 0.5) <= xd[3] / 2
