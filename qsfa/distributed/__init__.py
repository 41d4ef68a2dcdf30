"""Golden sets and conformance runs on a Dask cluster (the ``qsfa[distributed]`` extra).

    qsfa golden generate --set seed-rope0 --out golden/ --workers 8          # a local cluster of 8 processes
    qsfa golden generate --set seed-rope0 --out golden/ --scheduler tcp://head:8786
    qsfa conformance --profile nightly --seed 7 --seed-shards 16 --scheduler tcp://head:8786 --report r.json

* :func:`connect` - a ``distributed.Client`` of a new ``LocalCluster`` (N processes, one thread each, forked from
  a fork server that imported qsfa once - :func:`prestart`; closed on exit, Ctrl-C included) or of a running
  scheduler.
* :class:`GoldenExecutor` - the ``executor`` of :func:`qsfa.golden.generate`: tasks are cases and row ranges of
  long attention cases; the client writes a directory byte-identical to a serial run's.
* :func:`run_sharded` - conformance tasks are (property x seed shard); verdicts, reports and falsifying cases
  as a serial run with the same seeds.
* :class:`RunSummary` - tasks, workers, and the tasks that ran again after a worker died or an attempt raised.

Workers need qsfa (and, for conformance, hypothesis) importable; see docs/scaling.md for clusters on Slurm
and Kubernetes. This module imports ``distributed`` and ``tqdm`` lazily: :func:`require` says what to install.
"""

from ._cluster import (INSTALL_HINT, RETRIES, ClusterUsageError, DistributedUnavailable, RunSummary, Tasks,
                       check_workers, connect, prestart, require)

__all__ = [
    "INSTALL_HINT",
    "RETRIES",
    "ClusterUsageError",
    "DistributedUnavailable",
    "GoldenExecutor",
    "RunSummary",
    "Tasks",
    "check_workers",
    "connect",
    "prestart",
    "require",
    "run_sharded",
]


def __getattr__(name):
    if name == "GoldenExecutor":
        from .golden import GoldenExecutor

        return GoldenExecutor
    if name == "run_sharded":
        from .conformance import run_sharded

        return run_sharded
    raise AttributeError(f"module 'qsfa.distributed' has no attribute {name!r}")
