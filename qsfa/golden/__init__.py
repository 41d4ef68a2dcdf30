"""Golden tensor case sets for teams outside Python: generate, verify, compare (``qsfa golden ...``).

* :class:`Case` - operator + parameters + seed + input generator (+ explicit inputs); the
  ``qsfa-case/1`` file format shared with the conformance runner (``Case.save`` / ``Case.load``).
* :func:`generate` - run cases on the reference backend and write inputs, outputs and a manifest
  (``bin``: raw little-endian files; ``npz``) that are byte-identical on every machine.
* :func:`verify` / :func:`compare_dir` - checksums and recomputation; a kernel's outputs against a golden
  directory with the docs/numerics/comparison.md#float-criterion criteria.
* :func:`get_set` / :func:`case_sets` / :func:`register_set` - the catalogue of named case sets;
  :func:`register_generator` - named input generators.

See ``docs/golden.md`` for the file formats.
"""

from .case import CASE_FORMAT, Case, available_ops, resolve_op
from .catalogue import CaseSet, case_sets, get_set, register_set, seed_of
from .compare import CompareReport, compare_dir, format_report
from .generators import SENTINEL, generator_names, get_generator, register_generator
from .io import GoldenInputError
from .manifest import GOLDEN_FORMAT, MANIFEST, generate, load_array, load_manifest
from .verify import VerifyReport, verify

__all__ = [
    "CASE_FORMAT",
    "GOLDEN_FORMAT",
    "MANIFEST",
    "SENTINEL",
    "Case",
    "CaseSet",
    "CompareReport",
    "GoldenInputError",
    "VerifyReport",
    "available_ops",
    "case_sets",
    "compare_dir",
    "format_report",
    "generate",
    "generator_names",
    "get_generator",
    "get_set",
    "load_array",
    "load_manifest",
    "register_generator",
    "register_set",
    "resolve_op",
    "seed_of",
    "verify",
]
