"""A simulated SGLang or vLLM server, for demos, end-to-end tests and benchmarks.

It stands in for an engine where there is no GPU and no model, with a real tokenizer and chat
template, so the token ids it reports are those a client computes: it answers arithmetic
questions (right with probability ``--accuracy``), calls a calculator tool when offered one,
reasons in ``<think>`` with the thinking template, continues a partial assistant reply (from
text with ``continue_final_message``, or from token ids on ``/generate`` and
``/v1/completions``), and simulates latency, rate limits, server errors, aborts and outages.
Run it with ``python -m buffer.simulator --port 30000``; ``--help`` lists the options. It needs
the ``sim`` extra. It imports nothing of the service.

    config.py        SimConfig: the flags, and the latency distribution
    tokenizer.py     the built-in tokenizer and chat templates; ``python -m ...tokenizer DIR``
    model.py         SimModel: rendering prompts, encoding and decoding, the reply a prompt ends in
    conversation.py  a rendered prompt read back into messages; the model's output parsed
    protocol.py      the request models and the error bodies
    arithmetic.py    finding and solving the question (an AST walk, never eval)
    replies.py       what the model says, as token ids: drafts, stops, truncation, aborts, logprobs
    engines.py       where vLLM and SGLang put ids, logprobs, reasoning and the rest
    streaming.py     the SSE chunks of ``stream=true``
    outage.py        an outage started at run time (POST /outage): 503s or dropped connections
    app.py           create_sim_app(config): routes, faults, latency, /stats, /outage
    front.py         SimApp: the generation routes answered before FastAPI's stack
    cli.py           main(argv): flags, logging, uvicorn
"""

from buffer.simulator.app import create_sim_app
from buffer.simulator.cli import main
from buffer.simulator.config import SimConfig

__all__ = ["SimConfig", "create_sim_app", "main"]
