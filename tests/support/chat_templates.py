"""Real chat templates and small tokenizers built offline, for the tests that convert
trajectories to training samples.

The tokenizer is a small byte-level BPE trained on a few hundred sentences, with the marker
tokens each template writes added. The constants below are the public templates of Qwen2.5,
Qwen3, Llama-3.1 and DeepSeek-R1-Distill-Qwen, as their tokenizer_config.json files give them;
`TEMPLATE_SPECS` are the twenty of the matrix, kept as files in tests/support/templates/ (where each
comes from: docs/template-matrix.md).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Qwen2.5-*-Instruct.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""  # noqa: E501

# Qwen3 (a thinking model: reasoning kept only after the last user query; "<think>\n" opens the reply).
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
{%- endif %}"""  # noqa: E501

# Llama-3.1-*-Instruct (tools in the first user message; tool results as "ipython"; content trimmed).
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""  # noqa: E501

# DeepSeek-R1-Distill-Qwen-* (drops every assistant turn's reasoning; "<think>\n" opens the reply).
DEEPSEEK_R1_DISTILL_TEMPLATE = r"""{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}"""  # noqa: E501

SYSTEM = "You are a careful math tutor."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]

QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
# In Qwen's own tokenizer.json these are added tokens but not special ones; the Qwen3 tokenizer keeps that.
QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = [
    *("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"),
    *("<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
]
DEEPSEEK_SPECIAL = [
    *(
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
    ),
    *("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
    *("<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"),
    *("<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
]

LLAMA_SYSTEM_HEADER = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
)


def _corpus() -> list[str]:
    rng = random.Random(7)
    words = [
        *("the", "a", "answer", "is", "what", "sum", "of", "and", "plus", "minus", "times", "tool"),
        *("says", "call", "add", "tens", "ones", "check", "think", "let", "me", "you", "are", "careful"),
        *("math", "tutor", "thanks", "now", "use", "weather", "city", "today", "number", "result", "two"),
    ]
    lines = []
    for _ in range(250):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"What is {a} + {b}?\n\nThe answer is {a + b}.")
        lines.append(" ".join(rng.choice(words) for _ in range(9)).capitalize() + ".")
        lines.append(f'{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n')
        lines.append(f"Step {a}.\n\n")  # "\n\n" alone, as one token (Qwen's tokenizer has it too)
    return lines


@functools.cache
def train_bpe() -> str:
    """A small byte-level BPE, trained once per test process and serialised."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    return tokenizer.to_str()


def make_tokenizer(
    bpe_json: str,
    template: str,
    special: list[str],
    *,
    plain: list[str] | None = None,
    bos: str | None = None,
    eos: str,
) -> PreTrainedTokenizerFast:
    backend = Tokenizer.from_str(bpe_json)
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in plain or []])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = template
    return tokenizer


# --- the template matrix -----------------------------------------------------------------------------------
#
# tests/support/templates/*.jinja are public chat templates, kept as data. Each spec says which tokens the
# model's tokenizer adds (so the test tokenizer writes each marker as one token) and, for the matrix's oracle,
# what the template writes right before a generated reply (its headers, longest first, including the empty
# reasoning block it writes for a reply without reasoning), the tokens that close a reply, the markers of its
# reasoning slot (the whitespace it writes around them is the template's), whether its generation prompt
# opens the reasoning ("<think>\n"), the markers it writes that the model is not known to write (Llama 4's
# python tags around a tool-call message's content) and, for a template that closes no reply, the token the
# model samples to end one. These are read off the templates by hand, not by the code under test.

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    file: str
    special: tuple[str, ...]
    eos: str
    bos: str | None = None
    plain: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()
    ends: tuple[str, ...] = ()
    closes_every_reply: bool = True  # False: the template writes nothing after a reply (GLM-4.5)
    source: str = ""
    reasoning_slot: tuple[str, str] | None = (
        None  # what it writes around reasoning; its whitespace is its own
    )
    prompt_opens_reasoning: bool = False  # the generation prompt ends "<think>\n"
    untrained: tuple[str, ...] = ()  # markers in a tool-call message the model is not known to write
    stops: tuple[str, str] | None = None  # (after a reply, after a tool call): the model's stop tokens

    def template(self) -> str:
        return (TEMPLATES / self.file).read_text(encoding="utf-8")

    def tokenizer(self, bpe_json: str) -> PreTrainedTokenizerFast:
        return make_tokenizer(
            bpe_json, self.template(), list(self.special), plain=list(self.plain), bos=self.bos, eos=self.eos
        )


_CHATML = ("<|im_start|>assistant\n",)
_QWEN3_HEADERS = (
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<|im_start|>assistant\n<think>\n",
    *_CHATML,
)
_LLAMA3 = ("<|start_header_id|>assistant<|end_header_id|>\n\n",)
_LLAMA3_ENDS = ("<|eot_id|>", "<|eom_id|>")
_DEEPSEEK_TOOLS = (
    *("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
    *("<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"),
    *("<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
)
_DEEPSEEK = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    *_DEEPSEEK_TOOLS,
)
_DEEPSEEK_ENDS = ("<｜end▁of▁sentence｜>",)
_MISTRAL = (
    *("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"),
    *("[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
)
_MISTRAL_TEKKEN = (*_MISTRAL, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]", "[TOOL_CONTENT]")
_MISTRAL_HEADERS = ("[/INST]", "[/TOOL_RESULTS]")
_GEMMA = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")

TEMPLATE_SPECS = [
    TemplateSpec(
        "qwen2.5",
        "qwen2.5.jinja",
        tuple(QWEN_SPECIAL),
        "<|im_end|>",
        plain=tuple(QWEN_PLAIN),
        headers=_CHATML,
        ends=("<|im_end|>",),
        source="Qwen/Qwen2.5-7B-Instruct",
    ),
    TemplateSpec(
        "qwen3-thinking",
        "qwen3-thinking.jinja",
        tuple(QWEN_SPECIAL),
        "<|im_end|>",
        plain=tuple(QWEN_PLAIN),
        headers=_QWEN3_HEADERS,
        ends=("<|im_end|>",),
        source="Qwen/Qwen3-*-Thinking-2507",
        reasoning_slot=("<think>\n", "\n</think>\n\n"),
        prompt_opens_reasoning=True,
    ),
    TemplateSpec(
        "qwen3-hybrid",
        "qwen3-hybrid.jinja",
        tuple(QWEN_SPECIAL),
        "<|im_end|>",
        plain=tuple(QWEN_PLAIN),
        headers=(_QWEN3_HEADERS[0], *_CHATML),
        ends=("<|im_end|>",),
        source="Qwen/Qwen3-0.6B",
        reasoning_slot=("<think>\n", "\n</think>\n\n"),
    ),
    TemplateSpec(
        "llama-3.0",
        "llama-3.0.jinja",
        tuple(LLAMA_SPECIAL),
        "<|eot_id|>",
        bos="<|begin_of_text|>",
        headers=_LLAMA3,
        ends=_LLAMA3_ENDS,
        source="meta-llama/Meta-Llama-3-8B-Instruct",
    ),
    TemplateSpec(
        "llama-3.1",
        "llama-3.1.jinja",
        tuple(LLAMA_SPECIAL),
        "<|eot_id|>",
        bos="<|begin_of_text|>",
        headers=_LLAMA3,
        ends=_LLAMA3_ENDS,
        source="meta-llama/Llama-3.1-8B-Instruct",
    ),
    TemplateSpec(
        "llama-3.2",
        "llama-3.2.jinja",
        tuple(LLAMA_SPECIAL),
        "<|eot_id|>",
        bos="<|begin_of_text|>",
        headers=_LLAMA3,
        ends=_LLAMA3_ENDS,
        source="meta-llama/Llama-3.2-3B-Instruct",
    ),
    TemplateSpec(
        "llama-4",
        "llama-4.jinja",
        (
            *("<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>"),
            *("<|eom|>", "<|python_start|>", "<|python_end|>", "<|image|>"),
        ),
        "<|eot|>",
        bos="<|begin_of_text|>",
        headers=("<|header_start|>assistant<|header_end|>\n\n",),
        ends=("<|eot|>", "<|eom|>"),
        source="meta-llama/Llama-4-Scout-17B-16E-Instruct",
        untrained=("<|python_start|>", "<|python_end|>"),
    ),
    TemplateSpec(
        "deepseek-v3",
        "deepseek-v3.jinja",
        _DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        plain=("<think>", "</think>"),
        headers=("<｜Assistant｜>", "<｜tool▁outputs▁end｜>"),
        ends=_DEEPSEEK_ENDS,
        source="deepseek-ai/DeepSeek-V3",
    ),
    TemplateSpec(
        "deepseek-r1",
        "deepseek-r1.jinja",
        _DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        plain=("<think>", "</think>"),
        headers=("<｜Assistant｜><think>\n", "<｜Assistant｜>", "<｜tool▁outputs▁end｜>"),
        ends=_DEEPSEEK_ENDS,
        source="deepseek-ai/DeepSeek-R1",
        prompt_opens_reasoning=True,
    ),
    TemplateSpec(
        "deepseek-v3.1",
        "deepseek-v3.1.jinja",
        _DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        plain=("<think>", "</think>"),
        headers=("<｜Assistant｜></think>", "<｜Assistant｜>", "<｜tool▁output▁end｜>"),
        ends=_DEEPSEEK_ENDS,
        source="deepseek-ai/DeepSeek-V3.1",
    ),
    TemplateSpec(
        "deepseek-r1-distill",
        "deepseek-r1-distill.jinja",
        _DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        plain=("<think>", "</think>"),
        headers=("<｜Assistant｜><think>\n", "<｜Assistant｜>", "<｜tool▁outputs▁end｜>"),
        ends=_DEEPSEEK_ENDS,
        source="deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
        prompt_opens_reasoning=True,
    ),
    TemplateSpec(
        "glm-4.5",
        "glm-4.5.jinja",
        ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"),
        "<|endoftext|>",
        plain=(
            *("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>"),
            *("<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"),
        ),
        headers=("<|assistant|>\n<think></think>\n", "<|assistant|>"),
        ends=("</tool_call>",),
        closes_every_reply=False,
        source="zai-org/GLM-4.5 (llama.cpp's copy)",
        reasoning_slot=("\n<think>", "</think>\n"),
        stops=("<|user|>", "<|observation|>"),
    ),
    TemplateSpec(
        "mistral-v0.3",
        "mistral-v0.3.jinja",
        _MISTRAL,
        "</s>",
        bos="<s>",
        headers=_MISTRAL_HEADERS,
        ends=("</s>",),
        source="mistralai/Mistral-7B-Instruct-v0.3",
    ),
    TemplateSpec(
        "mistral-nemo",
        "mistral-nemo.jinja",
        _MISTRAL,
        "</s>",
        bos="<s>",
        headers=_MISTRAL_HEADERS,
        ends=("</s>",),
        source="mistralai/Mistral-Nemo-Instruct-2407",
    ),
    TemplateSpec(
        "mistral-small-3",
        "mistral-small-3.2.jinja",
        _MISTRAL_TEKKEN,
        "</s>",
        bos="<s>",
        headers=_MISTRAL_HEADERS,
        ends=("</s>",),
        source="mistralai/Mistral-Small-3.2-24B-Instruct-2506",
    ),
    TemplateSpec(
        "gemma-2",
        "gemma-2.jinja",
        _GEMMA,
        "<eos>",
        bos="<bos>",
        headers=("<start_of_turn>model\n",),
        ends=("<end_of_turn>",),
        source="google/gemma-2-2b-it",
    ),
    TemplateSpec(
        "gemma-3",
        "gemma-3.jinja",
        (*_GEMMA, "<start_of_image>"),
        "<eos>",
        bos="<bos>",
        headers=("<start_of_turn>model\n",),
        ends=("<end_of_turn>",),
        source="google/gemma-3-*-it",
    ),
    TemplateSpec(
        "phi-3",
        "phi-3.5.jinja",
        ("<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"),
        "<|endoftext|>",
        bos="<s>",
        headers=("<|assistant|>\n",),
        ends=("<|end|>",),
        source="microsoft/Phi-3.5-mini-instruct",
    ),
    TemplateSpec(
        "kimi-k2",
        "kimi-k2.jinja",
        (
            *("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"),
            *("<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"),
            *("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>"),
            *("<|tool_call_argument_begin|>", "<|tool_call_end|>"),
        ),
        "<|im_end|>",
        headers=("<|im_assistant|>assistant<|im_middle|>",),
        ends=("<|im_end|>",),
        source="moonshotai/Kimi-K2-Instruct",
    ),
    TemplateSpec(
        "gpt-oss",
        "gpt-oss.jinja",
        (
            *("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>"),
            *("<|return|>", "<|call|>", "<|constrain|>"),
        ),
        "<|return|>",
        headers=("<|start|>assistant",),
        ends=("<|return|>", "<|end|>", "<|call|>"),
        source="openai/gpt-oss-120b",
    ),
]
