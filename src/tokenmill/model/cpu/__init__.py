"""The CPU kernel backend and everything it owns: the C++ kernels' sources (``csrc/``), their instruction-set
variants (``variants.py``, torch-free: ``setup.py`` reads it), loading one (``kernels.py``), packing weights for
them (``packing.py``) and the backend that plans a step for them (``backend.py``)."""
