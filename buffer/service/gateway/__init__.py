"""The recording gateway: agents that already exist, trained without being rewritten.

An agent (an OpenAI-SDK loop, LangGraph, a coding CLI) is pointed at a session's ``base_url``
(``/sessions/{id}/v1``) as if it were the policy server. Each chat completion is forwarded to
the engine with token capture on, and recorded; ending the session turns the recorded calls
into a token-faithful trajectory written to the buffer like any other.

- ``calls``: one recorded chat completion (``Call``), as the journal keeps it.
- ``sessions``: the sessions' state, changed only by events that the buffer journals, so a
  restart replays them (``SessionStore``).
- ``tree``: which recorded call continues which (an agent that retries or branches).
- ``assembly``: a session's calls as a trajectory (messages, tools, turns).
- ``sampling``: the sampling fields a session pins, whatever the agent sends.
- ``images``: image content parts kept on the trajectory, by reference when large.
- ``proxy``: the engine call with capture, and the stream the agent asked for.
- ``service``: the ``Gateway`` the routes call (``buffer.service.routes.sessions``).
- ``anthropic``, ``responses``: Anthropic's Messages API and OpenAI's Responses API as the chat
  completion the gateway records, and its answer back (``buffer.service.routes.dialects``);
  ``translation``: what they share; ``completions``: legacy completions, sent to the engine's
  own ``/v1/completions`` and chained by token ids.

It may import the buffer core, the toolkit's engine readers (``buffer.toolkit.engines``) and
httpx; the core never imports it.
"""
