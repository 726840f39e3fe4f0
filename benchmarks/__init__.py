"""Benchmarks comparing tokenmill with its peers and with the hardware limits; see README.md."""

# Every benchmark runs under tokenmill's OpenMP spin setting (src/tokenmill/__init__.py): it must be in the
# environment before torch loads libgomp, and it applies to the peers in the same process alike.
import tokenmill  # noqa: E402,F401
