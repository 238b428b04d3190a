"""User-facing error types.

Every error jaxpar raises for bad input is a ``JaxparError``: it names the offending value and
says how to fix it, and it is raised before any device memory is touched. ``JobFailed`` is the one
kind that is not about input: the job ran and could not finish.
"""


def size_text(num_bytes: float) -> str:
    """Bytes as a message says them: GiB from one GiB up, else MiB."""
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


class JaxparError(ValueError):
    """Base class: bad input from the user, with the culprit and the fix in the message."""


class TopologyError(JaxparError):
    """An unknown topology name, or a malformed topology file."""


class SpecError(JaxparError):
    """A parallel spec that cannot be built on the devices at hand."""


class LayoutError(JaxparError):
    """Rules that conflict, or a tensor that the layout cannot shard."""


class JobFailed(JaxparError):
    """Not bad input: the job ran and failed (a process died or hung, an output could not be
    written). The command line exits with status 1 for it, and 2 for every other JaxparError."""


class NonFiniteStep(JobFailed):
    """A training step whose loss or gradient norm is NaN or infinite. The step's update was not
    applied: ``state`` is the state before it (with its step counter advanced), ``metrics`` the
    step's loss and gradient norm."""

    def __init__(self, message: str, step: int, state=None, metrics=None):
        super().__init__(message)
        self.step, self.state, self.metrics = step, state, metrics
