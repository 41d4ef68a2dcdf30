"""Metamorphic properties of the DeepSeek-V4 shared-KV attention (docs/numerics/attention-v4.md).

:func:`v4_properties` is called by :func:`qsfa.conformance.properties.catalogue` (beside
:func:`qsfa.conformance.properties_more.more_properties`); each expectation is a relation between two calls of
the backend, not a result of the reference:

* ``minus_inf_sinks``: sinks of -inf are no sinks - the call with ``sinks=None`` gives the same bytes;
* ``topk_permutation``: permuting a CSA row's top-k entries within each S2 tile of the chip (an indexer's list:
  distinct tokens below the bound, then -1; the 950's tile of 128 is shorter than its K = 512) changes no byte (faithful: every fp32 sum is the correctly rounded
  exact sum, so the order does not matter; exact mode's float64 BLAS sums do depend on it);
* ``split_merge`` (sparse_flash_mla, exact, BSND): the window part with the sinks and the compressed part without
  them, merged by their LSE (float64), equal the whole call within the float criterion.
"""

from __future__ import annotations

import numpy as np

from ._support import call, fail

__all__ = ["v4_properties"]

V4_OPS = ("sparse_flash_mla", "sparse_attn_sharedkv", "mixed_quant_sparse_flash_mla", "kv_quant_sparse_attn_sharedkv",
          "quant_sparse_flash_mla")


def _same(a, b, what):
    if a.shape != b.shape or a.tobytes() != b.tobytes():
        n = int((np.asarray(a).view(np.uint8) != np.asarray(b).view(np.uint8)).sum()) if a.shape == b.shape else -1
        fail(f"{what}: outputs differ ({n} bytes)")


def _s2_tile(op, args, backend) -> int:
    """The S2 tile of the chip the call models (qsfa.chips.SHAREDKV_NUMERICS): the compressed tokens are cut into
    tiles by their position in the top-k row, so a permutation within a tile keeps every tile's set."""
    from .. import chips as C
    from .._dispatch import get_backend, operator
    from ._support import current_chip

    chip = current_chip() or get_backend(backend).chip() or C.chip_for_args(operator(op).contract, args)
    return C.SHAREDKV_NUMERICS[chip]["s2_tile"]


def _minus_inf(op, P, examples):
    def check(ex, backend: str):
        a = ex.args
        n1 = a["q"].shape[-2]
        x = call(op, {**a, "sinks": np.full(n1, -np.inf, np.float32)}, backend)
        y = call(op, {**a, "sinks": None}, backend)
        _same(x["attention_out"], y["attention_out"], "sinks of -inf vs no sinks")
        _same(x["softmax_lse"], y["softmax_lse"], "sinks of -inf vs no sinks (softmax_lse)")

    # the check sets the sinks itself (-inf, then None); the pin "none" makes a chip whose kernels need sinks (every
    # V4 chip rule: "sinks must be given") report the property as not applicable before drawing, instead of failing
    # on the sinks=None call (qsfa.strategies.chips.merge_pins)
    pins = {"return_softmax_lse": True, "sinks": "none"}
    return P(f"{op}.minus_inf_sinks", (op,), "metamorphic",
             "Sinks of -inf add exp(-inf) = 0 to every denominator: the call equals the call with sinks=None, "
             "byte for byte (output and LSE).", examples(op, pins), check, pins)


def _permutation(op, P, examples):
    def check(ex, backend: str):
        a = ex.args
        idx = a.get("cmp_sparse_indices")
        if idx is None:
            return
        rng = np.random.default_rng(ex.seed)
        tile = _s2_tile(op, a, backend)
        flat = np.array(idx, copy=True).reshape(-1, idx.shape[-1])
        for r in range(flat.shape[0]):
            n = int(np.argmin(np.append(flat[r] != -1, False)))  # the valid prefix
            for lo in range(0, n, tile):  # within each S2 tile: the 950's tile (128) is shorter than K = 512
                hi = min(lo + tile, n)
                flat[r, lo:hi] = rng.permutation(flat[r, lo:hi])
        x = call(op, a, backend)
        y = call(op, {**a, "cmp_sparse_indices": flat.reshape(idx.shape)}, backend)
        _same(x["attention_out"], y["attention_out"], "top-k entries permuted")

    pins = {"scenario": "CSA", "topk": "indexer", "precision": "faithful"}  # exact: float64 sums follow the order
    return P(f"{op}.topk_permutation", (op,), "metamorphic",
             "Permuting the valid entries of every CSA top-k row within each S2 tile of the chip (512 tokens on "
             "A2/A3, 128 on the 950; distinct tokens below the bound) changes no output byte: every tile's set, and "
             "so its sums, stay the same.",
             examples(op, pins), check, pins)


def _split_merge(P, examples, op="sparse_flash_mla"):

    def check(ex, backend: str):
        from ..compare import compare_float

        a = {**ex.args, "precision": "exact", "return_softmax_lse": True}
        whole = call(op, a, backend)
        ori = call(op, {**a, "cmp_kv": None, "cmp_sparse_indices": None, "cmp_residual_kv": None,
                        "seqused_cmp_kv": None, "cmp_block_table": None, "cu_seqlens_cmp_kv": None,
                        "cmp_mask_mode": 0, "cmp_ratio": 1, **({"cmp_kv_descale": None} if "q_descale" in a else {})},
                   backend)
        bsz = a["q"].shape[0]
        # no sinks as sinks of -inf (minus_inf_sinks): the 950 kernel needs sinks given
        cmp = call(op, {**a, "ori_mask_mode": 0, "seqused_ori_kv": np.zeros(bsz, np.int32),
                        "sinks": np.full(a["q"].shape[-2], -np.inf, np.float32),
                        **({"ori_win_left": -1, "ori_win_right": -1} if "q_descale" in a else {})}, backend)
        lo, lc = ori["softmax_lse"].astype(np.float64), cmp["softmax_lse"].astype(np.float64)
        with np.errstate(invalid="ignore"):
            lse = np.logaddexp(lo, lc)
            wo = np.where(np.isneginf(lo), 0.0, np.exp(lo - lse))[:, 0, :, :, None]
            wc = np.where(np.isneginf(lc), 0.0, np.exp(lc - lse))[:, 0, :, :, None]
        merged = ori["attention_out"].astype(np.float64) * wo + cmp["attention_out"].astype(np.float64) * wc
        r = compare_float(merged, whole["attention_out"].astype(np.float64), dtype="float32")
        if not r.passed:
            fail(f"window part and compressed part merged by their LSE differ from the whole call: {r.message}")

    pins = {"scenario": ("CSA", "HCA"), "layout_q": "BSND", "layout_kv": "BSND", "ori_mask_mode": (3, 4),
            "cmp_mask_mode": 3, "residual": "exact", "precision": "exact"}
    draw = examples(op, pins)

    def make(bounds, chip=None, extra=None):
        from ..strategies.chips import NotApplicable

        # decided before drawing: the compressed part alone (ori_mask_mode 0, no window) is a call the chip refuses
        if chip in ("A2", "A3"):
            raise NotApplicable(op, chip, "chip_mask_modes", "Atlas A2/A3 need ori_mask_mode 4; the property "
                                "calls the compressed part alone with ori_mask_mode 0")
        if chip == "950" and op == "quant_sparse_flash_mla":
            raise NotApplicable(op, chip, "chip_window", "Ascend 950 needs ori_win_left 127 and ori_win_right 0; the "
                                "property calls the compressed part alone with no window")
        return draw(bounds, chip, extra)

    return P(f"{op}.split_merge", (op,), "metamorphic",
             "The window part (with the sinks, cmp_ratio 1) and the compressed part (ori_mask_mode 0 over zero window "
             "tokens, sinks of -inf), merged by their LSE in float64, equal the whole exact call within the float "
             "criterion.", make, check, pins)


def v4_properties(have: set, P, examples) -> list:
    out = []
    for op in V4_OPS:
        if op in have:
            out += [_minus_inf(op, P, examples), _permutation(op, P, examples)]
    if "sparse_flash_mla" in have:
        out.append(_split_merge(P, examples))
    if "quant_sparse_flash_mla" in have:
        out += [_split_merge(P, examples, "quant_sparse_flash_mla"), _descale_swap(P, examples)]
    return out


def _descale_swap(P, examples):
    """quant_sparse_flash_mla: q_descale x 2 with softmax_scale / 2 (both powers of two) is the same logit scale
    fp32(fp32(softmax_scale * q_descale) * kv_descale), bit for bit."""
    op = "quant_sparse_flash_mla"

    def check(ex, backend: str):
        a = ex.args
        x = call(op, a, backend)
        y = call(op, {**a, "softmax_scale": a["softmax_scale"] / 2,
                      "q_descale": (np.asarray(a["q_descale"], np.float32) * np.float32(2))}, backend)
        _same(x["attention_out"], y["attention_out"], "q_descale x 2 with softmax_scale / 2")

    pins = {"precision": "faithful"}
    return P(f"{op}.descale_power_of_two_swap", (op,), "metamorphic",
             "Doubling q_descale and halving softmax_scale leaves fp32(softmax_scale * q_descale) and so every logit "
             "unchanged: the output bytes are the same.", examples(op, pins), check, pins)
