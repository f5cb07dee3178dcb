"""Tensor parallelism (Megatron-style): ``LLM(..., tensor_parallel_size=N)``.

``tp``: the model transform (column / row-parallel linears, split heads, vocab-parallel
embedding and LM head). ``worker``: one rank's process. ``tp_executor``: the driver side, the
engine's :class:`~pensieve.engine.executor.Executor` then. Nothing here is imported when N is 1.
"""
