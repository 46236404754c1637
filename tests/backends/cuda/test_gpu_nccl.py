"""NCCL collectives over two GPUs (backends/cuda/nccl.py), one process per GPU as the split will run them, against
the host group the NumPy emulation meets at (backends/collective.py): the same sums (float32 and float16), joins of
parts of different sizes (a vocabulary cut unevenly), and a hidden state passed from one rank to the next; each
process has NCCL_NVLS_ENABLE=0. Needs 2 GPUs: `python -m pytest -m multi_gpu tests/backends/cuda/test_gpu_nccl.py`
on a 2-GPU machine."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from llamacli.backends.collective import HostGroup, set_nccl_environment  # noqa: E402
from llamacli.backends.cuda import cuda_available  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
if cp.cuda.runtime.getDeviceCount() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)
pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

SIZE = 2


def parts(rank: int) -> dict[str, np.ndarray]:
    """What rank `rank` contributes: partial sums of a [5, 64] hidden state, and logits of its vocabulary rows (3
    rows of 10 on rank 0, 3 rows of 7 on rank 1)."""
    rng = np.random.default_rng(rank)
    return {"sum32": rng.standard_normal((5, 64)).astype(np.float32),
            "sum16": rng.standard_normal((5, 64)).astype(np.float16),
            "logits": rng.standard_normal((3, 10 if rank == 0 else 7)).astype(np.float32),
            "hidden": np.full((4, 64), rank + 0.5, np.float32)}


def rank_main(rank: int, uid, out) -> None:  # noqa: ANN001 (a multiprocessing queue)
    try:
        from llamacli.backends.cuda.nccl import NcclCollective

        assert os.environ.get("NCCL_NVLS_ENABLE") == "0"
        comm = NcclCollective(rank, SIZE, uid, rank)
        mine = {k: cp.asarray(v) for k, v in parts(rank).items()}
        got = {"sum32": comm.all_reduce(mine["sum32"]).get(), "sum16": comm.all_reduce(mine["sum16"]).get(),
               "logits": comm.all_gather(mine["logits"], axis=-1).get(),
               "sized": comm.all_gather_sized(mine["logits"], [10, 7], axis=-1).get()}
        if rank == 0:
            comm.send(mine["hidden"], 1)
        else:
            got["hidden"] = comm.recv(0, (4, 64)).get()
        cp.cuda.get_current_stream().synchronize()
        comm.close()
        out.put((rank, got))
    except BaseException as exc:  # (the parent reports it)
        out.put((rank, repr(exc)))


def test_nccl_collectives_match_the_host_group():
    set_nccl_environment()
    from llamacli.backends.cuda.nccl import unique_id

    uid = unique_id()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, uid, out)) for r in range(SIZE)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(isinstance(r, dict) for r in results.values()), results

    group = HostGroup(SIZE)

    def host(rank):
        me, mine = group.member(rank), parts(rank)
        return {"sum32": me.all_reduce(mine["sum32"]), "sum16": me.all_reduce(mine["sum16"]),
                "logits": me.all_gather(mine["logits"], axis=-1)}

    want = group.run(host)
    for rank in range(SIZE):
        got = results[rank]
        np.testing.assert_allclose(got["sum32"], want[rank]["sum32"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["sum16"].astype(np.float32), want[rank]["sum16"].astype(np.float32),
                                   rtol=1e-3, atol=1e-3)
        assert np.array_equal(got["logits"], want[rank]["logits"]) and got["logits"].shape == (3, 17)
        assert np.array_equal(got["sized"], want[rank]["logits"])
    assert np.array_equal(results[1]["hidden"], np.full((4, 64), 0.5, np.float32))
