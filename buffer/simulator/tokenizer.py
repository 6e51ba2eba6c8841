"""The simulated model's tokenizer: a small byte-level BPE with a ChatML chat template.

``build_tokenizer()`` trains it at start-up, deterministically (the same corpus, the same
merges, the same ids on every machine, in about 20 ms), and wraps it as a transformers
``PreTrainedTokenizerFast`` whose chat template renders system prompts, tools (Qwen2.5's
``<tools>`` block), tool calls (``<tool_call>`` with the arguments as a JSON object), tool
results (``<tool_response>`` in a user turn) and, in the thinking variant (Qwen3-style),
``<think>...</think>`` reasoning: kept on assistant messages after the last user message,
dropped before it, and an empty think block after the generation prompt when the request
says ``enable_thinking: false``. A test or a generator renders prompts with the very same
tokenizer: ``python -m buffer.simulator.tokenizer DIR [--thinking]`` saves it, and the
simulator loads one with ``--tokenizer-path DIR``.

Needs the ``sim`` extra (``tokenizers``, ``transformers``, ``jinja2``; never torch); the
imports happen when a tokenizer is built or loaded, so importing the simulator costs nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from buffer.simulator.replies import GENERIC_REPLIES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

VOCAB_SIZE = 2048
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", EOS_TOKEN)
# Markers the model writes itself: whole tokens, kept in decoded text (Qwen's added tokens).
MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
MISSING_EXTRA = (
    "the simulator needs the 'sim' extra (tokenizers, transformers, jinja2): pip install -e '.[sim]'"
)

_CORPUS = (
    "You are a helpful assistant. Please reason step by step, and put your final answer within \\boxed{}.",
    "What is 17 + 25? Compute 3 * (4 + 5). Question 3: what is 100 - 58 * 2? What is 7 / 2?",
    "Let me work this out step by step.\n4 + 5 = 9\n3 * 9 = 27\nSo the answer is \\boxed{27}.",
    "The tool returned 42.\nSo the answer is \\boxed{42}.",
    "I need the calculator for this expression, so I call it.",
    "The question is arithmetic, so I compute it one operation at a time.",
    *GENERIC_REPLIES,  # what the model says to anything but arithmetic
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic '
    'expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, '
    '"required": ["expression"]}}}\n</tools>\n\nFor each function call, return a json object with '
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * (3 + 4) - 5"}}\n</tool_call>',
    "<tool_response>\n79\n</tool_response>",
    "<think>\nThe user asks for a sum. I add the numbers.\n</think>\n\nThe answer is 42.",
    "the of and to in is it that was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which "
    "do their time if will way about many then them write would like so these her long make thing see "
    "him two has look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father head stand own page "
    "should country found answer school grow study still learn plant cover food sun four between state "
    "keep eye never last let thought city tree cross farm hard start might story saw far sea draw left "
    "late run don't while press close night real life few north open seem together next white children "
    "begin got walk example ease paper group always music those both mark often letter until mile river "
    "car feet care second book carry took science eat room friend began idea fish mountain stop once "
    "base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever "
    "red list though feel talk bird soon body dog family direct pose leave song measure door product "
    "black short numeral class wind question happen complete ship area half rock order fire south "
    "problem piece told knew pass since top whole king space heard best hour better true during hundred "
    "five remember step early hold west ground interest reach fast verb sing listen six table travel "
    "less morning ten simple several vowel toward war lay against pattern slow center love person money "
    "serve appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall "
    "lead cry dark machine note wait plan figure star box noun field rest correct able pound done beauty "
    "drive stood contain front teach week final gave green quick develop ocean warm free minute strong "
    "special mind behind clear tail produce fact street inch multiply nothing course stay wheel full "
    "force blue object decide surface deep moon island foot system busy test record boat common gold "
    "possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat "
    "snow tire bring yes distant fill east paint language among grand ball yet wave drop heart present "
    "heavy dance engine position arm wide sail material size vary settle speak weight general ice matter "
    "circle pair include divide syllable felt perhaps pick sudden count square reason length represent",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 27 42 50 64 99 100 128 256 1000 2048",
    "( ) [ ] { } < > + - * / = , . ; : ! ? ' \" \\ | _ # @ $ % ^ & ~ `",
)

# Both templates share everything but the reasoning: ``{thinking}`` is filled in by _template().
_TEMPLATE = r"""
{%- set thinking = THINKING %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if thinking and loop.index0 > ns.last_query and message.reasoning_content is string and message.reasoning_content %}
{{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
{%- endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if thinking and enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()  # noqa: E501


class MissingExtraError(RuntimeError):
    """The simulator's optional dependencies are not installed."""


def chat_template(thinking: bool) -> str:
    """The ChatML template (Qwen2.5-style), or its thinking variant (Qwen3-style)."""
    return _TEMPLATE.replace("THINKING", "true" if thinking else "false")


def build_tokenizer(thinking: bool = False) -> PreTrainedTokenizerFast:
    """The default tokenizer, trained afresh: the same vocabulary and ids on every call."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise MissingExtraError(MISSING_EXTRA) from exc
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer)
    backend.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in MARKER_TOKENS])
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template(thinking)
    return tokenizer


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """A tokenizer saved by ``save_pretrained`` (this module's CLI, or a real model's directory)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise MissingExtraError(MISSING_EXTRA) from exc
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(str(path))
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer in {path} has no chat template")
    return tokenizer


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m buffer.simulator.tokenizer DIR``: save the default tokenizer to DIR."""
    parser = argparse.ArgumentParser(
        prog="python -m buffer.simulator.tokenizer",
        description="Save the simulator's default tokenizer to DIR.",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--thinking", action="store_true", help="the thinking (Qwen3-style) chat template")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no torch is needed
    try:
        tokenizer = build_tokenizer(thinking=args.thinking)
    except MissingExtraError as exc:
        sys.exit(str(exc))
    tokenizer.save_pretrained(str(args.directory))
    logging.basicConfig(level="INFO", format="%(message)s")
    logger.info("saved the simulator's tokenizer to %s", args.directory)


if __name__ == "__main__":
    main()
