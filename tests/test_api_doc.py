"""docs/api.md's field table agrees with the server: every declared request field and every
field :mod:`pensieve.server.fields` knows is listed, and nothing listed is unknown to them."""

from __future__ import annotations

import re
from pathlib import Path

from pensieve.server.fields import CHAT_ONLY_INERT, INERT_ONLY, NO_EFFECT
from pensieve.server.protocol import ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _documented() -> set[str]:
    text = DOC.read_text().split("## Other endpoints")[0]
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names.update(re.findall(r"`([a-z_]+)`", first_cell))
    return names


def test_every_field_is_documented_and_nothing_else() -> None:
    known = (set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
             | set(INERT_ONLY) | set(CHAT_ONLY_INERT) | set(NO_EFFECT))
    documented = _documented()
    assert known - documented == set(), "fields missing from docs/api.md"
    assert documented - known == set(), "docs/api.md lists fields the server does not know"
