"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``), served through chat.

- ``protocol``: the request body (strict: every field honoured, accepted and ignored, or refused naming it).
- ``conversation``: the request as the chat completion it is served as (items to messages, fields to fields).
- ``output``: the Response object and the stream's events, from the chat message and deltas.
- ``serving``: a request's preparation (as a chat completion's) and its stream of events.
- ``store``: the finished responses kept for retrieval and ``previous_response_id`` (LRU, in memory).
"""
