"""N ranking servers behind HAProxy, routed by user: ``python -m examples.ranker cluster``.

``python -m examples.ranker cluster --preset P --out DIR --port PORT --replicas N [server
flags]`` runs N ranking servers (``python -m examples.ranker server``: the same model and
flags, each on a port of 127.0.0.1 of its own and started with ``--replica-index i``, so
that its answers carry ``X-Ranker-Replica: i``) and HAProxy in front of them on HOST:PORT.

Why HAProxy: it is an existing, maintained proxy, packaged by Debian (``apt-get install
haproxy``), and it does the three things a set of replicas with history stores needs:

* **routing by user**: ``balance hdr(X-User-Id)`` with ``hash-type consistent`` puts each
  user on one replica (its history is cached once, where its requests land); when a replica
  leaves, only its users move (to the next replica on the ring), and they come back when it
  returns. A request without the header is routed round robin (HAProxy's documented fallback
  for ``balance hdr`` when the header is absent): it is answered, without affinity.
  ``--no-affinity`` routes every request round robin (the benchmark's baseline).
* **health checks** on each replica's ``/readyz`` every 500 ms: two failures take a replica
  out (a killed one leaves within about a second; a warming or draining one takes no
  traffic), one success puts it back. A probe may take 5 s: an overloaded replica, slow to
  answer but answering, stays in (taking it out would turn overload into an outage). With no
  replica up HAProxy answers 503 itself.
* **retries elsewhere**: a request whose replica refuses the connection or closes it without
  an answer (it died) is sent once more, to the next replica on the ring (ranking is
  idempotent), so a replica that dies costs its users a miss each, not an error. Only a
  request HAProxy holds whole can be sent again (its buffers take 128 KB); a larger one that
  was in flight on a replica that died gets 502.

The servers check ``X-User-Id`` against the body's ``user`` (400 naming both when they
differ): the proxy routes by the header, the store keys by the body.

Start-up: HAProxy's configuration is written to DIR/cluster/haproxy.cfg (with its log, the
replicas' logs and, unless JAX_COMPILATION_CACHE_DIR is set, the replicas' shared
compilation cache); HAProxy runs in the foreground (``-db``) as a child, every replica in
maintenance; replica 0 starts first and the others once it has loaded its model, so that
they read most of its compiled programs from the cache instead of compiling the same ones on
the same cores. Once every replica answers ``/readyz`` 200, the cluster takes them all out of
maintenance at once and, when HAProxy sees each one up, prints that it is ready: until then
the front port answers 503 (HAProxy's own: no replica is up). A replica that exits while the
command runs is started again (HAProxy routes its users to the others meanwhile). SIGTERM or
SIGINT stops everything the command started within 60 s (or the longest deadline and 15 s, if
later): the replicas get SIGTERM and drain (every accepted request answered), HAProxy a soft
stop (it finishes the requests it relays); whatever is left after
:meth:`Cluster.drain_seconds` is killed.

:class:`Cluster` is the same as a Python API (``start()``, ``replica_pids``, ``restart(i)``,
``states()``, ``stop()``), which the command runs on and tests and benchmarks use.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from examples.ranker.server import exit_with_parent
from examples.ranker.serverbench import LocalServer, free_ports

HAPROXY_MISSING = ("HAProxy is not installed (no haproxy on PATH or in /usr/sbin): the "
                   "cluster's proxy. Install it with `apt-get install haproxy` (as root; "
                   "Debian and Ubuntu), then run the command again.")
SBIN = "/usr/local/sbin:/usr/sbin:/sbin"
BACKEND = "replicas"
READY_SECONDS = 600.0   # a replica's start (model load and warm-up) at most
KILL_AFTER = 50.0       # stop(): what still runs then is killed, unless a deadline is longer
CHECK = "inter 500ms fall 2 rise 1"  # health checks: a dead replica out in ~1 s, back in 0.5
SOCKET_PATH_MAX = 107   # bytes in a UNIX socket's path (sockaddr_un), its terminator left out
CLUSTER_FLAGS = ("command", "replicas", "no_affinity", "port", "host", "out", "replica_index",
                 "parent_pid")


class Cluster:
    """``replicas`` ranking servers on 127.0.0.1 behind HAProxy on ``host``:``port``.

    ``out``: the run directory the servers serve (its newest checkpoint), under which
    ``cluster/`` holds HAProxy's configuration, socket and log and each replica's log.
    ``server_args``: every replica's server flags (not ``--out``, ``--port`` or
    ``--replica-index``, which the cluster sets). ``affinity``: route by ``X-User-Id``
    (consistent hashing), else round robin. ``env``: the replicas' environment (default
    this process's), given a shared compilation cache unless it names one.
    """

    def __init__(self, out: str, port: int, replicas: int, server_args: list[str], *,
                 host: str = "127.0.0.1", affinity: bool = True, env: dict | None = None):
        if replicas < 1:
            raise ValueError(f"a cluster needs at least 1 replica; got {replicas}")
        self.out, self.host, self.port, self.affinity = out, host, port, affinity
        self.server_args = list(server_args)
        self.directory = Path(out).resolve() / "cluster"
        self.socket_path = str(self.directory / "haproxy.sock")
        self.env = dict(os.environ if env is None else env)
        if "JAX_COMPILATION_CACHE_DIR" not in self.env:
            self.env.update(JAX_COMPILATION_CACHE_DIR=str(self.directory / "jax_cache"),
                            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        self.ports: list[int] = []
        self.replicas: list[LocalServer | None] = [None] * replicas
        self.starts = [0] * replicas  # per replica, the processes started so far (log names)
        self.haproxy: subprocess.Popen | None = None

    # --- Start. ---------------------------------------------------------------------------

    def start(self, ready_within: float = READY_SECONDS) -> "Cluster":
        """Start HAProxy and every replica; return once each replica is ready and HAProxy
        sees it up. Raises :class:`HAProxyMissing` before starting anything when HAProxy
        is not installed, RuntimeError (with the log) when a process fails."""
        binary = haproxy_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        if len(self.socket_path.encode()) > SOCKET_PATH_MAX:
            raise ValueError(f"HAProxy's socket path {self.socket_path} is longer than a UNIX "
                             f"socket's {SOCKET_PATH_MAX} bytes: pass a shorter --out")
        self.ports = free_ports(len(self.replicas))
        config = self.directory / "haproxy.cfg"
        config.write_text(haproxy_config(self.host, self.port, self.ports, self.affinity,
                                         self.socket_path, self._server_seconds()))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        # HAProxy first: the front port answers (503: no replica up) from the start.
        log = open(self.directory / "haproxy.log", "w")
        self.haproxy = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_for_haproxy()
        self._launch(0)
        self._wait_listening(self.replicas[0], ready_within)
        # The others start once replica 0 has loaded its model: they load theirs while it
        # compiles, then read most of its programs from the shared compilation cache.
        for i in range(1, len(self.replicas)):
            self._launch(i)
        for replica in self.replicas:
            replica.wait_ready(ready_within)
        for i in range(len(self.replicas)):  # out of maintenance (haproxy_config)
            self._haproxy_command(f"set server {BACKEND}/{replica_name(i)} state ready")
        self.wait_states(["UP"] * len(self.replicas), within=10.0)
        return self

    def drain_seconds(self) -> float:
        """How long a replica may take to stop after SIGTERM: :data:`KILL_AFTER`, or its
        longest deadline and a margin where that is longer (it answers every request it
        accepted, each within its deadline)."""
        return max(KILL_AFTER, self._server_seconds())

    def _server_seconds(self) -> int:
        """How long HAProxy waits for a replica's answer: the longest deadline a replica
        gives a request (--deadline-ms, 5 s by default) and a margin."""
        flags = self.server_args
        deadline_ms = (float(flags[flags.index("--deadline-ms") + 1])
                       if "--deadline-ms" in flags else 5000.0)
        return math.ceil(deadline_ms / 1e3) + 5

    def _wait_for_haproxy(self, within: float = 10.0) -> None:
        """Wait until HAProxy answers on its socket; raise with its log if it exits (a
        configuration it refuses, a port in use)."""
        deadline = time.monotonic() + within
        while True:
            if self.haproxy.poll() is not None:
                raise RuntimeError(f"HAProxy exited with status {self.haproxy.returncode}:\n"
                                   + (self.directory / "haproxy.log").read_text())
            with contextlib.suppress(OSError):
                self.states()
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy did not open {self.socket_path} within "
                                   f"{within:g} s:\n"
                                   + (self.directory / "haproxy.log").read_text())
            time.sleep(0.05)

    @staticmethod
    def _wait_listening(replica: LocalServer, within: float) -> None:
        """Wait until ``replica`` answers /livez (its model is loaded; it may still warm
        up); raise with its log if it exits first or does not answer within ``within``."""
        deadline = time.monotonic() + within
        while replica.get("/livez")[0] != 200:
            if replica.process.poll() is not None or time.monotonic() > deadline:
                replica.wait_ready(0)  # kills it and raises, with its log
            time.sleep(0.1)

    def _launch(self, i: int) -> None:
        """Start replica ``i`` on its port (not waiting for it)."""
        self.starts[i] += 1
        log = self.directory / f"replica-{i}.{self.starts[i]}.log"
        self.replicas[i] = LocalServer(
            self.out, [*self.server_args, "--replica-index", str(i)], str(log), self.env,
            ready_within=None, port=self.ports[i], own_session=True)

    # --- While it runs. -------------------------------------------------------------------

    @property
    def replica_pids(self) -> list[int]:
        """Each replica's process id (the current process of a restarted one)."""
        return [replica.process.pid for replica in self.replicas]

    def exited(self) -> list[int]:
        """The replicas whose process has exited."""
        return [i for i, r in enumerate(self.replicas) if r.process.poll() is not None]

    def restart(self, i: int, ready_within: float = READY_SECONDS) -> None:
        """Start replica ``i`` again on its port (stopping it first if it still runs, with
        SIGTERM: it drains); return once it is ready and HAProxy sees it up again."""
        old = self.replicas[i]
        if old.process.poll() is None:
            old.stop(timeout=self.drain_seconds())
        self._launch(i)
        self.replicas[i].wait_ready(ready_within)
        self.wait_states({i: "UP"}, within=10.0)

    def states(self) -> list[str]:
        """HAProxy's view of each replica (its ``show stat``): "UP", "DOWN", "MAINT" (until
        start() ends), or a transition such as "UP 1/2" (going down) or "DOWN 1/2"."""
        lines = self._haproxy_command("show stat").lstrip("# ").splitlines()
        status = {row["svname"]: row["status"] for row in csv.DictReader(lines)
                  if row.get("pxname") == BACKEND}
        return [status[replica_name(i)] for i in range(len(self.replicas))]

    def _haproxy_command(self, command: str) -> str:
        """HAProxy's answer to ``command`` on its stats socket (its management commands)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(self.socket_path)
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def wait_states(self, want, within: float) -> list[str]:
        """Wait until HAProxy's view matches ``want`` (a state per replica, or {index:
        state}); the states then. Raises RuntimeError after ``within`` seconds."""
        want = dict(enumerate(want)) if isinstance(want, list) else want
        deadline = time.monotonic() + within
        while any((states := self.states())[i] != state for i, state in want.items()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy sees the replicas {states}, not {want}, after "
                                   f"{within:g} s")
            time.sleep(0.05)
        return states

    # --- Stop. ----------------------------------------------------------------------------

    def stop(self, kill_after: float | None = None) -> dict[str, int]:
        """Stop everything started: SIGTERM to each replica (it drains: every request it
        accepted is answered), a soft stop to HAProxy (SIGUSR1: it stops listening and
        finishes the requests it relays); whatever still runs after ``kill_after`` seconds
        (default: :data:`KILL_AFTER`, or longer where a replica's drain may take longer) is
        killed. The exit status of each process ("replica i", "haproxy")."""
        if kill_after is None:
            kill_after = self.drain_seconds()
        processes = {f"replica {i}": r.process for i, r in enumerate(self.replicas) if r}
        if self.haproxy is not None:
            processes["haproxy"] = self.haproxy
        for name, process in processes.items():
            if process.poll() is None:
                process.send_signal(signal.SIGUSR1 if name == "haproxy" else signal.SIGTERM)
        deadline = time.monotonic() + kill_after
        statuses = {}
        for name, process in processes.items():
            try:
                statuses[name] = process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                statuses[name] = process.wait()
        return statuses

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:  # no __exit__ follows: what started must stop here
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class HAProxyMissing(RuntimeError):
    """HAProxy is not installed."""


def haproxy_binary() -> str:
    """HAProxy's path; raises :class:`HAProxyMissing` (saying how to install it) without
    one."""
    # Debian installs it in /usr/sbin, which a user's PATH often leaves out.
    binary = shutil.which("haproxy") or shutil.which("haproxy", path=SBIN)
    if binary is None:
        raise HAProxyMissing(HAPROXY_MISSING)
    return binary


def replica_name(i: int) -> str:
    return f"replica{i}"


def haproxy_config(host: str, port: int, replica_ports: list[int], affinity: bool,
                   socket_path: str, server_seconds: int) -> str:
    """HAProxy's configuration: the front on ``host``:``port``, the replicas on 127.0.0.1's
    ``replica_ports``, routed by ``X-User-Id`` on a consistent-hash ring (``affinity``) or
    round robin, health-checked on /readyz; its stats socket (admin level) at
    ``socket_path``."""
    balance = ("    # A user's requests go to one replica; a request without the header is\n"
               "    # routed round robin (HAProxy's fallback for balance hdr).\n"
               "    balance hdr(X-User-Id)\n"
               "    # Consistent hashing: a replica that leaves moves only its own users.\n"
               "    # avalanche: user ids are similar strings, which plain sdbm spreads badly.\n"
               "    hash-type consistent sdbm avalanche\n"
               if affinity else "    balance roundrobin  # --no-affinity\n")
    servers = "".join(f"    server {replica_name(i)} 127.0.0.1:{p} disabled\n"
                      for i, p in enumerate(replica_ports))
    return f"""\
# Written by examples/ranker/cluster.py at each start of the cluster: do not edit.
global
    stats socket {socket_path} mode 600 level admin
    # A soft stop (SIGUSR1) waits for the requests in flight, at most this long.
    hard-stop-after {server_seconds + 5}s
    # Buffers that hold a whole request (the small preset's largest is 93 KB): a retry
    # sends it again.
    tune.bufsize 131072
    log stdout format raw local0

defaults
    # Failed or unusual requests only (retried, refused, cut), into the command's log.
    log global
    option httplog
    option dontlog-normal
    mode http
    timeout connect 1s
    timeout client 60s
    # A replica answers every request by its deadline (--deadline-ms) and a margin.
    timeout server {server_seconds}s
    timeout http-keep-alive 30s
    # A health check may take this long: an overloaded replica still answers (its queue
    # refuses what it cannot take), and taking it out for a slow probe would turn overload
    # into an outage. A dead one refuses the connection at once, whatever this is.
    timeout check 5s
    # A request whose replica refused the connection or closed it without an answer (it
    # died since the last check, or while computing it) is sent once more, to the next
    # replica of the ring: ranking is idempotent. Only a request that fits a buffer can be
    # sent again (tune.bufsize), and only once HAProxy holds all of it (http-buffer-request:
    # it waits for the body before it picks a replica); a larger one gets 502.
    retries 1
    option redispatch 1
    retry-on conn-failure empty-response
    option http-buffer-request

frontend ranker
    bind {host}:{port}
    default_backend {BACKEND}

backend {BACKEND}
{balance}\
    # A replica takes traffic only while /readyz answers 200: not while it warms up or
    # drains, nor once a stage thread has died. weight 256 (the most): more points per
    # replica on the ring, so that users split evenly.
    option httpchk GET /readyz
    http-check expect status 200
    default-server check {CHECK} weight 256
    # Each starts in maintenance: the cluster takes them all out of it at once, once all
    # are ready (until then the front answers 503).
{servers}"""


# --- The command. ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags (passed on to every replica; --port and --host are the front's)
    and the cluster's own."""
    from examples.ranker import server

    server.add_arguments(parser)
    parser.add_argument("--replicas", type=int, default=2, help="server processes; default "
                        "%(default)s")
    parser.add_argument("--no-affinity", action="store_true", help="route round robin "
                        "instead of by X-User-Id (the benchmark's baseline)")


def replica_flags(args: argparse.Namespace) -> list[str]:
    """The server flags of ``args`` (every one set, defaults included), for each replica:
    everything but the cluster's own (CLUSTER_FLAGS)."""
    flags = []
    for dest, value in vars(args).items():
        if dest in CLUSTER_FLAGS or value is None or value is False:
            continue
        flags.append("--" + dest.replace("_", "-"))
        if value is not True:
            flags.append(str(value))
    return flags


class Interrupted(Exception):
    """SIGTERM or SIGINT reached the command."""


def _interrupt(sig, frame) -> None:
    raise Interrupted(signal.Signals(sig).name)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Start the cluster, print when it is ready, restart a replica that exits, and stop
    everything on SIGTERM / SIGINT; the exit status (0 after a stop, 1 when HAProxy or a
    replica's start failed)."""
    if args.replica_index is not None:
        parser.error("--replica-index: the cluster numbers its replicas itself")
    if args.replicas < 1:
        parser.error(f"--replicas must be positive; got {args.replicas}")
    try:
        haproxy_binary()
    except HAProxyMissing as err:
        parser.error(str(err))
    cluster = Cluster(args.out, args.port, args.replicas, replica_flags(args),
                      host=args.host, affinity=not args.no_affinity)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    if args.parent_pid is not None:  # its own parent's death stops it like a SIGTERM
        exit_with_parent(args.parent_pid)
    status = 0
    try:
        cluster.start()
        print(f"ready: {cluster.url} (HAProxy, routing "
              f"{'round robin' if args.no_affinity else 'by X-User-Id'}) -> "
              f"{len(cluster.replicas)} replicas on 127.0.0.1:"
              f"{', '.join(map(str, cluster.ports))} (pids "
              f"{', '.join(map(str, cluster.replica_pids))}); logs in {cluster.directory}",
              flush=True)
        while cluster.haproxy.poll() is None:
            for i in cluster.exited():
                print(f"replica {i} exited with status "
                      f"{cluster.replicas[i].process.returncode}: starting it again",
                      flush=True)
                cluster.restart(i)
                print(f"replica {i} is back (pid {cluster.replica_pids[i]})", flush=True)
            time.sleep(0.2)
        print(f"HAProxy exited with status {cluster.haproxy.returncode}; see "
              f"{cluster.directory / 'haproxy.log'}", file=sys.stderr)
        status = 1
    except Interrupted as signal_name:
        print(f"{signal_name}: stopping the cluster", flush=True)
    except RuntimeError as err:
        print(f"the cluster failed: {err}", file=sys.stderr)
        status = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # the stop is bounded: let it finish
            signal.signal(sig, signal.SIG_IGN)
        statuses = cluster.stop()
        print("stopped: " + ", ".join(f"{name} exit {code}" for name, code in statuses.items()),
              flush=True)
    return status
