"""Packages installed once into a user cache folder (~/.cache/rankattn/<name>), never into
the project's environment: the compilers and runtimes the deviceless compile scripts need."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile


def folder(name: str) -> str:
    """~/.cache/rankattn/<name>."""
    return os.path.join(os.path.expanduser("~"), ".cache", "rankattn", name)


def installed(name: str) -> str | None:
    """The folder if its install completed (its ``.complete`` marker exists), else None."""
    path = folder(name)
    return path if os.path.exists(os.path.join(path, ".complete")) else None


def install_once(name: str, requirements: list[str]) -> str:
    """The folder holding ``requirements`` (pip's ``--no-deps --target``), installed there on
    first use. Raises RuntimeError with pip's last lines when they cannot be had."""
    path = installed(name)
    if path:
        return path
    path = folder(name)
    # Staged beside the final folder (one file system, so the rename is atomic): a
    # concurrent install (two test workers) either wins the rename or finds it done.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f"{name}-staging-", dir=os.path.dirname(path))
    try:
        result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                 "--target", staging, *requirements],
                                capture_output=True, text=True)
        if result.returncode:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-5:])
            raise RuntimeError(f"pip could not install {' '.join(requirements)}:\n{tail}")
        open(os.path.join(staging, ".complete"), "w").close()
        try:
            os.rename(staging, path)
        except OSError:
            if not installed(name):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after a rename; else a loser's copy
    return path
