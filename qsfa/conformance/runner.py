"""Run conformance properties against a backend with hypothesis; save falsifying examples as golden cases.

:func:`run_property` runs one :class:`~qsfa.conformance.properties.Property` on one backend and returns a
:class:`PropertyResult`; :func:`run_conformance` runs a selection (optionally one shard of it) and returns a
:class:`ConformanceReport`. Both are what ``qsfa conformance`` and ``tests/test_conformance_*.py`` call.

Determinism: hypothesis' example database is off. Without a seed the profile decides (``ci`` is
derandomised: the same examples on every run and machine); with ``seed`` every property runs with
``hypothesis.seed(f(seed, property name))``, so a run is reproduced by its seed.

Falsifying examples: hypothesis shrinks a failure and replays the minimal example last; that replay's
arguments are saved (:func:`save_case`) as a ``qsfa-case/1`` file with explicit inputs
(:class:`qsfa.golden.Case`), replayable with ``qsfa golden generate --case FILE`` (the operator on the
reference) and with :func:`replay_case` / ``qsfa conformance --replay FILE`` (the property itself, on any
backend). Beside it, ``<name>.conformance.json`` records the property, backend, seed, failure message and
what the case format cannot hold (non-finite parameters, the constraint of an invalid-argument example).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np

from .._contract import Args
from .._errors import UnsupportedByBackend
from ._support import BackendRaised, helpers_on_reference, modelling_chip, start_tally
from .properties import Example, Property, catalogue

__all__ = [
    "PropertyResult",
    "ConformanceReport",
    "run_property",
    "run_conformance",
    "shard",
    "parse_shard",
    "save_case",
    "replay_case",
    "settings_for",
    "DEFAULT_CASES_DIR",
]

DEFAULT_CASES_DIR = os.path.join("conformance-out", "cases")
SIDE_FORMAT = "qsfa-conformance-case/1"
CASE_SAVE_ERROR = "could not save the case file:"  # the line the runner adds to a failure's message (reports)


@dataclass
class PropertyResult:
    """The outcome of one property on one backend.

    status: "passed", "failed" (a falsifying example was found), "skipped" (not applicable here: the
    backend lacks an operator, the chip cannot run the property - ``not_applicable``, decided before anything is
    drawn - or no drawn example fits the backend's limits) or "error" (no verdict: the backend raised instead of
    returning - the example is saved like a failure's - or the run itself broke; docs/conformance.md#verdicts).
    examples: calls of the check (passed + failed + errors; shrinking steps included); errors: calls where the
    backend raised (no verdict; counted apart from failed); rejected: draws the backend declined
    (UnsupportedByBackend) or that did not fit its limits.
    """

    property: str
    ops: list
    kind: str
    backend: str
    status: str
    examples: int = 0
    passed: int = 0
    failed: int = 0
    rejected: int = 0
    seconds: float = 0.0
    message: str = ""
    falsifying_example: dict | None = None
    case_file: str | None = None
    reproduce: str | None = None
    seed: int | None = None
    doc: str = ""
    chip: str | None = None  # the chip every call modelled (None: each call's own rule; docs/numerics/chips.md)
    edge_examples: int = 0  # explicit edge examples (qsfa._edges) run before the max_examples random ones
    standards: dict = field(default_factory=dict)  # --standard: {name: {"judged", "failed", "first_failure"}}
    not_applicable: bool = False  # skipped before drawing: the chip cannot run it (qsfa.strategies.chips)
    errors: int = 0  # calls where the backend raised (BackendRaised): no verdict, not counted as failed

    @property
    def op(self) -> str:
        return self.ops[0]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ConformanceReport:
    backend: str
    profile: str
    seed: int | None
    max_examples: int
    shard: str | None
    bounds: dict
    started: str
    seconds: float = 0.0
    versions: dict = field(default_factory=dict)
    results: list = field(default_factory=list)
    backend_modules: list = field(default_factory=list)  # --backend-module imports the backend needs (replay)
    env: dict = field(default_factory=dict)  # environment the backend ran under that a replay needs

    def replay_command(self, case_file: str) -> str:
        """The shell command that replays ``case_file`` on this run's backend."""
        env = "".join(f"{k}={v} " for k, v in sorted(self.env.items()))
        mods = "".join(f" --backend-module {m}" for m in self.backend_modules)
        return f"{env}qsfa conformance{mods} --replay {case_file}"

    @property
    def summary(self) -> dict:
        out = {"properties": len(self.results)}
        for s in ("passed", "failed", "skipped", "error"):
            out[s] = sum(1 for r in self.results if r.status == s)
        out["not_applicable"] = sum(1 for r in self.results if getattr(r, "not_applicable", False))
        out["examples"] = sum(r.examples for r in self.results)
        return out

    @property
    def ok(self) -> bool:
        return not any(r.status in ("failed", "error") for r in self.results)

    @property
    def exit_status(self) -> int:
        """0 passed (or skipped), 1 a property failed, 3 no failure but an ERROR (a backend raised, a run
        broke): a crash is never counted as a found bug (docs/conformance.md#verdicts)."""
        return exit_status(r.status for r in self.results)

    def to_dict(self) -> dict:
        return {
            "format": "qsfa-conformance/1",
            "backend": self.backend,
            "profile": self.profile,
            "seed": self.seed,
            "max_examples": self.max_examples,
            "shard": self.shard,
            "bounds": self.bounds,
            "started": self.started,
            "seconds": round(self.seconds, 3),
            "versions": self.versions,
            "summary": self.summary,
            "ok": self.ok,
            "results": [r.to_dict() for r in self.results],
            "backend_modules": list(self.backend_modules),
            "env": dict(self.env),
        }


#: exit status of a run whose worst verdict is FAIL / ERROR (``qsfa conformance``; 2 is bad usage)
EXIT_FAILED, EXIT_ERROR = 1, 3


def exit_status(statuses) -> int:
    """The exit status of a run with these property statuses: 1 if any failed, else 3 if any errored, else 0."""
    statuses = set(statuses)
    return EXIT_FAILED if "failed" in statuses else EXIT_ERROR if "error" in statuses else 0


# ---------------------------------------------------------------------------------------------------
# sharding


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n, as ``qsfa golden generate --shard``) -> ``(i, n)``; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not m or not (0 <= int(m.group(1)) < int(m.group(2))):
        raise ValueError(f"Invalid value for --shard, actual: {text!r}, reason: must be i/n with 0 <= i < n.")
    return int(m.group(1)), int(m.group(2))


def shard(props: list, i: int, n: int) -> list:
    """Shard ``i`` of ``n`` (0 <= i < n) of a property list: the properties k with ``k % n == i`` (the rule
    of ``qsfa golden generate --shard``), so the shards partition the list and each mixes operators."""
    return props[i::n]


# ---------------------------------------------------------------------------------------------------
# hypothesis settings


def settings_for(profile: str | None = None, *, max_examples: int | None = None, seed: int | None = None) -> dict:
    """Keyword arguments for ``hypothesis.settings`` of a run: the profile's, no example database, one
    reported failure per property, every health check that a filtered strategy may trip suppressed."""
    from hypothesis import HealthCheck, Phase

    from .._profiles import PROFILES, active_profile

    name = profile or active_profile()
    if name not in PROFILES:
        raise ValueError(f"Invalid value for profile, actual: {name!r}, reason: must be one of {sorted(PROFILES)}.")
    kw = dict(PROFILES[name])
    if max_examples is not None:
        kw["max_examples"] = int(max_examples)
    if seed is not None:
        kw["derandomize"] = False
    kw.update(database=None, report_multiple_bugs=False, suppress_health_check=list(HealthCheck), print_blob=True,
              # no explain phase: it re-runs the shrunk failure many times to annotate which parts of it matter, and
              # the report is built from the failure itself (message, example, reproduce line), never from that
              phases=tuple(p for p in Phase if p is not Phase.explain))
    return kw


def _property_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


# ---------------------------------------------------------------------------------------------------
# running one property


#: Seconds hypothesis may spend shrinking one property's first failure. After that every new candidate the
#: shrinker proposes is skipped (counted as passing, not run), so it stops at the smallest failure found so far
#: and replays that one; without a cap hypothesis shrinks silently for up to 5 minutes per property.
SHRINK_SECONDS = 20.0


class _State:
    def __init__(self):
        self.passed = self.failed = self.rejected = self.errors = 0
        self.final: list = []
        self.first_failure: float | None = None  # perf_counter() of the first failure (shrinking starts)
        self.shrink_skipped = 0


def _within_limits(prop: Property, be) -> Callable[[Example], bool] | None:
    limits = be.limits(prop.op)
    if not limits:
        return None
    from .._dispatch import operator

    contract = operator(prop.op).contract

    def ok(ex: Example) -> bool:
        try:
            a = contract.validate(Args(ex.args))
        except Exception:
            return False
        return all(c.check(a) is None for c in limits)

    return ok


def run_property(prop: Property, backend: str = "reference", *, profile: str | None = None,
                 max_examples: int | None = None, seed: int | None = None, bounds=None,
                 cases_dir: str | None = None, pins: dict | None = None, chip: str | None = None) -> PropertyResult:
    """Run ``prop`` against ``backend`` (see the module docstring). ``bounds``: a
    :class:`qsfa.strategies.Bounds` (default: the profile's). ``cases_dir``: where a falsifying example is
    saved (None: not saved). ``pins``: extra strategy pins (e.g. tiny shapes for an interpreter). ``chip``: the
    chip modelled by every call, backend's and reference's ("A2", "A3", "950"; None: the backend's device chip, or
    each call's own rule, docs/numerics/chips.md); examples are drawn within that chip's limits."""
    from hypothesis import example, given, reject, settings
    from hypothesis import seed as hyp_seed
    from hypothesis.control import current_build_context
    from hypothesis.errors import Unsatisfiable

    from .. import strategies as qst
    from .._dispatch import get_backend, operator
    from .._errors import BackendError
    from .._profiles import active_profile

    profile = profile or active_profile()
    res = PropertyResult(prop.name, list(prop.ops), prop.kind, backend, "skipped", doc=prop.doc, seed=seed)
    t0 = time.perf_counter()
    try:
        be = get_backend(backend)
    except BackendError as e:
        res.message = str(e)
        return res
    if be.name not in operator(prop.op).impls:
        res.message = f"backend {backend!r} does not implement {prop.op}"
        return res
    # helper operators the backend lacks (e.g. merge_attention_lse for split_merge) run on the reference
    helpers = [op for op in prop.ops[1:] if be.name not in operator(op).impls]
    if helpers:
        res.message = (f"helper operator(s) {', '.join(helpers)} ran on the reference (backend {backend!r} does not "
                       f"implement them); {prop.op} ran on {backend!r}")
    try:
        be_chip = be.chip()
    except Exception as e:  # noqa: BLE001
        res.status, res.message = "error", f"backend {backend!r}: chip() failed: {type(e).__name__}: {e}"
        return res
    if chip is not None and be_chip is not None and chip != be_chip:
        res.status, res.message = "error", f"backend {backend!r} runs on chip {be_chip!r}, not the requested {chip!r}"
        return res
    chip = chip or be_chip
    res.chip = chip
    b = bounds if bounds is not None else qst.bounds(profile)
    from ..strategies.chips import NotApplicable

    try:  # the chip's pins merged with the property's (qsfa.strategies.chips): nothing drawn yet
        strategy = prop.strategy(b, chip, pins or {})
    except NotApplicable as e:
        res.status, res.message, res.not_applicable = "skipped", str(e), True
        res.seconds = time.perf_counter() - t0
        return res
    fits = None if prop.family == "invalid_rejected" or prop.own_limits else _within_limits(prop, be)
    if fits is not None:
        strategy = strategy.filter(fits)

    state = _State()
    res.standards = start_tally()  # --standard: filled by the vs_reference checks (docs/numerics/comparison.md#standards)

    def test(ex):
        final = current_build_context().is_final
        if (not final and state.first_failure is not None
                and time.perf_counter() - state.first_failure > SHRINK_SECONDS):
            state.shrink_skipped += 1  # bounded shrinking (see SHRINK_SECONDS)
            return
        try:
            prop.check(ex, backend)
        except UnsupportedByBackend:
            state.rejected += 1
            reject()
        except Exception as e:
            if isinstance(e, BackendRaised):
                state.errors += 1
            else:
                state.failed += 1
            if state.first_failure is None:
                state.first_failure = time.perf_counter()
            if final:
                state.final.append((ex, e))
            raise
        state.passed += 1

    test.__name__ = re.sub(r"\W", "_", f"conformance_{prop.name}")
    wrapped = given(strategy)(test)
    from ._edge_phase import edge_examples, shrink_within_edge

    edges = edge_examples(prop, b, chip, pins or {}, fits)  # edges first (qsfa._edges), in EDGES order
    for _, ex in reversed(edges):
        wrapped = example(ex)(wrapped)
    edge_of = {id(ex): e for e, ex in edges}
    res.edge_examples = len(edges)
    wrapped._hypothesis_internal_add_digest = prop.name.encode()
    settings_kw = settings_for(profile, max_examples=max_examples, seed=seed)
    wrapped = settings(**settings_kw)(wrapped)
    if seed is not None:
        wrapped = hyp_seed(_property_seed(seed, prop.name))(wrapped)
    try:
        with modelling_chip(chip), helpers_on_reference(helpers):
            wrapped()
        res.status = "passed"
    except Unsatisfiable as e:
        res.status = "skipped"
        res.message = f"no drawn example fits backend {backend!r} ({e})"
    except Exception as e:  # noqa: BLE001
        if state.final and id(state.final[-1][0]) in edge_of:  # an explicit edge example: shrink within its edge
            state.first_failure = None  # a shrunk failure found there is appended to state.final
            with modelling_chip(chip), helpers_on_reference(helpers):
                shrink_within_edge(prop, edge_of[id(state.final[-1][0])], b, chip, pins or {}, fits, test,
                                   settings_kw)
        if state.final:
            ex, err = state.final[-1]
            res.status = "error" if isinstance(err, BackendRaised) else "failed"
            res.message = f"{type(err).__name__}: {err}" + (f"\n({res.message})" if helpers else "")
            if state.shrink_skipped:
                res.message += (f"\n(shrinking stopped after {SHRINK_SECONDS:g} s: the falsifying example is the "
                                "smallest found by then)")
            res.falsifying_example = summarize(ex)
            res.reproduce = _reproduce_line(e)
            if cases_dir is not None:
                try:
                    res.case_file = save_case(prop, backend, ex, res.message, cases_dir, seed=seed, chip=chip)
                except Exception as save_err:  # noqa: BLE001 - report, do not hide the failure
                    res.message += f"\n({CASE_SAVE_ERROR} {type(save_err).__name__}: {save_err})"
        else:
            res.status = "error"
            res.message = f"{type(e).__name__}: {e}"
    res.passed, res.failed, res.rejected, res.errors = state.passed, state.failed, state.rejected, state.errors
    res.examples = state.passed + state.failed + state.errors
    res.seconds = time.perf_counter() - t0
    return res


def _reproduce_line(e: BaseException) -> str | None:
    for note in getattr(e, "__notes__", []) or []:
        if "reproduce_failure" in note:
            return note.strip()
    return None


def summarize(ex: Example) -> dict:
    """A short JSON-able description of an example: arrays by shape / dtype (small ones by value)."""
    from .._arrays import dtype_name

    out = {}
    for k, v in ex.args.items():
        if isinstance(v, np.ndarray):
            try:
                dt = dtype_name(v)
            except Exception:  # noqa: BLE001
                dt = str(v.dtype)
            d = {"shape": list(v.shape), "dtype": dt}
            if v.size <= 16 and v.dtype.kind in "iub":
                d["values"] = v.reshape(-1).tolist()
            out[k] = d
        else:
            out[k] = _jsonable(v)
    if ex.constraint is not None:
        out["__constraint__"] = ex.constraint.id
    return out


def _jsonable(v):
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return f if np.isfinite(f) else {"float": repr(f)}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return {"repr": repr(v)}


# ---------------------------------------------------------------------------------------------------
# case files


def _case_name(backend: str, prop: Property) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{backend}.{prop.name}")


def save_case(prop: Property, backend: str, ex: Example, message: str, cases_dir: str, *, seed=None,
              chip: str | None = None) -> str:
    """Save the falsifying example ``ex`` of ``prop`` as ``<cases_dir>/<backend>.<property>.json`` (a
    ``qsfa-case/1`` file, arrays as explicit ``.npy`` inputs) plus the ``.conformance.json`` sidecar.
    Returns the case file's path. Each file replaces an older regular file of its name (a new file renamed
    over it); a name taken by a symbolic link or anything else is refused (GoldenInputError), nothing is
    written through it."""
    from ..golden.case import Case, _json_value
    from ..golden.guard import check_replaceable, replacing
    from ..golden.io import GoldenInputError

    name = _case_name(backend, prop)
    inputs, params, extra = {}, {}, {}
    for k, v in ex.args.items():
        if isinstance(v, np.ndarray):
            inputs[k] = np.array(v, order="C")  # a copy in C order; 0-d stays 0-d (ascontiguousarray makes it 1-d)
            continue
        try:
            params[k] = _json_value(k, v)
        except GoldenInputError:
            extra[k] = _jsonable(v)
    desc = (f"falsifying example of conformance property {prop.name} on backend {backend!r}: "
            f"{message.splitlines()[0][:300] if message else ''}")
    case = Case(name=name, op=prop.op, params=params, seed=0, generator=None, description=desc,
                inputs_given=inputs)
    path = os.path.join(cases_dir, name + ".json")
    side_name = name + ".conformance.json"
    check_replaceable(cases_dir, [side_name])  # a link in the sidecar's place: refused before anything is written
    case.save(path)  # new files renamed into place, never written through a link (qsfa.golden.guard.replacing)
    side = {
        "format": SIDE_FORMAT,
        "case": os.path.basename(path),
        "property": prop.name,
        "ops": list(prop.ops),
        "kind": prop.kind,
        "backend": backend,
        "chip": chip,  # the chip the failing run modelled (replayed with it)
        "seed": seed,
        "check_seed": int(ex.seed),
        "constraint": ex.constraint.id if ex.constraint is not None else None,
        "params_not_in_case": extra,
        "message": message,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    with replacing(cases_dir, side_name) as f:
        f.write((json.dumps(side, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return path


def load_example(path: str) -> tuple[Property, Example, dict]:
    """Load a saved falsifying example: ``(property, example, sidecar)``. The case file and its sidecar are
    checked first (:mod:`qsfa.conformance._casefile`): a file that is no call of the property's operator raises
    GoldenInputError naming the file, field, value and reason."""
    from ._casefile import load_example as _load

    return _load(path)


def replay_case(path: str, backend: str | None = None) -> tuple[bool | None, str]:
    """Re-run the property of a saved falsifying example on ``backend`` (default: the one it failed on).
    Returns ``(holds, message)``: ``holds`` is False when the property still fails on that backend, None when the
    backend raised instead (an ERROR, no verdict)."""
    prop, ex, side = load_example(path)
    be = backend or side["backend"]
    from .._errors import BackendError

    from .._dispatch import get_backend, operator

    name = get_backend(be).name
    helpers = [op for op in prop.ops[1:] if name not in operator(op).impls]
    try:
        with modelling_chip(side.get("chip")), helpers_on_reference(helpers):
            prop.check(ex, be)
    except AssertionError as e:
        return False, f"{prop.name} fails on {be!r}: {e}"
    except BackendRaised as e:
        return None, f"{prop.name}: ERROR on {be!r}: {e}"
    except BackendError:  # the backend cannot run the case at all (unknown, unusable, declines it): not a verdict
        raise
    except Exception as e:  # noqa: BLE001 - as in a run: any other error of the check is a failure of the property
        return False, f"{prop.name} fails on {be!r}: {type(e).__name__}: {e}"
    return True, f"{prop.name} holds on {be!r}"


# ---------------------------------------------------------------------------------------------------
# a whole run


def run_conformance(backend: str = "reference", *, ops: Iterable[str] | None = None,
                    properties: Iterable[str] | None = None, kinds: Iterable[str] | None = None,
                    profile: str | None = None, max_examples: int | None = None, seed: int | None = None,
                    shard_spec: str | tuple | None = None, cases_dir: str | None = DEFAULT_CASES_DIR,
                    bounds=None, pins: dict | None = None,
                    progress: Callable[[int, int, PropertyResult], None] | None = None,
                    props: list | None = None, chip: str | None = None, time_budget: float | None = None,
                    on_result: Callable[[ConformanceReport], None] | None = None,
                    backend_modules: Iterable[str] | None = None) -> ConformanceReport:
    """Run the selected properties against ``backend``; see :func:`run_property` for the arguments.
    ``shard_spec``: "i/n" or ``(i, n)``. ``progress(k, total, result)`` is called after each property;
    ``on_result(report)`` too (incremental reports: a run stopped later keeps what it measured).
    ``time_budget`` (seconds): properties not started when it is spent are reported as skipped ("not run").
    ``backend_modules``: the modules imported to register ``backend`` (``--backend-module``), for the replay
    commands of the reports; default: the module of the backend's class when it is not part of qsfa."""
    import hypothesis

    from .. import __version__
    from .. import strategies as qst
    from .._profiles import PROFILES, active_profile
    from .properties import select

    profile = profile or active_profile()
    selected = props if props is not None else select(ops=list(ops) if ops else None,
                                                        properties=list(properties) if properties else None,
                                                        kinds=list(kinds) if kinds else None)
    shard_text = None
    if shard_spec is not None:
        i, n = parse_shard(shard_spec) if isinstance(shard_spec, str) else shard_spec
        selected = shard(selected, i, n)
        shard_text = f"{i}/{n}"
    b = bounds if bounds is not None else qst.bounds(profile)
    report = ConformanceReport(
        backend=backend, profile=profile, seed=seed,
        max_examples=int(max_examples if max_examples is not None else PROFILES[profile]["max_examples"]),
        shard=shard_text, bounds=b.to_dict(),
        started=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        versions={"qsfa": __version__, "hypothesis": hypothesis.__version__, "numpy": np.__version__},
        backend_modules=list(backend_modules) if backend_modules is not None else _backend_modules(backend),
        env={"TRITON_INTERPRET": "1"} if os.environ.get("TRITON_INTERPRET") == "1" else {})
    t0 = time.perf_counter()
    for k, p in enumerate(selected, 1):
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            r = PropertyResult(p.name, list(p.ops), p.kind, backend, "skipped", doc=p.doc, seed=seed,
                               message=f"not run: the time budget ({time_budget:g} s) was spent")
        else:
            r = run_property(p, backend, profile=profile, max_examples=max_examples, seed=seed, bounds=b,
                             cases_dir=cases_dir, pins=pins, chip=chip)
        report.results.append(r)
        report.seconds = time.perf_counter() - t0
        if progress is not None:
            progress(k, len(selected), r)
        if on_result is not None:
            on_result(report)
    report.seconds = time.perf_counter() - t0
    return report


def _backend_modules(backend: str) -> list:
    from .._dispatch import get_backend

    try:
        mod = type(get_backend(backend)).__module__
    except Exception:  # noqa: BLE001 - the run reports an unusable backend itself
        return []
    return [] if mod == "__main__" or mod == "qsfa" or mod.startswith("qsfa.") else [mod]


def all_property_names() -> list[str]:
    return [p.name for p in catalogue()]
