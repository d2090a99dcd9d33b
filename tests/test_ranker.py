"""Runs tests/ranker/ (the reference ranker example, examples/ranker) in a subprocess.

The example imports flax, optax and orbax, which leave threads and an asyncio
event loop behind; in their own interpreter they cannot affect the rest of the
suite. Their failures fail this test, with their output.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ranker_example_suite():
    env = dict(os.environ, RANKATTN_RANKER_TESTS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/ranker"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (f"tests/ranker failed (exit {result.returncode}):\n"
                                    + result.stdout[-20000:] + result.stderr[-5000:])
    assert " passed" in result.stdout
