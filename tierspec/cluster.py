"""Ray glue for tierspec's jobs: a pool of workers (Ray actors) that each load their models once
and take units of work one at a time, and a driver that collects what they return and is its
only writer.

``tierspec bench --ray`` sends prompts (a unit is one prompt and repeat with the methods still
to run on it); ``tierspec drafter build-data --ray`` sends shards. The driver keeps one unit in
flight per worker and takes results with ``ray.wait`` as they finish. A worker returns a unit's
results together, so the driver never holds half a unit: all methods of one bench prompt come
from one worker, and its ratios are taken on one machine.

Faults. A unit whose worker is lost (killed, out of memory, its node gone) goes back to the front
of the queue, for the next free worker; Ray restarts the lost worker (``max_restarts``: it loads
its models again) and the pool takes it back once it answers. A unit that raised, or whose
worker was lost, ``max_tries`` times is given up and listed in ``WorkerPool.failures``, never
retried forever. A driver that dies takes its workers with it (they are not detached); its rerun
resumes from what it wrote.

Ray is an optional dependency (``pip install 'tierspec[ray]'``), imported only when a job
connects.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .errors import TierspecError
from .util import source_fingerprint

LOCAL = "local"  # a cluster started by the job itself, on this machine's loopback address


class ClusterError(TierspecError):
    """A Ray run that cannot start or go on: Ray missing, no cluster, too few resources, every
    worker gone."""


@dataclass(frozen=True)
class ClusterConfig:
    """Where a job runs on Ray and how wide. Not part of what a result measures: a folder made by
    one width resumes at another."""

    address: str  # LOCAL, "auto" (the cluster this machine belongs to), or HOST:PORT / ray://HOST:PORT
    workers: int | None = None  # default: as many as the cluster's CPUs (or GPUs) hold
    cpus_per_worker: int = 1  # CPUs each worker reserves, and its torch threads
    gpus_per_worker: float = 0.0  # Ray's num_gpus per worker: 1 on a GPU cluster (with --device cuda)
    max_tries: int = 3  # a unit that fails this often is reported, not tried again

    def __post_init__(self) -> None:
        if not self.address.strip():
            raise ClusterError("--ray needs an address: local, auto, or HOST:PORT of a running cluster")
        checks = {"workers": (self.workers, 1), "cpus_per_worker": (self.cpus_per_worker, 1),
                  "max_tries": (self.max_tries, 1)}
        for name, (value, least) in checks.items():
            if value is None and name == "workers":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ClusterError(f"{name} must be an integer >= {least}, got {value!r}")
        if not self.gpus_per_worker >= 0:
            raise ClusterError(f"gpus_per_worker must be >= 0, got {self.gpus_per_worker!r}")

    def check_device(self, device: str) -> None:
        """Ray hides the GPUs from a worker that reserves none (CUDA_VISIBLE_DEVICES is empty
        there), and a worker that reserves one on the CPU holds it for nothing: refuse both."""
        kind = str(device).split(":")[0]
        if self.gpus_per_worker > 0 and kind not in ("cuda", "auto"):
            raise ClusterError(f"--ray-gpus {self.gpus_per_worker:g} reserves GPUs for workers that run on --device "
                               f"{device}; pass --device cuda")
        if kind == "cuda" and self.gpus_per_worker == 0:
            raise ClusterError("--device cuda on Ray needs --ray-gpus (1 per worker): Ray hides the GPUs from a "
                               "worker that reserves none")


@dataclass(frozen=True)
class MachineInfo:
    """Who produced a result: the worker, its host and process, and the machine as far as the
    numbers depend on it (CPU model, torch threads, device)."""

    worker: str
    host: str
    pid: int
    cpu: str
    threads: int
    device: str

    @classmethod
    def here(cls, worker: str, device) -> "MachineInfo":
        import torch

        shown = str(device)
        if shown.startswith("cuda"):
            shown = f"{shown} ({torch.cuda.get_device_name(device)})"
        return cls(worker, socket.gethostname(), os.getpid(), cpu_model(), torch.get_num_threads(), shown)

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@dataclass
class UnitFailure:
    """A unit given up after ``tries`` tries, with the error of each try."""

    unit: str
    tries: int
    errors: list[str] = field(default_factory=list)


def _on_loopback(address: str) -> bool:
    """Whether ``address`` is LOCAL or a cluster on this machine's loopback address."""
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    return address == LOCAL or host in ("127.0.0.1", "localhost", "::1")


def _import_ray(loopback: bool):
    """Ray, imported on first use. A cluster started here for this job binds the loopback
    address, and a driver joining a cluster there must use it too: Ray resolves 127.0.0.1 to the
    machine's outward address unless its single-machine mode (the one it uses where
    multi-machine clusters are off) is chosen before it is imported."""
    if loopback and "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise ClusterError("--ray needs Ray: pip install 'tierspec[ray]' (on the driver and every node)") from None
    return ray


@contextmanager
def connected(cluster: ClusterConfig):
    """Connected to the cluster for the block: a new one for LOCAL (stopped after), or the one at
    the address. A process already connected (a test, a notebook) is left as it is."""
    ray = _import_ray(_on_loopback(cluster.address))
    if ray.is_initialized():
        yield ray
        return
    if cluster.address == LOCAL:
        count = cluster.workers or max(1, (os.cpu_count() or 1) // cluster.cpus_per_worker)
        # Ray starts its workers 15 steps nicer than the raylet by default, so that the raylet
        # stays responsive; here the workers are the job, and a run beside other load would
        # measure workers starved by it (a single process runs at the caller's priority).
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address=LOCAL, num_cpus=count * cluster.cpus_per_worker,
                 num_gpus=None if cluster.gpus_per_worker else 0, include_dashboard=False)
    else:
        try:
            ray.init(address=cluster.address)
        except ConnectionError as error:
            raise ClusterError(f"no Ray cluster at {cluster.address} ({error}); start one with `ray start --head` "
                               "or use --ray local") from None
    try:
        yield ray
    finally:
        ray.shutdown()


@dataclass(frozen=True)
class Readiness:
    """A worker's answer once started: its job worker's ``describe()``, the tierspec code it runs
    (``util.source_fingerprint``) and its host, or the user error that kept it from starting."""

    description: Any = None
    code: str = ""
    host: str = ""
    error: str | None = None


class Worker:
    """The body of each Ray actor: builds one job worker, ``factory(name, *args)``, on
    ``threads`` torch threads, and keeps a user error (``TierspecError``: a model path missing on
    that node) to report, where raising it would leave an actor Ray restarts over and over.

    A job worker has ``describe() -> dict`` (what it resolved: dtype, code, its machine) and
    ``run(unit)`` (the unit's results, returned whole)."""

    def __init__(self, factory: Callable, name: str, args: tuple, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.worker, self.error = None, None
        try:
            self.worker = factory(name, *args)
        except TierspecError as error:
            self.error = f"{error} (on {socket.gethostname()})"

    def ready(self) -> Readiness:
        if self.error is not None:
            return Readiness(error=self.error)
        return Readiness(self.worker.describe(), source_fingerprint(), socket.gethostname())

    def run(self, unit):
        if self.worker is None:
            raise ClusterError(self.error)
        return self.worker.run(unit)


class WorkerPool:
    """``workers`` Ray actors, each a ``Worker`` around ``factory(name, *args)``, that run units
    one at a time; see the module's docstring for the faults it survives. Use inside
    ``connected``: ``with WorkerPool(...) as pool: pool.start(); for unit, result in pool.run(units)``."""

    def __init__(self, factory: Callable, args: tuple, cluster: ClusterConfig):
        self.factory, self.args, self.cluster = factory, args, cluster
        self.actors: dict[str, Any] = {}
        self.failures: list[UnitFailure] = []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        ray = _import_ray(False)
        for actor in self.actors.values():
            ray.kill(actor)  # frees their CPUs now, for the next job of this process
        self.actors = {}

    def _count(self, ray) -> int:
        """The workers asked for, or as many as the cluster holds; refused where they cannot all
        be placed (they would wait for resources forever)."""
        resources = ray.cluster_resources()
        cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
        fit = int(cpus // self.cluster.cpus_per_worker)
        if self.cluster.gpus_per_worker:
            fit = min(fit, int(gpus // self.cluster.gpus_per_worker))
        count = self.cluster.workers or fit
        if count < 1 or count > fit:
            asked = f"{count} worker(s) × {self.cluster.cpus_per_worker} CPU" + (
                f" and {self.cluster.gpus_per_worker:g} GPU" if self.cluster.gpus_per_worker else "")
            raise ClusterError(f"the Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs: {asked} do not fit "
                               "(lower --ray-workers, --ray-cpus or --ray-gpus, or add nodes)")
        return count

    def start(self) -> list[dict]:
        """Starts the workers and waits until each has loaded its models; returns each one's
        ``describe()``. Refuses a worker that failed to start or runs other tierspec code."""
        ray = _import_ray(False)
        remote = ray.remote(Worker)
        for i in range(self._count(ray)):
            name = f"w{i}"
            # max_task_retries=0: a unit whose worker is lost comes back here, to be given to
            # any worker (not retried on the restarted one) and counted against its tries.
            self.actors[name] = remote.options(
                num_cpus=self.cluster.cpus_per_worker, num_gpus=self.cluster.gpus_per_worker,
                max_restarts=self.cluster.max_tries, max_task_retries=0,
            ).remote(self.factory, name, self.args, self.cluster.cpus_per_worker)
        mine = source_fingerprint()
        descriptions = []
        for name, actor in self.actors.items():
            try:
                answer = ray.get(actor.ready.remote())
            except ray.exceptions.RayError as error:
                raise ClusterError(f"worker {name} did not start: {error}") from None
            if answer.error is not None:
                raise ClusterError(f"worker {name}: {answer.error}")
            if answer.code != mine:
                raise ClusterError(f"worker {name} on {answer.host} runs other tierspec code than this driver "
                                   f"({answer.code} vs {mine}): install the same tierspec on every node")
            descriptions.append(answer.description)
        return descriptions

    def run(self, units: Iterable, describe: Callable[[Any], str] = str) -> Iterator[tuple[Any, Any]]:
        """Yields ``(unit, result)`` as units finish (in any order). A unit given up is not
        yielded: it is in ``failures``. ``describe(unit)`` names a unit in messages."""
        ray = _import_ray(False)
        units = list(units)
        queue = deque(range(len(units)))
        errors: dict[int, list[str]] = {}
        free = list(self.actors)
        running: dict[Any, tuple[str, int]] = {}  # ObjectRef of a unit → (worker, unit index)
        reviving: dict[Any, str] = {}  # ObjectRef of a lost worker's ready() → worker

        def submit() -> None:
            while queue and free:
                name, index = free.pop(0), queue.popleft()
                running[self.actors[name].run.remote(units[index])] = (name, index)

        def failed(index: int, name: str, reason: str, lost: bool) -> None:
            errors.setdefault(index, []).append(reason)
            tries = len(errors[index])
            what = f"worker {name} was lost running {describe(units[index])}" if lost else \
                f"{describe(units[index])} failed on worker {name}"
            if tries < self.cluster.max_tries:
                queue.appendleft(index)  # first in line: the next free worker takes it
                print(f"tierspec: {what} ({reason}); re-queued (try {tries + 1} of {self.cluster.max_tries})",
                      file=sys.stderr, flush=True)
            else:
                self.failures.append(UnitFailure(describe(units[index]), tries, errors[index]))
                print(f"tierspec: {what} ({reason}); given up after {tries} tries", file=sys.stderr, flush=True)

        submit()
        while queue or running:
            if not running and not reviving:
                raise ClusterError(f"every worker is gone, {len(queue)} unit(s) left undone; rerun to resume")
            ready, _ = ray.wait(list(running) + list(reviving), num_returns=1)
            ref = ready[0]
            if ref in reviving:
                name = reviving.pop(ref)
                try:
                    answer = ray.get(ref)
                except ray.exceptions.RayError as error:  # out of restarts
                    answer = Readiness(error=_first_line(error))
                if answer.error is not None:  # a restart that could not load its models takes no more units
                    print(f"tierspec: worker {name} is gone for good ({answer.error})", file=sys.stderr, flush=True)
                else:
                    free.append(name)
                submit()
                continue
            name, index = running.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as error:  # the unit raised; its worker lives on
                free.append(name)
                failed(index, name, _first_line(error.cause if error.cause is not None else error), lost=False)
            except ray.exceptions.RayError as error:  # the worker died: killed, out of memory, node gone
                reviving[self.actors[name].ready.remote()] = name  # answers once Ray has restarted it
                failed(index, name, _first_line(error), lost=True)
            else:
                free.append(name)
                submit()  # before the caller writes: no worker waits on the driver's disk
                yield units[index], result
                continue
            submit()


def _first_line(error: BaseException) -> str:
    """An error in one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
