"""User-facing error types.

Every error jaxpar raises for bad input is a ``JaxparError``: it names the offending value and
says how to fix it, and it is raised before any device memory is touched. ``JobFailed`` is the one
kind that is not about input: the job ran and could not finish.
"""


# Exit statuses, the same for every command (README: "Exit statuses"); ``JaxparError.exit_status``
# says which one each error ends a command with.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_SIGINT = 130  # 128 + the signal's number, as a shell reports a process killed by it
EXIT_SIGTERM = 143
EXIT_STATUSES = {
    EXIT_OK: "done",
    EXIT_FAILED: "the job failed: a process died or hung (launch), the loss became NaN or infinite (train), "
    "the plan does not fit in a chip's memory (compile), the layout differs from one device (check), "
    "or an output could not be written (a full disk)",
    EXIT_BAD_INPUT: "bad input, refused before any work: the message names the value and the fix",
    EXIT_SIGINT: "interrupted by SIGINT (Ctrl-C): train stops after the step in progress, saves a checkpoint "
    "(with --checkpoint-dir) and the metrics so far (with --metrics-json)",
    EXIT_SIGTERM: "stopped by SIGTERM, the same way",
}
EXIT_ON_SIGNAL = {"SIGINT": EXIT_SIGINT, "SIGTERM": EXIT_SIGTERM}


def size_text(num_bytes: float) -> str:
    """Bytes as a message says them: GiB from one GiB up, else MiB."""
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


class JaxparError(ValueError):
    """Base class: bad input from the user, with the culprit and the fix in the message."""

    exit_status = EXIT_BAD_INPUT


class TopologyError(JaxparError):
    """An unknown topology name, or a malformed topology file."""


class SpecError(JaxparError):
    """A parallel spec that cannot be built on the devices at hand."""


class LayoutError(JaxparError):
    """Rules that conflict, or a tensor that the layout cannot shard."""


class JobFailed(JaxparError):
    """Not bad input: the job ran and failed (a process died or hung, an output could not be
    written). The command line exits with status 1 for it, and 2 for every other JaxparError."""

    exit_status = EXIT_FAILED


class NonFiniteStep(JobFailed):
    """A training step whose loss or gradient norm is NaN or infinite. The step's update was not
    applied: ``state`` is the state before it (with its step counter advanced), ``metrics`` the
    step's loss and gradient norm."""

    def __init__(self, message: str, step: int, state=None, metrics=None):
        super().__init__(message)
        self.step, self.state, self.metrics = step, state, metrics
