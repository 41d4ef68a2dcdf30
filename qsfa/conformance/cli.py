"""``qsfa conformance``: run the property catalogue against a backend (loaded by :mod:`qsfa.cli`).

    qsfa conformance --backend reference
    qsfa conformance --backend npu --ops kv_quant_sparse_flash_attention --profile nightly --seed 7 \\
        --shard 2/8 --report out.json out.md out.xml --cases-dir cases/
    qsfa conformance --list                      # the catalogue
    qsfa conformance --replay cases/npu.kv_quant_sparse_flash_attention.vs_reference.json

Exit status: 0 every selected property passed (or was skipped as not applicable), 1 a property failed, 2 bad
usage, 3 no property failed but one ended in an ERROR (the backend raised, or the run broke: no verdict).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from ..cli import file_arg, seconds_arg
from ..distributed._options import CONFORMANCE_PRELOAD, add_cluster_options, cluster_target, start_early

__all__ = ["register", "main"]


def _split(values):
    out = []
    for v in values or ():
        out += [x for x in str(v).split(",") if x]
    return out


def register(subparsers):
    p = subparsers.add_parser(
        "conformance", help="hypothesis conformance runs of the property catalogue against a backend",
        description="Run qsfa's conformance properties (backend vs reference, and metamorphic relations - the "
                    "rejection of invalid inputs among them: --properties '*.invalid_rejected') "
                    "with hypothesis; print a per-operator table, write reports, save falsifying examples as "
                    "replayable golden case files.")
    p.add_argument("--backend", default=None,
                   help="backend to check (default: reference; with --replay: the backend the case failed on)")
    p.add_argument("--ops", nargs="+", metavar="OP", help="only properties that call these operators")
    p.add_argument("--properties", nargs="+", metavar="NAME",
                   help="only these properties: full names, fnmatch patterns ('*.page_permutation') or families "
                        "('vs_reference')")
    p.add_argument("--kind", nargs="+", choices=("vs_reference", "metamorphic"),
                   help="only properties of these kinds (the invalid-input properties are metamorphic)")
    p.add_argument("--chip", choices=("A2", "A3", "950"),
                   help="model this chip in every call, the backend's and the reference's, and draw examples within its "
                        "limits (default: the backend's device chip - automatic for npu - else each call's own rule; "
                        "docs/numerics/chips.md)")
    p.add_argument("--max-examples", type=int, metavar="N", help="examples per property (default: the profile's)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed (default: the profile's; ci is derandomised)")
    p.add_argument("--profile", choices=("ci", "dev", "nightly"), help="hypothesis profile and size bounds "
                   "(default: QSFA_HYPOTHESIS_PROFILE or ci)")
    p.add_argument("--bound", action="append", metavar="NAME=VALUE",
                   help="override a size bound of the profile, e.g. --bound max_kv_tokens=32 (repeatable)")
    p.add_argument("--shard", metavar="i/n",
                   help="only the selected properties k with k %% n == i (0 <= i < n, as qsfa golden --shard)")
    p.add_argument("--report", nargs="+", action="append", metavar="FILE",
                   help="write reports; the format follows the extension: .json, .md, .xml (JUnit)")
    p.add_argument("--cases-dir", default=None, metavar="DIR",
                   help="where falsifying examples are saved as case files (default: conformance-out/cases)")
    p.add_argument("--triton-interpret", action="store_true",
                   help="set TRITON_INTERPRET=1 (run the Triton kernels in the CPU interpreter)")
    p.add_argument("--list", action="store_true", help="list the selected properties and exit")
    p.add_argument("--replay", metavar="CASE", type=file_arg, help="re-run the property of a saved falsifying example")
    p.add_argument("--time-budget", type=seconds_arg, metavar="SECONDS",
                   help="start no property after this many seconds (the rest are reported as skipped, 'not run'); "
                        "--report files are rewritten after every property, so a timeout keeps them")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    from ..golden.cli import add_standard_options

    add_standard_options(p)
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the backend N times on every example of the vs_reference properties and fail on any "
                        "byte that differs between the runs (determinism; default 1)")
    add_cluster_options(p, verb="run the properties", same="same verdicts, reports and cases as a serial run")
    p.add_argument("--seed-shards", type=int, default=1, metavar="K",
                   help="with --seed: split each property's examples into K runs with seeds derived from it (tasks "
                        "for --workers/--scheduler; a serial run with the same K gives the same results)")
    p.set_defaults(func=main)
    return p


def _usage(msg):
    from ..cli import UsageError

    return UsageError(msg)


#: options a run takes and --replay does not (attribute, flag, value when not given): a replay re-runs the saved
#: case as recorded - its arguments, its chip, qsfa's criterion - so it would ignore them silently
REPLAY_IGNORES = (("ops", "--ops", None), ("properties", "--properties", None), ("kind", "--kind", None),
                  ("chip", "--chip", None), ("max_examples", "--max-examples", None), ("seed", "--seed", None),
                  ("profile", "--profile", None), ("bound", "--bound", None), ("shard", "--shard", None),
                  ("report", "--report", None), ("cases_dir", "--cases-dir", None), ("list", "--list", False),
                  ("time_budget", "--time-budget", None), ("standard", "--standard", None),
                  ("verdict_by", "--verdict-by", None), ("repeat", "--repeat", 1), ("workers", "--workers", None),
                  ("scheduler", "--scheduler", None), ("seed_shards", "--seed-shards", 1))


def replay_ignored(args) -> list[str]:
    """The options of ``args`` that ``--replay`` would not use, as ``--flag value`` strings."""
    out = []
    for attr, flag, unset in REPLAY_IGNORES:
        v = getattr(args, attr, unset)
        if v is None or v is False or v == unset:
            continue
        if isinstance(v, list):  # nargs="+" / action="append" (lists of lists for --report)
            v = " ".join(" ".join(map(str, x)) if isinstance(x, list) else str(x) for x in v)
        out.append(flag if v is True else f"{flag} {v}")
    return out


#: hypothesis' storage folder (its example database, the constants cache ``.hypothesis/constants``), read by
#: hypothesis from this variable where it is set (``hypothesis.configuration.storage_directory``)
STORAGE_VAR = "HYPOTHESIS_STORAGE_DIRECTORY"


@contextlib.contextmanager
def hypothesis_storage():
    """Hypothesis' storage folder for one command: a temporary folder created here and removed, with everything
    hypothesis put in it, when the block ends - so a run leaves no ``.hypothesis/`` in the caller's current
    directory. An explicit ``HYPOTHESIS_STORAGE_DIRECTORY`` is left as it is (hypothesis then uses it). The
    folder is set in this process (``set_hypothesis_home_dir``) and, through the variable, for the processes it
    starts (the workers of a local ``--workers`` cluster); both are restored on exit."""
    try:
        from hypothesis import configuration
    except ImportError:  # qsfa.cli reports the missing extra itself
        yield
        return
    if os.environ.get(STORAGE_VAR):
        yield
        return
    before = getattr(configuration, "__hypothesis_home_directory", None)  # a module global, not name-mangled
    tmp = tempfile.mkdtemp(prefix="qsfa-hypothesis-")
    os.environ[STORAGE_VAR] = tmp
    configuration.set_hypothesis_home_dir(tmp)
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(before)
        os.environ.pop(STORAGE_VAR, None)
        shutil.rmtree(tmp, ignore_errors=True)


def main(args) -> int:
    with hypothesis_storage():
        return _main(args)


def _main(args) -> int:
    if args.triton_interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    if not args.replay and not args.list:
        start_early(args, CONFORMANCE_PRELOAD)  # the workers' imports overlap selecting the properties here
    from .._dispatch import get_backend, operators
    from ..strategies import Bounds, bounds as profile_bounds
    from . import reports as R
    from .properties import select
    from .runner import DEFAULT_CASES_DIR, EXIT_ERROR, parse_shard, replay_case, run_conformance

    if args.replay:
        ignored = replay_ignored(args)
        if ignored:
            raise _usage(f"Invalid option for --replay, actual: {', '.join(ignored)}, reason: a replay re-runs the "
                         "saved case as recorded (its arguments, its chip, qsfa's criterion); it takes only --backend, "
                         "--backend-module, --triton-interpret and -q.")
        if not os.path.exists(args.replay):
            raise _usage(f"Invalid value for --replay, actual: {args.replay!r}, reason: no such file.")
        from ..golden.io import GoldenInputError

        try:
            holds, msg = replay_case(args.replay, args.backend)
        except GoldenInputError as e:  # a corrupt case file is bad usage (2), not a reproduced failure (1)
            text = " ".join(str(e).split())  # names the file (the case, its sidecar or an input), field, value, reason
            stem = os.path.splitext(os.path.basename(args.replay))[0]
            raise _usage(text if stem in text else f"--replay {args.replay}: {text}") from None
        print(msg)
        return 0 if holds else EXIT_ERROR if holds is None else 1

    ops = _split(args.ops)
    unknown = sorted(set(ops) - set(operators()))
    if unknown:
        raise _usage(f"Invalid value for --ops, actual: {', '.join(unknown)}, reason: unknown operator "
                     f"(known: {', '.join(sorted(operators()))}).")
    pats = _split(args.properties)
    props = select(ops=ops or None, properties=pats or None, kinds=args.kind)
    if not props:
        raise _usage("Invalid value for --ops/--properties/--kind, actual: "
                     f"{' '.join(ops + pats + (args.kind or []))!r}, reason: no property matches.")
    if args.list:
        for p in props:
            print(f"{p.name:60s} {p.kind:12s} {' + '.join(p.ops)}")
        return 0
    if args.profile is None:  # the environment's profile: a bad QSFA_HYPOTHESIS_PROFILE is bad usage
        from .._profiles import ProfileError, active_profile

        try:
            active_profile()
        except ProfileError as e:
            raise _usage(str(e)) from None
    if args.max_examples is not None and args.max_examples < 1:
        raise _usage(f"Invalid value for --max-examples, actual: {args.max_examples}, reason: must be >= 1.")
    if args.seed is not None and args.seed < 0:
        raise _usage(f"Invalid value for --seed, actual: {args.seed}, reason: must be >= 0.")
    if args.verdict_by is not None:
        from ..standards import needed_references

        need = needed_references(args.verdict_by)
        if need:
            raise _usage(f"Invalid value for --verdict-by, actual: {args.verdict_by!r}, reason: it needs "
                         f"{' and '.join(need)} outputs, which a conformance run does not have, so it would judge "
                         "no output.")
    shard = None
    if args.shard:
        try:
            shard = parse_shard(args.shard)
        except ValueError as e:
            raise _usage(str(e)) from None
    reports = [f for group in (args.report or []) for f in group]
    for f in reports:
        if os.path.splitext(f)[1].lower() not in R.REPORT_FORMATS:
            raise _usage(f"Invalid value for --report, actual: {f!r}, reason: the extension must be one of "
                         f"{', '.join(sorted(R.REPORT_FORMATS))}.")
    b = profile_bounds(args.profile)
    if args.bound:
        kw = b.to_dict()
        for item in args.bound:
            name, _, value = item.partition("=")
            try:  # a negative number is an integer: Bounds says the range ("-3" used to get the syntax message)
                number = int(value)
            except ValueError:
                number = None
            if name not in kw or number is None:
                raise _usage(f"Invalid value for --bound, actual: {item!r}, reason: must be NAME=INTEGER with NAME "
                             f"one of {', '.join(kw)}.")
            kw[name] = number
        try:
            b = Bounds(**kw)
        except ValueError as e:
            raise _usage(str(e)) from None

    get_backend(args.backend or "reference")  # unknown / unusable backend: one line, exit 2 (qsfa.cli)
    if args.repeat < 1:
        raise _usage(f"Invalid value for --repeat, actual: {args.repeat}, reason: must be >= 1.")
    judged = bool(args.standard or args.verdict_by or args.repeat != 1)
    if args.workers is not None or args.scheduler is not None or args.seed_shards != 1:
        if judged:
            raise _usage("Invalid value for --standard / --verdict-by / --repeat, actual: "
                         f"{' '.join(args.standard or []) or args.verdict_by or args.repeat}, reason: not supported "
                         "with --workers / --scheduler / --seed-shards (run them serially).")
        if args.time_budget is not None:
            raise _usage("Invalid value for --time-budget, actual: "
                         f"{args.time_budget}, reason: not supported with --workers / --scheduler / --seed-shards.")
        return _main_sharded(args, props, shard, b, reports)

    max_examples = args.max_examples
    budget = interpreter_budget(args)
    if budget is not None:
        from .. import _edges

        b, max_examples = budget
        _edges.ENABLED = False  # edge examples exceed the tiny bounds (rows of > 256 tokens): minutes each here
        if not args.quiet:
            print(f"Triton interpreter: tiny shapes ({', '.join(f'{k}={v}' for k, v in b.to_dict().items())}), "
                  f"{max_examples} examples per property, no edge examples; --bound / --max-examples override",
                  flush=True)

    from .runner import ConformanceReport, _backend_modules

    backend_modules = list(args.backend_module or []) or _backend_modules(args.backend or "reference")
    replay = ConformanceReport(args.backend or "reference", "", None, 0, None, {}, "",
                               backend_modules=backend_modules,
                               env={"TRITON_INTERPRET": "1"} if os.environ.get("TRITON_INTERPRET") == "1" else {}
                               ).replay_command

    def progress(k, total, r):
        if not args.quiet:
            print(R.format_progress(k, total, r, replay), flush=True)

    if args.time_budget is not None and args.time_budget < 0:
        raise _usage(f"Invalid value for --time-budget, actual: {args.time_budget}, reason: must be >= 0.")

    def incremental(rep):  # a run stopped by a timeout keeps the reports of what it finished
        for f in reports:
            base, ext = os.path.splitext(f)
            tmp = base + ".partial" + ext
            R.write_report(rep, tmp)
            os.replace(tmp, f)

    from ..golden.cli import _standard_names
    from ._support import judging

    with judging(_standard_names(args.standard), args.verdict_by, args.repeat):
        report = run_conformance(args.backend or "reference", props=props, profile=args.profile,
                                 max_examples=max_examples, seed=args.seed, shard_spec=shard,
                                 cases_dir=args.cases_dir or DEFAULT_CASES_DIR, bounds=b, progress=progress,
                                 chip=args.chip, time_budget=args.time_budget,
                                 on_result=incremental if reports else None, backend_modules=backend_modules)
    print()
    print(R.format_table(report))
    for f in reports:
        R.write_report(report, f)
        print(f"wrote {f}")
    return report.exit_status



def interpreter_budget(args):
    """``(bounds, max_examples)`` for a triton run in the CPU interpreter without --bound / --max-examples
    (tiny shapes, few examples: :data:`qsfa._profiles.INTERPRETER_BOUNDS`), else None."""
    if not (args.backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1" and not args.bound
            and args.max_examples is None):
        return None
    from .._profiles import INTERPRETER_BOUNDS, INTERPRETER_EXAMPLES, PROFILES, active_profile
    from ..strategies import Bounds

    prof = args.profile or active_profile()
    return Bounds(**INTERPRETER_BOUNDS), min(INTERPRETER_EXAMPLES[prof], PROFILES[prof]["max_examples"])


def _main_sharded(args, props, shard, bounds, reports) -> int:
    """--workers / --scheduler / --seed-shards: (property x seed shard) tasks (qsfa.distributed.conformance)."""
    from .. import distributed as D
    from .._profiles import PROFILES, active_profile
    from . import reports as R
    from .runner import DEFAULT_CASES_DIR, shard as shard_props

    profile = args.profile or active_profile()
    m = args.max_examples if args.max_examples is not None else PROFILES[profile]["max_examples"]
    env = {"TRITON_INTERPRET": "1"} if args.triton_interpret else {}
    try:
        from ..distributed.conformance import check_seed_shards, run_sharded

        check_seed_shards(args.seed_shards, args.seed, m)
        selected = shard_props(props, *shard) if shard else props
        kw = dict(profile=args.profile, max_examples=args.max_examples, seed=args.seed, seed_shards=args.seed_shards,
                  shard_spec=shard, bounds=bounds, cases_dir=args.cases_dir or DEFAULT_CASES_DIR, chip=args.chip)
        if args.workers is None and args.scheduler is None:
            def progress(k, total, r):
                if not args.quiet:
                    print(R.format_progress(k, total, r), flush=True)

            report, summary = run_sharded(selected, args.backend or "reference", progress=progress, **kw)
        else:
            where = cluster_target(args)
            # a local cluster's workers store hypothesis' files where this process does (hypothesis_storage)
            local = {k: os.environ[k] for k in (STORAGE_VAR,) if args.workers is not None and k in os.environ}
            with D.connect(**where, env={**env, **local}, same_code=("hypothesis", "numpy"),
                           preload=CONFORMANCE_PRELOAD) as client:
                report, summary = run_sharded(selected, args.backend or "reference", progress=not args.quiet,
                                              client=client, env=env, **kw)
    except (D.ClusterUsageError, D.DistributedUnavailable) as e:
        raise _usage(str(e)) from None
    if args.backend_module:  # the replay commands of the reports
        report.backend_modules = list(args.backend_module)
    print()
    print(R.format_table(report))
    if summary is not None:
        print(summary.line())
    for f in reports:
        R.write_report(report, f)
        print(f"wrote {f}")
    return report.exit_status
