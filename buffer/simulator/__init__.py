"""A simulated SGLang or vLLM server, for demos, end-to-end tests and benchmarks.

It stands in for an engine where there is no GPU and no model, with a real tokenizer and chat
template, so the token ids it reports are those a client computes: it answers arithmetic
questions (right with probability ``--accuracy``), calls a calculator tool when offered one,
reasons in ``<think>`` with the thinking template, continues a partial assistant reply (from
text with ``continue_final_message``, or from token ids on ``/generate`` and
``/v1/completions``), and simulates latency, rate limits, server errors, aborts and outages.
Run it with ``python -m buffer.simulator --port 30000``; ``--help`` lists the options. It needs
the ``sim`` extra. It imports nothing of the service.

    arithmetic.py    finding and solving the question (an AST walk, never eval)
    conversation.py  a rendered prompt read back into messages; the model's output parsed
    model.py         SimModel: rendering prompts, encoding and decoding, the reply a prompt ends in
    replies.py       what the model says, as token ids: drafts, stops, truncation, aborts, logprobs
    sampling.py      what sampling does to a token's logprob (temperature, top-p, top-k, min-p)
    experts.py       the MoE experts each token is routed to (``--routed-experts``), as SGLang sends them
    tokenizer.py     the built-in tokenizer and chat templates; ``python -m ...tokenizer DIR``
    protocol.py      the request models and the error bodies
    shapes.py        the answer pieces both engines write alike (logprobs, usage, meta_info)
    engines.py       DIALECTS: the engines imitated (vLLM, SGLang), where each puts what
    config.py        SimConfig: the flags, and the latency distribution
    prompts.py       a request's prompt as the model reads it, kept for a group's other samples
    streaming.py     the SSE chunks of ``stream=true``
    stats.py         the counters of GET /stats
    outage.py        an outage started at run time (POST /outage): 503s or dropped connections
    control.py       the engine's pause and weight-update routes (SGLang's; vLLM's in dev mode)
    server.py        Simulator: the state, and every generation request's path (faults, latency)
    chat.py          POST /v1/chat/completions
    completions.py   the token routes: POST /v1/completions and POST /generate
    front.py         SimApp: the generation routes answered before FastAPI's stack
    app.py           create_sim_app(config): the routes
    cli.py           main(argv): flags, logging, uvicorn

Each module imports only modules above it in this list.
"""

from buffer.simulator.app import create_sim_app
from buffer.simulator.cli import main
from buffer.simulator.config import SimConfig

__all__ = ["SimConfig", "create_sim_app", "main"]
