"""The JSON ending of a benchmark command: the result printed, and written to ``--out``."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any


def emit_result(result: Mapping[str, Any], out: str | None, brief: Collection[str] = ()) -> None:
    """Print ``result`` as indented JSON, less its ``brief`` keys (long lists such as every
    step or prompt), and when ``out`` is given write all of it there."""
    print(json.dumps({k: v for k, v in result.items() if k not in brief}, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
