"""Workers the tests launch as real Horovod ranks, and helpers the tests and benchmarks share."""

import os

# The checkout these files belong to.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
