"""Clients people already run, unmodified, against ``pensieve serve`` on the default model:
LangChain's ``ChatOpenAI`` with ``bind_tools`` and ``with_structured_output``, and a one-tool
agent of the OpenAI Agents SDK. Each drives a multi-turn exchange end to end, and the later
turn finds the history in the cache (the usage's ``cached_tokens``, which LangChain reports as
``input_token_details.cache_read``)."""

from __future__ import annotations

import pytest
from server_util import Server

from pensieve.config import DEFAULT_MODEL


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server


def _chat(server: Server):  # type: ignore[no-untyped-def]
    import langchain_openai  # here, not when the tests are collected (~0.5 s of each worker's)

    return langchain_openai.ChatOpenAI(model=DEFAULT_MODEL, base_url=server.url + "/v1",
                                       api_key="none", max_tokens=48, max_retries=0)


def test_langchain_bind_tools_round_trip_hits_the_cache(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"Sunny in {city}."

    llm = _chat(server).bind_tools([get_weather], tool_choice="get_weather")
    msgs = [HumanMessage("What is the weather in Paris?")]
    first = llm.invoke(msgs)
    assert len(first.tool_calls) == 1, first
    call = first.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str), call
    msgs += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    second = _chat(server).bind_tools([get_weather]).invoke(msgs)
    assert second.content or second.tool_calls, second
    cached = second.usage_metadata["input_token_details"].get("cache_read", 0)
    assert cached >= first.usage_metadata["input_tokens"] // 2, second.usage_metadata


def test_langchain_structured_output_follows_the_schema_and_hits_the_cache(server):
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        city: str

    llm = _chat(server).with_structured_output(Capital, include_raw=True)
    question = "What is the capital of France? Answer as JSON."
    first = llm.invoke(question)
    assert isinstance(first["parsed"], Capital), first
    again = llm.invoke(question)  # the same history again: all of it cached but the last token
    assert isinstance(again["parsed"], Capital), again
    usage = again["raw"].usage_metadata
    assert usage["input_token_details"].get("cache_read", 0) >= usage["input_tokens"] // 2, usage


def test_openai_agents_one_tool_loop_hits_the_cache(server):
    """The OpenAI Agents SDK: an agent with one tool runs its loop (the model calls the tool,
    the SDK runs it and sends the result back, the model answers), here through the Chat
    Completions API (``set_default_openai_api("chat_completions")``); its default, the
    Responses API, is tests/test_responses.py's. Tracing is off because it would upload to
    OpenAI."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    set_tracing_disabled(True)
    set_default_openai_api("chat_completions")
    set_default_openai_client(AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                          max_retries=0), use_for_tracing=False)
    agent = Agent(name="weather", instructions="Answer with the weather tool.",
                  tools=[get_weather], model=DEFAULT_MODEL,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls, "the agent never called its tool"
    assert isinstance(result.final_output, str) and result.final_output, result
    second = result.raw_responses[1].usage
    assert second.input_tokens_details.cached_tokens >= second.input_tokens // 2, second
