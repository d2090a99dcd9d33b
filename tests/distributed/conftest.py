"""Tests that need 8 devices. tests/test_distributed.py runs them in a subprocess whose
XLA_FLAGS give the CPU 8 fake devices (JAX reads the flag once, when it starts), so the
rest of the suite keeps seeing one device. Collected only in that subprocess."""

from __future__ import annotations

import os

SUBPROCESS_FLAG = "RANKATTN_MESH_TESTS"

if os.environ.get(SUBPROCESS_FLAG) != "1":
    collect_ignore_glob = ["test_*.py"]
