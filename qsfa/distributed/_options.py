"""The ``--workers N | --scheduler ADDRESS`` options of ``qsfa golden generate`` and ``qsfa conformance``.

One definition for both commands: the same flags, help text, validation and exit status 2 with what to install
when the ``qsfa[distributed]`` extra is missing. Importing this module imports neither dask nor tqdm.
"""

from __future__ import annotations

from ._cluster import INSTALL_HINT, check_workers, prestart, require

__all__ = ["add_cluster_options", "cluster_target", "start_early", "GOLDEN_PRELOAD", "CONFORMANCE_PRELOAD"]

FLAGS = "--workers/--scheduler"

#: the modules the tasks of each command import on a worker (:func:`~qsfa.distributed.prestart`)
GOLDEN_PRELOAD = ("qsfa.golden.manifest", "qsfa.golden.generators", "qsfa.distributed.golden")
CONFORMANCE_PRELOAD = ("hypothesis", "qsfa.conformance.properties", "qsfa.conformance.runner",
                       "qsfa.distributed.conformance")


def add_cluster_options(parser, *, verb: str, same: str):
    """Add the mutually exclusive ``--workers`` / ``--scheduler`` to ``parser`` (an argparse parser or group).

    ``verb``: what the command does there, e.g. "compute"; ``same``: what equals a serial run, e.g. "the written
    set is byte-identical to a serial run's". Returns the group."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, metavar="N",
                       help=f"{verb} on a new local Dask cluster of N processes ({INSTALL_HINT}); {same}")
    where.add_argument("--scheduler", metavar="ADDRESS",
                       help=f"{verb} on a running Dask cluster, e.g. tcp://host:8786 (workers need qsfa)")
    return where


def cluster_target(args) -> dict | None:
    """:func:`~qsfa.distributed.connect` keywords for the parsed options: ``{"workers": N}``, ``{"scheduler":
    ADDRESS}``, or None (neither given: run in this process). Raises
    :class:`~qsfa.distributed.DistributedUnavailable` (naming the flags and what to install) without the extra,
    and :class:`~qsfa.distributed.ClusterUsageError` for ``--workers`` below 1."""
    if args.workers is None and args.scheduler is None:
        return None
    require(FLAGS)
    if args.workers is not None:
        return {"workers": check_workers(args.workers)}
    return {"scheduler": args.scheduler}


def start_early(args, preload: tuple) -> bool:
    """With ``--workers N``: start the local cluster's fork server now (:func:`~qsfa.distributed.prestart`), so
    that it imports ``preload`` while the command still reads its input. Never raises: a bad value or a missing
    extra is reported later, by :func:`cluster_target`."""
    w = getattr(args, "workers", None)
    if isinstance(w, int) and not isinstance(w, bool) and w >= 1 and getattr(args, "scheduler", None) is None:
        return prestart(preload)
    return False
