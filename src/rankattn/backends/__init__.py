"""Backends behind :func:`rankattn.attention`, in the order ``impl='auto'`` tries them."""

from __future__ import annotations

from rankattn.backends.base import Backend
from rankattn.backends.cpu import Cpu
from rankattn.backends.mosaic_gpu import MosaicGpu
from rankattn.backends.pallas_tpu import PallasTpu, TpuTarget
from rankattn.backends.pallas_triton import GpuTarget, PallasTriton
from rankattn.backends.reference import Reference
from rankattn.backends.xla import Xla
from rankattn.blocks import BlockSizes

# impl="auto" takes the first that can run on this machine and can run the call; mosaic_gpu
# only where the GPU check timed it fastest on this GPU (MosaicGpu.auto_reasons).
BACKENDS: dict[str, Backend] = {b.name: b for b in (PallasTpu(), MosaicGpu(), PallasTriton(),
                                                    Cpu(), Xla(), Reference())}

__all__ = ["BACKENDS", "Backend", "BlockSizes", "Cpu", "GpuTarget", "MosaicGpu", "PallasTpu", "PallasTriton",
           "Reference", "TpuTarget", "Xla"]
