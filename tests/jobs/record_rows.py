"""Test job: ``jaxpar`` with the given arguments, each process recording the rows of every batch
it puts on its devices (OUT/rows-<process>.pkl: one list per batch, in order, of (start, stop,
rows) for each row range the process read). Usage:
    record_rows.py OUT JAXPAR_ARGS...
"""

import os
import pickle
import sys

from jaxpar import cli
from jaxpar.train.placement import BatchPlacement



def recording(batches: list):
    """``BatchPlacement.put_process`` that also appends each batch's [(start, stop, rows)] to ``batches``."""
    put = BatchPlacement.put_process

    def recorded(self, batch_size, rows):
        parts = []

        def read(start, stop):
            parts.append((start, stop, rows(start, stop)))
            return parts[-1][2]

        batch = put(self, batch_size, read)
        batches.append(parts)
        return batch

    return recorded


if __name__ == "__main__":
    seen = []
    BatchPlacement.put_process = recording(seen)
    code = cli.main(sys.argv[2:])
    with open(os.path.join(sys.argv[1], f"rows-{os.environ.get('JAXPAR_PROCESS_ID', '0')}.pkl"), "wb") as f:
        pickle.dump(seen, f)
    sys.exit(code)
