"""`finetune check`: a preflight for a (multi-node) job, launched exactly like the real run.

    accelerate launch --config_file accelerate_configs/ddp.yaml -m finetune check --config run.yaml

A multi-node job that is wrong usually fails late and unreadably: a rank that never starts (GPU init,
a hung filesystem, another command on that node) leaves the others in a 30-minute collective timeout;
version skew or two ranks on one GPU hang or corrupt silently; a node-local output_dir loses checkpoints
at resume. This check finds each of those in seconds and names the rank:

1. every rank gathers its facts (host, ranks, device and the physical GPU behind it, versions, a hash
   of the effective run config, output_dir) BEFORE it announces itself, so a rank stuck there is seen;
2. arrival: each rank writes its facts into the launcher's TCP store, before any process group exists;
   rank 0 waits --timeout seconds and names the ranks that never arrived;
3. a process group (gloo on CPU, nccl on GPU): all_gather of the facts, a broadcast and an all-reduce
   checked for the right values, and the all-reduce bandwidth;
4. each node's local main writes a file into output_dir: writable? shared between nodes? (And from the
   parse: has the run there finished already, so that the launch would end at once without training?)
5. rank 0 prints one table and "check passed" or a numbered list of problems, each with what to do.

Exit code: 0 all well, 1 a problem, 2 bad input. The logic that judges the gathered facts
(`find_problems`, `render_report`, ...) is pure: it takes the list of per-rank dicts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import socket
import sys
import time
from collections import defaultdict
from datetime import timedelta
from importlib import metadata

from finetune.config import ConfigError
from finetune.faults import fault_point
from finetune.launcher_report import write_error_file

PACKAGES = ("accelerate", "deepspeed", "transformers")
VERDICT_MARGIN_S = 10  # how much longer than rank 0 the other ranks wait for its verdict
NEVER_ARRIVED_CAUSES = (
    "the process is stuck before start (GPU initialisation, a hung network filesystem, a slow import), "
    "that node runs a different command or an old copy of this one, or its launcher never started "
    "(check the job scheduler's log for that node)"
)
NODE_FILE = ".finetune_check_{token}_node{node}"

EPILOG = """\
What it checks, in order (every rank; rank 0 reports):
  1. facts per rank: host, global/local/node rank, device and the physical GPU it maps to (uuid, PCI bus,
     CUDA_VISIBLE_DEVICES), versions of python, torch, accelerate, deepspeed, transformers, finetune, a hash
     of the effective run config (--config and overrides), output_dir;
  2. arrival through the launcher's TCP store within --timeout seconds; ranks that never arrive are named;
  3. a process group (gloo on CPU, nccl on GPU): gather of the facts, broadcast and all-reduce with checked
     results, all-reduce bandwidth (algbw and busbw = algbw * 2(n-1)/n, as nccl-tests define them);
  4. output_dir: writable on every node, and shared between nodes or node-local; under
     --resume_from_checkpoint auto on one machine, whether the run there finished already (the launch would
     end at once, exit 0, without training: one line says so, and how to train again).
Problems (exit 1): versions or run config differing between ranks, two ranks on one GPU, output_dir
not writable, ranks that never arrived, a collective with a wrong result. Bad input: exit 2.
Without a launcher (`python -m finetune check`) it checks this one process."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune check",
        description="Preflight for a (multi-node) job: launch it exactly like the real run.\n\n"
        "  accelerate launch --config_file accelerate_configs/ddp.yaml -m finetune check --config run.yaml\n\n"
        "Any --<field> VALUE after the options overrides the run config, as it would in the real run.",
        epilog=EPILOG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="the run config; its effective config (with any --<field> overrides after it) is hashed and "
        "compared between ranks, and its output_dir is checked",
    )
    parser.add_argument(
        "--output_dir", help="directory to check (default: the run config's output_dir; unchecked without either)"
    )
    parser.add_argument(
        "--timeout",
        type=_positive,
        default=30.0,
        help="seconds to wait for every rank to arrive, and for each collective (default: %(default)s)",
    )
    parser.add_argument(
        "--bandwidth_mb",
        type=_positive,
        help="size of the all-reduce bandwidth test in MB of float32 (default: 64 on GPU, 16 on CPU)",
    )
    return parser


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


# ---------------------------------------------------------------- facts (every rank, before arrival)


def env_ranks(env=os.environ) -> dict:
    """What the launcher says this process is (topology.Launcher). GROUP_RANK (torchrun) is the node; without it,
    derive it. Imported here: finetune.parallel imports torch, which _quiet must precede."""
    from finetune.parallel.topology import Launcher

    launcher = Launcher.read(env)
    return {
        "rank": launcher.rank,
        "local_rank": launcher.local_rank or 0,
        "node": launcher.node,
        "world_size": launcher.torchrun_world_size or 1,  # torchrun's: the store and ranks below are torchrun's
    }


def uses_gpu(env=os.environ) -> bool:
    """A GPU rank unless there is none or the Accelerate config asked for the CPU (use_cpu)."""
    import torch

    from finetune.parallel.topology import Launcher

    return torch.cuda.is_available() and not Launcher.read(env).use_cpu


def device_facts(local_rank: int) -> dict:
    """This rank's device and the physical GPU behind it: two ranks on one GPU show the same uuid.
    Initialises CUDA on purpose, before arrival: a rank stuck there is named as never arrived."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    facts = {"device": "cpu", "gpu": None, "gpu_bus": None, "cuda_visible_devices": visible, "device_error": None}
    if not uses_gpu():
        return facts
    import torch

    count = torch.cuda.device_count()
    if local_rank >= count:
        error = f"local rank {local_rank} but only {count} GPU(s) visible (CUDA_VISIBLE_DEVICES={visible or 'unset'})"
        return {**facts, "device": "cuda:?", "device_error": error}
    props = torch.cuda.get_device_properties(local_rank)
    uuid = str(getattr(props, "uuid", "") or "")
    bus = None
    if hasattr(props, "pci_bus_id"):
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"
    gpu = (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}") if uuid else bus
    return {**facts, "device": f"cuda:{local_rank}", "gpu": gpu, "gpu_bus": bus}


def versions(gpu: bool) -> dict[str, str]:
    """Versions that must match on every node. importlib.metadata, so deepspeed and transformers are not
    imported (slow and noisy); "-" when a package is missing."""
    import torch

    import finetune

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    out["finetune"] = finetune.__version__  # the code running, not whatever metadata an old install left
    if gpu:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def config_facts(args: argparse.Namespace, overrides: list[str]) -> dict:
    """Hash of the effective run config (what the real run would use), the output_dir to check, and whether the run
    in it finished already (`finished`: the line saying so, where the real run would end at once without training).
    A bad config is a ConfigError rendered into the facts: the rank still arrives, and rank 0 reports it."""
    if not args.config and not overrides:
        return {"config_hash": None, "config_error": None, "output_dir": args.output_dir, "finished": None}
    from finetune.config import parse

    argv = (["--config", args.config] if args.config else []) + overrides
    argv += ["--output_dir", args.output_dir] if args.output_dir else []
    try:
        cfg = parse(argv)
    except ConfigError as e:
        return {"config_hash": None, "config_error": e.render(), "output_dir": args.output_dir, "finished": None}
    flat = json.dumps(cfg.to_flat(), sort_keys=True, default=str)
    done = cfg.finished  # the real run would end at once here, exit 0: the check passes, but says it would not train
    return {
        "config_hash": hashlib.sha256(flat.encode()).hexdigest()[:12],
        "config_error": None,
        "output_dir": cfg.train.output_dir,
        "finished": done.launch_note(cfg.train.output_dir) if done and not done.differences else None,
    }


def local_facts(args: argparse.Namespace, overrides: list[str]) -> dict:
    facts = {**env_ranks(), "host": socket.gethostname(), **config_facts(args, overrides)}
    facts.update(device_facts(facts["local_rank"]))
    facts["versions"] = versions(facts["device"].startswith("cuda"))
    return facts


# ---------------------------------------------------------------- judging the facts (pure)


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def version_problems(rows: list[dict]) -> list[tuple[str, str]]:
    problems = []
    for name in rows[0]["versions"]:
        by_version = defaultdict(list)
        for row in rows:
            by_version[row["versions"].get(name, "-")].append(row["rank"])
        if len(by_version) > 1:
            where = "; ".join(f"{v} on {ranks_text(r)}" for v, r in sorted(by_version.items(), key=lambda x: x[1]))
            problems.append(
                (
                    f"{name} differs between ranks: {where}",
                    "install the same versions on every node (one container image or one environment); version "
                    "skew between nodes hangs collectives or changes results",
                )
            )
    return problems


def config_problems(rows: list[dict]) -> list[tuple[str, str]]:
    by_hash = defaultdict(list)
    for row in rows:
        by_hash[row["config_hash"]].append(row["rank"])
    if len(by_hash) < 2:
        return []
    where = "; ".join(f"{h or 'none'} on {ranks_text(r)}" for h, r in sorted(by_hash.items(), key=lambda x: x[1]))
    fix = "every node must read the same run config with the same overrides (a shared path, or the same copy)"
    return [(f"the effective run config differs between ranks: hash {where}", fix)]


_GPU_FIX = (
    "each rank needs its own GPU: do not set CUDA_VISIBLE_DEVICES per rank by hand (the launcher maps "
    "LOCAL_RANK to a GPU), and give the launcher at most as many processes per node as the node has GPUs"
)


def device_problems(rows: list[dict]) -> list[tuple[str, str]]:
    """Ranks without a device of their own to run on (these stop the check before any collective)."""
    return [(f"rank {r['rank']} on {r['host']}: {r['device_error']}", _GPU_FIX) for r in rows if r["device_error"]]


def shared_gpu_problems(rows: list[dict]) -> list[tuple[str, str]]:
    """Two ranks on one physical GPU (same host, same uuid): a hang or an out-of-memory error later."""
    problems = []
    by_gpu = defaultdict(list)
    for row in rows:
        if row["gpu"]:
            by_gpu[(row["host"], row["gpu"])].append(row["rank"])
    for (host, gpu), ranks in by_gpu.items():
        if len(ranks) > 1:
            problems.append((f"{ranks_text(ranks)} on {host} share one GPU ({gpu})", _GPU_FIX))
    return problems


def output_problems(rows: list[dict]) -> list[tuple[str, str]]:
    return [
        (
            f"output_dir {r['output_dir']} is not writable on node {r['node']} ({r['host']}): {r['output']['error']}",
            "create it with write permission for this user on every node, or pass another --output_dir",
        )
        for r in rows
        if r.get("output") and r["output"]["error"]
    ]


def collective_problems(rows: list[dict]) -> list[tuple[str, str]]:
    fix = (
        "the interconnect or its driver corrupts data: rerun with NCCL_DEBUG=INFO, check NCCL_SOCKET_IFNAME / "
        "NCCL_IB_HCA name the right interfaces, and the driver and NCCL versions on the nodes involved"
    )
    problems = []
    for key, what in (("broadcast_ok", "a broadcast from rank 0"), ("allreduce_ok", "an all-reduce (sum of ranks)")):
        bad = [r["rank"] for r in rows if r.get(key) is False]
        if bad:
            problems.append((f"{what} gave wrong values on {ranks_text(bad)} (seed {rows[0].get('seed')})", fix))
    return problems


def find_problems(rows: list[dict]) -> list[tuple[str, str]]:
    """(what is wrong, what to do) for everything that makes the check fail, from all ranks' rows."""
    checks = (
        version_problems,
        config_problems,
        device_problems,
        shared_gpu_problems,
        output_problems,
        collective_problems,
    )
    return [p for check in checks for p in check(rows)]


def output_summary(rows: list[dict]) -> str:
    """Writable? And with several nodes: does every node see the others' files (shared), or only its own?"""
    if not rows[0]["output_dir"]:
        return "output_dir: not checked (give --output_dir or --config)"
    mains = [r for r in rows if r.get("output")]
    path = rows[0]["output_dir"]
    writable = [r for r in mains if not r["output"]["error"]]
    created = " (created)" if any(r["output"]["created"] for r in writable) else ""
    if len(writable) == len(mains):
        state = f"writable{created}"
    elif writable:
        state = f"writable{created} on node(s) {', '.join(str(r['node']) for r in writable)} only"
    else:
        state = "not writable"
    nodes = sorted({r["node"] for r in rows})
    if len(nodes) < 2 or len(writable) < 2:
        return f"output_dir {path}: {state}"
    wrote = {r["node"] for r in writable}
    if all(wrote <= set(r["output"]["sees"]) for r in writable):
        sharing = f"shared by nodes {', '.join(map(str, sorted(wrote)))}"
    elif all(set(r["output"]["sees"]) & wrote == {r["node"]} for r in writable):
        sharing = "node-local (checkpoints are kept per machine: resume needs each node's own copy)"
    else:
        sees = "; ".join(f"node {r['node']} sees nodes {r['output']['sees']}" for r in writable)
        sharing = f"shared by some nodes only ({sees})"
    return f"output_dir {path}: {state}, {sharing}"


def bandwidth_summary(rows: list[dict]) -> str | None:
    bw = rows[0].get("bandwidth")
    if not bw:
        return None
    return (
        f"all-reduce bandwidth ({bw['mb']:g} MB float32, {bw['iterations']} iterations, {bw['seconds'] * 1e3:.1f} ms "
        f"each): algbw {bw['algbw']:.2f} GB/s, busbw {bw['busbw']:.2f} GB/s"
    )


def render_table(rows: list[dict]) -> str:
    """One line of versions that agree, then one row per rank; a version column only where ranks differ."""
    rows = sorted(rows, key=lambda r: r["rank"])
    names = list(rows[0]["versions"])
    differ = [n for n in names if len({r["versions"].get(n, "-") for r in rows}) > 1]
    same = ", ".join(f"{n} {rows[0]['versions'][n]}" for n in names if n not in differ)
    header = ["rank", "node", "host", "local", "device"]
    show_cvd = any(r["cuda_visible_devices"] for r in rows)
    header += ["CUDA_VISIBLE_DEVICES"] * show_cvd + differ
    show_hash = any(r["config_hash"] for r in rows)
    header += ["config"] * show_hash
    table = [header]
    for r in rows:
        gpu = f" {r['gpu'][:12]}" if r["gpu"] else ""  # GPU-<8 hex>: enough to tell GPUs apart by eye
        device = r["device"] + gpu + (f" (bus {r['gpu_bus']})" if r["gpu_bus"] else "")
        cells = [str(r["rank"]), str(r["node"]), r["host"], str(r["local_rank"]), device]
        cells += [r["cuda_visible_devices"] or "-"] * show_cvd + [r["versions"].get(n, "-") for n in differ]
        cells += [r["config_hash"] or "-"] * show_hash
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(([f"versions: {same}"] if same else []) + lines)


def render_problems(problems: list[tuple[str, str]]) -> str:
    n = len(problems)
    lines = [f"check failed: {n} problem{'s' if n > 1 else ''}"]
    for i, (what, fix) in enumerate(problems, 1):
        lines += [f"  {i}. {what}", f"     what to do: {fix}"]
    return "\n".join(lines)


def render_report(rows: list[dict], heading: str) -> tuple[str, int]:
    """The whole report rank 0 prints, and the exit code."""
    problems = find_problems(rows)
    parts = [heading, render_table(rows)]
    parts += [line for line in (bandwidth_summary(rows), output_summary(rows), rows[0]["finished"]) if line]
    parts.append(render_problems(problems) if problems else "check passed")
    return "\n".join(parts), 1 if problems else 0


def arrival_report(arrived: dict[int, dict], world: int, waited: float) -> str:
    """Who arrived (a table) and who never did, with the likely causes."""
    missing = [r for r in range(world) if r not in arrived]
    parts = [f"finetune check: {len(arrived)} of {world} ranks arrived"]
    if arrived:
        parts.append(render_table(list(arrived.values())))
    parts.append(f"{ranks_text(missing)} never arrived (waited {waited:.0f} s): likely {NEVER_ARRIVED_CAUSES}")
    return "\n".join(parts)


def config_error_report(rows: list[dict]) -> str | None:
    """A bad run config (exit 2): rank 0's message once, and any rank whose message differs from it."""
    errors = {r["rank"]: r["config_error"] for r in rows if r["config_error"]}
    if not errors:
        return None
    first = errors.get(rows[0]["rank"])
    lines = [first] if first else []
    by_rank = {r["rank"]: r for r in rows}
    lines += [f"rank {k} ({by_rank[k]['host']}): {msg}" for k, msg in sorted(errors.items()) if msg != first]
    return "\n".join(lines)


# ---------------------------------------------------------------- arrival through the launcher's store


def connect_store(rank: int, timeout: float):
    """The launcher's TCP store. torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE=True: every
    worker is a client); otherwise rank 0 hosts it, as init_process_group's env:// would."""
    from torch.distributed import TCPStore

    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK") if not os.environ.get(k)]
    if missing:
        raise ConfigError(
            [("environment", f"WORLD_SIZE > 1 but {', '.join(missing)} not set: start it with accelerate launch")]
        )
    from finetune.parallel.topology import Launcher

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    master = not Launcher.read().agent_store and rank == 0
    return TCPStore(host, port, is_master=master, timeout=timedelta(seconds=timeout), wait_for_workers=False)


def await_arrivals(store, prefix: str, world: int, timeout: float) -> tuple[dict[int, dict], float]:
    """Rank 0: every rank's facts, or those that arrived within `timeout` seconds."""
    start = time.monotonic()
    keys = [f"{prefix}/arrived/{r}" for r in range(world)]
    while not store.check(keys) and time.monotonic() - start < timeout:
        time.sleep(0.1)
    arrived = {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
    return arrived, time.monotonic() - start


def await_verdict(store, prefix: str, timeout: float) -> str | None:
    """Other ranks: rank 0's verdict. Rank 0 may start late: wait `timeout` for it to arrive, then its
    own `timeout` (plus a margin) for the verdict. None: rank 0 never arrived or never decided."""
    for key, limit in ((f"{prefix}/arrived/0", timeout), (f"{prefix}/verdict", timeout + VERDICT_MARGIN_S)):
        start = time.monotonic()
        while not store.check([key]):
            if time.monotonic() - start > limit:
                return None
            time.sleep(0.1)
    return store.get(f"{prefix}/verdict").decode()


def arrive(store, prefix: str, facts: dict, timeout: float) -> int | None:
    """Register, then agree on going on. Returns an exit code to stop with, or None to go on."""
    rank, world = facts["rank"], facts["world_size"]
    store.set(f"{prefix}/arrived/{rank}", json.dumps(facts))
    if rank != 0:
        verdict = await_verdict(store, prefix, timeout)
        if verdict == "go":
            return None
        if verdict is None:
            return stop(1, _report_silent_rank0(store, prefix, rank, world, timeout))
        code = stop(int(verdict.split(":")[1]), store.get(f"{prefix}/message").decode())
        store.set(f"{prefix}/stopped/{rank}", "")  # its message is where the launcher reads it: rank 0 may end
        return code
    arrived, waited = await_arrivals(store, prefix, world, timeout)
    if len(arrived) < world:
        code, report = 1, arrival_report(arrived, world, waited)
        message = report.splitlines()[-1]  # who never arrived
    else:
        rows = [arrived[r] for r in range(world)]
        report = message = config_error_report(rows)
        blocking = device_problems(rows)
        code = 2 if report else (1 if blocking else 0)
        if blocking and not report:
            message = render_problems(blocking)
            report = f"{_heading(rows, None)}\n{render_table(rows)}\n{message}"
    if code:
        stop(code, message)
        store.set(f"{prefix}/message", message)
    store.set(f"{prefix}/verdict", "go" if code == 0 else f"stop:{code}")
    if report:
        print(report, file=sys.stderr if code == 2 else sys.stdout, flush=True)
    if code:
        # The launcher stops the others as soon as one rank ends: each first leaves its message for the report.
        _await_keys(store, [f"{prefix}/stopped/{r}" for r in arrived if r != 0], VERDICT_MARGIN_S)
    return code or None


def stop(code: int, message: str) -> int:
    """A rank stops with `code`: its message (printed by rank 0) in the launcher's error file, as a run's
    (cli._stop_with), so that `accelerate launch` ends with the message and the code rather than its traceback."""
    write_error_file(message)
    return code


def _await_keys(store, keys: list[str], limit: float) -> None:
    start = time.monotonic()
    while keys and not store.check(keys) and time.monotonic() - start < limit:
        time.sleep(0.05)


def _report_silent_rank0(store, prefix: str, rank: int, world: int, timeout: float) -> str:
    """Rank 0 never arrived or never decided: only the others can tell. The lowest rank that arrived says so;
    returns what (the last line: who never arrived)."""
    keys = {r: f"{prefix}/arrived/{r}" for r in range(world)}
    arrived = {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}
    if 0 not in arrived:
        report = arrival_report(arrived, world, timeout)
    else:
        report = (
            f"finetune check rank {rank}: rank 0 arrived but gave no verdict within {timeout + VERDICT_MARGIN_S:.0f} s "
            "(it died or hung after arriving; see its output)"
        )
    if min(r for r in arrived if r != 0) == rank:
        print(report, flush=True)
    return report.splitlines()[-1]


# ---------------------------------------------------------------- collectives and output_dir


def init_group(store, prefix: str, facts: dict, timeout: float) -> str:
    """gloo on CPU, nccl on GPU, on the store the ranks arrived through (rank 0 may be hosting it)."""
    import torch
    import torch.distributed as dist

    gpu = facts["device"].startswith("cuda")
    kw = {}
    if gpu:
        torch.cuda.set_device(facts["local_rank"])
        kw["device_id"] = torch.device(facts["device"])
    backend = "nccl" if gpu else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{prefix}/pg", store),
        rank=facts["rank"],
        world_size=facts["world_size"],
        timeout=timedelta(seconds=timeout),
        **kw,
    )
    return backend


def check_broadcast(device: str, rank: int) -> tuple[bool, int]:
    """Rank 0 broadcasts a seed, then a random tensor from it; every rank regenerates it and compares."""
    import torch
    import torch.distributed as dist

    box = [random.SystemRandom().randrange(2**31) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, device=torch.device(device))
    seed = box[0]
    expected = torch.randn(4096, generator=torch.Generator().manual_seed(seed))
    data = expected.to(device) if rank == 0 else torch.zeros(4096, device=device)
    dist.broadcast(data, src=0)
    return bool(torch.equal(data.cpu(), expected)), seed


def check_allreduce(device: str, rank: int, world: int) -> bool:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank)], device=device)
    dist.all_reduce(value)
    return value.item() == world * (world - 1) / 2


def measure_bandwidth(device: str, world: int, mb: float, warmup: int = 2, iterations: int = 5) -> dict:
    """All-reduce bandwidth as nccl-tests report it: algbw = bytes / time, busbw = algbw * 2(n-1)/n."""
    import torch
    import torch.distributed as dist

    x = torch.ones(int(mb * 2**20) // 4, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        dist.all_reduce(x)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(x)
    sync()
    seconds = (time.perf_counter() - start) / iterations
    algbw = x.numel() * 4 / seconds / 1e9
    return {
        "mb": mb,
        "iterations": iterations,
        "seconds": seconds,
        "algbw": algbw,
        "busbw": algbw * 2 * (world - 1) / world,
    }


def probe_output_dir(facts: dict, token: int, barrier) -> dict | None:
    """Local mains write a node file into output_dir; after a barrier each lists which nodes' files it sees
    (all: shared; only its own: node-local); after another, each removes its own. None on other ranks."""
    path, mine = facts["output_dir"], facts["local_rank"] == 0
    result = {"error": None, "created": False, "sees": []}
    own = os.path.join(path, NODE_FILE.format(token=token, node=facts["node"])) if path else None
    if mine and path:
        try:
            result["created"] = not os.path.isdir(path)
            os.makedirs(path, exist_ok=True)
            with open(own, "w") as f:
                f.write(facts["host"])
        except OSError as e:
            result["error"] = f"{type(e).__name__}: {e}"
    barrier()
    if mine and path and not result["error"]:
        prefix = NODE_FILE.format(token=token, node="")
        result["sees"] = sorted(int(n[len(prefix) :]) for n in os.listdir(path) if n.startswith(prefix))
    barrier()
    if mine and path and not result["error"]:
        os.remove(own)
    return result if mine and path else None


def run_checks(facts: dict, args: argparse.Namespace) -> dict:
    """The collectives and the output_dir probe on one rank; their results join the rank's facts."""
    import torch.distributed as dist

    device, rank, world = facts["device"], facts["rank"], facts["world_size"]
    if world == 1:
        token = random.SystemRandom().randrange(2**31)
        return {"seed": None, "output": probe_output_dir(facts, token, lambda: None)}
    broadcast_ok, seed = check_broadcast(device, rank)
    allreduce_ok = check_allreduce(device, rank, world)
    mb = args.bandwidth_mb or (64 if device.startswith("cuda") else 16)
    return {
        "seed": seed,
        "broadcast_ok": broadcast_ok,
        "allreduce_ok": allreduce_ok,
        "bandwidth": measure_bandwidth(device, world, mb),
        "output": probe_output_dir(facts, seed, dist.barrier),
    }


def _heading(rows: list[dict], backend: str | None) -> str:
    if len(rows) == 1:
        return "finetune check: one process (no launcher): collectives not checked"
    nodes = len({r["node"] for r in rows})
    return f"finetune check: {len(rows)} ranks on {nodes} node(s)" + (f", {backend}" if backend else "")


# ---------------------------------------------------------------- entry point


def _quiet() -> None:
    """No library chatter in a report meant to be read: set before torch is imported."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv: list[str]) -> int:
    """Exit code 0, 1 or 2 on every rank; under `accelerate launch` the launcher's too, ending with the message
    (each rank that stops leaves it in the launcher's error file: `stop`)."""
    args, overrides = build_parser().parse_known_args(argv)
    _quiet()
    facts = local_facts(args, overrides)
    rank, world = facts["rank"], facts["world_size"]
    group = None
    if world > 1:
        from finetune.parallel.topology import Launcher

        launcher = Launcher.read()
        run_id = f"{launcher.run_id or 'none'}/{launcher.restart}"
        prefix = f"finetune_check/{run_id}"
        try:
            store = connect_store(rank, args.timeout)
            fault_point("hang-check", 0)  # tests: FINETUNE_FAULT=hang-check:0:<rank> hangs a rank before it arrives
            code = arrive(store, prefix, facts, args.timeout)
        except ConfigError as e:
            print(e.render(), file=sys.stderr)
            return stop(2, e.render())
        except (RuntimeError, TimeoutError) as e:  # torch's DistError and its kin are RuntimeErrors
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            first = (str(e).strip().splitlines() or [""])[0][:300]
            message = f"finetune check rank {rank}: the launcher's store at {where} failed: {first}"
            print(message, flush=True)
            return stop(1, message)
        if code is not None:
            return code
        group = (store, prefix, facts, args.timeout)
    elif facts["config_error"]:
        print(facts["config_error"], file=sys.stderr)
        return stop(2, facts["config_error"])
    return _collect_and_report(facts, args, group)


def _collect_and_report(facts: dict, args: argparse.Namespace, group: tuple | None) -> int:
    """Start the process group (`group`: init_group's arguments; None for one process), run the checks,
    gather every rank's row to every rank (same exit code everywhere); rank 0 prints."""
    import torch.distributed as dist

    from finetune.parallel import is_peer_failure

    try:
        backend = init_group(*group) if group else None
        row = {**facts, **run_checks(facts, args)}
        rows = [row]
        if backend:
            rows = [None] * facts["world_size"]
            dist.all_gather_object(rows, row)
    except Exception as e:
        if not is_peer_failure(e):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        message = f"finetune check rank {facts['rank']}: a collective failed or timed out: {first}"
        print(message, flush=True)
        return stop(1, message)
    report, code = render_report(rows, _heading(rows, backend))
    if code:
        stop(code, report[report.index("check failed:") :])  # every rank: the numbered problems
    try:
        if backend:
            dist.barrier()  # every rank's message is in place before one ends (and the launcher stops the others)
    except Exception as e:
        if not is_peer_failure(e):  # a peer gone after the gather: the report stands
            raise
    if facts["rank"] == 0:
        print(report, flush=True)
    if backend:
        dist.destroy_process_group()
    return code
