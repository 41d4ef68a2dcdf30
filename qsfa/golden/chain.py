"""Golden sets of whole layer chains and ``qsfa golden compare --chain`` (docs/golden.md#chains).

A chain golden set holds one case per link of each chain *instance*: case ``<instance>.<link>`` calls the
link's operator on the link's inputs (case inputs and the reference's intermediates of the earlier links),
so every intermediate is stored as the output of the link that makes it (``<instance>.<link>/out.<output>``)
and again as the input of the links that read it. The cases use the ``chain-link`` generator (the chain's
own generator makes the case inputs, the reference runs the links before this one), so a chain set is
built, generated, verified and replayed like any other set. The manifest records each instance's chain
(links, params and edges) under ``"chains"``.

:func:`compare_chain` walks an instance in chain order and judges each link by its outputs' own criteria
(bytes for caches and indices, the float criterion for attention), whether its upstream inputs matched,
and - given a backend - the link re-run on that backend fed with the *golden* inputs, which tells a
link's own error from one propagated from upstream.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

from . import io as gio
from .case import Case
from .io import GoldenInputError

__all__ = ["chain_cases", "chain_records", "compare_chain", "ChainReport", "LinkResult", "format_chain_report"]

LINK_GENERATOR = "chain-link"


def chain_cases(chain_name: str, instance: str, params: dict, *, seed: int, description: str = "") -> list[Case]:
    """The cases of one instance of a registered chain (qsfa.chain.get_chain with ``params``): one per link, named
    ``<instance>.<link>``, all with ``seed``, the chain parameters ``params`` and the link's literal arguments."""
    from ..chain import get_chain

    ch = get_chain(chain_name, params, ignore_unknown=True)
    out = []
    for lk in ch.links:
        lits = {k: v for k, v in lk.args.items() if k not in lk.refs()}
        p = {**params, **lits, "chain": chain_name, "link": lk.name}
        out.append(Case(name=f"{instance}.{lk.name}", op=lk.op, params=p, seed=seed, generator=LINK_GENERATOR,
                        description=(description + f" - link {lk.name}").strip(" -")))
    return out


def chain_records(entries: list) -> list:
    """The manifest's ``"chains"``: per instance, its chain (qsfa.chain's JSON form with its ``edges``: [source
    tensor, link, parameter]), its params and link -> case name."""
    from ..chain import get_chain

    recs: dict = {}
    for e in entries:
        p = e.get("params") or {}
        if e.get("generator") != LINK_GENERATOR or "chain" not in p or "link" not in p:
            continue
        inst = e["name"][: -len(p["link"]) - 1] if e["name"].endswith("." + p["link"]) else e["name"]
        if inst not in recs:
            ch = get_chain(p["chain"], p, ignore_unknown=True)
            recs[inst] = {"instance": inst, "chain": {**ch.to_dict(), "edges": ch.edges()},
                          "params": {k: v for k, v in p.items() if k not in ("chain", "link")}, "cases": {}}
        recs[inst]["cases"][p["link"]] = e["name"]
    return list(recs.values())


# --------------------------------------------------------------------------------------------------
# compare --chain


@dataclass
class LinkResult:
    link: str
    op: str
    case: str
    passed: bool
    outputs: list  # OutputResult of each output
    differing_inputs: list  # "<param> = <link>.<output>" whose upstream output failed
    rerun_passed: bool | None = None  # the link re-run on the backend with the golden inputs; None: not re-run
    rerun_error: str = ""

    @property
    def verdict(self) -> str:
        """PASS, or for a failing link: own (its inputs matched, or its re-run on golden inputs fails too),
        propagated (its inputs differed and its re-run on golden inputs passes), undecided (inputs differed,
        not re-run) or error (the re-run raised: no verdict)."""
        if self.passed:
            return "PASS"
        if self.rerun_error:
            return "error"
        if not self.differing_inputs or self.rerun_passed is False:
            return "own"
        return "propagated" if self.rerun_passed else "undecided"

    def to_dict(self) -> dict:
        return {"link": self.link, "op": self.op, "case": self.case, "passed": self.passed, "verdict": self.verdict,
                "differing_inputs": self.differing_inputs, "rerun_passed": self.rerun_passed,
                "rerun_error": self.rerun_error, "outputs": [r.to_dict() for r in self.outputs]}


@dataclass
class ChainReport:
    golden: str
    actual: str
    backend: str | None
    instances: list = field(default_factory=list)  # (instance, chain name, [LinkResult])

    @property
    def passed(self) -> bool:
        return all(lr.passed for _, _, links in self.instances for lr in links)

    @property
    def errored(self) -> bool:
        """A failing link's re-run raised on the backend: that link has no verdict, the report's verdict is ERROR."""
        return any(lr.rerun_error for _, _, links in self.instances for lr in links)

    def first_failing(self, instance: str) -> LinkResult | None:
        for inst, _, links in self.instances:
            if inst == instance:
                return next((lr for lr in links if not lr.passed), None)
        return None

    def to_dict(self) -> dict:
        from .compare import _json_safe

        return _json_safe({"golden": self.golden, "actual": self.actual, "backend": self.backend,
                           "verdict": "PASS" if self.passed else "ERROR" if self.errored else "FAIL",
                           "instances": [{"instance": i, "chain": c,
                                          "first_failing": (self.first_failing(i).link if self.first_failing(i)
                                                            else None),
                                          "links": [lr.to_dict() for lr in links]}
                                         for i, c, links in self.instances]})


def _rerun(golden: str, entry: dict, backend: str) -> tuple[bool | None, str]:
    """The link case re-run on ``backend`` from its golden inputs, compared with its golden outputs."""
    from .compare import compare_dir
    from .manifest import case_from_entry

    case = case_from_entry(golden, entry)
    try:
        outs = case.run(backend)
    except Exception as e:  # noqa: BLE001 - a backend that raises: that link's verdict is error (exit 3)
        return None, f"{type(e).__name__}: {e}"
    with tempfile.TemporaryDirectory(prefix="qsfa-chain-rerun-") as tmp:
        os.mkdir(os.path.join(tmp, entry["name"]))
        for name, a in outs.items():
            _, st = gio.to_storage(a)
            with open(os.path.join(tmp, entry["name"], f"out.{name}.bin"), "wb") as f:
                f.write(gio.storage_bytes(st))
        rep = compare_dir(golden, tmp, cases=[entry["name"]])
        _judge_topk(golden, tmp, entry, rep)
    return all(x.result.passed for x in rep.results), ""


def compare_chain(golden: str, actual: str, *, backend: str | None = None, instances=None) -> ChainReport:
    """Compare a backend's intermediates (``actual/<instance>.<link>/out.<output>.bin|.npy``, the golden
    layout) with a chain golden set link by link (see the module docstring). ``backend``: re-run every
    failing link there on its golden inputs. A missing intermediate or a manifest without chains is a
    :class:`GoldenInputError` naming the link, raised before any verdict."""
    import fnmatch

    from .compare import CompareReport, compare_dir
    from .manifest import load_manifest

    if backend == "reference":
        raise GoldenInputError("--backend reference: fed with the golden inputs the reference reproduces the golden "
                               "by construction, so it cannot tell own from propagated; name the backend under test")
    if backend is not None:
        from .._dispatch import get_backend

        try:
            get_backend(backend)
        except Exception as e:  # noqa: BLE001 - unknown / unusable backend: a usage error
            raise GoldenInputError(f"--backend {backend}: {e}") from None
    if not os.path.isdir(actual):
        raise GoldenInputError(f"--actual {actual}: --chain needs a directory of intermediates "
                               "(<instance>.<link>/out.<output>.bin or .npy)")
    man = load_manifest(golden)
    recs = _records(golden, man)
    if instances:
        recs = [r for r in recs if any(fnmatch.fnmatchcase(r.get("instance", ""), p) for p in instances)]
    if not recs:
        raise GoldenInputError(f"{golden} holds no layer chain" + (f" matching --case {instances}" if instances else "")
                               + " (generate a chain set, e.g. qsfa golden generate --set v32-layer-decode)")
    by_name = {c["name"]: c for c in man["cases"]}
    report = ChainReport(golden, actual, backend)
    for r in recs:
        ch = _checked_record(golden, r, by_name)
        inst, cases = r["instance"], r.get("cases") or {}
        link_of = {cases[lk.name]: lk.name for lk in ch.links}
        try:  # every intermediate present before any verdict (a chain of several links: no single-case fallback)
            rep_all = compare_dir(golden, actual, cases=sorted(link_of))
        except GoldenInputError as e:
            text = str(e)
            bad = next((n for n in link_of if f"{n}/out." in text), None)
            what = ("missing intermediate" if "no actual output" in text or "file not found" in text else
                    "unreadable intermediate")  # a file of the wrong size is there, not missing (review F13)
            where = f"link {link_of[bad]}: {what}" if bad else "intermediates"
            raise GoldenInputError(f"chain instance {inst}: {where}: {text}") from None
        per_link = {}
        for name, link in link_of.items():
            per_link[link] = CompareReport(golden, actual, results=[x for x in rep_all.results if x.case == name])
        exact = {(x.case, x.output): x.result.passed for x in rep_all.results}  # an input matched: bytes equal
        for lk in ch.links:
            _judge_topk(golden, actual, by_name[cases[lk.name]], per_link[lk.name])
        results = []
        for lk in ch.links:
            rep = per_link[lk.name]
            passed = {(x.output): x.result.passed for x in rep.results}
            differing = [f"{p} = {src}" for p, src in lk.refs().items()
                         if not src.startswith("input.")
                         and not exact[(cases[src.split(".", 1)[0]], src.split(".", 1)[1])]]
            lr = LinkResult(lk.name, lk.op, cases[lk.name], all(passed.values()) and bool(passed), rep.results,
                            differing)
            if not lr.passed and backend is not None:
                lr.rerun_passed, lr.rerun_error = _rerun(golden, by_name[cases[lk.name]], backend)
            results.append(lr)
        report.instances.append((inst, ch.name, results))
    return report


def _records(golden: str, man: dict) -> list:
    """The manifest's ``"chains"`` records, their structure checked (GoldenInputError otherwise)."""
    recs = man.get("chains") or []
    if not isinstance(recs, list) or not all(isinstance(r, dict) and isinstance(r.get("chain"), dict)
                                             and isinstance(r.get("instance"), str)
                                             and isinstance(r.get("cases", {}), dict) for r in recs):
        raise GoldenInputError(f"{golden}: the manifest's \"chains\" must be a list of objects with \"instance\", "
                               "\"chain\" and \"cases\" (regenerate the set)")
    return recs


def _checked_record(golden: str, r: dict, by_name: dict):
    """One chain record checked against the set's own files (see :func:`_check_recorded`); returns its Chain."""
    from ..chain import ChainError, chain_from_dict

    try:
        ch = chain_from_dict({k: v for k, v in r["chain"].items() if k != "edges"})
    except ChainError as e:
        raise GoldenInputError(f"{golden}: chain of instance {r.get('instance')!r}: {e}") from None
    inst, cases = r["instance"], r.get("cases") or {}
    for lk in ch.links:
        if cases.get(lk.name) not in by_name:
            raise GoldenInputError(f"{golden}: chain instance {inst}: link {lk.name} has no golden case here "
                                   "(a --shard or --only golden holds part of a chain; compare --chain needs "
                                   "every link: generate the set whole)")
    _check_recorded(golden, inst, ch, cases, by_name)
    return ch


def chain_record_problems(golden: str, man: dict) -> list[str]:
    """What ``compare --chain`` would refuse in a set's recorded chains (a cycle, a forward reference, an edge that
    does not give the stored array, a call the operator refuses), one line per instance; [] for a set without
    chains. ``qsfa golden verify`` reports them as errors, so it never says OK to a set compare --chain refuses."""
    if "chains" not in man:
        return []
    try:
        recs = _records(golden, man)
    except GoldenInputError as e:
        return [str(e)]
    by_name = {c["name"]: c for c in man["cases"]}
    out = []
    for r in recs:
        try:
            _checked_record(golden, r, by_name)
        except GoldenInputError as e:
            out.append(str(e))
    return out


def _check_recorded(golden: str, inst: str, ch, cases: dict, by_name: dict) -> None:
    """The recorded chain against the set's own files, before any verdict: each link's case calls the link's
    operator; every reference to an earlier link's output, through its recorded view, gives exactly the array the
    link's case stores for that parameter; and the link's call (literals as recorded, inputs as stored, the case's
    chip) passes the operator's contract. A chain record that could never have produced these files is bad input
    (GoldenInputError naming the instance, the link and the field), not a verdict."""
    from .._dispatch import check_call
    from .._errors import InvalidArgument, InvalidDtype
    from ..chain import _apply_view, _spec
    from .manifest import case_from_entry, load_array

    outs: dict = {}
    for lk in ch.links:
        entry = by_name[cases[lk.name]]
        where = f"chain instance {inst}: link {lk.name!r}"
        if entry.get("op") != lk.op:
            raise GoldenInputError(f"{where} op: the recorded chain calls {lk.op}, its case {entry['name']} "
                                   f"{entry.get('op')}")
        spec = _spec(lk.op)
        case = case_from_entry(golden, entry)
        stored = case.args()
        args = {}
        try:
            for p, v in lk.args.items():
                src = lk.refs().get(p)
                if src is None or src.startswith("input."):
                    args[p] = v if src is None else stored.get(p)
                    continue
                a = _apply_view(f"link {lk.name!r} args.{p}", src, outs[src], v) if isinstance(v, dict) else outs[src]
                got = stored.get(p)
                if got is None or np.shape(got) != a.shape or np.asarray(got).dtype != a.dtype or \
                        np.ascontiguousarray(got).tobytes() != np.ascontiguousarray(a).tobytes():
                    raise GoldenInputError(
                        f"{where} args.{p}: the recorded edge from {src} gives {a.dtype} {list(a.shape)}, not the "
                        f"array the case stores ({entry['name']}/in.{p}: "
                        f"{getattr(got, 'dtype', None)} {list(np.shape(got))} or other bytes)")
                args[p] = a
            full = {**spec.defaults, **args}
            full.pop("chip", None)
            check_call(lk.op, full, "reference", (case.params or {}).get("chip"))
        except (InvalidArgument, InvalidDtype) as e:
            raise GoldenInputError(f"{where} ({lk.op}): the operator refuses the recorded call: {e}") from None
        for a in entry["arrays"]:
            if a["role"] == "output":
                outs[f"{lk.name}.{a['name']}"] = load_array(golden, a)


# top-k index outputs judged fair to ties (qsfa.compare.compare_topk) where the golden scores of every candidate
# can be had from the link's golden inputs: op -> (index output, scores of its arguments)
def _li_scores(args):
    from ..reference.indexer import lightning_indexer_scores

    return lightning_indexer_scores(**args)


def _qli2_scores(args):
    from ..reference.indexer_v4 import quant_lightning_indexer_v2_scores

    return quant_lightning_indexer_v2_scores(**args)


TOPK_SCORES = {"lightning_indexer": ("sparse_indices", _li_scores)}
TOPK_SCORES["quant_lightning_indexer_v2"] = ("sparse_indices", _qli2_scores)


def _vqli_scores(args):
    from ..reference.indexer_v4 import vllm_quant_lightning_indexer_scores

    return vllm_quant_lightning_indexer_scores(**args)


TOPK_SCORES["vllm_quant_lightning_indexer"] = ("sparse_indices", _vqli_scores)  # the V4 layer chains' indexer


def _judge_topk(golden: str, actual: str, entry: dict, rep) -> None:
    """Replace the bytes verdict of a link's top-k index output by the top-k criterion where the golden scores are
    available (:data:`TOPK_SCORES`); the other outputs keep their manifest criterion."""
    from .. import compare as qcompare
    from .compare import _load_actual
    from .manifest import case_from_entry, load_array

    if entry["op"] not in TOPK_SCORES:
        return
    output, scores_of = TOPK_SCORES[entry["op"]]
    for x in rep.results:
        if x.output != output or x.result.passed:
            continue  # byte-equal indices need no scores
        e = next(a for a in entry["arrays"] if a["role"] == "output" and a["name"] == output)
        case = case_from_entry(golden, entry)
        gold = load_array(golden, e)
        act, _ = _load_actual(actual, dict(e, case=entry["name"]), False, False)
        scores = scores_of(case.args())
        res = qcompare.compare_topk(act, gold, scores, name=f"{entry['name']}/{output}")
        x.result, x.criterion = res, "topk"


def format_chain_report(rep: ChainReport) -> str:
    lines = [f"golden {rep.golden}, actual {rep.actual}" + (f", re-run on backend {rep.backend}" if rep.backend
                                                              else ", no --backend: failing links are not re-run")]
    for inst, chain, links in rep.instances:
        lines.append(f"chain {chain}, instance {inst}:")
        for i, lr in enumerate(links, 1):
            outs = ", ".join(f"{x.output} {x.criterion} {'ok' if x.result.passed else 'FAIL'}" + (
                f" ({x.result.topk['tie_rows']} of {x.result.topk['rows']} rows tie-tolerant, not exact)"
                if x.criterion == "topk" and x.result.topk and x.result.topk.get("tie_rows") else "")
                for x in lr.outputs)
            line = f"  {i}. {lr.link:14s} {lr.op:34s} {'PASS' if lr.passed else 'FAIL'}  [{outs}]"
            if not lr.passed:
                ins = ("inputs matched" if not lr.differing_inputs
                       else "inputs already differed: " + "; ".join(lr.differing_inputs))
                if lr.rerun_passed is None:
                    rr = ("re-run raised: " + lr.rerun_error) if lr.rerun_error else "not re-run"
                else:
                    rr = f"re-run on golden inputs {'passes' if lr.rerun_passed else 'fails'}"
                    if lr.rerun_passed and not lr.differing_inputs:
                        rr += " (so the intermediates given are not this backend's run, or it is not deterministic)"
                line += f"\n       {ins}; {rr} -> " + {
                    "own": "its own error (a kernel bug in this link)",
                    "propagated": "propagated from upstream (the link is right on golden inputs)",
                    "undecided": "own or propagated: re-run it with --backend to tell",
                    "error": "ERROR: no verdict (the backend under test raised)"}[lr.verdict]
            lines.append(line)
        first = next((lr for lr in links if not lr.passed), None)
        lines.append(f"  first failing link: {first.link} ({first.verdict})" if first else "  every link passes")
    lines.append(f"verdict: {'PASS' if rep.passed else 'ERROR' if rep.errored else 'FAIL'}")
    return "\n".join(lines)
