"""Several machines: what a run does differently when its processes are spread over more than one node.

  host_wait(), host_gather(value)
                       the ranks wait for, or agree with, a process that works alone on the host (writing a
                       checkpoint, final/, a merge; preparing data), and every exchange of Python objects between
                       them: on a gloo group with host_wait_timeout, never through the device
  node_first(acc)      a block run by the global main first, then by each machine's local main (from
                       the global main's shared cache, or into its own node-local one), then by the rest
  fetch_model(...)     Hub downloads: each machine's local main first, the others from its cache
  probe_storage(...)   is output_dir one filesystem every machine sees, or one per machine?
  agree_on_data(...)   every machine prepared the same data (node-local caches from each machine's own files)
  describe(...)        machines, processes per machine, hosts and the rendezvous, for the start log
  from_writer(...)     a value computed by the process that writes a machine's files, for every process

On one machine all of this reduces to what a single-node run did before (one writer, no probe). Stopping a run is
in stop.py, hang forensics in watchdog.py, fault injection (tests) in faults.py.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from finetune.config import ConfigError
from finetune.parallel.topology import Launcher

logger = logging.getLogger("finetune")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity; all of the machine's where the system does not say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_rank() -> int:
    """This process's machine (node) index, as the launcher says it (Launcher.node); 0 without a launcher."""
    return Launcher.read().node


_host_group = None  # start_host_group's


def start_host_group(num_processes: int, timeout_s: int) -> None:
    """Every rank, once, right after the Accelerator: the group the ranks wait on while one process works alone on
    the host (host_wait, host_gather). Those waits can be long for a large model (the main process writes a
    checkpoint's full tensors and checksums hundreds of GB, writes final/, merges an adapter; the first rank
    downloads a model or tokenizes a dataset), and a wait on the device's group is an NCCL collective that its
    watchdog ends after ddp_timeout (30 minutes), killing a run that was only writing. This group is gloo, over the
    host, whatever the device's backend, and waits host_wait_timeout. A rank that dies closes its connections: the
    others' wait fails at once, not at the timeout."""
    global _host_group
    if num_processes > 1:
        import datetime

        import torch.distributed as dist

        _host_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def host_group():
    """start_host_group's group (None in a single process)."""
    import torch.distributed as dist

    if _host_group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("finetune.cluster.start_host_group must run on every rank first")
    return _host_group


def host_wait() -> None:
    """Every rank waits here until all have come (a barrier on the host group)."""
    import torch.distributed as dist

    group = host_group()
    if group is not None:
        dist.barrier(group=group)


def host_gather(value, to: int | None = None) -> list:
    """Every rank's value (a picklable object), in rank order, on every rank; to: on that global rank only (the
    others get []), for large values (a model's weights) that one process writes. Over the host: a device group's
    object collectives would stage the pickled bytes, world size times the largest, on each GPU."""
    import torch.distributed as dist

    group = host_group()
    if group is None:
        return [value]
    out = [None] * dist.get_world_size(group)
    if to is None:
        dist.all_gather_object(out, value, group=group)
        return out
    dist.gather_object(value, out if dist.get_rank() == to else None, dst=to, group=group)
    return out if dist.get_rank() == to else []


def from_main(acc, value):
    """The main process's value, on every rank (under Megatron-LM accelerate's main process is the last rank, not
    rank 0). A collective."""
    return next(v for is_main, v in host_gather((acc.is_main_process, value)) if is_main)


def main_rank(acc) -> int:
    """The main process's global rank. A collective."""
    import torch.distributed as dist

    return from_main(acc, dist.get_rank() if dist.is_initialized() else 0)


@contextmanager
def node_first(acc):
    """The global main process first, then each machine's local main, then everyone else, waiting on the host
    group (a first rank may tokenize or download for hours).

    With a shared cache the global main prepares it and every other process reads it; with a
    node-local cache each machine's local main prepares its own. (accelerate's main_process_first
    alone is the *global* main: a node-local cache would then be prepared by no one on the other
    machines, or by all their ranks at once.) Two waits on every rank, as accelerate's
    main_process_first() nested with local_main_process_first() has them.
    """
    if not acc.is_main_process:
        host_wait()  # the global main has prepared
    if not acc.is_local_main_process:
        host_wait()  # each machine's local main has prepared
    yield
    if acc.is_local_main_process:
        host_wait()  # (the global main: its first wait; the other local mains: their second)
    if acc.is_main_process:
        host_wait()


def fetch_model(acc, name: str) -> None:
    """A Hub id is downloaded by each machine's local main process first; the other processes then load
    it from that machine's cache instead of all asking the Hub at once. Local directories need nothing.
    A failed download is left to from_pretrained, which reports it with the model id."""
    if os.path.isdir(name):
        return
    with node_first(acc):
        if acc.is_local_main_process:
            try:
                from huggingface_hub import snapshot_download

                snapshot_download(name, allow_patterns=FETCHED_FILES)
            except Exception as e:  # offline, unknown id, gated: from_pretrained says which, on every rank
                logger.info("could not pre-fetch %s (%s); loading directly", name, type(e).__name__)


# What from_pretrained reads for a model and its tokenizer (no .bin/.h5/.msgpack/.onnx duplicates).
FETCHED_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]


@dataclass(frozen=True)
class Storage:
    """Where the run's files live, as probed at start."""

    kind: str  # "one machine" | "shared" | "node-local"
    writes: bool  # this process writes the run's own files (checkpoint metadata, `latest`, run_config.yaml)

    @property
    def node_local(self) -> bool:
        return self.kind == "node-local"


def probe_storage(acc, output_dir: str, num_machines: int) -> Storage:
    """Whether every machine sees the same output_dir (a shared filesystem) or each has its own.

    Each machine's local main writes a marker file named by a token the global main chose; a machine
    that sees every machine's marker shares the directory. Shared (or one machine): the global main
    writes the run's files. Node-local: each machine's local main keeps a complete copy of every
    checkpoint, so each machine resumes from its own disk; final/ is written on machine 0.
    An output_dir that a machine cannot write is refused before anything loads.
    """
    if num_machines <= 1:
        return Storage("one machine", acc.is_main_process)
    token = from_main(acc, uuid.uuid4().hex[:12])
    mine = os.path.join(output_dir, f".finetune_probe_{token}_machine{machine_rank()}")
    error = None
    if acc.is_local_main_process:
        try:
            os.makedirs(output_dir, exist_ok=True)
            with open(mine, "w") as f:
                f.write(socket.gethostname())
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    host_wait()
    seen = None
    if acc.is_local_main_process and error is None:
        seen = sum(
            os.path.exists(os.path.join(output_dir, f".finetune_probe_{token}_machine{m}")) for m in range(num_machines)
        )
    reports = host_gather((machine_rank(), socket.gethostname(), acc.is_local_main_process, error, seen))
    if acc.is_local_main_process and error is None:
        os.remove(mine)
    writers = [r for r in reports if r[2]]
    failed = [f"machine {m} ({host}): {err}" for m, host, _, err, _ in writers if err]
    if failed:
        raise ConfigError(
            [
                (
                    "output_dir",
                    f"{output_dir} cannot be written on {'; '.join(failed)}; create it with write permission on "
                    "every machine, or choose another output_dir",
                )
            ]
        )
    if all(seen == num_machines for *_, seen in writers):
        return Storage("shared", acc.is_main_process)
    return Storage("node-local", acc.is_local_main_process)


def describe_storage(storage: Storage, output_dir: str, num_machines: int) -> str:
    """One line for the start log."""
    if storage.kind == "shared":
        return f"storage: {output_dir} is shared by the {num_machines} machines (one copy of each checkpoint)"
    if storage.node_local:
        return (
            f"storage: {output_dir} is NOT shared between the {num_machines} machines: each machine keeps its "
            "own copy of every checkpoint and resumes from it; final/ and metrics.jsonl are on machine 0"
        )
    return f"storage: {output_dir}"


def agree_on_resume(acc, path: str | None) -> None:
    """Every machine must continue from the same step; a node-local copy can lag (a machine's disk was
    full, its copy was deleted)."""
    if acc.num_processes == 1:
        return
    mine = os.path.basename(path) if path else "a fresh start"
    views = host_gather((machine_rank(), socket.gethostname(), mine))
    if len({v for *_, v in views}) > 1:
        found = "; ".join(sorted({f"machine {m} ({h}): {v}" for m, h, v in views}))
        raise ConfigError(
            [
                (
                    "resume_from_checkpoint",
                    f"the machines would resume from different checkpoints ({found}); give the same "
                    "checkpoints/step_N on every machine, or copy the newest checkpoint to the machines that lack it",
                )
            ]
        )


def agree_on_data(num_machines: int, facts: dict[str, object], key: str) -> None:
    """Every machine must train on the same rows. Each machine prepares its data from its own files (node_first: a
    node-local cache), and nothing else compares them: machines holding other contents of the same files trained
    silently on different data, and with other row counts planned other step counts, then the one with more steps
    waited ddp_timeout in a collective the other never joined. facts (Datasets.content, the step count) are
    gathered from every rank, and a difference is refused on every machine with the same message. One small
    collective; none on one machine."""
    if num_machines <= 1:
        return
    views = host_gather((machine_rank(), socket.gethostname(), facts))
    differ = [name for name in facts if len({repr(f.get(name)) for *_, f in views}) > 1]
    if not differ:
        return
    machines: dict[int, tuple[str, dict]] = {}
    for m, host, f in views:
        machines.setdefault(m, (host, f))
    found = []
    for name in differ:
        holders: dict[str, list[str]] = {}
        for m, (host, f) in sorted(machines.items()):
            holders.setdefault(str(f.get(name)), []).append(f"machine {m} ({host})")
        found.append(f"{name}: " + ", ".join(f"{v} on {' and '.join(ms)}" for v, ms in holders.items()))
    raise ConfigError(
        [
            (
                key,
                f"the machines prepared different data ({'; '.join(found)}); give every machine the same files (copy "
                "them to the same path on each, or put them on a filesystem every machine mounts)",
            )
        ]
    )


def from_writer(acc, storage: Storage, compute):
    """compute() run by the process that writes this machine's files (the global main, or each machine's local
    main when output_dir is not shared), and its result handed to every process that reads those files: a
    checkpoint is read (e.g. checksummed) once per copy, not once per process. The others wait on the host group."""
    mine = None
    if storage.writes:
        try:
            mine = compute()
        except ConfigError as e:  # raised on every process, not only where it was found
            mine = e
    if acc.num_processes > 1:
        everyone = host_gather((machine_rank(), storage.writes, mine))
        writers = [(m, value) for m, writes, value in everyone if writes]
        mine = writers[0][1] if len(writers) == 1 else next(v for m, v in writers if m == machine_rank())
    if isinstance(mine, ConfigError):
        raise mine
    return mine


def describe(acc, num_machines: int) -> str:
    """Machines, processes per machine, hosts and rendezvous: one line for the start log."""
    hosts = host_gather((machine_rank(), socket.gethostname()))
    by_machine: dict[int, set[str]] = {}
    for m, host in hosts:
        by_machine.setdefault(m, set()).add(host)
    names = ", ".join(f"{m}: {'/'.join(sorted(h))}" for m, h in sorted(by_machine.items()))
    launcher = Launcher.read()
    local = launcher.local_world_size
    per_machine = local if local is not None else acc.num_processes // max(1, num_machines)
    where = f"{os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}"
    run_id = launcher.run_id
    rendezvous = f"rendezvous {where}" + (f" (run id {run_id})" if run_id and run_id != "none" else "")
    return (
        f"machines: {num_machines} x {per_machine} process(es) per machine = {acc.num_processes} "
        f"(hosts {names}); {rendezvous}"
    )
