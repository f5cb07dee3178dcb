"""Small JSON files written atomically (profiles, fitted models)."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as indented JSON, creating the parent directory; atomic replace."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON object from ``path``; ValueError if the file is not JSON or not an object."""
    with open(os.fspath(path), encoding="utf-8") as f:
        try:
            data: object = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)}: not JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{os.fspath(path)}: expected a JSON object")
    return data
