"""Tool calling on chat completions (vLLM's ``tools`` and ``tool_choice``).

- ``protocol``: the request's tool shapes (``tools``, ``tool_choice``, an assistant message's ``tool_calls``).
- ``choice``: each tool choice's checks, output constraint, and messages and deltas (``ToolOutput``).
- ``readers``: the named function's and "required"'s readers of calls in a sample's text, piece by piece.
- ``hermes``: "auto"'s reader of ``<tool_call>`` blocks (``--tool-call-parser hermes``).
- ``object_scanner``: a JSON object's members as they are written (the readers stream arguments with it).
"""
