"""``qsfa golden generate | verify | compare | list`` (registered by ``qsfa.cli``).

Exit status: 0 success (generate wrote the set; verify: OK; compare: PASS), 1 a verdict of FAIL (values
differ: compare found a mismatch, verify --recompute found an output that no longer holds), 2 the tool's
input is unusable - bad usage, a missing, unreadable or changed file, a malformed or empty manifest, nothing
to generate - reported as one line on stderr, 3 ERROR (compare --chain: the backend under test raised when
a failing link was re-run on it, so that link has no verdict; as ``qsfa conformance``).
"""

from __future__ import annotations

import fnmatch
import os
import sys

from ..cli import file_arg, folder_arg
from ..distributed import ClusterUsageError, DistributedUnavailable
from ..distributed._options import GOLDEN_PRELOAD, add_cluster_options, cluster_target, start_early
from .io import GoldenInputError

HELP = "golden tensor case sets: generate, verify, compare, list"


def _usage_error(e: Exception):
    """One line on stderr, whatever the message holds (paths and values may carry newlines)."""
    from ..cli import UsageError

    if isinstance(e, OSError) and e.strerror:
        text = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    else:
        text = str(e)
    return UsageError(text.replace("\r", "\\r").replace("\n", "\\n"))


def _check_case_op(case, path: str) -> None:
    """A case file names an operator of this build (a set may hold cases for operators another build has:
    those are skipped; a single case file that cannot run is bad input)."""
    from .case import available_ops
    from .guard import field_error

    if case.op not in available_ops():
        raise field_error(path, "op", case.op, "not an operator of this build of qsfa (qsfa.operators() lists "
                          "them)", kind="case field")


def _warn_replaced(replaced: dict, out: str, stream) -> None:
    """One line when the run removed cases of the set that was in ``--out`` (they are not in this run)."""
    gone = replaced.get("cases") or []
    if not gone:
        return
    from .manifest import plural

    of = f" of set {replaced['set']}" if replaced.get("set") else ""
    shown = ", ".join(gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else "")
    print(f"warning: {out} held {plural(len(gone), 'case')}{of} that this run does not write; they were "
          f"removed with the previous manifest: {shown} (give each set its own --out to keep both)", file=stream)


def _cmd_generate(args) -> int:
    from .case import Case
    from .catalogue import get_set
    from .manifest import generate, parse_shard, plural, select_shard

    replaced: dict = {}
    try:
        start_early(args, GOLDEN_PRELOAD)  # the workers' imports overlap the rest of the preparation here
        cluster = _cluster_options(args)
        shard = parse_shard(args.shard)
        if args.set:
            cases = get_set(args.set).cases()
            label = args.set
        else:
            case = Case.load(args.case, allow_outside_inputs=args.allow_outside_inputs)
            _check_case_op(case, args.case)
            cases = [case]
            label = None
        if args.only:
            cases = [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in args.only)]
            if not cases:
                raise GoldenInputError(f"no case of {label or args.case} matches --only {' '.join(args.only)}")
        cases = [c.for_chip(args.chip) for c in cases]
        selected = select_shard(cases, *shard)
        if not selected:
            raise GoldenInputError(f"--shard {args.shard}: no case of the {plural(len(cases), 'selected case')} "
                                   "falls in this shard (case k goes to shard k % n)")
        summary = None
        if cluster is None:
            man = generate(selected, args.out, file_format=args.format, set_name=label, shard=shard,
                           progress=not args.quiet, replaced=replaced)
        else:
            from ..distributed import GoldenExecutor, connect

            with connect(**cluster, preload=GOLDEN_PRELOAD) as client:
                ex = GoldenExecutor(client, chunk_rows=args.chunk_rows, progress=not args.quiet)
                man = generate(selected, args.out, file_format=args.format, set_name=label, shard=shard,
                               executor=ex, replaced=replaced)
                summary = ex.summary
    except (GoldenInputError, ClusterUsageError, DistributedUnavailable, OSError) as e:
        raise _usage_error(e) from None
    n = len(man["cases"])
    files = sum(len(c["files"]) for c in man["cases"])
    what = f"set {args.set}" if args.set else args.case
    shard_txt = f" (shard {shard[0]}/{shard[1]} of {plural(len(cases), 'case')})" if shard[1] > 1 else ""
    print(f"wrote {plural(n, 'case')}, {plural(files, 'file')} and manifest.json to {args.out} from {what}{shard_txt}")
    if summary is not None:
        print(summary.line())
    for s in man["skipped"]:
        print(f"skipped {s['name']}: {s['reason']}", file=sys.stderr)
    _warn_replaced(replaced, args.out, sys.stderr)
    return 0


def _cluster_options(args) -> dict | None:
    """``connect()`` keywords for ``--workers`` / ``--scheduler`` (None: run here); checks the extra is installed."""
    if args.workers is None and args.scheduler is None:
        if args.chunk_rows is not None:
            raise GoldenInputError("--chunk-rows needs --workers or --scheduler")
        return None
    if args.chunk_rows is not None and args.chunk_rows < 0:
        raise ClusterUsageError(f"Invalid value for --chunk-rows, actual: {args.chunk_rows}, reason: must be >= 0.")
    return cluster_target(args)


def _cmd_verify(args) -> int:
    from .manifest import plural
    from .verify import verify

    try:
        rep = verify(args.dir, recompute=args.recompute, progress=not args.quiet)
    except (GoldenInputError, OSError) as e:
        raise _usage_error(e) from None
    for line in rep.lines():
        print(line)
    what = f"{plural(rep.cases, 'case')}, {plural(rep.files, 'file')}" + (
        f", {rep.recomputed} recomputed" if args.recompute else "")
    if rep.ok:
        print(f"OK {args.dir}: {what}")
        return 0
    if rep.errors:  # unusable: one line, the first error (the others are on stdout)
        besides = f" (and {plural(len(rep.failures), 'failure')})" if rep.failures else ""
        noun = "chain record problem" if rep.errors[0].startswith("chains: ") else "file problem"
        raise _usage_error(GoldenInputError(
            f"{args.dir}: {plural(len(rep.errors), noun)}{besides} in {what}; first: {rep.errors[0]}"))
    print(f"verify {args.dir}: FAIL: {plural(len(rep.failures), 'failure')} in {what}; first: {rep.failures[0]}",
          file=sys.stderr)
    return 1


def _check_destination(option: str, path: str) -> None:
    """An output file of compare (``--json``, ``--histogram``) must be writable before any work is done: its
    folder exists and is writable, and the path is not a folder."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise GoldenInputError(f"Invalid value for {option}, actual: {path!r}, reason: it is a directory; name "
                               "a file.")
    if not os.path.isdir(folder):
        raise GoldenInputError(f"Invalid value for {option}, actual: {path!r}, reason: its folder {folder} does "
                               "not exist.")
    if not os.access(folder, os.W_OK):
        raise GoldenInputError(f"Invalid value for {option}, actual: {path!r}, reason: its folder {folder} is "
                               "not writable.")


def _cmd_compare_chain(args) -> int:
    """``compare --chain``: DIR is a chain set (manifest with "chains", qsfa.golden.chain) or a chain's folder
    (chain.json + tensors, qsfa.chain.write_chain_golden); --actual the backend's intermediates (same names)."""
    from ..chain import ChainError, compare_chain_dirs
    from .chain import compare_chain, format_chain_report

    unsupported = [o for o, v in (("--output", args.output), ("--histogram", args.histogram),
                                  ("--standard", args.standard), ("--verdict-by", args.verdict_by)) if v]
    if unsupported:
        raise _usage_error(GoldenInputError(f"--chain judges every output of every link: {unsupported[0]} "
                                            "does not apply (compare one link's case without --chain)"))
    if args.backend == "reference":
        raise _usage_error(GoldenInputError(
            "--backend reference: fed with the golden inputs the reference reproduces the golden by construction, "
            "so it cannot tell a link's own error from a propagated one; name the backend under test (without "
            "--backend such links are undecided)"))
    if os.path.isfile(os.path.join(args.dir, "chain.json")):
        if args.json or args.case:
            raise _usage_error(GoldenInputError("--json and --case apply to a chain set (a golden directory with a "
                                                "manifest); this is a chain folder (chain.json)"))
        try:
            rep = compare_chain_dirs(args.dir, args.actual, rerun_backend=args.backend)
        except (ChainError, OSError, ValueError) as e:
            raise _usage_error(e) from None
        text = str(rep)
        print(text.rsplit("\n", 1)[-1] if args.quiet else text)
        return 0 if rep.passed else 3 if rep.errored else 1
    try:
        if args.json:
            _check_destination("--json", args.json)
        rep = compare_chain(args.dir, args.actual, backend=args.backend, instances=args.case)
        if args.json:
            import json

            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(rep.to_dict(), f, indent=1, sort_keys=True, allow_nan=False)
                f.write("\n")
    except (GoldenInputError, OSError) as e:
        raise _usage_error(e) from None
    text = format_chain_report(rep)
    print(text.rsplit("\n", 1)[-1] if args.quiet else text)
    return 0 if rep.passed else 3 if rep.errored else 1


def _cmd_compare(args) -> int:
    from .compare import compare_dir, format_report, matplotlib_available, write_histogram, write_json

    if getattr(args, "chain", False):
        return _cmd_compare_chain(args)
    if getattr(args, "backend", None):
        raise _usage_error(GoldenInputError("--backend re-runs the links of a chain: it needs --chain"))

    if args.histogram and not matplotlib_available():
        raise _usage_error(GoldenInputError(
            "--histogram needs matplotlib, which is not installed: pip install 'qsfa[plot]'"))
    try:
        for option, path in (("--json", args.json), ("--histogram", args.histogram)):
            if path:
                _check_destination(option, path)
        rep = compare_dir(args.dir, args.actual, cases=args.case, outputs=args.output,
                          keep_errors=bool(args.histogram), standards=_standard_names(args.standard),
                          verdict_by=args.verdict_by)
        if args.json:
            write_json(rep, args.json)
        if args.histogram:
            write_histogram(rep, args.histogram)
    except (GoldenInputError, OSError) as e:
        raise _usage_error(e) from None
    text = format_report(rep)
    print(text.rsplit("\n", 1)[-1] if args.quiet else text)
    return 0 if rep.final_passed else 1


def _standard_names(given):
    """--standard values (repeatable, "all" allowed) as compare_dir takes them."""
    if not given:
        return None
    return "all" if "all" in given else list(given)


def add_standard_options(p):
    """--standard / --verdict-by (golden compare and conformance; docs/numerics/comparison.md#standards)."""
    from ..standards import STANDARD_NAMES

    p.add_argument("--standard", action="append", choices=STANDARD_NAMES + ("all",), metavar="NAME",
                   help="also judge by an acceptance standard (repeatable, or 'all'): "
                        + ", ".join(STANDARD_NAMES) + "; reported beside qsfa's verdict")
    p.add_argument("--verdict-by", choices=STANDARD_NAMES, metavar="NAME",
                   help="let this standard's verdict set the exit status instead of qsfa's strict one")


def _cmd_list(args) -> int:
    from .case import available_ops
    from .catalogue import case_sets, get_set

    ops = available_ops()
    if args.set:
        try:
            s = get_set(args.set)
        except GoldenInputError as e:
            raise _usage_error(e) from None
        print(f"{s.name}: {s.description}")
        for c in s.cases():
            mark = "" if c.op in ops else "   [operator not in this build]"
            print(f"  {c.name:40s} {c.op:32s} {c.description}{mark}")
        return 0
    sets = case_sets()
    width = max(len(n) for n in sets)
    for name, s in sets.items():
        cases = s.cases()
        missing = sorted({c.op for c in cases if c.op not in ops})
        note = f" [{sum(c.op not in ops for c in cases)} need {', '.join(missing)}: not in this build]" if missing else ""
        print(f"{name:{width}s}  {len(cases):4d} cases  {s.description}{note}")
    return 0


def register(subparsers):
    """Add ``golden`` and its subcommands to the ``qsfa`` parser."""
    g = subparsers.add_parser("golden", help=HELP, description=HELP)
    sub = g.add_subparsers(dest="golden_command", metavar="SUBCOMMAND")

    def no_subcommand(args) -> int:
        g.print_help(sys.stderr)
        return 2

    g.set_defaults(func=no_subcommand)

    p = sub.add_parser("generate", help="write the inputs, reference outputs and manifest of a case set or case")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--set", help="a catalogue case set (see `qsfa golden list`)")
    src.add_argument("--case", type=file_arg,
                     help="a case file (qsfa-case/1 JSON), e.g. a saved conformance counterexample")
    p.add_argument("--out", required=True, type=folder_arg,
                   help="output directory (new, empty, or a previous golden directory)")
    p.add_argument("--format", choices=("bin", "npz"), default="bin",
                   help="bin: raw little-endian files + JSON (default); npz: one .npz per case")
    p.add_argument("--only", action="append", metavar="PATTERN",
                   help="only the cases whose names match (glob; repeatable), e.g. --only 'decode-*'")
    p.add_argument("--chip", choices=("A2", "A3", "950"),
                   help="model this chip's limits and rounding points in every case (default: each case's own "
                        "chip rule, recorded per case in the manifest as \"chip\"); cases the chip cannot run are "
                        "skipped and listed")
    p.add_argument("--shard", metavar="i/n", help="only cases k with k %% n == i (0 <= i < n), after --only")
    p.add_argument("--allow-outside-inputs", action="store_true",
                   help="with --case: let the case file name input files outside its own folder (absolute "
                        "paths, '..', symbolic links out); refused by default")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    add_cluster_options(p, verb="compute", same="the written set is byte-identical to a serial run's")
    p.add_argument("--chunk-rows", type=int, metavar="N",
                   help="with --workers/--scheduler: query rows per task of a long attention case (default: about "
                        "8M row x head x token units per task; 0: one task per case)")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("verify", help="check checksums (and, with --recompute, the outputs) of a golden directory")
    p.add_argument("dir", help="golden directory (holds manifest.json)")
    p.add_argument("--recompute", action="store_true", help="recompute every output from its inputs (reference)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("compare", help="compare a kernel's outputs with a golden directory")
    p.add_argument("dir", help="golden directory (holds manifest.json)")
    p.add_argument("--actual", required=True, metavar="FILE_OR_DIR",
                   help="the kernel's outputs: a directory laid out like the golden one, an .npz, or one .bin/.npy")
    p.add_argument("--case", action="append", metavar="PATTERN", help="only cases matching (glob; repeatable)")
    p.add_argument("--output", action="append", metavar="PATTERN", help="only outputs matching (glob; repeatable)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    p.add_argument("--histogram", metavar="OUT.png", help="also write an error histogram (needs matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only the verdict line, not the table and the worst elements")
    add_standard_options(p)
    p.add_argument("--chain", action="store_true",
                   help="DIR is a chain set (manifest with chains) or a chain's golden (chain.json + tensors, "
                        "qsfa.chain): compare link by link in chain order and name the first failing link, own error "
                        "or propagated (--case selects a set's instances)")
    p.add_argument("--backend", metavar="NAME",
                   help="with --chain: re-run each failing link on this backend (the one under test, not the "
                        "reference) fed with the golden inputs; without it a failing link whose inputs already "
                        "differed is undecided")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("list", help="the case sets (or the cases of one set)")
    p.add_argument("set", nargs="?", help="list this set's cases")
    p.set_defaults(func=_cmd_list)
    return g
