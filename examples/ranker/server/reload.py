"""Hot model swaps: the newest checkpoint of the run directory loaded beside the served
model and switched in, on ``POST /admin/reload`` (loopback clients only) or SIGHUP.

:meth:`Reloader.request` answers at once: 202 with the step it starts loading, 200 when that
step is already served, 404 when the run directory has no checkpoint, 409 while a reload is
in progress, 503 when the engine is not serving. A checkpoint is the one served when its
step and its directory are (a rewritten run directory may reuse the served step). The load
runs in a thread of its own (restore, then :meth:`Engine.swap`: checked, warmed, switched
between batches), so the server answers and stays ready throughout; a load that fails is logged and counted
(``ranker_reloads_total{outcome="failed"}``) and the served model stays.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import jax
import jax.numpy as jnp

from examples.ranker import train
from examples.ranker.server.engine import STATE_FIXES, Model
from examples.ranker.server.schema import Answer, error, unavailable

log = logging.getLogger("examples.ranker.server")


class Checkpoints:
    """The checkpoints ``train`` writes into the run directory ``out`` (read afresh on
    each call: a reload sees the ones written since the server started)."""

    def __init__(self, preset, out: str):
        self.preset, self.out = preset, out

    def latest(self) -> tuple[int, int, int] | None:
        """The newest checkpoint as (step, inode, mtime in ns) of its directory, None when
        there is none: a run directory rewritten by another training run may reuse a step,
        but not its directory."""
        if not os.path.isdir(os.path.join(self.out, "checkpoints")):
            return None
        with self._manager() as manager:
            return self._identity(manager)

    def restore(self) -> Model:
        """The newest checkpoint; FileNotFoundError when there is none (train.restore would
        give a fresh model)."""
        with self._manager() as manager:
            checkpoint = self._identity(manager)
            if checkpoint is None:
                raise FileNotFoundError(f"{self.out} has no checkpoint")
            step, graphdef, params, _ = train.restore(self.preset, manager)
        # Orbax restores arrays committed to a device, and a committed input makes a
        # program's outputs committed: the store's cache would change signature after
        # warm-up and its programs compile again. Uncommitted, as a fresh model's.
        return Model(step, graphdef, jax.tree.map(jnp.asarray, jax.device_get(params)),
                     checkpoint=checkpoint if checkpoint[0] == step else None)

    @staticmethod
    def _identity(manager) -> tuple[int, int, int] | None:
        step = manager.latest_step()
        if step is None:
            return None
        stat = os.stat(os.path.join(manager.directory, str(step)))  # orbax's step folder
        return step, stat.st_ino, stat.st_mtime_ns

    def _manager(self):
        """A checkpoint manager of ``out``, closed on exit (it owns threads and files)."""
        return contextlib.closing(train.checkpoints(self.preset, self.out))


class Reloader:
    """Swaps the engine's model for the newest of ``checkpoints`` on request."""

    def __init__(self, engine, checkpoints: Checkpoints):
        self.engine, self.checkpoints = engine, checkpoints
        self.loading: int | None = None  # the step being loaded
        self._lock = threading.Lock()

    def request(self) -> Answer:
        """Start a reload (see the module docstring for the answers); may read the run
        directory, so call it off the event loop."""
        state, reason = self.engine.health()
        if state != "serving":
            return unavailable(state, f"the server is {state}: {reason}; it reloads only "
                               "while serving.", STATE_FIXES[state])
        with self._lock:
            served = self.engine.model_step
            if self.loading is not None:
                return error(409, "reload_in_progress", None, f"step {self.loading} is being "
                              f"loaded (step {served} is served).", "Wait for it: GET /readyz "
                              "names the step served; then reload again if needed.")
            latest = self.checkpoints.latest()
            if latest is None:
                return error(404, "no_checkpoint", None, f"{self.checkpoints.out} has no "
                              f"checkpoint (step {served} is served).", "Write one first "
                              "(python -m examples.ranker train ... --out "
                              f"{self.checkpoints.out}), then reload.")
            if latest == self.engine.model_checkpoint:
                return Answer(200, {"model_step": served, "status": "current"})
            step = latest[0]
            self.loading = step
        threading.Thread(target=self._load, name="reload", daemon=True).start()
        return Answer(202, {"model_step": served, "loading": step, "status": "loading"})

    def on_signal(self) -> None:
        """SIGHUP's reload: :meth:`request`, its answer logged."""
        answer = self.request()
        log.info("SIGHUP: reload answered %d %s", answer.status, answer.body)

    def _load(self) -> None:
        try:
            self.engine.swap(self.checkpoints.restore())
        except Exception:  # noqa: BLE001 - logged and counted; the served model stays
            log.exception("reloading step %d failed; the served model stays", self.loading)
            self.engine.metrics.reloads.labels("failed").inc()
        else:
            self.engine.metrics.reloads.labels("swapped").inc()
        finally:
            with self._lock:
                self.loading = None
