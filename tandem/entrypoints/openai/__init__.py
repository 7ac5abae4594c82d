"""The OpenAI-compatible server (``tandem serve``)."""
