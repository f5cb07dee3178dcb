"""The pure-Python core: requests, scheduling, KV block bookkeeping.

Nothing under ``pensieve.core`` imports torch, triton or transformers. Token ids are
``list[int]``, block ids are ``int``; every decision the engine makes is taken here and is
testable in microseconds on the CPU. The runner (``pensieve.runner``) only executes the plan.
"""
