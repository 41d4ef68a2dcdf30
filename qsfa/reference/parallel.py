"""How many threads the attention oracle uses, and its thread pool (issue 15).

The oracle works in independent chunks of query rows (:func:`qsfa.reference.attention._core`); with more than one
chunk and more than one thread it runs the chunks on a pool of threads, each calling BLAS with one thread (the
float64 GEMMs, NumPy's ufuncs and copies release the GIL). Every chunk computes the same bytes on any thread, so
results do not depend on the thread count (benchmarks/bytecheck.py, tests/test_parallel.py).

Thread count, the smaller of:

1. ``qsfa.set_num_threads(n)`` if called (``None`` resets it), else the environment variable
   ``QSFA_NUM_THREADS``, else the CPUs this process may run on (``os.sched_getaffinity``);
2. the thread limit of NumPy's BLAS as threadpoolctl reports it now - so ``OMP_NUM_THREADS``,
   ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` and an enclosing ``threadpoolctl.threadpool_limits(n)`` are
   honoured. Without threadpoolctl (``pip install qsfa[threads]``) the BLAS threads of each worker cannot be
   pinned, so the default is 1 and an explicit count is capped by those environment variables instead.

While the pool runs, BLAS is limited to one thread per calling thread (process-wide, through threadpoolctl:
another thread of the caller that calls BLAS meanwhile also gets one thread). Each worker holds its own chunk
working set (see ``chunk_size``), so peak memory grows with the thread count.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["set_num_threads", "get_num_threads", "run_chunks"]

_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
_requested: int | None = None
_controller = None


def set_num_threads(n: int | None) -> None:
    """Use at most ``n`` threads in the attention oracle (``None``: back to ``QSFA_NUM_THREADS`` / the CPU count).

    The effective count is also capped by the BLAS thread limit (see the module docstring)."""
    global _requested
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            from .._errors import InvalidArgument

            raise InvalidArgument("value", "n", n, "must be a positive integer or None")
    _requested = n


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    try:
        n = int(v)
    except ValueError:
        return None
    return n if n >= 1 else None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _blas():
    """threadpoolctl's controller of the loaded BLAS libraries, or None without threadpoolctl / a BLAS."""
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _controller = False
        else:
            ctl = ThreadpoolController()
            _controller = ctl.select(user_api="blas") if ctl.select(user_api="blas").lib_controllers else False
    return _controller or None


def get_num_threads() -> int:
    """The number of threads the oracle uses now (see the module docstring)."""
    env = _env_int("QSFA_NUM_THREADS")
    want = _requested if _requested is not None else env
    blas = _blas()
    if blas is None:
        caps = [n for n in (_env_int(v) for v in _ENV_VARS) if n is not None]
        n = want if want is not None else 1
        return max(1, min([n, *caps]))
    if want is None:
        want = _cpus()
    limit = min(lib.num_threads for lib in blas.lib_controllers)
    return max(1, min(want, limit))


def run_chunks(fn, starts, n_threads: int | None = None) -> None:
    """``fn(s)`` for every ``s`` of ``starts``: in order on this thread, or on a pool of ``n_threads`` threads
    (default :func:`get_num_threads`) with BLAS at one thread each. Exceptions propagate."""
    starts = list(starts)
    n = min(get_num_threads() if n_threads is None else n_threads, len(starts))
    if n <= 1:
        for s in starts:
            fn(s)
        return
    _enter_one_blas_thread()
    try:
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="qsfa", initializer=_one_blas_thread_here) as pool:
            futures = [pool.submit(fn, s) for s in starts]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    finally:
        _leave_one_blas_thread()


# Pools of concurrent calls (several caller threads) share one BLAS limit: the first sets it, the last restores the
# limits found before the first (a per-call set / restore would leave BLAS at one thread after interleaved calls).
_limit_lock = threading.Lock()
_limit_users = 0
_limiter = None


def _one_blas_thread_here() -> None:
    """Pool worker start: one BLAS thread. Recent OpenBLAS builds keep the thread count per calling thread, so the
    limit the caller's thread set does not reach the workers; a global count is restored by the caller's exit."""
    blas = _blas()
    if blas is not None:
        blas.limit(limits=1)


def _enter_one_blas_thread() -> None:
    global _limit_users, _limiter
    with _limit_lock:
        if _limit_users == 0:
            blas = _blas()
            _limiter = blas.limit(limits=1) if blas is not None else None
        _limit_users += 1


def _leave_one_blas_thread() -> None:
    global _limit_users, _limiter
    with _limit_lock:
        _limit_users -= 1
        if _limit_users == 0 and _limiter is not None:
            _limiter.restore_original_limits()
            _limiter = None
