"""The Ascend NPU backend (``backend="npu"``): torch_npu functions and vLLM-Ascend custom ops.

* :mod:`qsfa.npu.device`     - availability, chip family (A2 / A3 / 950), limits of the call path.
* :mod:`qsfa.npu.mapping`    - pure functions from qsfa's arguments to the torch_npu / custom-op call.
* :mod:`qsfa.npu.signatures` - the recorded signatures of those callables (``signatures.json``).
* :mod:`qsfa.npu.backend`    - registers the implementations; imports torch and torch_npu, so it is only
  imported when the backend is used.

Importing this package imports neither torch nor torch_npu. See docs/backends.md for running on an
Ascend machine.
"""
