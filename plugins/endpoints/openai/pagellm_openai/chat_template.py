"""Rendering messages to a prompt through a chat template: which template (the request's, when
the server trusts them; else ``--chat-template``; else the tokenizer's), the variables it sees,
and the checks on the fields that steer it (each refusal an HTTP 400 naming its field)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateSyntaxError

from pagellm.entrypoints.http_errors import bad_request
from pagellm_openai.protocol import ChatMessage, ChatTemplateRequest, TextPart

# apply_chat_template's own parameters, and the names it gives the template: a template
# variable of one of these names would replace (or clash with) what the renderer sets.
RENDERER_NAMES = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "documents",
        "max_length",
        "messages",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "sanitize_control_tokens",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    }
)


@dataclass(frozen=True)
class RenderedChat:
    text: str
    token_ids: list[int]
    role: str
    """The role of the answer: ``assistant``, or the last message's when no new turn opens."""


@dataclass(frozen=True)
class ChatTemplates:
    server_template: str | None
    """``--chat-template`` (its text), replacing the tokenizer's."""
    trust_request_templates: bool
    """``--trust-request-chat-template``: a request may bring its own template."""

    def render(
        self,
        tokenizer: Any,
        request: ChatTemplateRequest,
        placeholders: Mapping[str, str] | None = None,
    ) -> RenderedChat:
        """The request's messages as the model reads them: the template's text, tokenized.
        ``placeholders``: the text each media part type is rendered as (the model's IO
        processor's); a media part of another type is refused."""
        template = self._template(tokenizer, request)
        kwargs = _template_variables(request.chat_template_kwargs)
        opens_a_new_turn = request.opens_a_new_turn()
        if opens_a_new_turn and request.continue_final_message:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true: the "
                "first continues the last message, the second opens a new turn after it.",
                param="continue_final_message",
            )
        try:
            text = tokenizer.apply_chat_template(
                [_template_message(m, placeholders or {}) for m in request.messages],
                chat_template=template,
                documents=request.documents,
                add_generation_prompt=opens_a_new_turn,
                continue_final_message=request.continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except TemplateSyntaxError as exc:
            whose = "The request's" if request.chat_template else "The server's"
            raise bad_request(
                f"{whose} chat template is not valid Jinja: {exc}", param="chat_template"
            ) from exc
        except ValueError as exc:  # transformers' own checks (continue_final_message's)
            param = "continue_final_message" if request.continue_final_message else "messages"
            raise bad_request(f"The messages cannot be rendered: {exc}", param=param) from exc
        except Exception as exc:  # the template's own checks (raise_exception, a missing key)
            raise bad_request(
                f"The chat template refused the messages: {exc}", param="messages"
            ) from exc
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        role = "assistant" if opens_a_new_turn else request.messages[-1].role
        return RenderedChat(text, list(ids), role)

    def _template(self, tokenizer: Any, request: ChatTemplateRequest) -> str:
        if request.chat_template is not None:
            if not self.trust_request_templates:
                raise bad_request(
                    "chat_template is not supported by this server: it runs only its own chat "
                    "template unless started with --trust-request-chat-template.",
                    param="chat_template",
                )
            return request.chat_template
        template = self.server_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise bad_request(
                "The model's tokenizer has no chat template and the server has no "
                "--chat-template: use /v1/completions.",
                param="messages",
            )
        return str(template)


def _template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    clashing = sorted(RENDERER_NAMES & set(kwargs or {}))
    if clashing:
        raise bad_request(
            f"chat_template_kwargs cannot set {', '.join(clashing)}: the renderer sets these "
            "itself (add_generation_prompt, continue_final_message, chat_template and "
            "documents are fields of the request).",
            param="chat_template_kwargs",
        )
    return dict(kwargs or {})


def _template_message(message: ChatMessage, placeholders: Mapping[str, str]) -> dict[str, Any]:
    """The message as the template reads it: its fields, content as one string (its parts
    joined by newlines, a media part as its placeholder)."""
    data = message.model_dump(exclude_none=True)
    if not isinstance(message.content, list):
        data["content"] = message.text()
        return data
    texts = []
    for part in message.content:
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif part.type in placeholders:
            texts.append(placeholders[part.type])
        else:
            raise bad_request(
                f"Content parts of type {part.type!r} are not supported here: this model takes "
                "no images (serve a vision-language model with an image IO processor, "
                "pagellm-io-image) and /tokenize renders text only.",
                param="messages",
            )
    data["content"] = "\n".join(texts)
    return data


def echoed_text(request: ChatTemplateRequest, role: str) -> str:
    """What an echoing answer starts with: the last message's content, when it has the
    answer's role (as vLLM echoes)."""
    last = request.messages[-1]
    return last.text() if last.role == role else ""
