"""llamacli.cpu_threads in the real command: -t reaches the BLAS that numpy loads after the options are read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_threads_reach_the_blas_numpy_loads_after_the_options(tmp_path):
    """The CLI reads -t before it imports numpy, where threadpoolctl finds no BLAS to limit: the libraries'
    variables carry the count to OpenBLAS as it loads (it ran with one thread per CPU instead)."""
    pytest.importorskip("threadpoolctl")
    from llamacli.testing import write_model

    model = write_model(tmp_path / "tiny.gguf", "tiny-llama", "F32")
    code = (
        "import json, os, sys\n"
        "leave = os._exit\n"
        "def report(status):\n"  # a model command leaves through os._exit (llamacli._leave)
        "    import threadpoolctl\n"
        "    sys.stderr.write('BLAS ' + json.dumps([i['num_threads'] for i in threadpoolctl.threadpool_info()\n"
        "                                           if i['user_api'] == 'blas']) + '\\n')\n"
        "    leave(status)\n"
        "os._exit = report\n"
        f"sys.argv = ['llamacli', 'generate', '-m', {str(model)!r}, '--backend', 'numpy', '-p', 'hi', '-n', '1',"
        " '-t', '1']\n"
        "import llamacli; llamacli.run()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                             "MKL_NUM_THREADS", "BLIS_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**env, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    counts = json.loads(next(line for line in r.stderr.splitlines() if line.startswith("BLAS "))[5:])
    assert counts and set(counts) == {1}
