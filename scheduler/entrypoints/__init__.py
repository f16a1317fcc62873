"""Front ends over the engine: the offline ``LLM``, the CLI and main job, text output processing, the HTTP server."""
