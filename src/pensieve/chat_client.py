"""``pensieve chat``: a small terminal client for a multi-turn chat with a pensieve server.

After the first answer it sends only the new message with the conversation id the server
returned, so the server computes only the new tokens. Commands: ``/new`` starts a new
conversation, ``/id`` prints the current id, ``/quit`` (or Ctrl-D) leaves. Ctrl-C during an
answer cancels that answer (the conversation stays as it was) and the chat goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--api-key", default=os.environ.get("PENSIEVE_API_KEY"))
    p.add_argument("--conversation", default=None, help="continue this conversation id")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the server's, which is the model's "
                        "recommended setting when it states one)")
    p.add_argument("--system", default=None, help="system message for a new conversation")


def _stream_turn(client: Any, args: argparse.Namespace, messages: list[dict[str, str]],
                 conv: str | None, out: Any) -> str | None:
    body: dict[str, Any] = {"messages": messages, "stream": True,
                            "max_tokens": args.max_tokens}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if conv:
        body["conversation_id"] = conv
    before = conv
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError):
                msg = r.text
            print(f"[error {r.status_code}] {msg}", file=out)
            return conv
        try:
            for line in sse_lines(r.iter_text()):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the turn failed mid-way: the conversation is as before
                    out.write(f"\n[error] {chunk['error'].get('message', chunk['error'])}")
                    conv = before
                    break
                conv = chunk.get("conversation_id") or conv
                for ch in chunk.get("choices", []):
                    out.write(ch.get("delta", {}).get("content") or "")
                    out.flush()
        except KeyboardInterrupt:  # Ctrl-C cancels the answer (the server aborts the turn)
            out.write("\n[cancelled]")
            conv = before
    out.write("\n")
    return conv


def sse_lines(chunks: Any) -> Any:
    """Lines of an SSE stream split on \n only (``str.splitlines`` would also split on
    U+2028 and the like inside the JSON)."""
    buf = ""
    for text in chunks:
        buf += text
        *lines, buf = buf.split("\n")
        yield from (line.rstrip("\r") for line in lines)
    if buf:
        yield buf


def chat(args: argparse.Namespace, stdin: Any = None, out: Any = None) -> int:
    import httpx

    stdin, out = stdin or sys.stdin, out or sys.stdout
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    conv: str | None = args.conversation
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        try:
            r = client.get("/v1/models")
            if r.status_code == 401:
                print(f"{args.url} says: bad or missing API key (--api-key or "
                      "PENSIEVE_API_KEY)", file=out)
                return 1
            name = r.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            print(f"cannot reach a pensieve server at {args.url}: {e}", file=out)
            return 1
        print(f"chatting with {name} at {args.url} (/new, /id, /quit)", file=out)
        pending_system = args.system
        while True:
            out.write("> ")
            out.flush()
            line = stdin.readline()
            if not line or line.strip() == "/quit":
                return 0
            text = line.strip()
            if not text:
                continue
            if text == "/new":
                conv, pending_system = None, args.system
                print("(new conversation)", file=out)
                continue
            if text == "/id":
                print(conv or "(none yet)", file=out)
                continue
            messages = [{"role": "user", "content": text}]
            if conv is None and pending_system:
                messages.insert(0, {"role": "system", "content": pending_system})
            conv = _stream_turn(client, args, messages, conv, out)
            pending_system = None
