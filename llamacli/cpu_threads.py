"""How many CPU threads the CPU backends may use: `-t/--threads`, as llama.cpp's. The NumPy backend's BLAS (and any
OpenMP pool) is limited here; the CPU backend's numba kernels read the count in force (`threads_in_force`) and
set it for the thread that runs them (numba's count is per calling thread).

The NumPy backend's matrix products run in the BLAS numpy was built with (OpenBLAS in numpy's wheels), whose
threads wait for each other by spinning. When other programs keep the CPUs busy, a thread that loses its CPU
holds up the rest: on a busy machine decode slows down many times over with two threads where one thread
keeps its pace (docs/perf-log.md). So the default is modest: half the CPUs this process may run on (about
the physical cores on machines with two hardware threads a core, llama.cpp's default), less the CPUs the
load average says other programs keep busy, and at least one.

The limit is set with threadpoolctl, which finds the BLAS and OpenMP libraries numpy (and anything else)
has loaded and calls their own set-threads functions: it reaches only libraries already loaded. Where numpy
is not imported yet (the CLI reads its options first), the libraries' environment variables are set as well,
which they read when they load; without threadpoolctl (an install that left it out) they are the only way,
and once numpy is loaded the request cannot be carried out and `set_threads` says so.
"""

from __future__ import annotations

import os
import sys

# The variables the BLAS and OpenMP libraries read when they load.
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
MAX_THREADS = 1024
_in_force: int | None = None  # the count set_threads last came to


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def busy_cpus() -> int:
    """The CPUs other programs keep busy, as the last minute's load average says (0 where it is unknown)."""
    try:
        return int(round(os.getloadavg()[0]))
    except (AttributeError, OSError):
        return 0


def default_threads(cpus: int | None = None, busy: int | None = None) -> int:
    """Half the available CPUs, less the busy ones, at least 1 (see the module doc)."""
    cpus = available_cpus() if cpus is None else cpus
    busy = busy_cpus() if busy is None else busy
    return max(1, min(cpus // 2, cpus - busy))


def check_threads(n: int | None) -> None:
    """A thread count the user gave: a positive number, or -1 for the default (llama.cpp's spelling of it);
    ValueError otherwise."""
    if n is not None and n != -1 and not 1 <= n <= MAX_THREADS:
        raise ValueError(f"must be from 1 to {MAX_THREADS}, or -1 for the default, got {n}")


def set_threads(n: int | None = None) -> int | None:
    """Limit the BLAS and OpenMP pools to `n` threads. Without `n` (or with -1): the environment's OPENBLAS_NUM_THREADS (or
    another of THREAD_VARIABLES) where one is set, as the libraries themselves would, else default_threads().
    Returns the count in force, or None when it cannot be set (numpy already loaded and threadpoolctl
    missing)."""
    global _in_force
    check_threads(n)
    if n is None or n == -1:
        given = next((os.environ[v] for v in THREAD_VARIABLES if os.environ.get(v, "").strip()), None)
        if given is not None:
            count = int(given) if given.strip().isdigit() else None  # the libraries read it themselves
            _in_force = count if count and count <= MAX_THREADS else None
            return count
        n = default_threads()
    _in_force = n
    loaded = "numpy" in sys.modules
    if not loaded:  # its BLAS is not loaded yet, so threadpoolctl cannot reach it: the variables do
        for name in THREAD_VARIABLES:
            os.environ[name] = str(n)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None if loaded else n
    threadpool_limits(limits=n)  # what is loaded already; stays in force (the object it returns restores the
    return n  # old limits only when used as a context)


def blas_threads() -> int | None:
    """The thread count of the first BLAS library loaded (None where threadpoolctl or BLAS is missing)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return next((int(i["num_threads"]) for i in threadpool_info() if i.get("user_api") == "blas"), None)


def threads_in_force() -> int:
    """The thread count -t (or its default, or the environment) came to in this process: set_threads' last
    count, else what set_threads() would choose (a library caller that never set one)."""
    if _in_force is None:
        given = next((os.environ[v] for v in THREAD_VARIABLES if os.environ.get(v, "").strip()), "")
        return int(given) if given.strip().isdigit() and 0 < int(given) <= MAX_THREADS else default_threads()
    return _in_force
