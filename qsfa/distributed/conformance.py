"""``qsfa conformance --workers N | --scheduler ADDRESS [--seed-shards K]``: properties on a Dask cluster.

Tasks are (property x seed shard). Without ``--seed-shards`` (K = 1) a task is one property run exactly as
:func:`qsfa.conformance.runner.run_property` runs it serially - the same seed (or the profile's derandomised
examples), the same verdict. With ``--seed S --seed-shards K`` a property's examples are split into K
independent hypothesis runs: shard k draws ``max_examples / K`` examples (the first ``max_examples % K``
shards one more; each also runs the property's explicit edge examples) with the seed :func:`shard_seed`
``(S, k)``; the property's verdict merges them (failed if any shard failed - the lowest such shard is
reported with its falsifying case -, else error if any errored, else passed if any passed, else skipped).
The serial run of the same ``--seed S --seed-shards K`` runs the same shards one after another
(:func:`run_sharded`), so it gives the same verdicts, reports and cases.

A task runs its property with a temporary case directory on the worker and returns the result and the
bytes of any falsifying case it saved; the client writes them into ``--cases-dir`` and the reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, replace

from ._cluster import ClusterUsageError, Tasks

__all__ = ["PropertyTask", "check_seed_shards", "plan", "shard_seed", "run_task", "merge", "run_sharded"]

#: hypothesis is not thread-safe: a worker with several threads runs one property at a time
_HYPOTHESIS_LOCK = threading.Lock()

#: hypothesis warns when the global ``random`` state changes while it draws an example. On a Dask worker the
#: event-loop thread changes it meanwhile: ``dask.sizeof`` samples large collections with ``random.sample`` when
#: it sizes task arguments and results. The drawn examples come from hypothesis's own generator (qsfa's strategies
#: and properties never use the global ``random``), so that warning is noise there; elsewhere it is left alone.
_FOREIGN_RANDOM = r"Do not use the `random` module inside strategies"


def _on_worker() -> bool:
    try:
        from distributed import get_worker

        get_worker()
        return True
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _other_threads_use_random():
    if not _on_worker():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FOREIGN_RANDOM)
        yield


@dataclass(frozen=True)
class PropertyTask:
    index: int  # position of the property in the selection
    name: str
    shard: int  # seed shard k of ``shards``
    shards: int
    seed: int | None  # the seed this task runs with
    max_examples: int | None

    @property
    def label(self) -> str:
        return self.name if self.shards == 1 else f"{self.name}[{self.shard}/{self.shards}]"


def shard_seed(seed: int, k: int, shards: int) -> int:
    """The seed of seed shard ``k`` of ``shards`` of a run with ``--seed seed`` (``seed`` itself when
    ``shards`` is 1, so an unsharded run matches a plain serial run)."""
    if shards == 1:
        return seed
    return int.from_bytes(hashlib.sha256(f"qsfa-seed-shard:{seed}:{k}:{shards}".encode()).digest()[:4], "little")


def check_seed_shards(seed_shards, seed: int | None, max_examples: int) -> int:
    """``--seed-shards K``: 1 <= K <= examples per property, K > 1 only with a seed."""
    k = int(seed_shards)
    if k < 1:
        raise ClusterUsageError(f"Invalid value for --seed-shards, actual: {seed_shards!r}, reason: must be >= 1.")
    if k > 1 and seed is None:
        raise ClusterUsageError(f"Invalid value for --seed-shards, actual: {k}, reason: needs --seed (without one the "
                         "profile's examples are derandomised: every shard would draw the same examples).")
    if k > max_examples:
        raise ClusterUsageError(f"Invalid value for --seed-shards, actual: {k}, reason: more shards than examples per "
                         f"property ({max_examples}).")
    return k


def plan(props, *, seed: int | None, max_examples: int, seed_shards: int = 1) -> list[PropertyTask]:
    """The tasks of a run: every property (in order) x its seed shards."""
    k = check_seed_shards(seed_shards, seed, max_examples)
    out = []
    for i, p in enumerate(props):
        for j in range(k):
            m = None if k == 1 else max_examples // k + (1 if j < max_examples % k else 0)
            out.append(PropertyTask(i, p.name, j, k, None if seed is None else shard_seed(seed, j, k), m))
    return out


def run_task(task: PropertyTask, backend: str, profile: str, max_examples, bounds, pins=None, chip=None) -> dict:
    """Run one task (on a worker, or inline): ``{"result": PropertyResult, "files": {name: bytes}}`` - the
    falsifying case and its sidecar, saved in a temporary directory, as bytes."""
    from ..conformance.properties import get
    from ..conformance.runner import PropertyResult, run_property

    tmp = tempfile.mkdtemp(prefix="qsfa-conformance-")
    try:
        with _HYPOTHESIS_LOCK, _other_threads_use_random():
            prop = None
            try:
                prop = get(task.name)
                res = run_property(prop, backend, profile=profile,
                                   max_examples=task.max_examples if task.shards > 1 else max_examples,
                                   seed=task.seed, bounds=bounds, cases_dir=tmp, pins=pins, chip=chip)
            except (MemoryError, OSError):
                raise
            except Exception as e:  # noqa: BLE001 - the run itself broke: an error verdict, reported once
                res = PropertyResult(task.name, list(getattr(prop, "ops", [])), getattr(prop, "kind", ""), backend,
                                     "error", seed=task.seed, message=f"{type(e).__name__}: {e}",
                                     doc=getattr(prop, "doc", ""))
        files = {}
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                files[name] = f.read()
        if res.case_file is not None:
            res.case_file = os.path.basename(res.case_file)
        return {"result": res, "files": files}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def merge(task_results: list, seed: int | None):
    """One property's result from its seed shards' (in shard order; see the module docstring)."""
    rs = [t["result"] for t in task_results]
    if len(rs) == 1:
        return rs[0], task_results[0]["files"]
    tasks = [t["task"] for t in task_results]
    pick = None
    for status in ("failed", "error", "passed", "skipped"):
        pick = next((j for j, r in enumerate(rs) if r.status == status), None)
        if pick is not None:
            break
    r, t = rs[pick], tasks[pick]
    merged = replace(r, seed=seed, examples=sum(x.examples for x in rs), passed=sum(x.passed for x in rs),
                     failed=sum(x.failed for x in rs), rejected=sum(x.rejected for x in rs),
                     errors=sum(x.errors for x in rs),
                     seconds=sum(x.seconds for x in rs), edge_examples=sum(x.edge_examples for x in rs))
    if r.status in ("failed", "error"):
        merged.message = (f"seed shard {t.shard}/{t.shards} (--seed {t.seed} --max-examples {t.max_examples}): "
                          f"{r.message}")
    files = task_results[pick]["files"] if r.status in ("failed", "error") else {}
    return merged, files


def _write_cases(files: dict, cases_dir: str | None):
    """Write a task's case files into ``cases_dir`` as the serial runner saves them (qsfa.golden.guard: plain
    file names only, each a new file renamed over an older regular one, never written through a link)."""
    if not files or cases_dir is None:
        return
    from ..golden.guard import check_replaceable, make_dirs, replacing

    make_dirs(cases_dir)
    check_replaceable(cases_dir, list(files))
    for name, data in files.items():
        with replacing(cases_dir, name) as f:
            f.write(data)


def _finish(props, tasks_plan, by_index, seed, cases_dir):
    results = []
    for i, p in enumerate(props):
        parts = sorted(by_index[i], key=lambda t: t["task"].shard)
        r, files = merge(parts, seed)
        try:
            _write_cases(files, cases_dir)
        except Exception as e:  # noqa: BLE001 - as a serial run: the failure is reported, with why no case was saved
            from ..conformance.runner import CASE_SAVE_ERROR

            r = replace(r, case_file=None, message=f"{r.message}\n({CASE_SAVE_ERROR} {type(e).__name__}: {e})")
        if r.case_file is not None:
            r.case_file = os.path.join(cases_dir, r.case_file) if cases_dir is not None else None
        results.append(r)
    return results


def _empty_report(backend, profile, max_examples, seed, shard_spec, bounds, chip):
    """The report header exactly as the serial runner makes it (no properties run)."""
    from ..conformance.runner import run_conformance

    return run_conformance(backend, props=[], profile=profile, max_examples=max_examples, seed=seed,
                           shard_spec=shard_spec, bounds=bounds, cases_dir=None, chip=chip)


def run_sharded(props, backend: str = "reference", *, profile: str | None = None, max_examples=None,
                seed: int | None = None, seed_shards: int = 1, shard_spec=None, bounds=None,
                cases_dir: str | None = None, progress=None, client=None, env: dict | None = None,
                chip: str | None = None):
    """Run ``props`` (already selected and sharded) as :func:`plan`'s tasks: on the Dask ``client``, or in
    this process when it is None. Returns ``(ConformanceReport, RunSummary or None)``; ``progress`` (bool)
    shows a tqdm bar with a client, or is called as ``progress(k, total, result)`` per property without."""
    from .. import strategies as qst
    from .._profiles import PROFILES, active_profile

    profile = profile or active_profile()
    b = bounds if bounds is not None else qst.bounds(profile)
    m = int(max_examples if max_examples is not None else PROFILES[profile]["max_examples"])
    tasks_plan = plan(props, seed=seed, max_examples=m, seed_shards=seed_shards)
    report = _empty_report(backend, profile, max_examples, seed, shard_spec, b, chip)
    by_index: dict = {i: [] for i in range(len(props))}
    t0 = time.perf_counter()
    summary = None
    if client is None:
        done = 0
        for t in tasks_plan:
            by_index[t.index].append(dict(run_task(t, backend, profile, max_examples, b, chip=chip), task=t))
            if len(by_index[t.index]) == t.shards and callable(progress):
                done += 1
                r, _ = merge(sorted(by_index[t.index], key=lambda x: x["task"].shard), seed)
                progress(done, len(props), r)
    else:
        tasks = Tasks(client, "conformance", bool(progress), env=env)
        try:
            for t in tasks_plan:
                tasks.submit(run_task, t, backend, profile, max_examples, b, None, chip, label=f"property-{t.label}",
                             tag=t, priority=_priority(props[t.index]))
            for t, fut in tasks.completed():
                by_index[t.index].append(dict(_task_result(t, fut, backend), task=t))
                del fut
        except BaseException:
            tasks.cancel()
            raise
        finally:
            tasks.close()
        summary = tasks.summary()
    report.results = _finish(props, tasks_plan, by_index, seed, cases_dir)
    report.seconds = time.perf_counter() - t0
    return report, summary


def _priority(prop) -> int:
    """Attention properties first: they take most of a run (ci: three quarters of the time in 15 of 57 properties),
    and a long task started last leaves the other workers idle at the end."""
    return 1 if any("attention" in op and "merge" not in op for op in prop.ops) else 0


def _task_result(t: PropertyTask, fut, backend: str) -> dict:
    """A task's value, or an error verdict when the cluster gave up on it (KilledWorker, retries spent)."""
    from ..conformance.runner import PropertyResult

    try:
        return fut.result()
    except Exception as e:  # noqa: BLE001
        return {"result": PropertyResult(t.name, [], "", backend, "error", seed=t.seed,
                                         message=f"the cluster could not run this property: {type(e).__name__}: {e}"),
                "files": {}}

