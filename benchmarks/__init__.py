"""Benchmarks comparing tokenmill with its peers and with the hardware limits; see README.md."""
