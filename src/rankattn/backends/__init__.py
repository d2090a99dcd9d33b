"""Backends behind :func:`rankattn.attention`, in the order ``impl='auto'`` tries them."""

from __future__ import annotations

from rankattn.backends.base import Backend
from rankattn.backends.cpu import Cpu
from rankattn.backends.pallas_tpu import PallasTpu, TpuTarget
from rankattn.backends.pallas_triton import GpuTarget, PallasTriton
from rankattn.backends.reference import Reference
from rankattn.backends.xla import Xla
from rankattn.blocks import BlockSizes

# impl="auto" takes the first that can run on this machine and can run the call.
BACKENDS: dict[str, Backend] = {b.name: b for b in (PallasTpu(), PallasTriton(), Cpu(), Xla(),
                                                    Reference())}

__all__ = ["BACKENDS", "Backend", "BlockSizes", "Cpu", "GpuTarget", "PallasTpu", "PallasTriton",
           "Reference", "TpuTarget", "Xla"]
