"""Test-session settings that must be in place before torch starts its thread pool."""

# tokenmill's OpenMP spin setting (src/tokenmill/__init__.py) must be in place before torch loads: the
# test run starts server subprocesses next to itself, and threads spinning long would crawl.
import tokenmill  # noqa: F401
