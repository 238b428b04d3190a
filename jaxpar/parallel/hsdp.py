"""Hybrid sharded data parallelism (HSDP): ZeRO-3 inside a group, plain DP across groups.

Spelled ``data=R,fsdp=F``: weights are sharded over the F devices of a group (``fsdp``, fast
links) and replicated over the R groups (``data``, which may cross DCN). After the in-group
reduce-scatter each device holds 1/F of the gradient, and only that shard is all-reduced across
groups: 2*(Psi_b/F)*(R-1)/R extra bytes per device per step.
"""

from jaxpar.parallel import data


def cross_group_bytes(psi_bytes: float, groups: int, group_size: int) -> float:
    """Bytes one device sends to all-reduce its 1/group_size gradient shard across ``groups``."""
    return data.grad_allreduce_bytes(psi_bytes / group_size, groups)
