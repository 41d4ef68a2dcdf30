"""Bytes a layout leaves unspecified (docs/numerics/layouts.md#unspecified-bytes): declared as data
(qsfa.layouts.unspecified_bytes), ignored exactly by vs_reference, round_trip, skip_slots_untouched,
token_permutation, `qsfa golden compare` and `qsfa golden verify`; the reference still writes 0 there.

A backend leaving random scratch in those bytes passes; the same scratch one byte earlier (on a specified byte)
fails. Positions are derived here from the layout tables of docs/numerics/flashmla-model1.md and
docs/numerics/cache-writers.md#kv_compress_epilog_vllm, not from the code under test.
"""

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.cli import main
from qsfa.conformance import get, run_property
from qsfa.conformance.mutants import Mutant, register_mutant, scratch_writer, unregister_mutant
from qsfa.layouts import unspecified_bytes

M1Q = "layouts.flashmla_model1_quantize"
KCEV = "kv_compress_epilog_vllm"


def test_model1_pad_bytes_are_declared():
    k = np.zeros((3, 2, 1, 512), ml_dtypes.bfloat16)
    m = unspecified_bytes(M1Q, dict(k=k))["cache"]
    # bs 2: 1168 data bytes, padded to 1728; token t's pad byte at 576 * 2 + 8 t + 7
    want = np.zeros(1728, bool)
    want[[1159, 1167]] = True
    want[1168:] = True
    assert m.shape == (3, 1728) and (m == want).all()
    cache = qsfa.layouts.flashmla_model1_quantize(k)
    assert not cache[m].any()  # the reference still writes 0 there


def test_kcev_layout2_scale_padding_of_written_tokens_only():
    x = np.zeros((3, 512), ml_dtypes.bfloat16)
    cache = np.zeros((2, 4, 1, 576 + 8), ml_dtypes.float8_e4m3fn)
    slots = np.array([5, -1, 0])
    m = unspecified_bytes(KCEV, dict(kv_compress_cache=cache, x=x, slot_mapping=slots, quant_group_size=64,
                                     layout=2))["kv_compress_cache"]
    # d 512: n 448, 7 scale bytes + 1 pad per token; block b holds 4 * 576 value bytes, then 8 scale bytes per token
    want = np.zeros((2, 4 * 584), bool)
    want[1, 4 * 576 + 1 * 8 + 7] = True  # slot 5: block 1, position 1
    want[0, 4 * 576 + 0 * 8 + 7] = True  # slot 0
    assert (m.reshape(2, -1) == want).all()
    rows = np.zeros((8, 1, 640), ml_dtypes.float8_e4m3fn)
    assert unspecified_bytes(KCEV, dict(kv_compress_cache=rows, x=x, slot_mapping=slots, layout=1)) == {}
    assert unspecified_bytes("scatter_by_slot", {}) == {}
    with pytest.raises(qsfa.InvalidArgument, match="Invalid shape for kv_compress_cache"):  # the operator's rules
        unspecified_bytes(KCEV, dict(kv_compress_cache=cache, x=x, slot_mapping=slots, layout=1))
    with pytest.raises(qsfa.InvalidArgument, match="Invalid value for arguments, .* missing a required argument: 'k'"):
        unspecified_bytes(M1Q, {})


@pytest.mark.parametrize("op,out,chip", [(M1Q, "cache", None), (KCEV, "kv_compress_cache", "950")])
def test_scratch_in_unspecified_bytes_passes_one_byte_away_fails(op, out, chip, monkeypatch):
    from qsfa import _edges

    monkeypatch.setattr(_edges, "ENABLED", False)  # a few drawn examples (layout 2 among them) suffice here
    props = ["vs_reference", "round_trip"] if op == M1Q else ["vs_reference", "skip_slots_untouched"]
    for shift, want in ((0, "passed"), (-1, "failed")):
        m = Mutant(f"test.scratch{shift}", op, "scratch", scratch_writer(op, out, shift=shift), chip)
        name = register_mutant(m)
        try:
            # one byte away on a written token is judged by vs_reference; skip_slots_untouched looks at the slots a
            # call skips (and at two runs agreeing), which a deterministic wrong byte in a written token leaves alone
            for fam in (props if shift == 0 or op == M1Q else props[:1]):
                r = run_property(get(f"{op}.{fam}"), name, max_examples=6)
                assert r.status == want, (fam, shift, r.message)
        finally:
            unregister_mutant(m)


def _scratched(cache, mask, shift):
    out = np.array(cache, copy=True)
    mask = np.roll(mask, shift, axis=-1)
    out.view(np.uint8)[mask] = np.uint8(0xA5)
    return out


def test_golden_compare_and_verify_ignore_exactly_the_unspecified_bytes(tmp_path, capsys):
    from qsfa.golden import load_manifest
    from qsfa.golden.manifest import load_storage
    from qsfa.golden import io as gio
    from qsfa.golden.verify import VerifyReport, _recompute

    g = tmp_path / "g"
    assert main(["golden", "generate", "--set", "flashmla-model1", "--only", "m1q-bs2", "--out", str(g), "-q"]) == 0
    man = load_manifest(str(g))
    (c,) = man["cases"]
    e = next(a for a in c["arrays"] if a["role"] == "output" and a["name"] == "cache")
    assert e["masked"]
    golden = gio.from_storage(load_storage(str(g), e), e["dtype"])
    k = next(gio.from_storage(load_storage(str(g), a), a["dtype"]) for a in c["arrays"] if a["role"] == "input")
    mask = unspecified_bytes(M1Q, dict(k=k))["cache"]
    for shift, rc in ((0, 0), (-1, 1)):
        act = tmp_path / f"act{shift}.npy"
        np.save(act, _scratched(golden, mask, shift))
        assert main(["golden", "compare", str(g), "--actual", str(act), "--case", "m1q-bs2", "--output",
                     "cache"]) == rc, shift
        capsys.readouterr()
        # verify: a stored golden holding scratch there (as a kernel-made one would) recomputes clean
        stored = {(a["role"], a["name"]): gio.from_storage(load_storage(str(g), a), a["dtype"]) for a in c["arrays"]}
        stored[("output", "cache")] = kernel_made = _scratched(golden, mask, shift)
        made = dict(c, arrays=[dict(a, sha256=gio.array_sha256(gio.to_storage(kernel_made)[1]))
                               if a is e else a for a in c["arrays"]])  # its manifest records those bytes
        report = VerifyReport(str(g))
        _recompute(str(g), made, stored, report)
        assert (report.problems == []) == (shift == 0), report.problems


def test_unspecified_bytes_refuses_unknown_ops_and_non_dict_args_by_name():
    with pytest.raises(qsfa.InvalidArgument, match="for op, actual: 'no_such_op'"):
        unspecified_bytes("no_such_op", {})
    with pytest.raises(qsfa.InvalidArgument, match="for args, actual: 'NoneType'"):
        unspecified_bytes(M1Q, None)
    with pytest.raises(qsfa.InvalidArgument, match="for args"):
        unspecified_bytes("formats.encode", None)  # an operator without such bytes checks its args too


def test_unspecified_bytes_takes_torch_tensors_like_the_operator():
    torch = pytest.importorskip("torch")
    k = np.zeros((3, 2, 1, 512), ml_dtypes.bfloat16)
    want = unspecified_bytes(M1Q, dict(k=k))["cache"]
    got = unspecified_bytes(M1Q, dict(k=torch.zeros((3, 2, 1, 512), dtype=torch.bfloat16)))["cache"]
    assert isinstance(got, np.ndarray) and got.dtype == bool
    np.testing.assert_array_equal(got, want)
