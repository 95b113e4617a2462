"""The HTTP face of the engine: OpenAI-compatible /v1/completions and /v1/chat/completions
(streamed by server-sent events or whole), /v1/models, /health and Prometheus /metrics.

FastAPI (on Starlette, served by uvicorn) because it is a real ASGI stack: async request
handling, so one slow client never blocks the others, streaming responses that notice a client
going away, and request bodies validated by pydantic models. The engine runs in its own thread;
its events reach each request's asyncio queue through `loop.call_soon_threadsafe`.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ...errors import UserError
from ..sampling import SamplingParams
from ..structured import Grammar, GrammarError, json_object_grammar, json_schema_grammar, regex_grammar
from .engine import Engine, Event, GenerationRequest, QueueFull, RequestRejected
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, error_body

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = error_body(message, type_, param, code)


class CompletionFormat:
    """Response objects of /v1/completions."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    @staticmethod
    def choice(text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    chunk_choice = choice

    @staticmethod
    def first_chunk_choice() -> dict | None:
        return None


class ChatFormat:
    """Response objects of /v1/chat/completions."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    @staticmethod
    def choice(text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}

    @staticmethod
    def chunk_choice(text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}

    @staticmethod
    def first_chunk_choice() -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


def create_app(engine: Engine, model_name: str) -> FastAPI:
    """The server for `engine`'s model, known to clients as `model_name`; the app starts the
    engine's thread when it starts and stops it when it stops."""
    tokenizer = engine.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="llmstack", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        engine.metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
        engine.metrics.rejected.labels("400").inc()
        errors = e.errors()
        if errors[0]["type"] == "json_invalid":
            return JSONResponse(
                error_body(f"the request body is not valid JSON: {errors[0]['ctx']['error']}"), status_code=400
            )
        where = [".".join(str(p) for p in err["loc"] if p != "body") or "body" for err in errors]
        message = "; ".join(f"{w}: {err['msg']}" for w, err in zip(where, errors))
        field = [p for p in errors[0]["loc"] if p != "body"]
        return JSONResponse(error_body(message, param=str(field[0]) if field else None), status_code=400)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {"status": "ok" if engine.alive else "engine stopped"}, status_code=200 if engine.alive else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "llmstack",
            "max_model_len": engine.context_length,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if isinstance(body.prompt, str):
            prompt_ids = tokenizer(body.prompt)["input_ids"]
        else:
            prompt_ids = body.prompt
            if any(not 0 <= t < engine.model.config.vocab_size for t in prompt_ids):
                raise ApiError(
                    400, f"prompt token ids must be in [0, {engine.model.config.vocab_size})", param="prompt"
                )
        max_tokens = body.max_tokens or max(engine.context_length - len(prompt_ids), 1)  # null: up to the context
        return await respond(request, body, prompt_ids, max_tokens, CompletionFormat)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if not tokenizer.chat_template:
            raise ApiError(
                400,
                "this model's tokenizer has no chat template: use /v1/completions, or restart the "
                "server with --chat-template FILE (a Jinja template)",
                param="messages",
            )
        text = tokenizer.apply_chat_template(
            [m.model_dump() for m in body.messages], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        max_tokens = body.token_limit() or max(engine.context_length - len(prompt_ids), 1)
        return await respond(request, body, prompt_ids, max_tokens, ChatFormat)

    async def respond(
        request: Request,
        body: SamplingFields,
        prompt_ids: list[int],
        max_tokens: int,
        form: type[CompletionFormat | ChatFormat],
    ) -> Response:
        if body.model != model_name:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        pieces: list[str] = []  # a whole response's text, gathered in the engine thread

        def deliver(event: Event) -> None:
            """Wake the event loop for every event of a stream, but only for the last of a whole
            response: each wake-up costs the engine thread the GIL while it decodes the batch."""
            if body.stream or event.finish_reason is not None:
                loop.call_soon_threadsafe(events.put_nowait, event)
            else:
                pieces.append(event.text)

        generation = GenerationRequest(
            prompt_ids,
            max_tokens,
            SamplingParams(body.temperature, max(body.top_k, 0), body.top_p, body.repetition_penalty),
            body.stop_strings(),
            body.seed,
            body.ignore_eos,
            on_event=deliver,
            grammar=grammar_of(body),
        )
        try:
            engine.submit(generation)
        except RequestRejected as e:
            code = None if e.param == "response_format" else "context_length_exceeded"
            raise ApiError(400, str(e), param=e.param, code=code) from None
        except QueueFull as e:
            raise ApiError(429, str(e), type_="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        head = {"id": form.id_prefix + generation.id, "created": int(time.time()), "model": model_name}

        def usage(completion_tokens: int) -> dict:
            return {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            }

        if body.stream:
            chunks = stream(
                generation.id, events, head | {"object": form.chunk_object}, form, usage if body.include_usage else None
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    engine.abort(generation.id)
                    return Response(status_code=499)
                continue
            pieces.append(event.text)  # the last event: the engine thread appends no more
            break
        if event.error:
            raise ApiError(500, f"generation failed: {event.error}", type_="server_error")
        return JSONResponse(
            head
            | {
                "object": form.object,
                "choices": [form.choice("".join(pieces), event.finish_reason)],
                "usage": usage(event.completion_tokens),
            }
        )

    async def stream(
        request_id: str,
        events: asyncio.Queue[Event],
        head: dict[str, Any],
        form: type[CompletionFormat | ChatFormat],
        usage: Callable[[int], dict[str, Any]] | None,
    ) -> AsyncIterator[str]:
        """Server-sent events; a client that goes away cancels the request (the `finally`)."""
        finished = False
        try:
            if (first := form.first_chunk_choice()) is not None:
                yield sse(head | {"choices": [first]})
            while True:
                event = await events.get()
                if event.error:
                    yield sse(error_body(f"generation failed: {event.error}", "server_error"))
                    break
                if event.text or event.finish_reason:
                    yield sse(head | {"choices": [form.chunk_choice(event.text, event.finish_reason)]})
                if event.finish_reason is not None:
                    break
            if usage is not None:
                yield sse(head | {"choices": [], "usage": usage(event.completion_tokens)})
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                engine.abort(request_id)

    return app


def grammar_of(body: SamplingFields) -> Grammar | None:
    """The grammar `response_format` or `guided_regex` asks for; None for plain text."""
    form = body.response_format
    if body.guided_regex is not None and form is not None and form.type != "text":
        raise ApiError(400, "give either response_format or guided_regex, not both", param="guided_regex")
    try:
        if body.guided_regex is not None:
            return regex_grammar(body.guided_regex)
        if form is None or form.type == "text":
            return None
        if form.type == "json_object":
            return json_object_grammar()
        if form.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs json_schema", param="response_format")
        return json_schema_grammar(form.json_schema.schema_)
    except GrammarError as e:
        raise ApiError(400, str(e), param="response_format") from None
    except UserError as e:  # the [structured] extra is not installed
        raise ApiError(400, f"this server cannot constrain output: {e}", param="response_format") from None


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
