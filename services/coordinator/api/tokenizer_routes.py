"""vLLM's tokenizer endpoints: `/tokenize`, `/detokenize`, `/tokenizer_info`.

Evaluation harnesses count and split prompts with the served model's own tokenizer;
lm-evaluation-harness (`local-completions`, `tokenizer_backend=auto`) looks for these
endpoints and uses them when they answer, so it needs no tokenizer download of its own and
scores exactly the ids the server sees. The coordinator already holds each model's
tokenizer (it tokenizes every request), so these cost no worker a call. Same API key as
`/v1`; errors in OpenAI's shape.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from services.coordinator.api.http_body import read_json_object
from services.coordinator.errors import APIError, bad_request, from_validation_error
from services.coordinator.generation_backend import GenerationBackend, ModelInfo
from services.coordinator.prepare.chat_prompt import render_chat
from services.coordinator.prepare.schemas import ChatCompletionRequest
from services.coordinator.settings import APISettings

T = TypeVar("T", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TokenizeText(_Body):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # the file's BOS/EOS policy, as vLLM applies it
    return_token_strs: StrictBool = False


class Detokenize(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]


def add_tokenizer_routes(app: FastAPI, backend: GenerationBackend, settings: APISettings) -> None:
    keyring = settings.keyring

    def model_for(name: str | None) -> ModelInfo:
        wanted = name or settings.model_id
        for info in backend.models():
            if info.id == wanted:
                return info
        raise APIError(
            404, f"The model '{wanted}' does not exist.", param="model", code="model_not_found"
        )

    async def body_of(request: Request) -> dict[str, Any]:
        keyring.authenticate(request)
        return await read_json_object(request, settings.max_body_bytes)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        data = await body_of(request)
        if "messages" in data:  # a conversation: rendered exactly as a chat request is
            chat = _validated(ChatCompletionRequest, data)
            model = model_for(chat.model)
            ids = model.tokenizer.encode(render_chat(chat, model.tokenizer).text)
            strs = False
        else:
            text = _validated(TokenizeText, data)
            model = model_for(text.model)
            ids = model.tokenizer.encode(text.prompt, add_special_tokens=text.add_special_tokens)
            strs = text.return_token_strs
        tokenizer = model.tokenizer
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": model.context_length,
                "tokens": ids,
                "token_strs": [tokenizer.id_to_token(t) for t in ids] if strs else None,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = _validated(Detokenize, await body_of(request))
        tokenizer = model_for(body.model).tokenizer
        bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens"
            )
        return JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> JSONResponse:
        keyring.authenticate(request)
        model = model_for(request.query_params.get("model"))
        tokenizer = model.tokenizer

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.id_to_token(token_id)

        return JSONResponse(
            {
                "tokenizer_class": "GGUFTokenizer",
                "model": model.id,
                "vocab_size": tokenizer.vocab_size,
                "model_max_length": model.context_length,
                "bos_token": text(tokenizer.bos_token_id),
                "eos_token": text(tokenizer.eos_token_id),
                "pad_token": text(tokenizer.pad_token_id),
                "chat_template": tokenizer.chat_template,
            }
        )


def _validated(schema: type[T], data: dict[str, Any]) -> T:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
