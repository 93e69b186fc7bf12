"""The OpenAI-compatible HTTP server (`folio serve`): FastAPI app, protocol models, errors and metrics."""
