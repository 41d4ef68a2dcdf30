from hypothesis import settings

from qsfa._profiles import register_profiles

settings.load_profile(register_profiles())
