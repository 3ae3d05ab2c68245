"""Weight sync: move the trainer's sharded weights into the rollout fleet after every RL step.

layouts -> ``planner.plan_sync`` (who sends which region to whom, in buckets) -> ``schedule``
(one global bucket order, deadlock-free windowing) -> ``packing`` (bucket <-> one flat byte
buffer) -> ``transport`` (gloo | nccl | cuda_ipc) -> ``receiver`` (assembles HF tensors, each
region exactly once). ``sender`` turns a trainer rank's local shards into the region reader the
transport packs from. ``endpoints``: the two ends, each one object with its life cycle and state
(the replica's ``ReceiverEndpoint`` holds the version it serves); ``session``: the controller's
view, which publishes the versions. Failures raise ``errors.SyncError``.
"""
