"""Weight sync: move the trainer's sharded weights into the rollout fleet after every RL step.

layouts -> ``planner.plan_sync`` (who sends which region to whom, in buckets) -> ``schedule``
(one global bucket order, deadlock-free windowing) -> ``packing`` (bucket <-> one flat byte
buffer) -> ``transport`` (gloo | nccl | cuda_ipc) -> ``receiver`` (assembles HF tensors, commits
a version). ``sender`` turns a trainer rank's local shards into the region reader the transport
packs from. Failures raise ``errors.SyncError``.
"""
