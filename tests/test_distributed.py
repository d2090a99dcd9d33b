"""Runs tests/distributed/ (attention and serving on 8 fake CPU devices) in a subprocess.

JAX fixes the number of CPU devices when its backend starts, so those tests run in
their own interpreter with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import os

from helpers import run_suite


def test_distributed_suite_on_8_fake_devices():
    run_suite("distributed", dict(RANKATTN_MESH_TESTS="1",
                                  XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                                            + os.environ.get("XLA_FLAGS", "")))
