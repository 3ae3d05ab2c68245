"""The single controller: the RL step (``controller``), the Megatron ranks as Ray actors
(``megatron_worker``), the step's data and metrics, checkpoints, and asynchronous training
(``asynchronous/``). It talks to ``WorkerGroup`` and ``RolloutFleet``, never to Ray handles inside them.
"""
