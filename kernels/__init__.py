"""Triton kernels of qsfa (installed as ``qsfa.kernels``)."""
