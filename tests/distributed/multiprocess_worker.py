"""One process of tests/test_multiprocess.py: sharded attention over 2 processes x 2 CPU devices.

Run as ``python multiprocess_worker.py PROCESS_ID PORT`` with
XLA_FLAGS=--xla_force_host_platform_device_count=2. Both processes build the same
inputs, compute one context- and batch-sharded attention and its gradients on the
4-device global mesh, gather the results, and compare them with a single-device run in
this process. Exit status 0 and a line "ok ..." when they agree.
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=process_id, initialization_timeout=120)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import rankattn  # noqa: E402
# run(sharding, causal, softcap): jit of (q, k, v, seg, d_out, d_lse) -> (out, lse, dq, dk, dv)
# through jax.vjp; this script's folder is on sys.path when it runs.
from test_mesh_attention import run  # noqa: E402

B, S, HQ, HKV, D = 2, 32, 4, 2, 8
rng = np.random.default_rng(0)  # the same inputs in both processes
q = rng.normal(0, 1.5, (B, S, HQ, D)).astype(np.float32)
k, v = (rng.normal(0, 1, (B, S, HKV, D)).astype(np.float32) for _ in range(2))
d_out = rng.normal(0, 1, (B, S, HQ, D)).astype(np.float32)
d_lse = rng.normal(0, 1, (B, HQ, S)).astype(np.float32)
seg = np.zeros((B, S), np.int32)
seg[0, :13], seg[0, 13:16], seg[0, 16:30], seg[0, 30:32] = 1, -1, 2, -2
seg[1, 8:24], seg[1, 24:28] = 3, -3

assert jax.device_count() == 4 and jax.local_device_count() == 2, jax.devices()
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "ctx"))


def global_array(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


for strategy in ("ring", "all_gather"):
    sharding = rankattn.Sharding(mesh, batch="data", context="ctx", strategy=strategy)
    rows, heads_rows = P("data", "ctx"), P("data", None, "ctx")
    args = [global_array(q, rows), global_array(k, rows), global_array(v, rows),
            global_array(seg, rows), global_array(d_out, rows), global_array(d_lse, heads_rows)]
    got = [np.asarray(multihost_utils.process_allgather(x, tiled=True))
           for x in run(sharding, True, None)(*args)]
    with jax.default_device(jax.local_devices()[0]):
        want = [np.asarray(x) for x in run(None, True, None)(q, k, v, seg, d_out, d_lse)]
    for name, w, g in zip(("out", "lse", "dq", "dk", "dv"), want, got):
        if name == "lse":
            assert np.array_equal(np.isneginf(w), np.isneginf(g)), name
            w, g = np.where(np.isneginf(w), 0, w), np.where(np.isneginf(g), 0, g)
        bound = 1e-5 if name in ("out", "lse") else 1e-4 * np.abs(w).max()
        error = float(np.abs(w - g).max())
        assert error <= bound, f"process {process_id} {strategy} {name}: error {error} > {bound}"
    print(f"ok process {process_id} {strategy}", flush=True)

jax.distributed.shutdown()
