"""Backends behind :func:`rankattn.attention`, in the order ``impl='auto'`` tries them."""

from __future__ import annotations

from rankattn.backends.base import Backend
from rankattn.backends.reference import Reference
from rankattn.backends.xla import BlockSizes, Xla

# impl="auto" takes the first that can run the call.
BACKENDS: dict[str, Backend] = {b.name: b for b in (Xla(), Reference())}

__all__ = ["BACKENDS", "Backend", "BlockSizes", "Reference", "Xla"]
