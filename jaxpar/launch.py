"""Multi-host: joining ``jax.distributed``, and ``jaxpar launch``, which runs a job as N local
processes, watches them and restarts the job from its last checkpoint when one fails.

Every byte between processes goes through JAX: the coordination service of ``jax.distributed``
and XLA's collectives (gloo on CPU, NCCL on GPU, ICI/DCN on TPU). Nothing here opens a socket of
its own, except a TCP probe of the coordinator's port so that an unreachable coordinator is
reported in words instead of by the runtime aborting the process.

Where a job's processes come from, in order of precedence:

1. explicit ``--coordinator --num-processes --process-id`` (``DistributedArgs``);
2. ``JAXPAR_COORDINATOR`` / ``JAXPAR_NUM_PROCESSES`` / ``JAXPAR_PROCESS_ID``, set by ``jaxpar launch``;
3. a cluster JAX detects itself (SLURM, Open MPI, Cloud TPU / GKE), which jaxpar recognises from
   the environment and then leaves to ``jax.distributed.initialize()``;
4. none of these: one process, no ``jax.distributed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from jaxpar.errors import EXIT_BAD_INPUT, JaxparError, JobFailed
from jaxpar.flags import flag

ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_STATUS_DIR = "JAXPAR_STATUS_DIR"  # where each process reports its progress to the launcher
ENV_RESUME = "JAXPAR_RESUME"  # "auto" on a restart: resume from the last complete checkpoint if any
# decoupled learners (jaxpar launch --learners): each process's part, and where the syncer's store is
ENV_ROLE = "JAXPAR_ROLE"  # learner | syncer
ENV_LEARNERS = "JAXPAR_LEARNERS"
ENV_LEARNER = "JAXPAR_LEARNER"  # this learner's index
ENV_SYNCER = "JAXPAR_SYNCER"  # HOST:PORT of the key-value store
ENV_QUORUM = "JAXPAR_QUORUM"
ENV_GRACE = "JAXPAR_GRACE"
ENV_FAULTS = "JAXPAR_FAULTS"  # --inject-faults
ENV_STARTUP_TIMEOUT = "JAXPAR_STARTUP_TIMEOUT"
ENV_TASK = "JAXPAR_TASK"  # this process's task in the store, and its progress file's number


MULTI_HOST = "multi-host (jax.distributed; default: detect SLURM / Open MPI / Cloud TPU, else one process)"


@dataclasses.dataclass(frozen=True)
class DistributedArgs:
    coordinator: str | None = flag(None, "address of process 0's coordination service", metavar="HOST:PORT", group=MULTI_HOST)
    num_processes: int | None = flag(None, metavar="N", group=MULTI_HOST)
    process_id: int | None = flag(None, metavar="I", group=MULTI_HOST)
    # "on" forces JAX's own cluster detection (e.g. Cloud TPU VMs)
    mode: str = flag("auto", "on: always call jax.distributed.initialize() (Cloud TPU VMs); off: never", name="distributed",
                     choices=["auto", "on", "off"], group=MULTI_HOST)
    init_timeout_s: int = flag(300, "seconds to wait for every process to join (default 300)", name="init-timeout",
                               metavar="S", group=MULTI_HOST)
    # declared dead by the coordinator
    heartbeat_timeout_s: int = flag(100, "a process silent this long is declared dead (default 100)", name="heartbeat-timeout",
                                    metavar="S", group=MULTI_HOST)


def detect_cluster(environ=os.environ) -> str | None:
    """The multi-process cluster the environment describes, if any: 'slurm', 'openmpi' or 'tpu'.

    Only clusters with more than one process count; JAX reads the details itself."""
    if "SLURM_JOB_ID" in environ and int(environ.get("SLURM_NTASKS", environ.get("SLURM_NPROCS", "1"))) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in environ and int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "openmpi"
    hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h]) > 1:
        return "tpu"
    return None


def _explicit(args: DistributedArgs, environ) -> tuple[str, int, int] | None:
    """(coordinator, num_processes, process_id) from flags or the launcher's environment."""
    given = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise JaxparError(
                f"--coordinator {args.coordinator}, --num-processes {args.num_processes}, --process-id {args.process_id}: "
                "give all three or none (none lets jaxpar detect the cluster from the environment)"
            )
        coordinator, count, rank = given
    elif ENV_COORDINATOR in environ:
        coordinator, count, rank = environ[ENV_COORDINATOR], int(environ[ENV_NUM_PROCESSES]), int(environ[ENV_PROCESS_ID])
    else:
        return None
    if count < 1 or not 0 <= rank < count:
        raise JaxparError(f"process id {rank} is not in [0, {count}) for {count} processes; ids run from 0 to num_processes - 1")
    _split_address(coordinator)
    return coordinator, count, rank


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise JaxparError(f"coordinator address {address!r} is not host:port (e.g. 10.0.0.1:1234)")
    return host, int(port)


def wait_for_coordinator(address: str, timeout_s: float):
    """Return once ``address`` accepts TCP connections; raise a JaxparError after ``timeout_s``.

    jax.distributed's client aborts the process (not a Python error) when the coordinator never
    answers, with a message about another task dying; this says what is really wrong first."""
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise JaxparError(
                    f"coordinator {address} could not be reached within {timeout_s:g} s ({err.strerror or err}); "
                    "check that process 0 runs and listens on that host and port, that the port is open, "
                    "or raise the wait with --init-timeout"
                ) from None
            time.sleep(0.2)


def local_share(num_chips: int, args: DistributedArgs = DistributedArgs(), environ=os.environ) -> int:
    """How many of a CPU topology's ``num_chips`` simulated devices each local process gets: all of
    them for one process, an equal share in a job whose process count is known up front."""
    if environ.get(ENV_ROLE) == "syncer":  # it merges on the host: one device
        return 1
    if environ.get(ENV_ROLE) == "learner":  # its group's share, over the learner's own processes
        count = int(environ[ENV_LEARNERS]) * int(environ.get(ENV_NUM_PROCESSES, 1))
        if num_chips % count:
            raise JaxparError(f"{num_chips} chips do not split evenly over {count} learner processes; use counts that divide {num_chips}")
        return num_chips // count
    explicit = _explicit(args, environ) if args.mode != "off" else None
    count = explicit[1] if explicit else 1
    if num_chips % count:
        raise JaxparError(f"{num_chips} chips do not split evenly over {count} processes; use a process count that divides {num_chips}")
    return num_chips // count


def initialize(args: DistributedArgs = DistributedArgs(), platform: str = "cpu", environ=os.environ) -> int:
    """Join the job's ``jax.distributed`` runtime if it has several processes; return the count.

    Must run before JAX creates its backends. On CPU, cross-process collectives use gloo."""
    if args.mode not in ("auto", "on", "off"):
        raise JaxparError(f"distributed mode {args.mode!r} is not one of auto, on, off")
    if args.mode == "off":
        return 1
    explicit = _explicit(args, environ)
    cluster = detect_cluster(environ)
    if explicit is None and cluster is None and args.mode == "auto":
        return 1
    import jax

    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = dict(initialization_timeout=args.init_timeout_s, heartbeat_timeout_seconds=args.heartbeat_timeout_s)
    if explicit is None:
        jax.distributed.initialize(**timeouts)  # JAX's own detection (SLURM, Open MPI, Cloud TPU, GKE)
        return jax.process_count()
    coordinator, count, rank = explicit
    if count == 1:
        return 1
    if rank != 0:
        wait_for_coordinator(coordinator, args.init_timeout_s)
    jax.distributed.initialize(coordinator, count, rank, **timeouts)
    return count


# --- progress reports: how the launcher tells a hung process from a busy one ---------------------


# The phases a process reports within one step, in the order it reaches them ("evaluating" and
# "saving" come after "done" of the same step).
_PHASES = ("start", "done", "evaluating", "saving")


def report_progress(phase: str, step: int, environ=os.environ):
    """Tell the launcher (if any) that this process reached ``phase`` of ``step``.

    Written atomically to ``$JAXPAR_STATUS_DIR/process-<id>.json``; a no-op outside ``jaxpar launch``."""
    directory = environ.get(ENV_STATUS_DIR)
    if not directory:
        return
    rank = environ.get(ENV_TASK, environ.get(ENV_PROCESS_ID, "0"))
    path = os.path.join(directory, f"process-{rank}.json")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"phase": phase, "step": step, "pid": os.getpid(), "time": time.time()}, f)
    os.replace(tmp, path)


def read_progress(directory: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(directory, f"process-{rank}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --- the local launcher --------------------------------------------------------------------------


LEARNERS = "decoupled learners (jaxpar launch --learners M -- jaxpar train --strategy federation=M,...)"


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    # jaxpar launch's options (jaxpar.flags)
    # None: 2 for one job; with --learners, 1 for each learner
    processes: int | None = flag(None, commands=("launch",), help="processes to start on this machine (default 2; with --learners, "
                                                                    "of each learner, default 1)")
    # simulated CPU devices each; None: the topology's chips / processes
    devices_per_process: int | None = flag(None, commands=("launch",), help="simulated CPU devices per process (default: the topology's chips / processes)")
    max_restarts: int = flag(0, commands=("launch",), help="restart the whole job this many times after a failure (default 0)")
    # once training runs: no progress report from any process for this long is a hang
    hang_timeout_s: float = flag(600.0, name="hang-timeout", metavar="S", commands=("launch",),
                                 help="once steps run, no progress from any process for S seconds is a hang (default 600)")
    # before every process has reported its first step (imports, compiling)
    startup_timeout_s: float = flag(1800.0, name="startup-timeout", metavar="S", commands=("launch",),
                                    help="the same before every process has begun its first step: imports, compiling (default 1800)")
    # coordinator port on 127.0.0.1; None: a free one
    port: int | None = flag(None, commands=("launch",), help="coordinator port on 127.0.0.1 (default: a free one)")
    # None: a fresh temporary directory
    status_dir: str | None = flag(None, commands=("launch",), help="where processes report progress (default: a temporary directory)")
    # decoupled learners (jaxpar/decoupled.py): M jobs and a syncer instead of one job
    learners: int | None = flag(None, metavar="M", commands=("launch",), group=LEARNERS, help=(
        "run the command's federation=M groups as M separate learners and a syncer that merges them"))
    quorum: int | None = flag(None, metavar="K", commands=("launch",), group=LEARNERS,
                              help="merge a round once K learners have reported (default: all M)")
    grace_s: float = flag(0.0, name="grace", metavar="S", commands=("launch",), group=LEARNERS,
                          help="then wait up to S seconds more for the others (default 0); a later report is dropped")
    inject_faults: str = flag("", metavar="SPEC", commands=("launch",), group=LEARNERS, help=(
        "a fault drill: kill=I@STEP (learner I dies before STEP, once), slow=I:S (sleeps S s a step); comma-separated"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _pump(stream, prefix: str, out):
    """Copy a child's output line by line, prefixed with its process id."""
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()
    stream.close()


class _Attempt:
    """One start of the whole job: N processes, their output threads, and their watchdog."""

    def __init__(self, command, cfg: LaunchConfig, status_dir: str, restart: int, out):
        self.cfg, self.status_dir, self.procs, self.threads = cfg, status_dir, [], []
        for rank in range(cfg.processes):  # last attempt's reports; nothing else there is touched
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(status_dir, f"process-{rank}.json"))
        port = cfg.port or _free_port()
        for rank in range(cfg.processes):
            env = dict(os.environ)
            env.update({
                ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(cfg.processes),
                ENV_PROCESS_ID: str(rank), ENV_STATUS_DIR: status_dir, "PYTHONUNBUFFERED": "1",
            })
            # an inherited device count is the parent's, not this process's share of the job
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
            if cfg.devices_per_process:
                flags.append(f"--xla_force_host_platform_device_count={cfg.devices_per_process}")
            env["XLA_FLAGS"] = " ".join(flags)
            if restart:
                env[ENV_RESUME] = "auto"
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            thread = threading.Thread(target=_pump, args=(proc.stdout, f"[p{rank}] ", out), daemon=True)
            thread.start()
            self.procs.append(proc)
            self.threads.append(thread)
        self.started = time.time()

    def _last_progress(self, rank: int) -> tuple[float, dict | None]:
        report = read_progress(self.status_dir, rank)
        return (report["time"] if report else self.started), report

    def wait(self, poll_s: float = 0.2) -> tuple[str, int | None] | None:
        """Block until every process exits 0 (returns None) or the job fails: returns why, and the
        exit status of the process to blame (None for a hang)."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                # The others fail *because* of the first: blame a process killed by a signal before
                # one that aborted (SIGABRT: the runtime's reaction) or exited with an error.
                failed.sort(key=lambda r: 0 if codes[r] < 0 and codes[r] != -signal.SIGABRT else 1 if codes[r] < 0 else 2)
                what = [f"process {r} (pid {self.procs[r].pid}) {_describe_exit(codes[r])}" for r in failed]
                return what[0] + (f" (then {', '.join(what[1:])})" if len(what) > 1 else ""), codes[failed[0]]
            if all(code == 0 for code in codes):
                return None
            progress = [self._last_progress(r) for r in range(len(self.procs))]
            started = all(report for _, report in progress)
            limit = self.cfg.hang_timeout_s if started else self.cfg.startup_timeout_s
            if time.time() - max(t for t, _ in progress) > limit:
                return self._describe_hang(limit), None
            time.sleep(poll_s)

    def _describe_hang(self, limit: float) -> str:
        """Name the process that is behind: the others wait for it inside a collective."""
        reports = {r: self._last_progress(r)[1] for r in range(len(self.procs))}
        # furthest through the step loop last; of equals, the one silent longest is the one stuck
        position = lambda r: (reports[r]["step"], _PHASES.index(reports[r]["phase"]), reports[r]["time"]) if reports[r] else (-1, 0, 0.0)  # noqa: E731
        behind = min(reports, key=position)
        where = reports[behind]
        state = f"last reported {where['phase']} of step {where['step']}" if where else "never reported progress"
        return (
            f"no process made progress for {limit:g} s: process {behind} "
            f"(pid {self.procs[behind].pid}) looks hung ({state}); the others wait for it"
        )

    def stop(self, grace_s: float = 5.0):
        _stop(self.procs, self.threads, grace_s)


def _stop(procs, threads, grace_s: float = 5.0):
    """SIGTERM every process group still running, SIGKILL after ``grace_s``; then their output threads."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace_s
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=2.0)


def launch(command: list[str], cfg: LaunchConfig = LaunchConfig(), out=None) -> int:
    """Run ``command`` as ``cfg.processes`` local processes of one ``jax.distributed`` job.

    When a process dies or the job hangs, every process is stopped (within the poll interval plus
    a 5 s grace for a death; ``hang_timeout_s`` for a hang) and the job is started again, at most
    ``max_restarts`` times, with ``JAXPAR_RESUME=auto`` so that ``jaxpar train`` continues from its
    last complete checkpoint. Returns 0 on success; raises JobFailed when restarts run out, and
    JaxparError, without restarting, when a process refused its input (exit status 2: it would
    refuse it again). A status directory made here is removed on every way out."""
    if not command:
        raise JaxparError("a command is needed after '--', e.g. jaxpar launch --processes 2 -- jaxpar train")
    if cfg.learners is not None:
        return _launch_learners(command, cfg, out or sys.stdout)
    if cfg.quorum is not None or cfg.grace_s or cfg.inject_faults:
        raise JaxparError("--quorum, --grace and --inject-faults are for decoupled learners: add --learners M or drop them")
    cfg = dataclasses.replace(cfg, processes=2 if cfg.processes is None else cfg.processes)
    if cfg.processes < 1:
        raise JaxparError(f"--processes {cfg.processes} must be at least 1")
    if cfg.devices_per_process is not None and cfg.devices_per_process < 1:
        raise JaxparError(f"--devices-per-process {cfg.devices_per_process} must be at least 1")
    if cfg.max_restarts < 0:
        raise JaxparError(f"--max-restarts {cfg.max_restarts} must be 0 or more")
    if cfg.hang_timeout_s <= 0 or cfg.startup_timeout_s <= 0:
        raise JaxparError(f"--hang-timeout {cfg.hang_timeout_s} and --startup-timeout {cfg.startup_timeout_s} must be positive (seconds)")
    if shutil.which(command[0]) is None:
        raise JaxparError(
            f"command {command[0]!r} was not found: it is neither an executable file nor a program on PATH; "
            f"give one, e.g. jaxpar launch -- jaxpar train"
        )

    out = out or sys.stdout
    status_dir = cfg.status_dir or tempfile.mkdtemp(prefix="jaxpar-launch-")
    try:
        os.makedirs(status_dir, exist_ok=True)
        for restart in range(cfg.max_restarts + 1):
            note = f" (restart {restart} of {cfg.max_restarts})" if restart else ""
            out.write(f"jaxpar launch: starting {cfg.processes} processes{note}; progress reports in {status_dir}\n")
            attempt = _Attempt(command, cfg, status_dir, restart, out)
            try:
                failure = attempt.wait()
                if failure is None:
                    out.write(f"jaxpar launch: all {cfg.processes} processes finished\n")
                    return 0
                why, code = failure
                out.write(f"jaxpar launch: {why}; stopping the job\n")
                out.flush()
                if code == EXIT_BAD_INPUT:
                    raise JaxparError(f"{why}: the command refused its input (its message is above); fix the command, a restart would not help")
            finally:
                attempt.stop()
        raise JobFailed(f"{why}; no restarts left (--max-restarts {cfg.max_restarts})")
    finally:
        if cfg.status_dir is None:  # ours: a temporary directory, not one the user named
            shutil.rmtree(status_dir, ignore_errors=True)


# --- decoupled learners: M jobs and a syncer around a key-value store ------------------------------


def kv_service(port: int, nodes: int, heartbeat_timeout_s: int = 100):
    """JAX's coordination service (the one ``jax.distributed`` starts in process 0) for ``nodes``
    tasks, with recoverable tasks: one may die and connect again, and the others go on."""
    from jax._src.lib import _jax  # JAX has no public constructor for the service alone

    return _jax.get_distributed_runtime_service(f"[::]:{port}", nodes, heartbeat_timeout=heartbeat_timeout_s, recoverable=True)


def kv_client(address: str, node: int, timeout_s: float):
    """A connected client of ``kv_service`` as task ``node`` (its key-value store; no devices)."""
    from jax._src.lib import _jax  # (as kv_service)

    wait_for_coordinator(address, timeout_s)
    client = _jax.get_distributed_runtime_client(address, node, init_timeout=int(timeout_s), use_compression=True)
    client.connect()  # the first time, once every task has connected
    return client


def startup_timeout(environ=os.environ) -> float:
    return float(environ.get(ENV_STARTUP_TIMEOUT, LaunchConfig.startup_timeout_s))


def parse_faults(text: str, learners: int) -> dict[int, dict]:
    """``--inject-faults``: ``kill=I@S`` (learner I kills itself before step S, on its first start)
    and ``slow=I:SECONDS`` (learner I sleeps that long after each step), comma-separated:
    {learner: {"kill": S, "slow": seconds}}."""
    faults: dict[int, dict] = {}
    for part in filter(None, text.split(",")):
        kind, _, spec = part.partition("=")
        try:
            if kind == "kill":
                who, at = spec.split("@")
                faults.setdefault(int(who), {})["kill"] = int(at)
            elif kind == "slow":
                who, seconds = spec.split(":")
                faults.setdefault(int(who), {})["slow"] = float(seconds)
            else:
                raise ValueError
        except ValueError:
            raise JaxparError(f"--inject-faults {part!r}: write kill=LEARNER@STEP or slow=LEARNER:SECONDS "
                              "(e.g. kill=1@6,slow=2:0.5)") from None
    wrong = [who for who in faults if not 0 <= who < learners]
    if wrong:
        raise JaxparError(f"--inject-faults names learner {wrong[0]}, but the learners are 0 to {learners - 1}")
    return faults


def _check_learners(cfg: LaunchConfig) -> int:
    """The quorum, refusing in words what ``--learners`` cannot run."""
    learners = cfg.learners
    if learners < 1:
        raise JaxparError(f"--learners {learners} must be at least 1")
    quorum = learners if cfg.quorum is None else cfg.quorum
    if not 1 <= quorum <= learners:
        raise JaxparError(f"--quorum {quorum} must be between 1 and the {learners} learners: a merge waits for that many reports")
    if cfg.grace_s < 0:
        raise JaxparError(f"--grace {cfg.grace_s} must be 0 or more seconds")
    if cfg.processes is not None and cfg.processes < 1:
        raise JaxparError(f"--processes {cfg.processes} must be at least 1 (the processes of each learner)")
    if cfg.max_restarts < 0:
        raise JaxparError(f"--max-restarts {cfg.max_restarts} must be 0 or more")
    parse_faults(cfg.inject_faults, learners)
    return quorum


class _Learners:
    """The syncer (member 0, one process) and the learners (members 1..M, ``processes`` each: one
    ``jax.distributed`` job apiece) of a decoupled run around the launcher's key-value store, whose
    tasks are the syncer (0) and every learner process (1 + i P + p). A member is restarted whole
    when one of its processes dies (``max_restarts`` times each)."""

    def __init__(self, command, cfg: LaunchConfig, quorum: int, status_dir: str, out):
        self.command, self.cfg, self.status_dir, self.out = command, cfg, status_dir, out
        self.each = cfg.processes or 1
        self.port = cfg.port or _free_port()
        self.service = kv_service(self.port, 1 + cfg.learners * self.each)
        self.env = {ENV_LEARNERS: str(cfg.learners), ENV_SYNCER: f"127.0.0.1:{self.port}", ENV_QUORUM: str(quorum),
                    ENV_GRACE: str(cfg.grace_s), ENV_FAULTS: cfg.inject_faults, ENV_STATUS_DIR: status_dir,
                    ENV_STARTUP_TIMEOUT: str(cfg.startup_timeout_s), "PYTHONUNBUFFERED": "1"}
        self.procs, self.threads, self.restarts = {}, [], dict.fromkeys(range(cfg.learners + 1), 0)
        for member in range(cfg.learners + 1):
            self.start(member)

    def name(self, member: int) -> str:
        return "syncer" if member == 0 else f"learner {member - 1}"

    def start(self, member: int):
        """Start ``member``'s processes (again, after a failure: resuming)."""
        count = 1 if member == 0 else self.each
        coordinator = f"127.0.0.1:{_free_port()}"  # the learner's own jax.distributed job
        self.procs[member] = []
        for rank in range(count):
            env = dict(os.environ, **self.env)
            for name in (ENV_RESUME, ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID):
                env.pop(name, None)
            task = 0 if member == 0 else 1 + (member - 1) * self.each + rank
            env.update({ENV_ROLE: "syncer" if member == 0 else "learner", ENV_TASK: str(task)})
            if member:
                env[ENV_LEARNER] = str(member - 1)
            if count > 1:
                env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(count), ENV_PROCESS_ID: str(rank)})
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
            if self.cfg.devices_per_process and member:
                flags.append(f"--xla_force_host_platform_device_count={self.cfg.devices_per_process}")
            env["XLA_FLAGS"] = " ".join(flags)
            if self.restarts[member]:
                env[ENV_RESUME] = "auto"
            proc = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            prefix = "[syncer] " if member == 0 else f"[l{member - 1}" + (f".{rank}] " if count > 1 else "] ")
            thread = threading.Thread(target=_pump, args=(proc.stdout, prefix, self.out), daemon=True)
            thread.start()
            self.procs[member].append(proc)
            self.threads.append(thread)

    def wait(self, poll_s: float = 0.2) -> int:
        """Until the syncer finishes (0): each member one of whose processes dies restarted whole
        while it has restarts left; a refused input, or too few learners left for the quorum, ends
        the job."""
        quorum, gone = int(self.env[ENV_QUORUM]), set()
        while True:
            if self.procs[0][0].poll() == 0:
                self._let_learners_finish()
                return 0
            for member, procs in self.procs.items():
                failed = [p for p in procs if p.poll() not in (None, 0)]
                if not failed or member in gone:
                    continue
                why = f"{self.name(member)} (pid {failed[0].pid}) {_describe_exit(failed[0].returncode)}"
                if failed[0].returncode == EXIT_BAD_INPUT:
                    raise JaxparError(f"{why}: the command refused its input (its message is above); fix the command")
                _stop(procs, [])  # its other processes wait on the dead one
                if self.restarts[member] < self.cfg.max_restarts:
                    self.restarts[member] += 1
                    self.out.write(f"jaxpar launch: {why}; restarting it (restart {self.restarts[member]} of {self.cfg.max_restarts})\n")
                    self.start(member)
                    continue
                if member == 0 or self.cfg.learners - len(gone | {member}) < quorum:
                    raise JobFailed(f"{why}; no restarts left (--max-restarts {self.cfg.max_restarts}), and the job cannot go on without it")
                gone.add(member)
                self.out.write(f"jaxpar launch: {why}; no restarts left: the others go on without it\n")
            time.sleep(poll_s)

    def _let_learners_finish(self):
        """Learners end on the last merge's announcement; one still busy (slow, or restarting) has
        nothing left to add: it gets the grace window and a little more, then is stopped."""
        deadline = time.time() + self.cfg.grace_s + 30.0
        while time.time() < deadline and any(p.poll() is None for procs in self.procs.values() for p in procs):
            time.sleep(0.1)

    def stop(self):
        _stop([p for procs in self.procs.values() for p in procs], self.threads)
        self.service.shutdown()


def _launch_learners(command: list[str], cfg: LaunchConfig, out) -> int:
    """``launch`` with ``--learners``: see ``jaxpar/decoupled.py``."""
    quorum = _check_learners(cfg)
    if shutil.which(command[0]) is None:
        raise JaxparError(f"command {command[0]!r} was not found; give one, e.g. jaxpar launch --learners 2 -- jaxpar train")
    status_dir = cfg.status_dir or tempfile.mkdtemp(prefix="jaxpar-launch-")
    out.write(f"jaxpar launch: starting a syncer and {cfg.learners} learners (quorum {quorum}, grace {cfg.grace_s:g} s)\n")
    try:
        os.makedirs(status_dir, exist_ok=True)
        job = _Learners(command, cfg, quorum, status_dir, out)
        try:
            code = job.wait()
            out.write("jaxpar launch: the syncer made its last merge\n")
            return code
        finally:
            job.stop()
    finally:
        if cfg.status_dir is None:
            shutil.rmtree(status_dir, ignore_errors=True)
