"""Chain golden sets (v32-layer-decode / -prefill), the registered chain v32-mla-c8 and ``compare --chain`` on a
chain set (docs/golden.md#chains).

Independent checks: the chain's intermediates equal the hard-coded ``qsfa.c8_pipeline`` byte for byte; a chain
set stores every intermediate (a link's input file is the upstream link's output file) and the chain's edges in
the manifest; ``generate --chip`` skips the instances that chip refuses; an edge the next operator refuses stops
generation with exit 2 naming the link, nothing written.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import qsfa
from qsfa import chain as C
from qsfa.cli import main
from qsfa.golden.generators import get_generator
from _golden_cli import cli, actual_copy

DECODE = dict(q_lens=[1, 1, 1], kv_lens=[37, 20, 64], key_dtype="int8", sparse_count=16, scale_value=576 ** -0.5,
              return_softmax_lse=True)


def inputs(params, seed=1):
    return get_generator("v32-mla-c8")(params, np.random.default_rng(seed))


def u8(a):
    return np.ascontiguousarray(a).view(np.uint8)


def test_chain_equals_the_hard_coded_c8_pipeline():
    """Same inputs through qsfa.c8_pipeline (the chain written as code): every intermediate byte-identical."""
    p = dict(q_lens=[20, 13], kv_lens=[20, 29], key_dtype="int8", sparse_count=8, scale_value=576 ** -0.5,
             return_softmax_lse=True)
    x = inputs(p, seed=3)
    v = C.run_chain(C.get_chain("v32-mla-c8", p, ignore_unknown=True), x)
    kv_cache, index_cache = x["kv_cache"].copy(), x["index_cache"].copy()
    out, mx, sm, idx = qsfa.c8_pipeline(
        x["query"], x["kv"], x["gamma"], x["cos"], x["sin"], x["index_query"], x["index_key"], x["weights"],
        x["slot_mapping"], kv_cache, index_cache, x["block_table"], x["actual_seq_lengths_query"],
        x["actual_seq_lengths_kv"], scale_value=p["scale_value"], key_dtype="int8", sparse_count=8,
        layout_query="TND", return_softmax_lse=True)
    for key, want in (("cache.kv_cache", kv_cache), ("index_cache.cache", index_cache),
                      ("indexer.sparse_indices", idx), ("attention.attention_out", out),
                      ("attention.softmax_max", mx), ("attention.softmax_sum", sm)):
        assert u8(v[key]).tobytes() == u8(want).tobytes(), key
    # the chain inputs stay as they were (in-place buffers are copied)
    assert not x["index_cache"].astype(np.float32)[x["slot_mapping"] // 16, x["slot_mapping"] % 16].any()


def test_unknown_chain_and_unknown_until_are_named():
    with pytest.raises(C.ChainError, match="Invalid value for chain, actual: 'v9-layer'.*v32-mla-c8"):
        C.get_chain("v9-layer")
    ch = C.get_chain("v32-mla-c8", DECODE, ignore_unknown=True)
    with pytest.raises(C.ChainError, match="Invalid value for until, actual: 'attn'.*links: cache, index_cache"):
        C.run_chain(ch, inputs(DECODE), until="attn")


# --------------------------------------------------------------------------------------------------
# golden sets


@pytest.fixture(scope="module")
def decode_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain") / "decode"
    assert main(["golden", "generate", "--set", "v32-layer-decode", "--out", str(out), "-q", "--only",
                 "decode-a3-int8.*"]) == 0
    return out


def test_chain_set_stores_every_intermediate_and_the_edges(decode_set, capsys):
    man = json.loads((decode_set / "manifest.json").read_text())
    (rec,) = man["chains"]
    assert rec["instance"] == "decode-a3-int8" and rec["chain"]["name"] == "v32-mla-c8"
    assert rec["cases"] == {lk: f"decode-a3-int8.{lk}" for lk in ("cache", "index_cache", "indexer", "attention")}
    assert ["cache.kv_cache", "attention", "key"] in rec["chain"]["edges"]
    assert ["indexer.sparse_indices", "attention", "sparse_indices"] in rec["chain"]["edges"]
    # the stored intermediates are the chain's own, and each link's input is the upstream link's output file
    p = {k: v for k, v in man["cases"][0]["params"].items() if k not in ("chain", "link")}
    v = C.run_chain(C.get_chain("v32-mla-c8", p, ignore_unknown=True), inputs(p, seed=man["cases"][0]["seed"]), chip=p["chip"])
    d = decode_set
    assert (d / "decode-a3-int8.cache/out.kv_cache.bin").read_bytes() == u8(v["cache.kv_cache"]).tobytes()
    assert (d / "decode-a3-int8.attention/in.key.bin").read_bytes() == u8(v["cache.kv_cache"]).tobytes()
    assert (d / "decode-a3-int8.attention/in.sparse_indices.bin").read_bytes() == \
        (d / "decode-a3-int8.indexer/out.sparse_indices.bin").read_bytes()
    assert (d / "decode-a3-int8.attention/out.attention_out.bin").read_bytes() == \
        u8(v["attention.attention_out"]).tobytes()
    # each link replays from its stored inputs (verify --recompute re-runs every link case)
    rc, out, err = cli(capsys, "verify", decode_set, "--recompute", "-q")
    assert rc == 0 and "4 recomputed" in out, out + err


def test_a_shard_generates_links_alone_and_compare_chain_asks_for_every_link(tmp_path, capsys):
    """--shard splits a chain's links (each link case recomputes its upstream), and a shard is no whole chain."""
    rc, out, err = cli(capsys, "generate", "--set", "v32-layer-decode", "--shard", "1/2", "--out", tmp_path / "s", "-q")
    assert rc == 0, err
    man = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert sorted(man["chains"][0]["cases"]) == ["attention", "index_cache"]
    rc, _, err = cli(capsys, "compare", tmp_path / "s", "--actual", tmp_path / "s", "--chain")
    assert rc == 2 and "link cache has no golden case here" in err and "generate the set whole" in err, err


def test_generate_with_chip_skips_the_instances_that_chip_cannot_run(tmp_path, capsys):
    rc, out, err = cli(capsys, "generate", "--set", "v32-layer-prefill", "--chip", "A3", "--out", tmp_path / "g", "-q")
    assert rc == 0 and "wrote 4 cases" in out, out + err
    assert err.count("skipped prefill-950-fp8.") == 4 and "packed caches are int8 only" in err, err
    man = json.loads((tmp_path / "g" / "manifest.json").read_text())
    assert [r["instance"] for r in man["chains"]] == ["prefill-a3-int8"]


def test_generating_a_chain_whose_edge_is_refused_is_exit_2_and_writes_nothing(tmp_path, capsys):
    from qsfa.golden import catalogue, generators
    from qsfa.golden.chain import chain_cases as link_cases

    def bad_chain(**p):  # the indexer reads the packed C8 cache instead of the indexer keys
        d = C.get_chain("v32-mla-c8", p, ignore_unknown=True).to_dict()
        d["name"] = "test-bad-edge"
        d["links"][2]["args"]["key"] = "$cache.kv_cache"
        return C.chain_from_dict(d)

    bad_chain.__signature__ = __import__("inspect").signature(C.v32_mla_c8)
    C.register_chain("test-bad-edge", bad_chain)
    generators.register_generator("test-bad-edge", generators.get_generator("v32-mla-c8"))
    catalogue.register_set("test-bad-edge", "a chain whose indexer reads the packed cache",
                           lambda: link_cases("test-bad-edge", "x", dict(DECODE, chip="A3"), seed=1))
    try:
        rc, _, err = cli(capsys, "generate", "--set", "test-bad-edge", "--out", tmp_path / "out", "-q")
    finally:
        catalogue.unregister_set("test-bad-edge")
        generators._GENERATORS.pop("test-bad-edge", None)
        C._CHAINS.pop("test-bad-edge", None)
    assert rc == 2 and err.count("\n") == 1, err
    assert "link 'indexer' (lightning_indexer)" in err and "Invalid dtype for key, actual: 'uint8'" in err, err
    assert not (tmp_path / "out").exists()
def flip(path, dtype, idx, mask):
    a = np.fromfile(path, dtype)
    a[idx] ^= mask
    a.tofile(path)


def test_compare_chain_identical_passes(decode_set, capsys):
    rc, out, err = cli(capsys, "compare", decode_set, "--actual", decode_set, "--chain")
    assert rc == 0 and "every link passes" in out and "verdict: PASS" in out, out + err


def test_planted_divergence_in_one_link_is_its_own(decode_set, tmp_path, capsys):
    """Attention output changed, everything upstream golden: the first failing link is attention, inputs matched."""
    a = actual_copy(decode_set, tmp_path)
    flip(a / "decode-a3-int8.attention/out.attention_out.bin", np.uint16, slice(0, 64), 0x0100)
    rc, out, err = cli(capsys, "compare", decode_set, "--actual", a, "--chain", "--json", tmp_path / "r.json")
    assert rc == 1, out + err
    assert "first failing link: attention (own)" in out and "inputs matched" in out, out
    rep = json.loads((tmp_path / "r.json").read_text())
    links = rep["instances"][0]["links"]
    assert [lk["verdict"] for lk in links] == ["PASS", "PASS", "PASS", "own"]
    assert rep["instances"][0]["first_failing"] == "attention"


def test_planted_divergence_upstream_is_propagated(decode_set, tmp_path, capsys, mirror_backend):
    """The indexer's indices changed (so the attention that read them differs too): the indexer is the first failing
    link, its own error; the attention's inputs already differed and its re-run on the golden inputs passes on
    the backend, so its failure is propagated. Without --backend it is undecided."""
    a = actual_copy(decode_set, tmp_path)
    idx = a / "decode-a3-int8.indexer/out.sparse_indices.bin"
    s = np.fromfile(idx, np.int32)
    s[[0, 16]] = s[[16, 0]]  # request 0 and 1 swap their best token
    s.tofile(idx)
    flip(a / "decode-a3-int8.attention/out.attention_out.bin", np.uint16, slice(0, 8), 0x0040)
    rc, out, _ = cli(capsys, "compare", decode_set, "--actual", a, "--chain")
    assert rc == 1 and "first failing link: indexer (own)" in out and "re-run it with --backend" in out, out
    rc, out, _ = cli(capsys, "compare", decode_set, "--actual", a, "--chain", "--backend",
                     mirror_backend("chain-test-right-device"), "--json", tmp_path / "r.json")
    assert rc == 1, out
    links = json.loads((tmp_path / "r.json").read_text())["instances"][0]["links"]
    assert [lk["verdict"] for lk in links] == ["PASS", "PASS", "own", "propagated"]
    assert links[3]["differing_inputs"] == ["sparse_indices = indexer.sparse_indices"]
    assert links[3]["rerun_passed"] is True
    assert "propagated from upstream" in out


def test_rerun_on_a_backend_with_a_bug_in_the_link_says_own(decode_set, tmp_path, capsys):
    """A backend whose attention differs: the re-run on golden inputs fails too, so the attention's failure is its
    own even though its inputs already differed."""
    from qsfa import _dispatch

    a = actual_copy(decode_set, tmp_path)
    idx = a / "decode-a3-int8.indexer/out.sparse_indices.bin"
    s = np.fromfile(idx, np.int32)
    s[[0, 16]] = s[[16, 0]]
    s.tofile(idx)
    flip(a / "decode-a3-int8.attention/out.attention_out.bin", np.uint16, slice(0, 8), 0x0040)

    class Buggy(_dispatch.Backend):
        name = "chain-test-buggy"

    _dispatch.register_backend(Buggy())
    try:
        for name, op in _dispatch.operators().items():
            ref = op.impls["reference"]
            if name == "kv_quant_sparse_flash_attention":
                def bad(*args, _ref=ref, **kw):
                    out, mx, sm = _ref(*args, **kw)
                    return (np.asarray(out, np.float32) + 1).astype(out.dtype), mx, sm
                _dispatch.register_impl("chain-test-buggy", name, bad)
            else:
                _dispatch.register_impl("chain-test-buggy", name, ref)
        rc, out, _ = cli(capsys, "compare", decode_set, "--actual", a, "--chain", "--backend", "chain-test-buggy",
                         "--json", tmp_path / "r.json")
    finally:
        _dispatch.unregister_backend("chain-test-buggy")
    links = json.loads((tmp_path / "r.json").read_text())["instances"][0]["links"]
    assert rc == 1 and [lk["verdict"] for lk in links] == ["PASS", "PASS", "own", "own"], out
    assert links[3]["rerun_passed"] is False


def test_missing_intermediate_is_exit_2_naming_the_link(decode_set, tmp_path, capsys):
    a = actual_copy(decode_set, tmp_path)
    os.remove(a / "decode-a3-int8.index_cache/out.cache.bin")
    rc, out, err = cli(capsys, "compare", decode_set, "--actual", a, "--chain", "--json", tmp_path / "r.json")
    assert rc == 2 and "link index_cache: missing intermediate" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r.json").exists()


def test_compare_chain_usage_errors(decode_set, tmp_path, capsys):
    rc, _, err = cli(capsys, "generate", "--set", "smoke", "--out", tmp_path / "smoke", "-q", "--only", "dbq-*")
    assert rc == 0, err
    rc, _, err = cli(capsys, "compare", tmp_path / "smoke", "--actual", tmp_path / "smoke", "--chain")
    assert rc == 2 and "holds no layer chain" in err, err
    rc, _, err = cli(capsys, "compare", decode_set, "--actual", decode_set, "--backend", "reference")
    assert rc == 2 and "needs --chain" in err, err
    rc, _, err = cli(capsys, "compare", decode_set, "--actual", decode_set, "--chain", "--backend", "reference")
    assert rc == 2 and "--backend reference" in err and "cannot tell" in err and err.count("\n") == 1, err
    rc, _, err = cli(capsys, "compare", decode_set, "--actual", decode_set, "--chain", "--backend", "nope")
    assert rc == 2 and "--backend nope" in err, err
    rc, _, err = cli(capsys, "compare", decode_set, "--actual", decode_set, "--chain", "--case", "prefill-*")
    assert rc == 2 and "no layer chain matching" in err, err


# --------------------------------------------------------------------------------------------------
# conformance over whole chains (hypothesis; shrinks to a minimal failing chain)


def test_a_recorded_chain_naming_an_unknown_operator_or_a_later_link_is_exit_2(decode_set, tmp_path, capsys):
    g = actual_copy(decode_set, tmp_path)
    man = json.loads((g / "manifest.json").read_text())
    man["chains"][0]["chain"]["links"][2]["op"] = "lightning_indexer_v9"
    (g / "manifest.json").write_text(json.dumps(man))
    rc, _, err = cli(capsys, "compare", g, "--actual", decode_set, "--chain")
    assert rc == 2 and "link 'indexer' op" in err and "lightning_indexer_v9" in err, err
    man["chains"][0]["chain"]["links"][2]["op"] = "lightning_indexer"
    man["chains"][0]["chain"]["links"][2]["args"]["key"] = "$attention.attention_out"
    (g / "manifest.json").write_text(json.dumps(man))
    rc, _, err = cli(capsys, "compare", g, "--actual", decode_set, "--chain")
    assert rc == 2 and "link 'indexer' args.key" in err and "a later one" in err, err


def test_verify_refuses_the_recorded_chain_compare_chain_refuses(decode_set, tmp_path, capsys):
    """verify said OK (exit 0) to a set whose recorded chain reads a later link (a cycle), which compare --chain
    then refused: the chains are part of the set, so verify checks them too (after the files)."""
    assert cli(capsys, "verify", decode_set, "-q")[0] == 0
    g = actual_copy(decode_set, tmp_path)
    man = json.loads((g / "manifest.json").read_text())
    man["chains"][0]["chain"]["links"][2]["args"]["key"] = "$attention.attention_out"
    (g / "manifest.json").write_text(json.dumps(man))
    rc, out, err = cli(capsys, "verify", g)
    assert rc == 2 and "ERROR chains: " in out and "link 'indexer' args.key" in out and "a later one" in out, (out, err)
    assert "1 chain record problem in " in err, err


# --------------------------------------------------------------------------------------------------
# top-k indices judged fair to ties (qsfa.compare.compare_topk) where the golden scores can be had


@pytest.fixture(scope="module")
def tied_set(tmp_path_factory):
    """A decode instance whose indexer-key history comes in equal pairs (tokens 2t and 2t+1 of request 0): their
    scores tie exactly, and with an odd top-k (15) the golden's last index has a tied twin it did not take."""
    from qsfa.golden import catalogue, generators
    from qsfa.golden.chain import chain_cases as link_cases

    def tied(params, rng):
        x = generators.get_generator("v32-mla-c8")(params, rng)
        bs, t = 16, x["block_table"][0]
        ic = x["index_cache"]
        for p in range(1, params["kv_lens"][0] - 1, 2):
            ic[t[p // bs], p % bs] = ic[t[(p - 1) // bs], (p - 1) % bs]
        return x

    C.register_chain("test-ties", C.v32_mla_c8)
    generators.register_generator("test-ties", tied)
    catalogue.register_set("test-ties", "tied indexer keys",
                           lambda: link_cases("test-ties", "t", dict(DECODE, chip="A3", sparse_count=15), seed=2))
    out = tmp_path_factory.mktemp("ties") / "g"
    try:
        assert main(["golden", "generate", "--set", "test-ties", "--out", str(out), "-q"]) == 0
    finally:
        catalogue.unregister_set("test-ties")
        generators._GENERATORS.pop("test-ties", None)
        C._CHAINS.pop("test-ties", None)
    return out


def test_topk_indices_tie_tolerant_pass_and_a_wrong_index_fails(tied_set, tmp_path, capsys):
    idx_file = "t.indexer/out.sparse_indices.bin"
    gold = np.fromfile(tied_set / idx_file, np.int32).reshape(3, 15)
    last = int(gold[0, 14])
    twin = last ^ 1
    assert twin not in gold[0] and twin < 36  # the tied twin the golden did not take (lower index first)
    a = actual_copy(tied_set, tmp_path)
    s = gold.copy()
    s[0, 14] = twin
    s.tofile(a / idx_file)
    rc, out, err = cli(capsys, "compare", tied_set, "--actual", a, "--chain", "--json", tmp_path / "r.json")
    assert rc == 0 and "sparse_indices topk ok (1 of 3 rows tie-tolerant, not exact)" in out, out + err
    ix = json.loads((tmp_path / "r.json").read_text())["instances"][0]["links"][2]["outputs"][0]
    assert ix["kind"] == "topk" and ix["topk"]["exact_rows"] == 2 and ix["topk"]["tie_rows"] == 1
    # a clearly lower-scored candidate instead: fails
    from qsfa.golden.manifest import case_from_entry, load_manifest
    from qsfa.reference.indexer import lightning_indexer_scores

    entry = next(c for c in load_manifest(str(tied_set))["cases"] if c["name"] == "t.indexer")
    sc = lightning_indexer_scores(**case_from_entry(str(tied_set), entry).args()).reshape(3, -1)
    worst = int(np.argmin(np.where(np.isfinite(sc[0]), sc[0], np.inf)))
    s[0, 14] = worst
    s.tofile(a / idx_file)
    rc, out, err = cli(capsys, "compare", tied_set, "--actual", a, "--chain")
    assert rc == 1 and "sparse_indices topk FAIL" in out and "first failing link: indexer (own)" in out, out + err


def test_scores_table_ranks_to_the_indexers_indices():
    """lightning_indexer_scores is the table the indexer ranks: its top-k (lower index first) is the indexer's."""
    from qsfa.reference.indexer import lightning_indexer_scores, top_k_desc

    p = dict(DECODE, key_dtype="int8")
    x = inputs(p, seed=4)
    v = C.run_chain(C.get_chain("v32-mla-c8", p, ignore_unknown=True), x)
    args = dict(query=x["index_query"], key=v["index_cache.cache"], weights=x["weights"],
                actual_seq_lengths_query=x["actual_seq_lengths_query"],
                actual_seq_lengths_key=x["actual_seq_lengths_kv"], block_table=x["block_table"], layout_query="TND",
                layout_key="PA_BSND", sparse_mode=3)
    sc = lightning_indexer_scores(**args).reshape(3, -1)
    assert sc.shape == (3, 64) and np.isfinite(sc).sum(1).tolist() == [37, 20, 64]
    idx, _ = top_k_desc(sc, 16, np.isfinite(sc).sum(1))
    assert (idx == v["indexer.sparse_indices"].reshape(3, 16)).all()


# --------------------------------------------------------------------------------------------------
# batch invariance and conformance over whole chains (hypothesis; a failing chain shrinks to a minimal one)

from hypothesis import HealthCheck, find, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qsfa.strategies.chain import chain_cases  # noqa: E402

#: a chain example costs two chain runs: a quarter of the profile's examples, at least 8 (ci: 8)
CHAIN_EXAMPLES = max(8, settings.default.max_examples // 4)


def request_alone(x, params, r):
    """Request ``r`` of a batch as a chain case of its own: its new-token and query rows, its block-table row and
    lengths; the caches (whole, with the other requests' history in them) as they are."""
    q = np.concatenate([[0], np.cumsum(params["q_lens"])])
    out = dict(x)
    for k in ("query", "kv", "cos", "sin", "slot_mapping", "index_key", "index_query", "weights"):
        out[k] = x[k][q[r]:q[r + 1]]
    out.update(block_table=x["block_table"][r:r + 1],
               actual_seq_lengths_query=np.asarray([params["q_lens"][r]], np.int32),
               actual_seq_lengths_kv=np.asarray([params["kv_lens"][r]], np.int32))
    return out, slice(q[r], q[r + 1])


def assert_alone_equals_batched(x, p, r, chip=None):
    ch = C.get_chain("v32-mla-c8", p, ignore_unknown=True)
    batch = C.run_chain(ch, x, chip=chip)
    alone_in, rows = request_alone(x, p, r)
    alone = C.run_chain(ch, alone_in, chip=chip)
    pages = x["block_table"][r][x["block_table"][r] >= 0]
    for key in ("cache.kv_cache", "index_cache.cache"):
        assert u8(alone[key][pages]).tobytes() == u8(batch[key][pages]).tobytes(), key
    for key in ("indexer.sparse_indices", "attention.attention_out"):
        assert u8(alone[key]).tobytes() == u8(batch[key][rows]).tobytes(), key
    for key in ("attention.softmax_max", "attention.softmax_sum"):
        if key in batch and batch[key].size:
            assert u8(alone[key]).tobytes() == u8(batch[key][:, rows]).tobytes(), key


def test_batch_invariance_one_request_alone_equals_it_inside_an_uneven_batch():
    """Request 1 of q_lens [3, 5, 1] / kv_lens [9, 40, 23] run alone gives the same bytes as inside the batch: its
    cache rows, its indices, its attention rows and LSE."""
    p = dict(q_lens=[3, 5, 1], kv_lens=[9, 40, 23], key_dtype="int8", sparse_count=16, scale_value=576 ** -0.5,
             return_softmax_lse=True)
    assert_alone_equals_batched(inputs(p, seed=5), p, 1)


@settings(max_examples=CHAIN_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain_cases(max_requests=3), st.integers(0, 2))
def test_batch_invariance_property(case, r):
    """Any drawn batch: each request alone equals it inside the batch, byte for byte on the reference."""
    r = r % len(case["params"]["q_lens"])
    assert_alone_equals_batched(case["inputs"], case["params"], r, chip=case["chip"])


@settings(max_examples=CHAIN_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain_cases())
def test_every_drawn_chain_is_valid_and_the_reference_conforms(case):
    """Every drawn case passes every link's contract on its chip, and the reference conforms to itself."""
    ch = C.get_chain(case["chain"], case["params"], ignore_unknown=True)
    assert C.first_divergence(ch, case["inputs"], backend="reference", chip=case["chip"]) is None


@pytest.fixture
def buggy_backend():
    """A backend whose attention is off by one in every element when some request holds more than 9 tokens, and
    (name + "-idx") one whose indexer swaps the first two indices of its first row."""
    from qsfa import _dispatch

    def bad_attention(*args, _ref, **kw):
        out, mx, sm = _ref(*args, **kw)
        if int(np.max(kw["actual_seq_lengths_kv"])) > 9:
            out = (np.asarray(out, np.float32) + 1).astype(out.dtype)
        return out, mx, sm

    def bad_indexer(*args, _ref, **kw):
        idx, val = _ref(*args, **kw)
        idx = np.array(idx)
        flat = idx.reshape(-1, idx.shape[-1])
        flat[0, [0, 1]] = flat[0, [1, 0]] if flat.shape[1] > 1 and flat[0, 1] >= 0 else flat[0, [0, 1]] + 1
        return idx, val

    names = []
    for name, bug_op, bug in (("chain-test-long-history", "kv_quant_sparse_flash_attention", bad_attention),
                              ("chain-test-indexer", "lightning_indexer", bad_indexer)):
        class Bug(_dispatch.Backend):
            pass

        Bug.name = name
        _dispatch.register_backend(Bug())
        names.append(name)
        for op_name, op in _dispatch.operators().items():
            ref = op.impls["reference"]
            impl = (lambda *a, _ref=ref, _bug=bug, **kw: _bug(*a, _ref=_ref, **kw)) if op_name == bug_op else ref
            _dispatch.register_impl(name, op_name, impl)
    yield names
    for name in names:
        _dispatch.unregister_backend(name)


def test_a_failing_chain_shrinks_to_a_minimal_one(buggy_backend):
    def fails(case):
        d = C.first_divergence(C.get_chain(case["chain"], case["params"], ignore_unknown=True), case["inputs"], backend=buggy_backend[0],
                               chip=case["chip"])
        return d is not None and d["link"] == "attention" and d["verdict"] == "own"

    case = find(chain_cases(chip="A3", max_requests=2, max_kv=16), fails,
                settings=settings(max_examples=200, deadline=None, database=None, derandomize=True))
    assert case["params"]["kv_lens"] == [10] and case["params"]["q_lens"] == [1], case["params"]


def test_first_divergence_tells_own_from_propagated(buggy_backend):
    """The indexer's wrong indices are its own error (its inputs matched); the attention that read them differs
    too, but that is not reported: the first failing link is the indexer."""
    p = dict(DECODE)
    ch = C.get_chain("v32-mla-c8", p, ignore_unknown=True)
    d = C.first_divergence(ch, inputs(p, seed=6), backend=buggy_backend[1], chip="A3")
    assert d == {"link": "indexer", "op": "lightning_indexer", "outputs": ["sparse_indices"], "differing_inputs": [],
                 "rerun_passed": None, "verdict": "own"}, d


def test_first_divergence_a_byte_differing_input_is_told_propagated():
    """A backend whose LSE merge lands 1 ulp above (within the float criterion, so the merge link passes) makes the
    e5m2 encode after it round the other way at midpoints: the encode fails with a differing input, and re-run
    on the backend fed with the reference's values it passes, so its failure is propagated."""
    from qsfa import _dispatch, formats

    chain = C.chain_from_dict({"name": "merge-encode", "inputs": ["out", "m", "l"], "links": [
        {"name": "merge", "op": "merge_attention_lse",
         "args": {"attention_out": "$input.out", "softmax_max": "$input.m", "softmax_sum": "$input.l",
                  "layout_query": "TND"}},
        {"name": "enc", "op": "formats.encode", "args": {"x": "$merge.attention_out", "fmt": "float8_e5m2"}}]})
    # one shard (the merge returns it as it is) of normal e4m3 values: the odd codes are e5m2 midpoints
    vals = np.asarray(formats.decode(np.arange(0x08, 0x70, dtype=np.uint8), "float8_e4m3fn"), np.float32)
    x = {"out": vals.reshape(1, 13, 8, 1)[..., [0] * 8], "m": np.zeros((1, 1, 13, 8), np.float32),
         "l": np.ones((1, 1, 13, 8), np.float32)}

    class Nudge(_dispatch.Backend):
        name = "chain-test-nudge"

    _dispatch.register_backend(Nudge())
    try:
        for op_name, op in _dispatch.operators().items():
            ref = op.impls["reference"]
            if op_name == "merge_attention_lse":
                def up(*a, _ref=ref, **kw):
                    out, m, l_ = _ref(*a, **kw)
                    return np.nextafter(np.asarray(out, np.float32), np.float32(np.inf)), m, l_
                _dispatch.register_impl("chain-test-nudge", op_name, up)
            else:
                _dispatch.register_impl("chain-test-nudge", op_name, ref)
        d = C.first_divergence(chain, x, backend="chain-test-nudge")
    finally:
        _dispatch.unregister_backend("chain-test-nudge")
    assert d == {"link": "enc", "op": "formats.encode", "outputs": ["codes"],
                 "differing_inputs": ["x = merge.attention_out"], "rerun_passed": True, "verdict": "propagated"}, d


def test_chain_set_manifest_with_malformed_chains_is_exit_2(decode_set, tmp_path, capsys):
    g = actual_copy(decode_set, tmp_path)
    man = json.loads((g / "manifest.json").read_text())
    man["chains"] = "x"
    (g / "manifest.json").write_text(json.dumps(man))
    rc, _, err = cli(capsys, "compare", g, "--actual", g, "--chain")
    assert rc == 2 and '"chains" must be a list' in err and err.count("\n") == 1, err


def test_a_backend_that_raises_in_the_rerun_is_an_error_exit_3(decode_set, tmp_path, capsys, mirror_backend):
    """As qsfa conformance: the backend under test raised, so the re-run link has no verdict (ERROR, exit 3)."""
    a = actual_copy(decode_set, tmp_path)
    idx = a / "decode-a3-int8.indexer/out.sparse_indices.bin"
    s = np.fromfile(idx, np.int32)
    s[[0, 16]] = s[[16, 0]]
    s.tofile(idx)
    flip(a / "decode-a3-int8.attention/out.attention_out.bin", np.uint16, slice(0, 8), 0x0040)

    def raising(_ref):
        def impl(*args, **kw):
            raise RuntimeError("device lost")
        return impl

    be = mirror_backend("chain-test-raising", {"kv_quant_sparse_flash_attention": raising})
    rc, out, _ = cli(capsys, "compare", decode_set, "--actual", a, "--chain", "--backend", be, "--json",
                     tmp_path / "r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rc == 3 and rep["verdict"] == "ERROR" and "verdict: ERROR" in out, out
    links = rep["instances"][0]["links"]
    assert links[3]["verdict"] == "error" and "device lost" in links[3]["rerun_error"]


def test_get_chain_refuses_unknown_and_non_dict_params():
    with pytest.raises(C.ChainError, match=r"for params, actual: \['batch'\]"):
        C.get_chain("v32-mla-c8", {"batch": 2})
    with pytest.raises(C.ChainError, match="for params, actual: 'list'"):
        C.get_chain("v32-mla-c8", [("key_dtype", "int8")])
    assert C.get_chain("v32-mla-c8", {"batch": 2, "key_dtype": "int8"}, ignore_unknown=True).name == "v32-mla-c8"


def test_a_truncated_intermediate_is_named_unreadable_not_missing(decode_set, tmp_path, capsys):
    """A dump of the wrong size is there: it was reported as a "missing intermediate" (review F13)."""
    a = actual_copy(decode_set, tmp_path)
    f = a / "decode-a3-int8.index_cache/out.cache.bin"
    f.write_bytes(f.read_bytes()[:100])
    rc, out, err = cli(capsys, "compare", decode_set, "--actual", a, "--chain", "--json", tmp_path / "r.json")
    assert rc == 2 and "link index_cache: unreadable intermediate" in err and "100 bytes" in err, err
    assert not (tmp_path / "r.json").exists()
