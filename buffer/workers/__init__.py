"""Generators out of the service's process: worker processes, Ray actors, and the lease board
that shares a job's work between them.

A job's generator runs in worker processes the service starts and owns (``process``), each a
fresh interpreter in a process group of its own (``child``): whatever the generator does there
(block its event loop, exit, leak, start processes of its own) cannot stop the service, and a
cancel stops all of it. Trajectories come back over HTTP to the service's loopback address,
the path every remote generator already takes: batched, deduplicated by ``uid``, slowed by 429.
The service hands out a job's work through the lease board (``leases``); Ray actors
(``ray_worker``) and ``rollout-buffer worker`` (``remote``) run the same worker code.

It may import the core's generator discovery (``buffer.core.registry``) and the shared leaves;
never the service or the toolkit (``.importlinter``). A worker learns everything from its
``WorkerSpec`` and hands its generator a ``buffer.current.JobContext``: its own machinery is a
dozen modules (``tests/workers/test_child.py`` holds it to 15).
"""
