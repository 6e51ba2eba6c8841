"""A simulated OpenAI-compatible LLM server, for demos, end-to-end tests and benchmarks.

It stands in for an SGLang or vLLM server where there is no GPU and no model: it answers
arithmetic questions (right with probability ``--accuracy``), calls a calculator tool when
offered one, continues a partial assistant message (SGLang's ``continue_final_message``), and
simulates latency, rate limits, server errors and SGLang's aborts. Run it with
``python -m buffer.simulator --port 30000``; ``--help`` lists the options. An outage can be
started while it runs: ``POST /outage {"seconds": 10, "mode": "503"}`` (or ``"reset"``: dropped
connections) makes every chat completion fail for that long.

    config.py       SimConfig: the flags, and the latency distribution
    protocol.py     the request models and OpenAI's error body
    arithmetic.py   finding and solving the question (an AST walk, never eval)
    replies.py      what the model says: drafts, tokens, truncation, aborts, logprobs
    outage.py       an outage started at run time (POST /outage): 503s or dropped connections
    app.py          create_sim_app(config): routes, faults, latency, /stats, /outage
    cli.py          main(argv): flags, logging, uvicorn
"""

from buffer.simulator.app import create_sim_app
from buffer.simulator.cli import main
from buffer.simulator.config import SimConfig

__all__ = ["SimConfig", "create_sim_app", "main"]
