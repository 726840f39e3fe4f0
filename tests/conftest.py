"""Test-session settings that must be in place before torch starts its thread pool."""

import os

# See src/tokenmill/__init__.py: spinning OpenMP threads crawl when another process shares the 2 cores
# (the test run starts server subprocesses next to itself).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
