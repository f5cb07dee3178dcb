"""``pensieve serve``: an OpenAI-compatible HTTP server over the stateful engine."""
