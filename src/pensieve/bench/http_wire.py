"""What the HTTP benchmark client sends and reads back, apart from the connection.

- The user text of a chat turn: words from :data:`CHAT_WORDS` (common English words that are
  one token each in Llama/Mistral-class 32k SentencePiece vocabularies), one per prompt token id
  the load generator drew (``word = CHAT_WORDS[id % len]``), so every system sees the same texts
  for the same seed (:func:`words_text`).
- The lines of an SSE stream (:func:`sse_lines`).
- A streamed turn assembled into a :class:`~pensieve.engine.request_output.RequestOutput`
  (:class:`StreamedTurn`): first-token and finish times, the finish reason, the ``usage``
  token counts (``prompt_tokens_details.cached_tokens`` where the server reports it) and
  Pensieve's per-turn cache stats (``pensieve.cache`` in the chunk with the finish reason).
  Outputs hold dummy token ids of the ``usage`` lengths.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pensieve.engine.request_output import RequestOutput

_WORDS = """
    the of and to in is that for it as with was on be by this are from at or an have not which
    but they one all were there can has more will their if about would when what so out up
    into than them some could other only new time these two may then do first any like now my
    over such our even most made after also did many before must through back years where much
    your way well down should because each just those people how too little state good very
    make world still own see men work long get here between both life being under never day
    same another know while last might great old year off come since against go came right
    used take three states himself few house use during without again place around however
    home small found thought went say part once general high upon school every does got left
    number course until always away something fact though water less public put think almost
    hand enough far took head yet government system better set told nothing night end why
    called find look asked later point knew city next program business give group toward young
    days let room side social given present several order national possible rather second face
    per among form important often things looked early white case become large big need four
    within felt along children saw best ever least power development light thing seemed family
    interest want members mind country area others done turn although open service certain
    kind problem began different door thus help sense means whole matter perhaps itself times
    law human line above name example action company hands local show whether five history
    gave today either act feet across taken past quite anything seen having experience body
    word half really field am car words already themselves information tell college shall
    money period held keep sure probably free seems real behind cannot question air office
    making brought whose special heard major problems ago became moment study available known
    result street economic position reason change south board individual job society areas
    west close turned community true court force full seem future age wanted department voice
    center woman control common necessary following front sometimes six clear further land run
    students provide feel party able music education university child effect level stood short
    town morning total figure rate art class private file code test function value error
    output input data table query user server request response model build check update list
    tool call search read write memory
"""
CHAT_WORDS: tuple[str, ...] = tuple(_WORDS.split())
"""Common English words, each one token after a space in the demo model's tokenizer (Mistral's
32k SentencePiece vocabulary; Llama 2's is of the same kind): a turn's user text."""


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an SSE stream, split on ``\n`` only (a trailing ``\r`` dropped). httpx's
    ``aiter_lines`` splits as ``str.splitlines`` does, also on U+0085, U+2028 and U+2029,
    which a server may leave unescaped inside a data line's JSON."""
    buf = ""
    async for text in chunks:
        buf += text
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if buf:
        yield buf


def words_text(ids: list[int], tokens_per_word: float = 1.0) -> str:
    """User text of about ``len(ids)`` tokens: one word of :data:`CHAT_WORDS` per id, the
    number of words scaled by ``1 / tokens_per_word``."""
    n = max(1, round(len(ids) / tokens_per_word)) if ids else 1
    src = ids or [0]
    return " ".join(CHAT_WORDS[src[i % len(src)] % len(CHAT_WORDS)] for i in range(n))


class StreamFailed(Exception):
    """A streamed request that failed: a non-200 answer, an error event, or a stream without
    what the turn needs (a finish reason, a usage chunk)."""


class StreamedTurn:
    """The chunks of one streamed completion, as they arrive: :meth:`feed` each parsed SSE
    chunk with its arrival time, then :meth:`output`. ``chat``: the chunks are chat chunks
    (``choices[].delta.content``, kept in ``parts``), else completion chunks
    (``choices[].text``, counted in ``text_chunks``)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.first_t: float | None = None
        """The first data line's arrival: a server sends its first chunk once the first
        token is sampled, so this marks the first token even when it decodes to no text."""
        self.finish_t: float | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.cache: Any = None
        """``pensieve.cache`` of the chunk with the finish reason (None without one)."""
        self.server_cid: Any = None
        """The latest ``conversation_id`` a chunk named (Pensieve's; None if none did)."""
        self.parts: list[str] = []
        self.text_chunks = 0

    def feed(self, now: float, chunk: dict[str, Any]) -> None:
        if self.first_t is None:
            self.first_t = now
        self.server_cid = chunk.get("conversation_id") or self.server_cid
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if self.chat:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    self.parts.append(delta["content"])
            else:
                self.text_chunks += bool(choice.get("text"))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.finish_t = now
                self.cache = (chunk.get("pensieve") or {}).get("cache")

    def output(self, rid: str, ids: list[int], arrival: float,
               conversation_id: str | None) -> RequestOutput:
        """The finished turn (call once :attr:`finish_reason` is set). Token counts come from
        ``usage``; a chat turn requires it (:class:`StreamFailed` without it), a completion
        falls back to the prompt's length and the number of chunks with text."""
        if self.chat and self.usage is None:
            raise StreamFailed("the stream had no usage chunk (stream_options.include_usage)")
        usage = self.usage
        prompt_len = int(usage["prompt_tokens"]) if usage else len(ids)
        n_out = int(usage["completion_tokens"]) if usage else self.text_chunks
        cache = dict(self.cache) if self.cache else {}
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            cache["usage_cached_tokens"] = int(cached)
        return RequestOutput(rid, [0] * prompt_len, [0] * n_out, self.finish_reason,
                             arrival_time=arrival, first_token_time=self.first_t,
                             finish_time=self.finish_t, conversation_id=conversation_id,
                             cache_stats=cache or None)


__all__ = ["CHAT_WORDS", "StreamFailed", "StreamedTurn", "sse_lines", "words_text"]
