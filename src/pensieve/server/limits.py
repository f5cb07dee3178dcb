"""Default bounds on a request's retention hints, shared by the request models
(:mod:`.protocol`) and the command line (:mod:`.main`); kept apart from the request models so
that building ``pensieve serve``'s parser (``--help``) does not import pydantic."""

from __future__ import annotations

DEFAULT_MAX_PRIORITY = 100.0
"""Default bound on a request's ``priority`` (``--max-priority``)."""
DEFAULT_MAX_KEEP_ALIVE_S = 3600.0
"""Default bound on a request's ``keep_alive_s`` (``--max-keep-alive-s``)."""
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0
"""``--grammar-compile-timeout``: a schema of a few hundred properties compiles in well under a
second; 3,000 optional ones took 187 s on a busy 2-core machine."""
