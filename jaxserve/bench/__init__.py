"""Benchmarks as code: ``jaxserve bench`` (offline serving: ``offline.py`` the command line,
``serving.py`` the measured run), the fixed-seed workloads it serves (``workload.py``) and the
measuring helpers the scripts in ``bench/`` share (``measure.py``)."""
