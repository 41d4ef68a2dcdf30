from hypothesis import settings

from qsfa._profiles import register_profiles

pytest_plugins = ["qsfa.conformance.pytest_plugin"]  # --qsfa-backend / --qsfa-backend-module

settings.load_profile(register_profiles())
