"""One model replica across several processes (hosts), with JAX's multi-controller runtime.

`python -m model_service --coordinator HOST:PORT --num-processes N --process-id I` joins N processes with
jax.distributed into one global (data, model) mesh (sharding.make_multihost_mesh: one TPU slice is one mesh
along its torus; slices over DCN and CPU/GPU processes are blocks of a hybrid mesh). Process 0 serves gRPC and
runs the scheduler over a `LockstepEngine` (lockstep.py), which sends each Engine call to the followers over
a socket (link.py) and runs it without waiting for them; the followers replay the calls (follower.py), and
the steps' own collectives keep every process in step. The op table is ops.py.
A lost or stalled process breaks the group: process 0 reports NOT_SERVING, fails in-flight requests with
UNAVAILABLE and exits with EXIT_GROUP_BROKEN; the followers exit too; restarting all of them restores it.
"""

from model_service.distributed.config import EXIT_GROUP_BROKEN, DistributedConfig, initialize

__all__ = ["EXIT_GROUP_BROKEN", "DistributedConfig", "initialize"]
