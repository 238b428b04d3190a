"""Where a training batch goes: split over the layout's batch axes by dim 0, checked first.

Both paths take the batch in this one sharding. With several processes, ``put_process`` asks the
data source only for the rows this process's devices hold. Where a strategy splits the sequence
(context parallelism) every device of a row's group receives the whole row, and the step cuts out
the positions it holds (the strategies' ``local_batch``): token ids are small next to activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import LayoutError
from jaxpar.parallel import STRATEGIES
from jaxpar.rules import Layout


class BatchPlacement:
    """Batches for ``layout`` cut into ``microbatches`` micro-batches per device. A batch is an
    array (or a pytree of arrays) whose dim 0 is the batch."""

    def __init__(self, layout: Layout, microbatches: int = 1):
        self.layout, self.microbatches = layout, microbatches
        self.spec = PartitionSpec(layout.batch_axes or None)  # of every leaf
        self._leaf = NamedSharding(layout.mesh, self.spec)

    def sharding(self, batch) -> Any:
        return jax.tree.map(lambda _: self._leaf, batch)

    def abstract(self, batch_size: int, seq_len: int, packed: bool = False, fields: dict | None = None):
        """A (batch_size, seq_len + 1) int32 token batch as a sharded ShapeDtypeStruct, for
        compiling a step without data; ``packed``: the dict ``train.data.packed_batch_at`` makes;
        ``fields``: ``{key: (width, dtype)}`` of the rows a model family makes
        (``Family.batch_fields``: a block diffusion model's [x_t ; x_0], 2 x seq_len)."""
        if fields is not None:
            return {k: jax.ShapeDtypeStruct((batch_size, width), t, sharding=self._leaf) for k, (width, t) in fields.items()}
        if packed:
            dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "positions": jnp.int32, "segments": jnp.int32, "weights": jnp.float32}
            return {k: jax.ShapeDtypeStruct((batch_size, seq_len), t, sharding=self._leaf) for k, t in dtypes.items()}
        return jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32, sharding=self._leaf)

    def check(self, batch, length: int | None = None):
        """Refuse a batch the layout cannot split; ``length``: its sequence length where the batch
        is only a (batch_size, 1) stand-in."""
        shards = self.layout.batch_shards * self.microbatches
        for leaf in jax.tree.leaves(batch):
            if leaf.shape[0] % shards:
                raise LayoutError(
                    f"batch of {leaf.shape[0]} examples does not split evenly over {shards} = batch axes "
                    f"{self.layout.batch_axes} x {self.microbatches} micro-batches; use a multiple of {shards}"
                )
        for module in STRATEGIES:  # e.g. a sequence length the context ring cannot cut
            module.check_batch(self.layout, batch, length)

    def put(self, batch):
        """Place a host batch on the devices, split over the batch axes."""
        self.check(batch)
        return jax.device_put(batch, self.sharding(batch))

    def put_process(self, batch_size: int, rows: Callable[[int, int], Any]):
        """Build a global batch of ``batch_size`` rows of which this process makes only its own.

        ``rows(start, stop)`` returns rows ``[start, stop)`` of the global batch as a host array
        (or a dict of them). It is called for the row ranges held by this process's devices (in
        order), so with several processes each one reads only its shard of the data."""
        self.check(np.zeros((batch_size, 1)))
        held = self._leaf.addressable_devices_indices_map((batch_size,)).values()
        ranges = sorted({(index[0].start or 0, batch_size if index[0].stop is None else index[0].stop) for index in held})
        local = jax.tree.map(lambda *parts: np.concatenate(parts), *[rows(start, stop) for start, stop in ranges])
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self._leaf, x, (batch_size,) + x.shape[1:]), local)
