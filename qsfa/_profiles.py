"""Hypothesis profiles shared by the test suite and ``qsfa conformance``.

* ``ci``: derandomised (same examples on every run), few examples, no deadline - fits CI's budget.
* ``nightly``: many random examples, for conformance runs on real hardware or overnight.
* ``dev``: a middle ground for local work.

Select one with ``QSFA_HYPOTHESIS_PROFILE`` (tests) or ``--profile`` (CLI). Size bounds for the
strategies (tokens, heads, blocks, ...) are kept per profile in :data:`SIZE_BOUNDS`.
"""

from __future__ import annotations

import os

PROFILES = {
    "ci": dict(max_examples=25, derandomize=True, deadline=None, print_blob=True),
    "dev": dict(max_examples=100, deadline=None, print_blob=True),
    "nightly": dict(max_examples=2000, deadline=None, print_blob=True),
}

#: Upper bounds the strategies respect under each profile (see qsfa.strategies).
SIZE_BOUNDS = {
    "ci": dict(max_batch=2, max_q_tokens=4, max_kv_tokens=96, max_sparse=48, max_heads=8, max_block_size=32),
    "dev": dict(max_batch=3, max_q_tokens=8, max_kv_tokens=256, max_sparse=128, max_heads=16, max_block_size=64),
    "nightly": dict(max_batch=4, max_q_tokens=32, max_kv_tokens=4096, max_sparse=2048, max_heads=128,
                    max_block_size=256),
}


#: The Triton CPU interpreter (TRITON_INTERPRET=1) runs kernels about a thousand times slower than a device:
#: ``qsfa conformance --backend triton`` there defaults to these tiny shapes (one batch, two query rows, 16 KV
#: tokens, two heads), at most this many examples per property and no edge examples (:mod:`qsfa._edges`: they
#: exceed these bounds) - ``--bound`` / ``--max-examples`` override.
INTERPRETER_BOUNDS = dict(max_batch=1, max_q_tokens=2, max_kv_tokens=16, max_sparse=4, max_heads=2,
                          max_block_size=16, max_tokens=4)
INTERPRETER_EXAMPLES = {"ci": 8, "dev": 25, "nightly": 100}


def register_profiles():
    """Register the profiles with hypothesis (idempotent); returns the active profile name."""
    from hypothesis import HealthCheck, settings

    for name, kw in PROFILES.items():
        settings.register_profile(
            name, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **kw
        )
    return active_profile()


class ProfileError(ValueError):
    """``QSFA_HYPOTHESIS_PROFILE`` names no profile: ``qsfa conformance`` exits 2 with it, pytest (through
    :mod:`qsfa.conformance.pytest_plugin`) stops with it as a usage error."""


#: the environment variable that selects the profile where no ``--profile`` is given
PROFILE_VAR = "QSFA_HYPOTHESIS_PROFILE"


def active_profile() -> str:
    """The profile ``QSFA_HYPOTHESIS_PROFILE`` names (default ``ci``); :class:`ProfileError` if it names none."""
    name = os.environ.get(PROFILE_VAR, "ci")
    if name not in PROFILES:
        raise ProfileError(f"Invalid value for {PROFILE_VAR}, actual: {name!r}, reason: must be one of "
                           f"{', '.join(PROFILES)} (or unset: ci).")
    return name
