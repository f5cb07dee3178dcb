"""``pensieve chat``: a small terminal client for a multi-turn chat with a pensieve server.

After the first answer it sends only the new message with the conversation id the server
returned, so the server computes only the new tokens. Commands: ``/new`` starts a new
conversation, ``/id`` prints the current id, ``/quit`` (or Ctrl-D) leaves.
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
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--system", default=None, help="system message for a new conversation")


def _stream_turn(client: Any, args: argparse.Namespace, messages: list[dict[str, str]],
                 conv: str | None, out: Any) -> str | None:
    body: dict[str, Any] = {"messages": messages, "stream": True,
                            "max_tokens": args.max_tokens, "temperature": args.temperature}
    if conv:
        body["conversation_id"] = conv
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError):
                msg = r.text
            print(f"[error {r.status_code}] {msg}", file=out)
            return conv
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            conv = chunk.get("conversation_id") or conv
            for ch in chunk.get("choices", []):
                out.write(ch.get("delta", {}).get("content") or "")
                out.flush()
    out.write("\n")
    return conv


def chat(args: argparse.Namespace, stdin: Any = None, out: Any = None) -> int:
    import httpx

    stdin, out = stdin or sys.stdin, out or sys.stdout
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    conv: str | None = args.conversation
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        try:
            name = client.get("/v1/models").json()["data"][0]["id"]
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
