"""qsfa.strategies: every valid strategy passes its operator's contract, every invalid one breaks exactly the
constraint it names, size bounds and pins are honoured, and the attention strategies poison what must never
be read. Expectations are derived here from docs/numerics/attention.md#token-selection (causal limits, -1 padding), not from the strategies.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsfa import strategies as qst
from qsfa._contract import Args
from qsfa._dispatch import operators

OPS = sorted(qst.STRATEGIES)
TINY = qst.Bounds(max_batch=2, max_q_tokens=3, max_kv_tokens=24, max_sparse=12, max_heads=4, max_block_size=16)


def test_every_operator_has_a_strategy():
    assert set(OPS) == set(operators()), "an operator without a strategy (or a strategy without an operator)"


@pytest.mark.parametrize("op", OPS)
def test_valid_strategy_passes_the_contract(op):
    contract = operators()[op].contract

    @settings(suppress_health_check=list(HealthCheck), database=None)
    @given(qst.valid_args(op))
    def check(args):
        hit = contract.first_violation(Args(args))
        assert hit is None, f"{hit[0].id}: {hit[0].error(hit[1])}"
        contract.validate(Args(args))  # normalisation accepts it too

    check()


@pytest.mark.parametrize("op", OPS)
def test_invalid_strategy_breaks_exactly_the_named_constraint(op):
    contract = operators()[op].contract
    seen = set()

    @settings(suppress_health_check=list(HealthCheck), database=None)
    @given(qst.invalid_args(op, TINY))
    def check(inv):
        hit = contract.first_violation(Args(inv.args))
        assert hit is not None and hit[0].id == inv.constraint.id
        assert inv.constraint.chips is None  # chip=None: only the operator's own rules
        seen.add(inv.constraint.id)

    check()
    assert len(seen) >= 2, f"the invalid strategy of {op} drew only {seen}"


def test_invalid_strategy_for_a_chip_draws_chip_rules():
    contract = operators()["kv_quant_sparse_flash_attention"].contract
    chip_ids = [c.id for c in contract.constraints if c.chips and "A2" in c.chips]

    @settings(suppress_health_check=list(HealthCheck), database=None, max_examples=10)
    @given(qst.invalid_args("kv_quant_sparse_flash_attention", TINY, chip="A2", constraints=chip_ids))
    def check(inv):
        assert inv.constraint.id in chip_ids
        hit = contract.first_violation(Args(inv.args), "A2")
        assert hit[0].id == inv.constraint.id
        assert contract.first_violation(Args(inv.args)) is None  # valid for the reference's union

    check()


def test_bounds_come_from_the_profile_and_overrides():
    from qsfa._profiles import SIZE_BOUNDS

    assert qst.bounds("ci").max_kv_tokens == SIZE_BOUNDS["ci"]["max_kv_tokens"]
    assert qst.bounds("nightly").max_kv_tokens == SIZE_BOUNDS["nightly"]["max_kv_tokens"]
    assert qst.bounds("ci", max_heads=2).max_heads == 2
    with pytest.raises(ValueError, match="Invalid value for profile"):
        qst.bounds("weekly")
    with pytest.raises(ValueError, match="max_batch"):
        qst.Bounds(max_batch=0, max_q_tokens=1, max_kv_tokens=1, max_sparse=1, max_heads=1, max_block_size=1)


def _rows_and_limits(a):
    """Per query row (batch, position, real row, limit = min(actKV, causal threshold)) from docs/numerics/attention.md#token-selection."""
    q = a["query"]
    if a["layout_query"] == "BSND":
        b, s = q.shape[:2]
        lens = a["actual_seq_lengths_query"]
        act_q = np.full(b, s) if lens is None else lens.astype(np.int64)
        batch, pos = np.divmod(np.arange(b * s), s)
        real = pos < act_q[batch]
    else:
        ends = a["actual_seq_lengths_query"].astype(np.int64)
        act_q = np.diff(np.concatenate([[0], ends]))
        r = np.arange(q.shape[0])
        batch = np.searchsorted(ends, r, side="right")
        real = batch < ends.size
        batch = np.minimum(batch, ends.size - 1)
        pos = r - (ends - act_q)[batch]
    lay = a.get("layout_kv", a.get("layout_key"))
    lk = a.get("actual_seq_lengths_kv", a.get("actual_seq_lengths_key"))
    key = a["key"]
    if lay == "BSND":
        act_kv = np.full(batch.max() + 1 if lk is None else lk.size, key.shape[1]) if lk is None else lk.astype(np.int64)
    elif lay == "TND":
        act_kv = np.diff(np.concatenate([[0], lk.astype(np.int64)]))
    else:
        act_kv = lk.astype(np.int64)
    thr = act_kv[batch] - act_q[batch] + pos + 1 if a["sparse_mode"] == 3 else act_kv[batch]
    limit = np.where(real, np.clip(np.minimum(act_kv[batch], thr), 0, None), 0)
    return batch, limit, act_kv


@pytest.mark.parametrize("op", ["kv_quant_sparse_flash_attention", "sparse_flash_attention"])
@settings(suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_sparse_indices_are_causal_strays_then_minus1(op, data):
    a = data.draw(qst.valid_args(op, TINY))
    _, limit, _ = _rows_and_limits(a)
    sbs = a["sparse_block_size"]
    idx = a["sparse_indices"].reshape(limit.size, -1).astype(np.int64)
    neg = idx < 0
    first = np.where(neg.any(1), neg.argmax(1), idx.shape[1])
    assert (idx >= -1).all()
    for row, k, lim in zip(idx, first, limit):
        head = row[:k]
        causal = head[head * sbs < lim]  # blocks that start below the row's limit: no repeats
        assert len(set(causal.tolist())) == causal.size
        # when the row draws every causal block it can hold, all of them are present
        stray = head[head * sbs >= lim]
        assert causal.size + stray.size == k


@settings(suppress_health_check=list(HealthCheck), database=None, max_examples=30)
@given(qst.valid_args("kv_quant_sparse_flash_attention", TINY, stray_entries=0.0, key_dtype="int8"))
def test_without_strays_every_entry_before_minus1_is_causal(a):
    _, limit, _ = _rows_and_limits(a)
    idx = a["sparse_indices"].reshape(limit.size, -1).astype(np.int64)
    neg = idx < 0
    first = np.where(neg.any(1), neg.argmax(1), idx.shape[1])
    before = np.arange(idx.shape[1])[None, :] < first[:, None]
    assert ((idx * a["sparse_block_size"] < limit[:, None]) | ~before).all()


def test_strays_are_non_causal_and_shuffled_in():
    rng = np.random.default_rng(3)
    idx = qst.sparse_index_rows(rng, np.array([4, 4, 0]), 12, strays=1.0, total_blocks=9)
    for row, lim in zip(idx, (4, 4, 0)):
        head = row[row >= 0] if (row < 0).sum() == 0 else row[: int(np.argmax(row < 0))]
        assert sorted(head[head < lim].tolist()) == list(range(lim))
        assert ((head >= lim) & (head <= 9) | (head < lim)).all()
    assert (idx[:2] >= 4).any()


def _unreadable_rows(a):
    """Flat key-storage rows that hold no token < actKV of any batch."""
    batch, _, act_kv = _rows_and_limits(a)
    key = a["key"]
    lay = a.get("layout_kv", a.get("layout_key"))
    n = int(np.prod(key.shape[:-2]))
    readable = np.zeros(n, bool)
    for b in range(act_kv.size):
        j = np.arange(act_kv[b])
        if lay == "BSND":
            rows = b * key.shape[1] + j
        elif lay == "TND":
            rows = np.concatenate([[0], np.cumsum(act_kv)])[b] + j
        else:
            bs = key.shape[1]
            rows = a["block_table"][b, j // bs].astype(np.int64) * bs + j % bs
        readable[rows] = True
    return ~readable


@settings(suppress_health_check=list(HealthCheck), database=None)
@given(qst.valid_args("kv_quant_sparse_flash_attention", TINY))
def test_qsfa_unread_rows_are_poisoned(a):
    bad = _unreadable_rows(a)
    rows = np.ascontiguousarray(a["key"]).reshape(bad.size, -1).view(np.uint8)
    scales = np.ascontiguousarray(rows[:, -16:]).view("<f4")
    assert np.isnan(scales[bad]).all()
    assert np.isfinite(scales[~bad]).all()


@settings(suppress_health_check=list(HealthCheck), database=None)
@given(qst.valid_args("sparse_flash_attention", TINY))
def test_sfa_unread_rows_are_nan(a):
    bad = _unreadable_rows(a)
    k = a["key"].reshape(bad.size, -1).astype(np.float32)
    assert np.isnan(k[bad]).all() and np.isfinite(k[~bad]).all()
    if a["value"] is not None:
        assert np.isnan(a["value"].reshape(bad.size, -1).astype(np.float32)[bad]).all()


@settings(suppress_health_check=list(HealthCheck), database=None)
@given(qst.valid_args("kv_quant_sparse_flash_attention", TINY, layout_kv="PA_BSND", key_dtype="int8",
                      sparse_block_size=1, n_heads=1))
def test_pins_are_honoured_and_bounds_respected(a):
    assert a["layout_kv"] == "PA_BSND" and a["key_dtype"] == "int8" and a["sparse_block_size"] == 1
    assert a["query"].shape[-2] == 1
    assert a["key"].shape[1] <= max(TINY.max_block_size, 16)
    assert a["actual_seq_lengths_kv"].max() <= TINY.max_kv_tokens
    assert a["sparse_indices"].shape[-1] <= TINY.max_sparse


@settings(suppress_health_check=list(HealthCheck), database=None)
@given(qst.valid_args("c8_cache_write", TINY))
def test_slot_mappings_are_unique_with_skips(a):
    s = a["slot_mapping"]
    valid = s[s >= 0]
    assert len(set(valid.tolist())) == valid.size
    assert valid.max(initial=-1) < a["kv_cache"].shape[0] * a["kv_cache"].shape[1]
    assert s.shape == (a["k_nope"].shape[0],)


def test_slot_mapping_helper():
    rng = np.random.default_rng(0)
    s = qst.slot_mapping(rng, 10, 4, skip_fraction=0.0)
    assert (s >= 0).sum() == 4 and len(set(s[s >= 0].tolist())) == 4
    s = qst.slot_mapping(rng, 3, 100, skip_fraction=0.0, dtype="int32")
    assert s.dtype == np.int32 and (s >= 0).sum() >= 2


def test_sparse_index_rows_helper():
    rng = np.random.default_rng(1)
    idx = qst.sparse_index_rows(rng, np.array([0, 3, 10]), 5)
    assert idx.dtype == np.int32
    assert (idx[0] == -1).all()
    assert sorted(idx[1][:3].tolist()) == [0, 1, 2] and (idx[1][3:] == -1).all()
    assert len(set(idx[2].tolist())) == 5 and idx[2].max() < 10
    junk = qst.sparse_index_rows(rng, np.array([2, 2]), 6, junk_after=True, total_blocks=9)
    assert (junk[:, 2] == -1).all()  # the first -1 stays; entries after it may be anything >= -1


def test_strided_cache_keeps_its_layout():
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 1, 4)
    s = qst.strided_like(a, (40, 4, 4, 1))
    assert not s.flags.c_contiguous and np.array_equal(s, a)
    c = qst.clone(s)
    assert c.strides == s.strides and np.array_equal(c, a)
    c[0, 0, 0, 0] = 99
    assert s[0, 0, 0, 0] == 0  # a clone owns its memory


def test_indexer_inputs_give_exact_scores():
    """Integer / power-of-two inputs: every score is an exact fp32 number (so top-k ties are well defined)."""
    from qsfa.reference import formats as F

    @settings(suppress_health_check=list(HealthCheck), database=None, max_examples=10)
    @given(qst.valid_args("quant_lightning_indexer", TINY))
    def check(a):
        fmt = a["query_dtype"] or ("int8" if a["query"].dtype == np.int8 else "float8_e4m3fn")
        v = F.decode(np.ascontiguousarray(a["query"]).view(np.uint8), fmt)
        assert (v == np.round(v)).all() and np.abs(v).max() <= 8
        sc = a["query_dequant_scale"].astype(np.float64)
        assert (np.log2(sc) == np.round(np.log2(sc))).all() and sc.min() >= 0.25

    check()


def test_random_values_cast_the_same_with_every_ml_dtypes_version():
    """ml_dtypes 0.7 rounds float64 to bfloat16 once, older versions through float32 (twice): as_dtype, which the
    strategies and the benchmarks' input generators use, always goes through float32 for ml_dtypes' types, so a
    seed gives the same inputs (and benchmarks/bytecheck_hashes.json the same hashes) with every version."""
    import ml_dtypes

    from qsfa._values import as_dtype

    x = np.array([1 + 2.0 ** -8 + 2.0 ** -30, -(1 + 2.0 ** -8 + 2.0 ** -30), 3.0])  # a bf16 midpoint after fp32
    got = as_dtype(x, ml_dtypes.bfloat16)
    assert got.dtype == ml_dtypes.bfloat16
    assert got.astype(np.float64).tolist() == [1.0, -1.0, 3.0]  # fp32 1 + 2^-8 is a tie: even, 1.0
    h = np.array([1 + 2.0 ** -11 + 2.0 ** -30])  # NumPy's float16 cast: one rounding, kept
    assert as_dtype(h, np.float16).astype(np.float64).tolist() == [1 + 2.0 ** -10]
    f = np.array([1.5], np.float32)
    assert as_dtype(f, ml_dtypes.float8_e4m3fn).astype(np.float32).tolist() == [1.5]


# ---------------------------------------------------------------------------------------------------
# chip-aware drawing (qsfa.strategies.chips)

CHIP_OPS = [(op, chip) for chip in ("A2", "950") for op in OPS]


@pytest.mark.parametrize("op,chip", CHIP_OPS, ids=[f"{op}-{chip}" for op, chip in CHIP_OPS])
def test_chip_pins_draw_only_what_the_chip_runs(op, chip):
    """The chip's pins alone (no contract filter) keep every draw within the chip's rules: nothing drawn is thrown
    away by valid_args(op, chip=...); an operator the chip lacks is not applicable before anything is drawn."""
    from qsfa.strategies.chips import NotApplicable, merge_pins

    contract = operators()[op].contract
    try:
        pins = merge_pins(op, chip, {}, TINY)
    except NotApplicable as e:
        assert e.rule in {c.id.split(".", 1)[1] for c in contract.constraints if c.chips and chip in c.chips}
        with pytest.raises(NotApplicable, match=f"not applicable on {chip}: "):
            qst.valid_args(op, TINY, chip=chip)
        return

    @settings(suppress_health_check=list(HealthCheck), database=None, max_examples=10)
    @given(qst.STRATEGIES[op](TINY, **pins))
    def check(args):
        hit = contract.first_violation(Args(args), chip)
        assert hit is None, f"{chip}: {hit[0].id}: {hit[0].error(hit[1])}"

    check()


def test_chip_rules_name_the_contract_rules_they_keep():
    from qsfa.strategies.chips import CHIP_RULES

    for op, rules in CHIP_RULES.items():
        by_id = {c.id: c for c in operators()[op].contract.constraints}
        for chips, rid, _, _ in rules:
            c = by_id.get(f"{op}.{rid}")
            assert c is not None and c.chips and set(chips) <= set(c.chips), (op, rid)


def test_a_property_pin_the_chip_forbids_is_not_applicable():
    from qsfa.strategies.chips import NotApplicable, merge_pins

    qsfa = "kv_quant_sparse_flash_attention"
    with pytest.raises(NotApplicable, match="not applicable on 950: .*return_softmax_lse") as e:
        qst.valid_args(qsfa, TINY, chip="950", return_softmax_lse=True)
    assert e.value.rule == "950_return_softmax_lse"
    # a pin both allow keeps the common values; the A2's rule leaves int8 of the two key formats
    assert merge_pins(qsfa, "A2", {"key_dtype": ("int8", "float8_e4m3fn")})["key_dtype"] == "int8"
    assert merge_pins(qsfa, None, {"return_softmax_lse": True}) == {"return_softmax_lse": True}
