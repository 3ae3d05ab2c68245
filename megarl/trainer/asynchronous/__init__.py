"""Asynchronous training: the producer that generates ahead of the trainer (``producer``), the
buffer of finished groups (``sample_buffer``), the staleness bound (``staleness``) and what the
controller calls (``batches.AsyncBatches``).
"""
