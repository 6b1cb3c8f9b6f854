"""The HTTP front end: OpenAI-compatible request/response shapes, errors and text streaming helpers."""
