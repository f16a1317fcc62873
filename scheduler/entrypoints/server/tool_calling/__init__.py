"""Tool calling on chat completions (vLLM's ``tools`` and ``tool_choice``).

- ``protocol``: the request's tool shapes (``tools``, ``tool_choice``, an assistant message's ``tool_calls``).
- ``choice``: each tool choice's checks, output constraint, and messages and deltas (``ToolOutput``).
- ``readers``: the named function's and "required"'s readers of calls in a sample's text, piece by piece.
- ``parsers``: ``--tool-call-parser``'s names and their "auto" readers:
  - ``hermes``: ``<tool_call>`` blocks;
  - ``llama3_json``: ``<|python_tag|>`` and ``{"name", "parameters"}`` objects separated by ``;``;
  - ``pythonic``: a Python list of calls, ``[f(a=1), g()]``;
  - ``mistral``: ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` objects.
  - ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...`` XML, values typed by the
    request's tool schemas;
  - ``deepseek_v3``, ``deepseek_v31``: DeepSeek's ``<｜tool▁calls▁begin｜>`` blocks of V3 (R1-0528) and V3.1.
- ``call_object``: a call written as a JSON object, read as it arrives (streamed once led by its name).
- ``call_sequence``: calls one after another with separators (llama3_json's, mistral's, pythonic's).
- ``object_scanner``: a JSON object's members as they are written (the readers stream arguments with it).
"""
