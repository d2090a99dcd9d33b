"""Runs tests/ranker/ (the reference ranker example, examples/ranker) in a subprocess.

The example imports flax, optax and orbax, which leave threads and an asyncio
event loop behind; in their own interpreter they cannot affect the rest of the
suite.
"""

from __future__ import annotations

from helpers import run_suite


def test_ranker_example_suite():
    run_suite("ranker", dict(RANKATTN_RANKER_TESTS="1"), timeout=900)
