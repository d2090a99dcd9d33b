"""Run-time fixes of gaps in JAX's Mosaic GPU interpreter (jax 0.10.2), applied by
:mod:`rankattn.backends.mosaic_gpu` in interpret mode only: nothing here touches the real
lowering, and where JAX's private interpreter modules differ (another JAX version) the
backend declines interpret mode with the reason (:data:`IMPORT_ERROR`).

Both gaps are in the interpretation of ``wgmma_ref_p``, the warpgroup matmul:

* B as a transposed SMEM ref (``plgpu.transpose_ref(k_smem, (1, 0))`` for q k^T): the
  interpreter's wgmma callback (``interpret/gpu_callbacks.py``, ``wgmma``) turns operand
  transforms into an index range (``mosaic/interpret/utils.py``, ``to_range``), which
  takes every transform for an indexer and fails on a ``TransposeTransform``. Fix: read
  with the indexers, then transpose.
* A in registers (p v with p a value, as FA3 does): ``_interpret_wgmma_ref_p``
  (``interpret/jaxpr_interpret.py``) passes every operand as an allocation key, so a
  register value is decoded as a bogus one. Fix: pass a value through.

The replacement callback also reads the SMEM operands through the interpreter's checked
read (``gpu_callbacks._get``), so the race detector sees wgmma reading a K / V slot (the
stock callback reads without recording): a missing "consumed" barrier before the memory
warpgroup refills a slot is then reported.

The interpreter makes a fresh race detector for each kernel launch and its ``get_races``
returns the latest only, so after a call's forward, dq and dk / dv kernels the first two
verdicts would be gone: the detectors rankattn's calls make also report to this module
(:func:`races_found`).

The kernel avoids two more gaps instead of patching them: ``pl.run_state`` /
``plgpu.ACC.init`` ("Higher-order primitive run_state" is not interpreted; p v goes into
a fresh accumulator and is added), and ``plgpu.layout_cast`` (Warpgroup semantics infers
layouts).
"""

from __future__ import annotations

import functools
import inspect

import jax
import numpy as np

try:  # JAX's private interpreter modules, as of 0.10.2
    from jax._src import callback
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gcb
    from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as ji
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from jax._src.state import indexing
    from jax._src.state import types as state_types
    IMPORT_ERROR = None
    # jax 0.11 rewrote the interpreter's threads (mesh_location / thread objects in place of
    # device / grid point / thread ids): every import above still succeeds there, so check
    # the layout the fixes are written for.
    if not hasattr(interpret_utils, "GPULoggingInfo") or "thread_id" not in \
            inspect.signature(gcb._get).parameters:
        IMPORT_ERROR = (f"JAX {jax.__version__}'s Mosaic GPU interpreter is not the one "
                        "rankattn's fixes are written for (jax 0.10's)")
except ImportError as error:  # pragma: no cover - depends on the installed JAX
    IMPORT_ERROR = str(error)

_APPLIED = False
_RACED = False  # a launch's detector found a race since the last races_found()


def _read_operand(token, device_id, grid_point_coords, thread_id, key, transforms,
                  source_info):
    """A checked read (the race detector records it) of an SMEM operand whose transforms
    are indexers, then transposes (what ``transpose_ref`` of a sliced ref gives)."""
    transforms = gcb._remove_noop_transforms(tuple(transforms))
    indexers = [t for t in transforms if isinstance(t, indexing.NDIndexer)]
    transposes = transforms[len(indexers):]
    assert transforms[:len(indexers)] == tuple(indexers), transforms
    assert all(isinstance(t, state_types.TransposeTransform) for t in transposes), transforms
    token, value = gcb._get(token=token, device_id=device_id,
                            grid_point_coords=grid_point_coords, thread_id=thread_id,
                            allocation_key_as_array=key, transforms=tuple(indexers),
                            source_info=source_info)
    value = np.asarray(value)
    for t in transposes:
        value = np.transpose(value, t.permutation)
    return token, value


def _wgmma_callback(*, token, device_id, grid_point_coords, thread_id,
                    acc_allocation_key_as_array, acc_transforms, acc_dtype,
                    a_allocation_key_as_array, a_transforms, a_value,
                    b_allocation_key_as_array, b_transforms, source_info=None):
    """``gpu_callbacks.wgmma`` with both fixes: acc += a b."""
    if a_value is not None:  # A in registers
        a = np.asarray(a_value)
    else:
        token, a = _read_operand(token, device_id, grid_point_coords, thread_id,
                                 a_allocation_key_as_array, a_transforms, source_info)
    token, b = _read_operand(token, device_id, grid_point_coords, thread_id,
                             b_allocation_key_as_array, b_transforms, source_info)
    device, thread = int(device_id), int(thread_id)
    shared_memory = gcb._get_shared_memory()
    global_thread = shared_memory.get_global_thread_id(device, thread)
    acc_range = interpret_utils.to_range(
        jax.tree.map(int, gcb._remove_noop_transforms(acc_transforms)))
    info = interpret_utils.GPULoggingInfo(
        device_id=device, grid_point_coords=tuple(int(x) for x in grid_point_coords),
        thread_id=thread, source_info=source_info)
    acc_key = gcb.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, global_thread,
                                                 logging_info=info)
    shared_memory.store_buffer_content(acc_key, acc_range,
                                       acc + np.matmul(a, b, dtype=acc_dtype),
                                       global_thread, logging_info=info)
    return token


def _interpret_wgmma_ref_p(self, eqn, token, get_invals):
    """``JaxprInterpreter._interpret_wgmma_ref_p`` passing a register A as a value."""
    acc, a, b, *leaves = get_invals()
    empty = jax.tree.structure([])
    acc_t, a_t, b_t = jax.tree.unflatten(
        jax.tree_util.treedef_tuple(tuple(eqn.params[f"{x}_transforms_tree"] or empty
                                          for x in ("acc", "a", "b"))), leaves)
    a_is_ref = isinstance(eqn.invars[1].aval, state_types.AbstractRef)
    return callback.io_callback(
        functools.partial(_wgmma_callback, acc_dtype=eqn.invars[0].aval.dtype,
                          source_info=eqn.source_info),
        gcb.TOKEN_SHAPE_DTYPE, token=token, device_id=self.device_info.device_id,
        grid_point_coords=self.grid_point_coords, thread_id=self.thread_id,
        acc_allocation_key_as_array=acc, acc_transforms=acc_t,
        a_allocation_key_as_array=a if a_is_ref else None, a_transforms=a_t,
        a_value=None if a_is_ref else a, b_allocation_key_as_array=b, b_transforms=b_t,
        ordered=True), []


def _reporting(detector_class):
    """``detector_class`` whose instances set :data:`_RACED` when they find a race (the
    interpreter keeps only the latest launch's detector)."""

    class Reporting(detector_class):
        @property
        def races_found(self) -> bool:
            return self.__dict__.get("_races_found", False)

        @races_found.setter
        def races_found(self, value: bool) -> None:
            global _RACED
            self.__dict__["_races_found"] = value
            _RACED = _RACED or bool(value)

    return Reporting


def interpret_params():
    """The interpreter's parameters for rankattn's kernels (race detection on), with the
    fixes above applied (once)."""
    global _APPLIED
    if not _APPLIED:
        ji.JaxprInterpreter._interpret_wgmma_ref_p = _interpret_wgmma_ref_p
        gcb.RaceDetectionState = _reporting(gcb.RaceDetectionState)
        _APPLIED = True
    return InterpretGPUParams(detect_races=True)


def races_found() -> bool:
    """Whether any kernel launch since the last call found a race: every launch of a call
    (forward, dq, dk / dv), not only the latest (tests read it after a call)."""
    global _RACED
    raced, _RACED = _RACED, False
    return raced
