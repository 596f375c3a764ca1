"""The test suite (tiers: `pytest -m unit`, `-m horovod`, `-m system`; README, "Tests")."""
