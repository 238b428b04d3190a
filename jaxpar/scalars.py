"""Per-step figures where people look at them: TensorBoard event files (``--tensorboard DIR``,
written with tensorboardX: a small writer with no TensorFlow, read by TensorBoard itself) and a
progress bar on a terminal (rich), a line every 10% of the steps in a log."""

from __future__ import annotations

import contextlib
import time

from jaxpar.errors import JaxparError


class TensorBoard:
    """Scalars by step into an event file under ``directory`` (``add``), flushed as they come."""

    def __init__(self, directory: str):
        try:
            from tensorboardX import SummaryWriter  # the `data` extra
        except ImportError:
            raise JaxparError("--tensorboard needs tensorboardX: pip install -e \".[data]\"") from None
        self.writer = SummaryWriter(directory)

    def add(self, step: int, values: dict):
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, float(value), step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class Progress:
    """Steps done, loss, tokens/s and time left: a rich progress bar on a terminal; in a log (a
    stream that is not a terminal) a line every 10% of the steps instead of redrawing."""

    def __init__(self, first: int, total: int, stream, what: str = "train"):
        self.first, self.total, self.stream, self.start = first, total, stream, time.perf_counter()
        self.bar = None
        if terminal(stream):
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self.bar = Bar(TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                           TimeRemainingColumn(), console=Console(file=stream))
            self.task = self.bar.add_task(what, total=total, completed=first, status="")
            self.bar.start()

    def update(self, done: int, status: str, always: bool = False):
        """``always``: a line in a log even between the 10% marks (a held-out loss)."""
        if self.bar is not None:
            self.bar.update(self.task, completed=done, status=status)
            return
        if done % max(self.total // 10, 1) and done != self.total and not always:
            return
        left = (time.perf_counter() - self.start) / (done - self.first) * (self.total - done)
        self.stream.write(f"{done}/{self.total} {status} {left:4.0f}s left\n")
        self.stream.flush()

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def terminal(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


@contextlib.contextmanager
def working(what: str, stream):
    """Around long work with no steps to count (a compile): on a terminal a spinner with ``what``
    and the time so far, gone when done; either way a line ``what: N s`` at the end."""
    began = time.perf_counter()
    if stream is None:
        yield
        return
    if terminal(stream):
        from rich.console import Console
        from rich.progress import Progress as Bar, SpinnerColumn, TextColumn, TimeElapsedColumn

        with Bar(SpinnerColumn(), TextColumn(what), TimeElapsedColumn(), console=Console(file=stream), transient=True) as bar:
            bar.add_task(what, total=None)
            yield
    else:
        yield
    stream.write(f"{what}: {time.perf_counter() - began:.1f} s\n")
    stream.flush()
