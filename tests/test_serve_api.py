"""`llmstack serve`'s HTTP API on a real uvicorn server (in a thread), through httpx and the
official openai client: results, streaming, bad input, cancellation, back-pressure, metrics."""

import json
import re
import threading
import time

import httpx
import pytest
from inference_fixtures import tiny_model, tiny_tokenizer

from llmstack.cli.main import main
from llmstack.inference import generate_text
from llmstack.inference.serve.api import create_app
from llmstack.inference.serve.server import build_engine
from llmstack.net import free_port

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
NAME = "tiny"
HANG_GUARD_S = 300  # waits and request timeouts only catch hangs; a busy machine is slow, not stuck


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(vocab_size=len(tokenizer), max_position_embeddings=128)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    import uvicorn

    engine = build_engine(model, tokenizer, kv_cache_mb=1, max_waiting=8)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(engine, NAME), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    uv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def url(server):
    return server[0]


def greedy(model, tokenizer, prompt, max_tokens, stop=()):
    return generate_text(model, tokenizer, [prompt], max_new_tokens=max_tokens, stop_strings=stop)[0]


def metric(url, name):
    """The value of a sample on /metrics (0 for a labelled sample not yet created)."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def sse_payloads(response):
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_health_models_and_metrics(url):
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [NAME]
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "llmstack_requests_waiting",
        "llmstack_requests_running",
        "llmstack_generation_tokens_per_second",
        "llmstack_time_to_first_token_seconds_bucket",
        "llmstack_inter_token_latency_seconds_bucket",
        "llmstack_kv_cache_slots_used",
    ):
        assert name in text


def test_concurrent_greedy_completions_equal_generate_alone(url, model, tokenizer):
    prompts = ["def add", "The quick brown fox", "class Stack:\n    def push", "Return the sum"]
    results = {}

    def ask(i):
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": 6 + 3 * i, "temperature": 0}
        results[i] = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        assert results[i]["choices"][0]["text"] == greedy(model, tokenizer, prompt, 6 + 3 * i)
        assert results[i]["object"] == "text_completion"
        assert results[i]["usage"]["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])


def test_streamed_completion_and_chat_through_the_openai_client(url, model, tokenizer):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    whole = client.completions.create(model=NAME, prompt="def add", max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="def add",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.choices[0].text == greedy(model, tokenizer, "def add", 12)

    messages = [{"role": "user", "content": "Return the sum"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = generate_text(model, tokenizer, [prompt], max_new_tokens=10)[0]  # the template has no BOS
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected


def test_stop_strings_cut_streamed_and_whole_completions(url, model, tokenizer):
    full = greedy(model, tokenizer, "The quick", 24)
    stop = next(
        full[i : i + 2] for i in range(3, len(full)) if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    body = {"model": NAME, "prompt": "The quick", "max_tokens": 24, "temperature": 0, "stop": [stop]}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S).json()
    assert whole["choices"][0] == {
        "index": 0,
        "text": full[: full.find(stop)],
        "logprobs": None,
        "finish_reason": "stop",
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=HANG_GUARD_S) as response:
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    assert "".join(json.loads(p)["choices"][0]["text"] for p in payloads[:-1]) == full[: full.find(stop)]


def test_null_max_tokens_completes_up_to_the_context(server, model, tokenizer):
    """OpenAI clients may send max_tokens: null; it once reached the engine as None (a 500)."""
    url, engine = server
    body = {"model": NAME, "prompt": "def add", "max_tokens": None, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)
    assert response.status_code == 200
    room = engine.context_length - len(tokenizer("def add")["input_ids"])
    assert response.json()["choices"][0]["text"] == greedy(model, tokenizer, "def add", room)


BAD_REQUESTS = {
    "invalid JSON": (b'{"model": "tiny", "prompt": ', 400, None),
    "missing prompt": ({"model": NAME}, 400, "prompt"),
    "missing model": ({"prompt": "x"}, 400, "model"),
    "max_tokens a string": ({"model": NAME, "prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    "prompt a number": ({"model": NAME, "prompt": 3}, 400, "prompt"),
    "prompt longer than the context": ({"model": NAME, "prompt": "def add " * 200}, 400, "prompt"),
    "prompt + max_tokens past the context": (
        {"model": NAME, "prompt": "def add", "max_tokens": 500},
        400,
        "max_tokens",
    ),
    "max_tokens 0": ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    "temperature < 0": ({"model": NAME, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    "unknown model": ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    "token id out of range": ({"model": NAME, "prompt": [5, 100000]}, 400, "prompt"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error_and_the_server_serves_on(url, case):
    body, status, param = BAD_REQUESTS[case]
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    response = httpx.post(f"{url}/v1/completions", timeout=HANG_GUARD_S, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["param"] == param
    ok = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2}, timeout=HANG_GUARD_S)
    assert ok.status_code == 200


def test_chat_without_a_template_is_a_clear_error(url, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    response = httpx.post(
        f"{url}/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 400 and "no chat template" in response.json()["error"]["message"]


def wait_for(condition, timeout=HANG_GUARD_S):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_client_that_disconnects_mid_stream_is_cancelled_and_its_cache_slot_freed(url):
    def aborted():
        return metric(url, 'llmstack_requests_finished_total{reason="abort"}')

    before = aborted()
    body = {"model": NAME, "prompt": "def add", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert metric(url, "llmstack_kv_cache_slots_used") > 0
    # leaving the block closed the connection after the first event
    wait_for(lambda: aborted() == before + 1)
    assert metric(url, "llmstack_kv_cache_slots_used") == 0 and metric(url, "llmstack_requests_running") == 0


def test_past_the_queue_limit_requests_get_429_with_retry_after(server, model, monkeypatch):
    url, engine = server
    monkeypatch.setattr(engine, "max_running", 1)
    monkeypatch.setattr(engine, "max_waiting", 1)
    gate, real_forward = threading.Event(), model.forward

    def gated_forward(*args, **kwargs):
        gate.wait(60)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", gated_forward)
    body = {"model": NAME, "prompt": "def add", "max_tokens": 3}
    answers = []

    def ask():
        answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S))

    clients = [threading.Thread(target=ask) for _ in range(2)]
    clients[0].start()
    wait_for(lambda: metric(url, "llmstack_requests_running") == 1)  # admitted, held in its forward
    clients[1].start()
    wait_for(lambda: metric(url, "llmstack_requests_waiting") == 1)
    refused = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    gate.set()
    for client in clients:
        client.join()
    assert [a.status_code for a in answers] == [200, 200]


def test_serve_refuses_bad_options_before_loading(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--kv-cache-mb", "0"]) == 2
    assert "--kv-cache-mb must be positive" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--prefix-cache-mb", "-1"]) == 2
    assert "--prefix-cache-mb must be >= 0" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--prefix-block-size", "0"]) == 2
    assert "--prefix-block-size must be positive" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--chunked-prefill-size", "-1"]) == 2
    assert "--chunked-prefill-size must be >= 0" in capsys.readouterr().err


def test_response_format_constrains_chat_output_and_a_bad_schema_is_a_400(url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "A digit"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "digit", "schema": schema}},
    )
    assert 0 <= json.loads(chat.choices[0].message.content)["answer"] <= 9
    assert chat.choices[0].finish_reason == "stop"
    body = {"model": NAME, "prompt": "x", "max_tokens": 4}
    bad = httpx.post(
        f"{url}/v1/completions",
        json=body | {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
        timeout=HANG_GUARD_S,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    regex = httpx.post(f"{url}/v1/completions", json=body | {"guided_regex": "[ab]{3}"}, timeout=HANG_GUARD_S)
    assert re.fullmatch("[ab]{3}", regex.json()["choices"][0]["text"])
