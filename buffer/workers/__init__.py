"""Generators out of the service's process: worker processes, their channel back to the buffer,
and the hooks' time limit.

A job's generator runs in worker processes the service starts and owns (``process``), each a
fresh interpreter in a process group of its own (``child``): whatever the generator does there
(block its event loop, exit, leak, start processes of its own) cannot stop the service, and a
cancel stops all of it. Trajectories come back over HTTP to the service's loopback address,
the path every remote generator already takes: batched, deduplicated by ``uid``, slowed by 429.
"""
