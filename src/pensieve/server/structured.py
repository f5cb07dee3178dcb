"""What a chat request constrains its answer to, checked before the engine sees it.

``response_format`` ``json_object`` (any JSON object) or ``json_schema`` (the schema; with or
without ``strict`` the answer follows it: constrained decoding cannot do less), and
``tool_choice`` ``required`` or a named function (a call of the allowed tools whose arguments
follow their parameter schemas, :func:`.tools.call_grammar`). Each becomes a
:class:`~pensieve.core.sampling_params.GrammarSpec`.

Compiling (:func:`compile_constraint`). The spec is compiled where the engine lives, into the
cache its runner builds matchers from, in a thread of its own: never inside a step, so the
other requests keep producing tokens while it compiles (a 20,000-property schema used to
pause every stream for 45 s). The request is added once it compiled (its first step's compile
is then a cache hit); a schema xgrammar cannot compile is a 400 (``invalid_schema``) naming
the problem, and one that does not compile within ``--grammar-compile-timeout`` seconds a 400
(``grammar_too_complex``). The timeout counts the compile alone: the compiler (the tokenizer
and its xgrammar info), built in the background when the engine starts, is waited for apart.
Such a schema is remembered and refused at once when sent again; its compile, which cannot be
interrupted, goes on in its thread until it ends, and later grammars compile in a new thread
(up to two such compiles run aside; past that, new grammars wait behind them, each for at
most the timeout).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from pensieve.core.sampling_params import GrammarSpec
from pensieve.server.engine_loop import EngineRequestError
from pensieve.server.errors import APIError
from pensieve.server.protocol import ChatCompletionRequest
from pensieve.server.state import ServerState
from pensieve.server.tools import call_grammar, forced_names
from pensieve.server.turns import off_loop

TOO_COMPLEX_REMEMBERED = 1024
"""Grammars that ran out of time, remembered (their hashes) to refuse them at once."""


@dataclass(frozen=True)
class Constraint:
    """A chat turn's grammar (None: free text) and whether its answer is read for calls."""

    grammar: GrammarSpec | None
    tool_format: str | None
    """The call format to parse the answer in (None: no tools, or ``tool_choice: none``)."""
    param: str = "response_format"
    """The field the grammar comes from (``tools`` for a forced call), named by its 400s."""


def constraint(state: ServerState, body: ChatCompletionRequest) -> Constraint:
    """The request's constraint (400 on a bad one; :func:`compile_constraint` compiles it)."""
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
    if spec is not None and renderer is None:
        raise APIError(400, "constrained output needs a tokenizer", param=param)
    return Constraint(spec, fmt, param)


async def compile_constraint(state: ServerState, wanted: Constraint) -> None:
    """Compile the request's grammar where the engine lives, off its step loop, within
    ``state.grammar_compile_timeout_s`` (module docstring); a 400 when it cannot compile or
    runs out of time."""
    spec = wanted.grammar
    if spec is None:
        return
    slow = state.too_complex_grammars
    if spec in slow:
        slow.move_to_end(spec)
        raise _too_complex(state, spec, wanted.param, again=True)
    try:
        await _compiler_ready(state)  # not timed: the timeout counts the compile alone
        await asyncio.wait_for(_compile(state, spec), state.grammar_compile_timeout_s)
    except TimeoutError:
        slow[spec] = None
        while len(slow) > TOO_COMPLEX_REMEMBERED:
            slow.popitem(last=False)
        raise _too_complex(state, spec, wanted.param) from None
    except EngineRequestError:
        raise
    except ValueError as e:  # GrammarError: the compiler's reason
        raise APIError(400, str(e), param=wanted.param, code="invalid_schema") from e


async def _compiler_ready(state: ServerState) -> None:
    """Until the grammar compiler exists: the engine's, building since the engine started
    (its tokenizer and xgrammar's tokenizer info), or where the engine cannot compile ahead,
    the server's own."""
    if await state.engine.compile_grammar(None):
        return
    renderer = state.renderer
    assert renderer is not None
    await off_loop(state, renderer.grammar_compiler)


async def _compile(state: ServerState, spec: GrammarSpec) -> None:
    """Where the engine lives; where it cannot compile ahead of a request (tensor
    parallelism's executor: its first step compiles), here in the server's thread pool, to
    refuse a bad grammar before the request is added."""
    if await state.engine.compile_grammar(spec):
        return
    renderer = state.renderer
    assert renderer is not None
    await off_loop(state, lambda: renderer.grammar_compiler().compile(spec))


def _too_complex(state: ServerState, spec: GrammarSpec, param: str,
                 again: bool = False) -> APIError:
    what = spec.kind.replace("_", " ")
    return APIError(400, f"the {what} did not compile within {state.grammar_compile_timeout_s:g}"
                    f" s (--grammar-compile-timeout){': refused again' if again else ''}; "
                    "simplify it (fewer properties or alternatives)", param=param,
                    code="grammar_too_complex")
