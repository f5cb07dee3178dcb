"""A request's two priorities, each under its own name.

- ``priority``: vLLM's scheduling priority, an integer, default 0: a waiting turn is admitted
  before waiting turns of a larger value (``SamplingParams.priority``).
- ``retention_priority``: Pensieve's retention weight of the conversation's KV (> 0, default 1,
  at most ``--max-retention-priority``). It was called ``priority`` before vLLM's field was
  accepted; for one release a server started with ``--priority-means-retention`` still reads
  a request's ``priority`` as the retention weight (its scheduling priority is then 0).
"""

from __future__ import annotations

from pensieve.server.errors import APIError
from pensieve.server.protocol import _Sampling
from pensieve.server.state import ServerState


def settle_priorities(state: ServerState, body: _Sampling) -> None:
    """Give ``body.priority`` (an int) and ``body.retention_priority`` their meaning, or a
    400 naming the field."""
    if state.priority_means_retention and "priority" in body.model_fields_set:
        if body.retention_priority is not None:
            raise APIError(400, "with --priority-means-retention, priority is the retention "
                           "weight: give it or retention_priority, not both", param="priority")
        if not body.priority > 0:
            raise APIError(400, "priority (the retention weight, --priority-means-retention) "
                           f"must be > 0, got {body.priority:g}", param="priority")
        body.retention_priority, body.priority = body.priority, 0
        return
    if body.priority != int(body.priority):
        raise APIError(400, "priority is vLLM's scheduling priority, an integer (lower runs "
                       f"first), got {body.priority:g}; the KV retention weight is "
                       "retention_priority", param="priority")
    body.priority = int(body.priority)
