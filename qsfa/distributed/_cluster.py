"""Connecting to a Dask cluster, submitting qsfa's tasks and accounting for what the cluster did with them.

Every task runs through :func:`_attempt`, which logs one event per attempt (topic ``qsfa-attempt``) on the
scheduler before the work starts. Together with the scheduler's own ``remove-worker`` events (topic ``all``:
which tasks were processing on, or held results by, a worker that died) this tells the client which tasks ran
more than once - the summary :class:`RunSummary` reports them. Nothing here writes files: tasks return
values, the client writes. A local cluster's scratch space (Dask's ``dask-scratch-space``) is a temporary folder
:func:`connect` creates and removes, unless the user's Dask configuration names one (``temporary-directory``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field

__all__ = ["INSTALL_HINT", "DistributedUnavailable", "ClusterUsageError", "check_workers", "check_same_code",
           "code_fingerprint", "require", "connect", "prestart", "Tasks", "RunSummary", "RETRIES", "WORKER_PRELOAD"]

INSTALL_HINT = "pip install 'qsfa[distributed]'"

#: Dask re-runs a task that raised this many more times. Tasks return deterministic failures (the operator
#: rejects a case, a property errors) as values, so only what may pass elsewhere - MemoryError, OSError, a
#: result that could not be sent - is retried. A worker that dies mid-task is a separate matter: the scheduler
#: reschedules its tasks (at most ``distributed.scheduler.allowed-failures`` times, default 3).
RETRIES = 2

#: event topic of the per-attempt records
ATTEMPT_TOPIC = "qsfa-attempt"

#: what the fork server of a local cluster imports once, before it forks the worker processes (callers add the
#: modules of their tasks); see :func:`prestart`
WORKER_PRELOAD = ("numpy", "distributed", "qsfa", "qsfa.reference")


class DistributedUnavailable(ImportError):
    """``dask.distributed`` or ``tqdm`` is not installed (the ``qsfa[distributed]`` extra)."""


class ClusterUsageError(ValueError):
    """A bad ``--workers`` / ``--scheduler`` / ``--seed-shards`` / ``--chunk-rows`` value, or no scheduler there."""


def require(flag: str = "--workers/--scheduler") -> None:
    """Raise :class:`DistributedUnavailable` (naming ``flag`` and what to install) unless the extra is there."""
    try:
        import distributed  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as e:
        top = (e.name or "distributed").split(".")[0]
        raise DistributedUnavailable(
            f"{flag} needs the {top} package, which is not installed ({INSTALL_HINT})") from None


def check_workers(n) -> int:
    """``--workers N``: a positive integer."""
    try:
        v = int(n)
    except (TypeError, ValueError):
        v = 0
    if isinstance(n, bool) or v < 1 or str(v) != str(n).strip():
        raise ClusterUsageError(f"Invalid value for --workers, actual: {n!r}, reason: must be an integer >= 1.")
    return v


def _start_method() -> str:
    """How a local cluster starts its worker processes: Dask's ``distributed.worker.multiprocessing-method`` where
    it is set (a Dask configuration file, ``DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD``, or
    ``dask.config.set``), else ``forkserver`` where the platform has it (Dask's own default is ``spawn``)."""
    import multiprocessing

    import dask.config

    key = "distributed.worker.multiprocessing-method"
    method = dask.config.get(key, "spawn")
    if method != "spawn":
        return method
    try:
        explicit = dask.config.get(key, None, config=dask.config.collect()) is not None  # files and environment
    except Exception:  # noqa: BLE001 - an unreadable configuration file: Dask reports it itself
        explicit = False
    if not explicit and "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver"
    return method


#: Dask's default for its workers, ``MALLOC_TRIM_THRESHOLD_=65536`` (``distributed.nanny.pre-spawn-environ``), turns
#: off glibc's adaptive mmap threshold: every NumPy temporary above 128 KiB is then mapped and unmapped afresh. The
#: ci conformance work took 8x the page faults and about 17% more CPU with it (docs/scaling.md); qsfa's local
#: cluster leaves it unset, as a serial run does, unless it is set in the environment or Dask's configuration.
TRIM = "MALLOC_TRIM_THRESHOLD_"
_PRE_SPAWN = "distributed.nanny.pre-spawn-environ"


#: Dask's workers sample every thread's stack every 10 ms for the dashboard's profile
#: (``distributed.worker.profile.enabled``): for qsfa's Python-heavy tasks that took 12-20% more CPU per task than the
#: same tasks in a plain process (docs/scaling.md). qsfa's local cluster has no dashboard, so it turns it off unless
#: a Dask configuration file or ``DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED`` sets it.
PROFILE = "distributed.worker.profile.enabled"


def _local_settings() -> dict:
    """The Dask settings of qsfa's local cluster (``dask.config.set`` keywords): the above, each unless set by the
    user (a Dask configuration file, ``DASK_*`` variables, or ``MALLOC_TRIM_THRESHOLD_`` in the environment)."""
    import dask.config

    try:
        collected = dask.config.collect()
    except Exception:  # noqa: BLE001 - an unreadable configuration file: Dask reports it itself
        collected = {}
    out = {}
    user = dask.config.get(_PRE_SPAWN, {}, config=collected) or {}
    if TRIM not in user and TRIM not in os.environ:
        out[f"{_PRE_SPAWN}.{TRIM}"] = None
    if dask.config.get(PROFILE, None, config=collected) is None:
        out[PROFILE] = False
    return out


def _pre_spawn_environ() -> dict:
    """What Dask's nanny puts in the environment before it spawns a worker (``distributed.nanny._get_env_variables``:
    the setting ``distributed.nanny.pre-spawn-environ``, a variable already in the environment winning, None
    unsetting), with :func:`_local_settings`. Read without importing distributed where it is not imported yet
    (distributed adds its defaults, ``distributed.yaml``, to Dask's configuration when imported)."""
    import dask.config

    with dask.config.set(_local_settings()):
        cfg = None
        if "distributed" not in sys.modules:
            try:
                import importlib.util

                import yaml

                spec = importlib.util.find_spec("distributed")
                with open(os.path.join(list(spec.submodule_search_locations)[0], "distributed.yaml")) as f:
                    defaults = yaml.safe_load(f)
                cfg = dask.config.get(_PRE_SPAWN, {}, config=dask.config.merge(defaults, dask.config.config))
            except Exception:  # noqa: BLE001 - another layout: import it
                import distributed  # noqa: F401
        if cfg is None:
            cfg = dask.config.get(_PRE_SPAWN, {})
        # (inside: ``cfg`` is Dask's own dictionary, which the end of the ``with`` restores)
        return {str(k): os.environ.get(str(k), str(v)) for k, v in (cfg or {}).items() if v is not None}


@contextlib.contextmanager
def _environ_restored(keys):
    """On exit, the variables ``keys`` of this process's environment are as they were on entry (set to their old
    value, or unset). Dask's nanny puts its pre-spawn environment (``OMP_NUM_THREADS=1`` and the like) into the
    process that starts a local cluster and leaves it there; qsfa's local cluster takes it out again, so that
    what the caller runs or starts afterwards (torch's thread pool, a subprocess) sees the caller's environment."""
    keys = [str(k) for k in keys]
    before = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def prestart(preload: tuple = ()) -> bool:
    """Start the fork server of a local cluster now (True), so that it imports :data:`WORKER_PRELOAD` and
    ``preload`` while this process still prepares its tasks; :func:`connect` then forks the workers from it.

    A spawned worker is a fresh interpreter that imports distributed, NumPy and qsfa itself (about a second of
    CPU each, before its first task); forked from the server, every worker starts with them imported, once for
    all workers. The server is a single-threaded process (multiprocessing's ``forkserver`` start method, not a
    fork of this process and its threads), started with the environment Dask sets for its workers before
    spawning them (``distributed.nanny.pre-spawn-environ``: one BLAS thread, the malloc trim threshold), so the
    workers' NumPy reads it at import as a spawned one would. It lives until this process exits.

    Best effort, never raises: False (nothing started) without the extra, where the start method is not the
    fork server (:func:`_start_method`), or when the server cannot start - :func:`connect` then spawns."""
    try:
        import importlib.util

        if any(importlib.util.find_spec(m) is None for m in ("distributed", "tqdm")):
            return False  # connect() says what to install
        if _start_method() != "forkserver":
            return False
        import multiprocessing
        from multiprocessing import forkserver

        pre = _pre_spawn_environ()
        with _environ_restored(pre):  # the server starts with it; this process keeps its own environment
            # what Dask's nanny does in this process before it spawns a worker (distributed.nanny.WorkerProcess.start)
            os.environ.update(pre)
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(dict.fromkeys([*WORKER_PRELOAD, *preload])))
            # before this process imports distributed (about 0.3 s of CPU), which it then does while the server does
            forkserver.ensure_running()
        return True
    except Exception:  # noqa: BLE001 - an optimisation: connect() falls back to spawning
        return False


@contextlib.contextmanager
def _scratch_space():
    """The scratch folder of a local cluster's scheduler, nannies and workers (Dask's ``temporary-directory``, where
    it puts ``dask-scratch-space``): a new temporary folder, removed with everything in it when the block ends -
    unless the user's Dask configuration (a file, ``DASK_TEMPORARY_DIRECTORY``, ``dask.config.set``) names one,
    which is then left to Dask as it is. Without this, Dask leaves ``dask-scratch-space`` in the system's temporary
    folder after every run."""
    import dask.config

    if dask.config.get("temporary-directory", None) is not None:
        yield
        return
    scratch = tempfile.mkdtemp(prefix="qsfa-dask-")
    try:
        with dask.config.set({"temporary-directory": scratch}):
            yield
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def connect(workers: int | None = None, scheduler: str | None = None, *, env: dict | None = None,
            timeout: float = 30.0, same_code: tuple = (), preload: tuple = ()):
    """A ``distributed.Client``: of a new local cluster of ``workers`` processes with one thread each (closed
    on exit, Ctrl-C included), or of the running cluster at ``scheduler`` (e.g. ``tcp://host:8786``; left
    running), whose workers must run the same qsfa sources and versions of the modules ``same_code``
    (:func:`check_same_code`). ``env``: environment variables for the new workers (e.g. ``TRITON_INTERPRET``).
    ``preload``: modules the local cluster's workers import before their first task (:func:`prestart`)."""
    require()
    import dask
    from distributed import Client, LocalCluster

    if (workers is None) == (scheduler is None):
        raise ClusterUsageError("Invalid value for --workers/--scheduler, actual: "
                                f"{workers!r}/{scheduler!r}, reason: give exactly one of them.")
    n = check_workers(workers) if scheduler is None else None
    cluster = client = None
    with contextlib.ExitStack() as stack:
        if n is not None:
            # the nannies set the pre-spawn environment in this process (see _environ_restored)
            stack.enter_context(_environ_restored({*_pre_spawn_environ(), *(dask.config.get(_PRE_SPAWN, {}) or {})}))
            stack.enter_context(dask.config.set(_local_settings()))
            stack.enter_context(_scratch_space())
        if n is not None and prestart(preload):
            # for the whole run: a worker that dies is restarted by its nanny from the same server
            stack.enter_context(dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}))
        try:
            if scheduler is not None:
                try:
                    client = Client(scheduler, timeout=timeout, set_as_default=False)
                except (OSError, TimeoutError, ValueError, TypeError) as e:
                    raise ClusterUsageError(f"Invalid value for --scheduler, actual: {scheduler!r}, reason: cannot "
                                            f"connect ({type(e).__name__}: {e}).") from None
                check_same_code(client, same_code)
            else:
                cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                       dashboard_address=None, silence_logs=logging.ERROR, env=dict(env or {}),
                                       # no dashboard, and the scheduler's remaining HTTP routes on a free port: the
                                       # default 8787 warns on stderr (even with -q) when another cluster holds it
                                       scheduler_kwargs={"dashboard": False, "dashboard_address": ":0"})
                client = Client(cluster, set_as_default=False)
            yield client
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
            if cluster is not None:
                with contextlib.suppress(Exception):
                    cluster.close()


def code_fingerprint(modules: tuple = ()) -> dict:
    """What must be equal on the client and every worker for their results to be equal: a sha256 over the qsfa
    package's Python sources (Triton kernels aside) and the versions of ``modules`` (e.g. hypothesis, whose
    version decides the examples a seed draws)."""
    import hashlib
    import importlib

    import qsfa

    root = os.path.dirname(os.path.abspath(qsfa.__file__))
    h = hashlib.sha256()
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("kernels", "__pycache__"))
        for f in sorted(files):
            if f.endswith((".py", ".json")):
                path = os.path.join(base, f)
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(fh.read())
    out = {"qsfa": f"{qsfa.__version__} (sources {h.hexdigest()[:16]})"}
    for m in modules:
        try:
            out[m] = getattr(importlib.import_module(m), "__version__", "?")
        except ImportError:
            out[m] = "not installed"
    return out


def check_same_code(client, modules: tuple = ()) -> None:
    """Refuse (ClusterUsageError) a cluster whose workers run other qsfa sources, or other versions of
    ``modules``, than this process: their bytes or examples could differ from a serial run's."""
    mine = code_fingerprint(modules)
    try:
        theirs = client.run(code_fingerprint, modules)
    except Exception as e:  # noqa: BLE001 - e.g. qsfa not installed on the workers
        raise ClusterUsageError(f"Invalid value for --scheduler, actual: {client.scheduler.address!r}, reason: its "
                                f"workers cannot run qsfa ({type(e).__name__}: {e}).") from None
    bad = {w: fp for w, fp in theirs.items() if fp != mine}
    if bad:
        w, fp = sorted(bad.items())[0]
        diff = ", ".join(f"{k} {fp.get(k)} (here: {v})" for k, v in mine.items() if fp.get(k) != v)
        raise ClusterUsageError(f"Invalid value for --scheduler, actual: {client.scheduler.address!r}, reason: "
                                f"{len(bad)} of {len(theirs)} workers run other code than this process, e.g. {w}: "
                                f"{diff}; install the same qsfa there.")


def _attempt(fn, key, env, *args):
    """Run ``fn(*args)`` on a worker after logging this attempt (see the module docstring)."""
    try:
        from distributed import get_worker

        w = get_worker()
        w.log_event(ATTEMPT_TOPIC, {"key": key, "worker": w.address, "pid": os.getpid()})
    except ValueError:  # not on a worker (a test calling it directly)
        pass
    if env:
        os.environ.update(env)
    return fn(*args)


@dataclass
class RunSummary:
    """What the cluster did: tasks run, workers, and the tasks that ran more than once (``reruns``: label ->
    extra attempts) with the workers lost meanwhile."""

    tasks: int = 0
    workers: int = 0
    reruns: dict = field(default_factory=dict)
    lost_workers: list = field(default_factory=list)

    @property
    def rerun_tasks(self) -> int:
        return len(self.reruns)

    def line(self) -> str:
        w = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        s = f"dask: {self.tasks} task{'s' if self.tasks != 1 else ''} on {w}"
        if not self.reruns:
            return s + ", none re-run"
        lost = f"; {len(self.lost_workers)} worker(s) lost: {', '.join(self.lost_workers)}" if self.lost_workers else ""
        names = ", ".join(f"{k} (x{n + 1})" for k, n in sorted(self.reruns.items()))
        return f"{s}, {len(self.reruns)} re-run after a failure{lost}; re-run: {names}"


class Tasks:
    """The futures of one run: unique keys (``qsfa-<label>-<run id>``), completion order, a tqdm bar over
    tasks on stderr, and the :class:`RunSummary` at the end."""

    def __init__(self, client, desc: str, progress: bool = True, env: dict | None = None):
        from distributed import as_completed
        from tqdm import tqdm

        self.client = client
        self.env = dict(env or {})
        self.run_id = uuid.uuid4().hex[:10]
        self.workers_at_start = _n_workers(client)
        self.labels: dict = {}  # key -> label
        self.tags: dict = {}  # key -> caller's tag
        self.futures: dict = {}  # key -> future, until taken
        self._ac = as_completed(loop=client.loop)
        self.bar = tqdm(total=0, desc=desc, unit="task", file=sys.stderr, disable=not progress, dynamic_ncols=True)

    def submit(self, fn, *args, label: str, tag=None, priority: int = 0):
        """Submit ``fn(*args)`` (``args`` may hold futures); ``label`` names it in the summary."""
        key = f"qsfa-{label}-{self.run_id}"
        if key in self.labels:
            raise ValueError(f"duplicate task label {label!r}")
        f = self.client.submit(_attempt, fn, key, self.env, *args, key=key, pure=False, retries=RETRIES,
                               priority=priority)
        self.labels[key] = label
        self.tags[key] = tag
        self.futures[key] = f
        self._ac.add(f)
        self.bar.total += 1
        return f

    def completed(self):
        """``(tag, future)`` in completion order, new submissions included; the bar advances after each."""
        for f in self._ac:
            yield self.tags[f.key], f
            self.futures.pop(f.key, None)
            self.bar.update(1)

    def cancel(self):
        """Cancel what has not finished (an error or Ctrl-C on the client)."""
        pending = [f for f in self.futures.values() if not f.done()]
        self.futures.clear()
        if pending:
            with contextlib.suppress(Exception):
                self.client.cancel(pending)

    def close(self):
        self.bar.close()

    def summary(self) -> RunSummary:
        """Which of this run's tasks ran more than once, from the scheduler's event log."""
        attempts: dict = {}
        with contextlib.suppress(Exception):
            for _, msg in self.client.get_events(ATTEMPT_TOPIC):
                k = msg.get("key") if isinstance(msg, dict) else None
                if k in self.labels:
                    attempts[k] = attempts.get(k, 0) + 1
        died: dict = {}
        lost = []
        with contextlib.suppress(Exception):
            for _, msg in self.client.get_events("all"):
                if not isinstance(msg, dict) or msg.get("action") != "remove-worker":
                    continue
                # tasks it was running; results it held that are recomputed show up as extra attempts
                hit = [k for k in msg.get("processing-tasks") or () if k in self.labels]
                for k in hit:
                    died[k] = died.get(k, 0) + 1
                if hit:
                    lost.append(str(msg.get("worker")))
        reruns = {}
        for k, label in self.labels.items():
            extra = max(attempts.get(k, 1) - 1, died.get(k, 0))
            if extra > 0:
                reruns[label] = extra
        return RunSummary(tasks=len(self.labels), workers=max(self.workers_at_start, _n_workers(self.client)),
                          reruns=reruns, lost_workers=sorted(set(lost)))


def _n_workers(client) -> int:
    try:
        return len(client.scheduler_info().get("workers", {}))
    except Exception:  # noqa: BLE001
        return 0
