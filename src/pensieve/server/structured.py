"""What a chat request constrains its answer to, checked before the engine sees it.

``response_format`` ``json_object`` (any JSON object) or ``json_schema`` (the schema; with or
without ``strict`` the answer follows it: constrained decoding cannot do less), and
``tool_choice`` ``required`` or a named function (a call of the allowed tools whose arguments
follow their parameter schemas, :func:`.tools.call_grammar`). Each becomes a
:class:`~pensieve.core.sampling_params.GrammarSpec`, compiled here in the server's thread pool
(cached by its text) so a schema xgrammar cannot compile is a 400 naming the problem before
the request is added; the engine compiles the same text into its own cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pensieve.core.sampling_params import GrammarSpec
from pensieve.server.errors import APIError
from pensieve.server.protocol import ChatCompletionRequest
from pensieve.server.state import ServerState
from pensieve.server.tools import call_grammar, forced_names


@dataclass(frozen=True)
class Constraint:
    """A chat turn's grammar (None: free text) and whether its answer is read for calls."""

    grammar: GrammarSpec | None
    tool_format: str | None
    """The call format to parse the answer in (None: no tools, or ``tool_choice: none``)."""


def constraint(state: ServerState, body: ChatCompletionRequest) -> Constraint:
    """The request's constraint, compiled once to check it (400 on a bad one)."""
    renderer = state.renderer
    tools = [t.as_dict() for t in body.tools or []]
    fmt = renderer.tool_format if renderer is not None and tools else None
    if body.tool_choice not in (None, "none", "auto") and not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if body.tool_choice == "none":
        fmt = None
    try:
        names = forced_names(tools, body.tool_choice) if tools else None
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from e
    spec, param = None, "response_format"
    rf = body.response_format
    if names is not None:
        assert fmt is not None
        if rf is not None and rf.type != "text":
            raise APIError(400, "response_format cannot be combined with a forced tool_choice",
                           param="response_format")
        spec, param = call_grammar(tools, names, body.parallel_tool_calls, fmt), "tools"
    elif rf is not None and rf.type == "json_object":
        spec = GrammarSpec("json_object")
    elif rf is not None and rf.type == "json_schema":
        schema = (rf.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, an "
                           "object", param="response_format")
        spec = GrammarSpec("json_schema", json.dumps(schema))  # keys in the order given
    if spec is not None:
        if renderer is None:
            raise APIError(400, "constrained output needs a tokenizer", param=param)
        from pensieve.runner.grammar import GrammarError

        try:
            renderer.grammar_compiler().compile(spec)
        except GrammarError as e:
            raise APIError(400, str(e), param=param, code="invalid_schema") from e
    return Constraint(spec, fmt)
