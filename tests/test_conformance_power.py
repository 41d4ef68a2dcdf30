"""The conformance catalogue's power, measured: mutant backends (qsfa.conformance.mutants) registered like a
third-party backend must each be caught, the edge cases (qsfa._edges) are valid arguments, and the campaign tool
reports kills with replayable case files."""

import json

import numpy as np
import pytest

pytest.importorskip("hypothesis")

import qsfa  # noqa: E402
from qsfa import _edges as E  # noqa: E402
from qsfa import strategies as qst  # noqa: E402
from qsfa._contract import Args  # noqa: E402
from qsfa._dispatch import operator  # noqa: E402
from qsfa.conformance import campaign, mutants  # noqa: E402
from qsfa.conformance import properties as P  # noqa: E402
from qsfa.conformance._edge_phase import edge_examples  # noqa: E402
from qsfa.conformance.runner import replay_case, run_property  # noqa: E402

CI = qst.bounds("ci")


def test_mutants_cover_every_operator_with_distinct_names():
    ms = mutants.mutants()
    assert len(ms) >= 50 and len({m.name for m in ms}) == len(ms)
    with_strategy = {op for op in qst.STRATEGIES if op in qsfa.operators()}
    core = {"formats.encode", "formats.decode", "formats.pack_fp4", "formats.unpack_fp4", "dynamic_block_quant",
            "scatter_by_slot", "c8_cache_write", "c8_rmsnorm_rope_cache", "kv_compress_epilog",
            "kv_rmsnorm_rope_cache", "kv_quant_sparse_flash_attention", "sparse_flash_attention",
            "lightning_indexer", "quant_lightning_indexer", "merge_attention_lse"}
    assert core <= with_strategy and core <= {m.op for m in ms}


def test_a_mutant_is_a_backend_registered_through_the_public_api():
    m = mutants.mutants(["scatter_by_slot.minus1_writes_last_row"])[0]
    name = mutants.register_mutant(m)
    try:
        status = qsfa.backends()[name]
        assert status.usable and "scatter_by_slot" in status.operators and "formats.encode" in status.operators
        rng = np.random.default_rng(0)
        cache = rng.integers(0, 256, (2, 4, 8), dtype=np.uint8)
        rows = rng.integers(0, 256, (3, 8), dtype=np.uint8)
        slots = np.array([0, -1, 5])
        want = qsfa.scatter_by_slot(cache.copy(), rows, slots)
        got = qsfa.scatter_by_slot(cache.copy(), rows, slots, backend=name)
        assert np.array_equal(got[:, :3], want[:, :3]) and np.array_equal(got[-1, -1], rows[1])
        assert not np.array_equal(got, want)  # the bug: slot -1 wrote the last row
    finally:
        mutants.unregister_mutant(m)
    assert name not in qsfa.backends()


@pytest.mark.parametrize("op", sorted(E.EDGES))
def test_every_edge_is_a_valid_argument_set(op):
    if op not in qsfa.operators():
        pytest.skip(f"{op} not defined")
    prop = P.get(f"{op}.vs_reference")
    exs = edge_examples(prop, CI, None, {})
    assert [e for e, _ in exs] == list(E.EDGES[op])  # the reference accepts every edge
    contract = operator(op).contract
    for e, ex in exs:
        contract.validate(Args(dict(ex.args)))


@pytest.mark.parametrize("op", sorted({m.op for m in mutants.mutants()}))
def test_every_mutant_fails_an_edge_example_of_its_operator(op):
    """The ci profile's edge phase alone catches every mutant (the random phase only adds to this); one test per
    operator, so no single test runs the whole campaign."""
    from qsfa.conformance._support import modelling_chip
    from qsfa.strategies.chips import NotApplicable

    cache = {}
    survivors, false_alarms = [], []
    for m in (m for m in mutants.mutants() if m.op == op):
        name = mutants.register_mutant(m)
        try:
            caught = False
            for p in P.select(ops=[m.op]):
                if (p.name, m.chip) not in cache:  # a mutant with a chip runs as a device of that chip
                    try:
                        cache[p.name, m.chip] = edge_examples(p, CI, m.chip, {})
                    except NotApplicable:
                        cache[p.name, m.chip] = []
                for _, ex in cache[p.name, m.chip]:
                    try:
                        with modelling_chip(m.chip):
                            p.check(ex, name)
                    except AssertionError:  # the property fails (a mutant that crashes is a stale mutant, not a catch)
                        caught = True
                        break
                if caught:
                    break
            if m.control and caught:
                false_alarms.append(m.name)
            elif not caught and not m.control:
                survivors.append(m.name)
        finally:
            mutants.unregister_mutant(m)
    assert not survivors, f"mutants no edge example catches: {survivors}"
    assert not false_alarms, f"must-pass controls an edge example fails: {false_alarms}"


def test_campaign_kills_with_replayable_cases_and_writes_reports(tmp_path):
    ms = mutants.mutants(["formats.pack_fp4", "scatter_by_slot.block_row_mod16"])
    js, md = tmp_path / "c.json", tmp_path / "c.md"
    seen = []
    rep = campaign.run_campaign(ms, cases_dir=str(tmp_path / "cases"), on_result=lambda r: seen.append(
        len(r.results)) or campaign.write(r, str(js)))
    assert seen == list(range(1, len(ms) + 1))  # the report is rewritten after every mutant
    assert [r.status for r in rep.results] == ["killed"] * len(ms)
    for r in rep.results:
        assert r.replayable and r.killed_by.startswith(r.op)  # failed again on the mutant when replayed
        assert replay_case(r.case_file, "reference")[0] is True
        assert mutants.backend_name(mutants.mutants([r.mutant])[0]) not in qsfa.backends()  # unregistered
    d = json.loads(js.read_text())
    assert d["format"] == "qsfa-mutation-campaign/1" and d["summary"]["killed"] == len(ms)
    campaign.write(rep, str(md))
    assert "| formats.pack_fp4" not in md.read_text() or "killed" in md.read_text()


def test_a_kill_whose_case_file_fails_the_replay_checks_is_not_replayable(tmp_path, monkeypatch):
    """replay_case refuses a case that is no call of the property (GoldenInputError, --replay's exit 2): the
    mutant is still killed, its case counted as not replayable - not an error of the campaign."""
    from qsfa.conformance import runner
    from qsfa.golden.io import GoldenInputError

    def refuse(path, backend=None):
        raise GoldenInputError(f"{path}: Invalid sidecar field for constraint, actual: 'x', reason: test.")

    monkeypatch.setattr(runner, "replay_case", refuse)
    (r,) = campaign.run_campaign(mutants.mutants(["pack_fp4.*"])[:1], cases_dir=str(tmp_path)).results
    assert r.status == "killed" and r.case_file and r.replayable is False
    assert "case file not replayable: " in r.message and "reason: test." in r.message


def test_campaign_cli(tmp_path, capsys):
    assert campaign.main(["--list", "--mutants", "merge_attention_lse"]) == 0
    out = capsys.readouterr().out
    assert out.count("merge_attention_lse.") == len(mutants.mutants(["merge_attention_lse"]))
    assert campaign.main(["--mutants", "no.such.mutant"]) == 2
    assert campaign.main(["--mutants", "pack_fp4.*", "--report", str(tmp_path / "r.txt")]) == 2
    js = tmp_path / "r.json"
    assert campaign.main(["--mutants", "pack_fp4.*", "-q", "--cases-dir", str(tmp_path / "c"),
                          "--report", str(js)]) == 0
    assert json.loads(js.read_text())["summary"]["replayable"] == 1


def test_a_spent_time_budget_starts_no_mutant(tmp_path):
    ms = mutants.mutants(["formats.pack_fp4", "formats.unpack_fp4"])
    rep = campaign.run_campaign(ms, cases_dir=str(tmp_path), time_budget=0.0)
    assert [r.status for r in rep.results] == ["not_run", "not_run"] and rep.summary["not_run"] == 2


def test_uniform_scores_holds_on_small_normalised_bf16_cases():
    """The expectation models the probability as the kernel rounds it (bf16(fp32(1 / count)), not 1 / count):
    the old mean-of-V expectation failed the reference here (cos_diff 1.0-1.2e-5)."""
    for op in ("kv_quant_sparse_flash_attention", "sparse_flash_attention"):
        prop = P.get(f"{op}.uniform_scores")
        for seed in range(3):
            r = run_property(prop, "reference", seed=seed, pins={"dtype": "bfloat16", "probability_rounding":
                                                                  "normalised", "precision": "faithful"})
            assert r.status == "passed", r.message


def test_uniform_scores_catches_a_divide_by_a_bf16_rounded_sum(tmp_path):
    m = mutants.mutants(["qsfa.final_divide_by_bf16_sum"])[0]
    name = mutants.register_mutant(m)
    try:
        r = run_property(P.get("kv_quant_sparse_flash_attention.uniform_scores"), name, cases_dir=str(tmp_path))
    finally:
        mutants.unregister_mutant(m)
    assert r.status == "failed" and "derived bound" in r.message


def test_strided_clone_of_every_ml_dtype():
    import ml_dtypes

    for dt in (ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16, np.int8):
        a = np.repeat((np.arange(12, dtype=np.float32) % 5).astype(dt).reshape(3, 4), 2, axis=0)[::2]
        c = qst.clone(a)
        assert c.strides == a.strides and np.ascontiguousarray(c).tobytes() == np.ascontiguousarray(a).tobytes()


def test_nan_softmax_statistics_fail_the_property_and_replay_exits_1(tmp_path):
    """A backend returning NaN LSE statistics fails split_merge with that message (not a merge input error),
    and replaying the saved case exits 1 (a failing property), not 2 (bad usage)."""
    from qsfa.cli import main

    op = "kv_quant_sparse_flash_attention"
    ref = operator(op).impls["reference"]

    class NanLse(qsfa.Backend):
        name = "test-nan-lse"

    def impl(**kw):
        o, m, s = ref(**kw)
        if m.size:
            m = m.copy()
            m.reshape(-1)[0] = np.nan
        return o, m, s

    qsfa.register_backend(NanLse(), replace=True)
    for name, o in qsfa.operators().items():
        qsfa.register_impl("test-nan-lse", name, impl if name == op else o.impls["reference"])
    try:
        r = run_property(P.get(f"{op}.split_merge"), "test-nan-lse", cases_dir=str(tmp_path))
        assert r.status == "failed" and "non-finite" in r.message and "Invalid" not in r.message, r.message
        assert main(["conformance", "--replay", r.case_file]) == 1
        assert main(["conformance", "--replay", r.case_file, "--backend", "reference"]) == 0
    finally:
        qsfa.unregister_backend("test-nan-lse")


def test_a_missing_helper_operator_runs_on_the_reference_and_is_reported(tmp_path):
    """split_merge needs merge_attention_lse: a backend that only has QSFA is still checked (the merge runs on the
    reference, and the result says so) instead of being skipped with exit 0."""
    op = "kv_quant_sparse_flash_attention"

    class OnlyQsfa(qsfa.Backend):
        name = "test-only-qsfa"

    qsfa.register_backend(OnlyQsfa(), replace=True)
    qsfa.register_impl("test-only-qsfa", op, operator(op).impls["reference"])
    try:
        r = run_property(P.get(f"{op}.split_merge"), "test-only-qsfa", max_examples=3)
        assert r.status == "passed" and r.examples > 0
        assert "merge_attention_lse ran on the reference" in r.message
        r = run_property(P.get("merge_attention_lse.vs_reference"), "test-only-qsfa")
        assert r.status == "skipped" and "does not implement merge_attention_lse" in r.message
    finally:
        qsfa.unregister_backend("test-only-qsfa")


def test_reports_are_written_incrementally_under_a_time_budget(tmp_path):
    from qsfa.cli import main
    from qsfa.conformance.runner import run_conformance

    seen = []
    rep = run_conformance("reference", props=P.select(ops=["formats.pack_fp4"]), cases_dir=None,
                          on_result=lambda r: seen.append([x.status for x in r.results]))
    assert seen == [["passed"] * k for k in range(1, len(rep.results) + 1)]
    js = tmp_path / "r.json"
    assert main(["conformance", "--ops", "formats.pack_fp4", "--time-budget", "0", "-q", "--report", str(js)]) == 0
    d = json.loads(js.read_text())
    assert d["results"] and all(r["status"] == "skipped" and "time budget" in r["message"] for r in d["results"])
    assert not list(tmp_path.glob("*.partial*"))
    with pytest.raises(SystemExit) as e:  # refused by the option's type, as argparse refuses it: usage exit 2
        main(["conformance", "--ops", "formats.pack_fp4", "--time-budget", "-1"])
    assert e.value.code == 2


@pytest.mark.parametrize("chip", ["A2", "950"])
def test_every_edge_draws_at_once_within_each_chip(chip):
    """With a chip, each edge's simplest draw is already within the chip's rules (the chip's pins win over the
    edge's, qsfa.strategies.chips): no edge falls back to a search through rejected draws."""
    from qsfa.conformance._edge_phase import _simplest
    from qsfa.strategies.chips import NotApplicable

    for op in sorted(E.EDGES):
        if op not in qsfa.operators():
            continue
        prop = P.get(f"{op}.vs_reference")
        contract = operator(op).contract
        for e in E.EDGES[op]:
            try:
                s = prop.strategy(CI, chip, {"edge": e, "edge_full": True})
            except NotApplicable:
                break  # the chip lacks the operator
            ex = _simplest(s)
            assert ex is not None, f"{op} edge {e} on {chip}: its simplest draw breaks a rule of the chip"
            assert contract.first_violation(Args(dict(ex.args)), chip) is None
