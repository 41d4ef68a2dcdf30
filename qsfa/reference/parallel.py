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
working set.

``QSFA_NUM_THREADS`` and ``QSFA_WORKSET_MIB`` must be positive integers when set (anything else is refused with
:class:`qsfa.InvalidArgument` naming the variable at the next call, instead of silently meaning the default).

Working-set budget: ``qsfa.set_workset_mib(n)`` if called (``None`` resets it), else the environment variable
``QSFA_WORKSET_MIB``, else :data:`DEFAULT_WORKSET_MIB` (256) MiB for the chunks of one call, divided among its
threads (:func:`workset_bytes_per_thread`). The oracle sizes its chunks of query rows from the share
(``qsfa.reference.attention._rows_per_chunk``: a model of the float64 K / V and score arrays one row needs), so
the peak does not grow with the number of query tokens, nor the total with the thread count - down to one row
per chunk, whose working set (about 20 KiB per selected token for 576-wide K, plus 32 bytes per selected token
and head) is the floor. Results do not depend on the budget (nor on the chunking).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["set_num_threads", "get_num_threads", "run_chunks", "set_workset_mib", "get_workset_mib",
           "workset_bytes_per_thread", "DEFAULT_WORKSET_MIB"]

_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
_requested: int | None = None
_controller = None
#: working-set budget of one oracle call in MiB (all its threads together) when nothing else is set
DEFAULT_WORKSET_MIB = 256
_workset: int | None = None


def set_num_threads(n: int | None) -> None:
    """Use at most ``n`` threads in the attention oracle (``None``: back to ``QSFA_NUM_THREADS`` / the CPU count).

    The effective count is also capped by the BLAS thread limit (see the module docstring)."""
    global _requested
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            from .._errors import InvalidArgument

            raise InvalidArgument("value", "n", n, "must be a positive integer or None")
    _requested = n


def set_workset_mib(mib: int | None) -> None:
    """Bound the attention oracle's working set to about ``mib`` MiB per call, shared by its threads (``None``:
    back to ``QSFA_WORKSET_MIB`` / :data:`DEFAULT_WORKSET_MIB`); see the module docstring."""
    global _workset
    if mib is not None:
        if isinstance(mib, bool) or not isinstance(mib, int) or mib < 1:
            from .._errors import InvalidArgument

            raise InvalidArgument("value", "mib", mib, "must be a positive integer (MiB) or None")
    _workset = mib


def get_workset_mib() -> int:
    """The working-set budget in MiB now: :func:`set_workset_mib`, else ``QSFA_WORKSET_MIB``, else the default
    (a value that is not a positive integer is refused, as for ``QSFA_NUM_THREADS``)."""
    if _workset is not None:
        return _workset
    env = _qsfa_env_int("QSFA_WORKSET_MIB")
    return env if env is not None else DEFAULT_WORKSET_MIB


def workset_bytes_per_thread(n_threads: int) -> int:
    """One thread's share of the budget in bytes when ``n_threads`` threads run the chunks."""
    return (get_workset_mib() << 20) // max(int(n_threads), 1)


def _env_int(name: str) -> int | None:
    """A positive integer from another library's environment variable (OMP_NUM_THREADS, ...), else None."""
    v = os.environ.get(name, "").strip()
    try:
        n = int(v)
    except ValueError:
        return None
    return n if n >= 1 else None


def _qsfa_env_int(name: str) -> int | None:
    """qsfa's own variable ``name`` (QSFA_NUM_THREADS, QSFA_WORKSET_MIB): None when unset or empty, else a positive
    integer; any other value is refused (a typo must not silently give the default)."""
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        from .._errors import InvalidArgument

        raise InvalidArgument("value", name, v, "the environment variable must be a positive integer (or unset)")
    return n


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


def _blas_threads() -> int:
    """The BLAS thread limit now (1 without threadpoolctl / a BLAS: nothing to pin)."""
    blas = _blas()
    return 1 if blas is None else min(lib.num_threads for lib in blas.lib_controllers)


def get_num_threads() -> int:
    """The number of threads the oracle uses now (see the module docstring)."""
    env = _qsfa_env_int("QSFA_NUM_THREADS")
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
    (default :func:`get_num_threads`) with BLAS at one thread each; with ``n_threads`` 1, BLAS at one thread
    too. Exceptions propagate."""
    starts = list(starts)
    allowed = get_num_threads() if n_threads is None else n_threads
    n = min(allowed, len(starts))
    if n <= 1:
        # one thread allowed: BLAS too (its default pool on small GEMMs costs 20x on a machine whose cores are
        # busy); one chunk with more threads allowed: BLAS keeps them for that chunk
        pin = allowed <= 1 and _blas_threads() > 1  # (already one: nothing to set, nothing to restore)
        if pin:
            _enter_one_blas_thread()
        try:
            for s in starts:
                fn(s)
        finally:
            if pin:
                _leave_one_blas_thread()
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
