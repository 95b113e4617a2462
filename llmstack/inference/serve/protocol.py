"""Request bodies of the OpenAI API subset the server speaks, validated strictly (a string where a
number belongs is an error, not a conversion), and the OpenAI error body."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = "response"
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (JSON valid against `json_schema.schema`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Fields /v1/completions and /v1/chat/completions share. Unknown fields are ignored, as
    OpenAI-compatible servers do; `top_k`, `repetition_penalty` and `ignore_eos` are vLLM's
    extensions (pass them through the openai client's `extra_body`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 and -1 (vLLM's spelling) both disable it
    repetition_penalty: float = Field(1.0, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    guided_regex: str | None = None  # vLLM's extension: the output matches this regular expression

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, gt=0)  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)  # the newer name of max_tokens

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
