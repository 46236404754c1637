"""`bench -npl` (engine/batched_bench.py) on the CUDA backend: B sequences in B cache slots through Backend.step (the
batched decode step), rows for every B. Needs a GPU (marker gpu)."""

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
        assert [r.b for r in rows] == [1, 4], said
        for r in rows:
            assert r.n_kv == r.b * 24 and r.speed_pp > 0 and r.speed_tg > 0
        assert len(m.seqs) == 4 and all(len(seq) == 0 for seq in m.seqs)
    finally:
        m.close()
