"""`bench -npl` (engine/batched_bench.py) on the CUDA backend: every B it holds slots for runs through Backend.step
(its batched decode where it has one), the others are skipped with a reason. Needs a GPU (marker gpu)."""

from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from llamacli.backends.cuda import cuda_available  # noqa: E402
from llamacli.engine.batched_bench import run_batched  # noqa: E402
from llamacli.engine.generate import Model  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu


def test_batched_bench_rows_on_cuda(random_model) -> None:
    m = Model(random_model("small-llama", "Q4_K_M"), backend="cuda", ctx=64)
    said: list[str] = []
    try:
        rows = run_batched(m, [16], [8], [1, 4], progress=said.append)
        bs = [r.b for r in rows]
        assert bs[0] == 1 and set(bs) <= {1, 4}
        if 4 not in bs:  # a backend of one slot: B = 4 skipped, saying why
            assert any(line.startswith("skipping B 4: -npl 4:") for line in said)
        for r in rows:
            assert r.n_kv == r.b * 24 and r.speed_pp > 0 and r.speed_tg > 0
        assert all(len(seq) == 0 for seq in m.seqs)
    finally:
        m.close()
