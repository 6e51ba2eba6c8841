"""The trainer side: the client that polls the buffer, the conversion of trajectories to
training samples, slime's rollout function and W&B logging of reads.

It runs in the trainer's process, so it imports no service, store, core, worker or toolkit code
(``.importlinter``): only the shared leaves and itself.
"""
