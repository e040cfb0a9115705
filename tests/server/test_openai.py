"""The official ``openai`` client against the engine's /v1 routes: live sessions and checkpoints."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest

from sess.engine import ServiceClient
from sess.engine.protocol.types import SamplingParams
from sess.engine.server.keys import KeyStore

from helpers import SENTENCES, train_steps


@pytest.fixture(scope="module")
def served(http_engine, sess_home):
    svc = ServiceClient(http_engine["url"], home=sess_home)
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=7)
    train_steps(tc, SENTENCES, 2e-2, steps=2)
    checkpoint = tc.save_weights_for_sampler(name="for-openai").result().path
    client = openai.OpenAI(base_url=f"{http_engine['url']}/v1", api_key=svc.transport.api_key, max_retries=0)
    yield svc, tc, checkpoint, client
    tc.stop()
    svc.close()


def test_models_lists_sessions_and_checkpoints(served):
    _, tc, checkpoint, client = served
    ids = [m.id for m in client.models.list().data]
    assert tc.name in ids and checkpoint in ids


@pytest.mark.parametrize("source", ["session", "checkpoint"])
def test_chat_completion_n2_stop_seed(served, source):
    svc, tc, checkpoint, client = served
    model = tc.name if source == "session" else checkpoint
    before = svc.get_usage(tc.name)
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "What is 2 + 2?"}],
        n=2,
        max_tokens=12,
        temperature=1.0,
        stop=["\n\n"],
        seed=42,
    )
    response = client.chat.completions.create(**kwargs)
    assert response.object == "chat.completion" and len(response.choices) == 2
    for choice in response.choices:
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert "\n\n" not in choice.message.content and choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0 and 0 < response.usage.completion_tokens <= 24
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in response.choices]
    after = svc.get_usage(tc.name)  # the usage block is the engine's own accounting
    assert after.prefill_tokens - before.prefill_tokens == 2 * response.usage.prompt_tokens
    # the second request's prompt was found cached but for its last token, counted as such
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert (
        cached
        == after.cached_prefill_tokens - before.cached_prefill_tokens
        == response.usage.prompt_tokens - 1
    )
    assert after.sampled_tokens - before.sampled_tokens == 2 * response.usage.completion_tokens


@pytest.mark.parametrize("source", ["session", "checkpoint"])
def test_text_completion(served, source):
    _, tc, checkpoint, client = served
    response = client.completions.create(
        model=tc.name if source == "session" else checkpoint,
        prompt="12 + 30 =",
        max_tokens=5,
        seed=1,
        temperature=0,
    )
    assert response.object == "text_completion" and len(response.choices) == 1
    assert isinstance(response.choices[0].text, str) and response.usage.completion_tokens <= 5


def test_openai_errors_are_4xx_with_messages(served):
    _, tc, _, client = served
    with pytest.raises(openai.NotFoundError, match="not a live session"):
        client.completions.create(model="nobody", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=tc.name, prompt="hi", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=tc.name, messages=[], max_tokens=2)
    # errors name the fields the client sent, not the engine's (num_samples, sampling_params.*)
    for kwargs, message in [
        ({"n": 0}, "400 - n: expected a value in 1..1024, got 0"),
        ({"temperature": 1e39}, "400 - temperature: expected a value in 0.0..10000.0"),
        ({"logprobs": 21}, "400 - logprobs: expected a value in 0..20, got 21"),
        ({"extra_body": {"max_tokens": 0}}, "400 - max_tokens: 0 samples nothing"),
        ({"best_of": 3}, "400 - best_of: not supported"),
        ({"suffix": "x"}, "400 - suffix: not supported"),
        ({"extra_body": {"frequency_penalty_x": 1}}, "400 - frequency_penalty_x: not a field"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=tc.name, prompt="hi", max_tokens=2, **kwargs)
        assert message in str(refused.value), refused.value
    with pytest.raises(openai.BadRequestError, match="an integer of 401 digits"):
        client.completions.create(
            model=tc.name, prompt="hi", max_tokens=2, extra_body={"temperature": 10**400}
        )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).models.list()


def test_max_completion_tokens_is_max_tokens(served):
    _, tc, _, client = served
    for limit in (1, 3):
        response = client.chat.completions.create(
            model=tc.name,
            messages=[{"role": "user", "content": "Count on"}],
            max_completion_tokens=limit,
            seed=5,
        )
        assert response.usage.completion_tokens == limit and response.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens: 3 differs from max_tokens 4"):
        client.chat.completions.create(
            model=tc.name, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, max_tokens=4
        )
    with pytest.raises(openai.BadRequestError, match="tools: not supported"):
        client.chat.completions.create(
            model=tc.name,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )


def _sdk_tokens(svc, checkpoint, prompt_ids, max_tokens):
    """The checkpoint's greedy continuation of ``prompt_ids`` through the sess SDK."""
    sampler = svc.create_sampling_client(model_path=checkpoint)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    return sampler, sampler.sample(prompt_ids, sampling_params=params).result().sequences[0]


def test_completion_logprobs_and_echo_are_the_sdks(served):
    svc, _, checkpoint, client = served
    prompt_ids = [5, 17, 42, 9, 3, 77]
    sampler, sequence = _sdk_tokens(svc, checkpoint, prompt_ids, 4)
    response = client.completions.create(
        model=checkpoint, prompt=prompt_ids, max_tokens=4, temperature=0, echo=True, logprobs=3, seed=0
    )
    logprobs = response.choices[0].logprobs
    expected = sampler.compute_logprobs(prompt_ids + sequence.tokens).result()
    assert len(logprobs.token_logprobs) == len(prompt_ids) + len(sequence.tokens)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(logprobs.token_logprobs[1:], expected[1:])) < 1e-5
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert response.choices[0].text == "".join(logprobs.tokens)  # tiny-llama's tokens decode one by one
    for logprob, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert len(top) <= 3 and max(top.values()) >= logprob - 1e-6
    sampled = logprobs.top_logprobs[len(prompt_ids) :]  # greedy: each sampled token tops its position
    assert all(abs(max(top.values()) - lp) < 1e-5 for top, lp in zip(sampled, sequence.logprobs))
    # the prompt alone, nothing sampled: compute_logprobs' values, billed as its prefill only
    before = svc.get_usage(checkpoint.split("/")[2])
    scored = client.completions.create(
        model=checkpoint, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=0
    )
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(prompt_ids)
    prompt_only = sampler.compute_logprobs(prompt_ids).result()
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(prompt_only[1:], abs=1e-5)
    assert svc.get_usage(checkpoint.split("/")[2]).sampled_tokens == before.sampled_tokens


def test_chat_logprobs_in_openais_shape(served):
    _, tc, _, client = served
    response = client.chat.completions.create(
        model=tc.name,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}
        ],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
        seed=1,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5  # greedy: the top token
    with pytest.raises(openai.BadRequestError, match=r"content\[0\]: only .*text.* parts"):
        client.chat.completions.create(
            model=tc.name,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )
    with pytest.raises(openai.BadRequestError, match="top_logprobs: needs logprobs"):
        client.chat.completions.create(
            model=tc.name, messages=[{"role": "user", "content": "x"}], top_logprobs=2
        )


def test_batched_prompts_answer_in_index_order(served):
    _, tc, _, client = served
    prompts = ["one two", "three", [5, 6, 7]]
    kwargs = dict(model=tc.name, max_tokens=4, seed=11, temperature=1.0, n=2)
    batched = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in batched.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    # index = prompt * n + sample, each as the prompt sent alone at the same seed gives it
    assert [c.text for c in batched.choices] == [c.text for a in alone for c in a.choices]
    assert batched.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batched.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    tokens = client.completions.create(prompt=[[5, 6, 7], [8, 9]], **kwargs)
    assert [c.text for c in tokens.choices[:2]] == [c.text for c in alone[2].choices]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])  # as drawn; cut from the finished answer
def test_stream_is_the_unstreamed_answer(served, chat, logprobs):
    _, tc, _, client = served
    kwargs = dict(model=tc.name, max_tokens=8, seed=3, temperature=1.0, n=2, stop=["e"])
    if logprobs:
        kwargs.update(dict(logprobs=True, top_logprobs=2) if chat else dict(logprobs=2))
    if chat:
        create, kwargs["messages"] = client.chat.completions.create, [{"role": "user", "content": "Go"}]
    else:
        create, kwargs["prompt"] = client.completions.create, "Once upon"
    whole = create(**kwargs)
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if chat else choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    expected = [c.message.content if chat else c.text for c in whole.choices]
    assert texts == expected and reasons == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens > 0


def test_stream_wire_format(served):
    _, tc, _, client = served
    with httpx.stream(
        "POST",
        f"{client.base_url}completions",
        headers={"Authorization": f"Bearer {client.api_key}"},
        json={"model": tc.name, "prompt": "a", "max_tokens": 3, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert len(lines) >= 2


def test_models_lists_base_models(served):
    _, _, _, client = served
    ids = [m.id for m in client.models.list().data]
    assert "tiny-llama" in ids and "smollm2-135m" in ids


def test_a_long_prompt_is_named_as_such(served, http_engine):
    _, tc, _, client = served
    with pytest.raises(openai.BadRequestError, match=r"prompt: 5000 tokens is over the model's context"):
        client.completions.create(model=tc.name, prompt=[1] * 5000, max_tokens=2)
    # a declared body over the cap is refused before a byte of it is read
    url = httpx.URL(str(client.base_url))
    with socket.create_connection((url.host, url.port), timeout=30) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nAuthorization: Bearer {client.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {1 << 30}\r\n\r\n{{".encode()
        )
        answer = b""
        while b"over the limit" not in answer and (part := conn.recv(4096)):  # head and body may come apart
            answer += part
        answer = answer.decode()
    assert answer.startswith("HTTP/1.1 413") and "over the limit" in answer


def test_a_second_key_reaches_none_of_the_firsts_models(served, http_engine, sess_home):
    _, tc, checkpoint, client = served
    other = openai.OpenAI(
        base_url=str(client.base_url), api_key=KeyStore(sess_home).add("openai-b")["key"], max_retries=0
    )
    ids = [m.id for m in other.models.list().data]
    assert tc.name not in ids and checkpoint not in ids and "tiny-llama" in ids
    with pytest.raises(openai.NotFoundError):
        other.completions.create(model=tc.name, prompt=["a", "b"], max_tokens=2)
    with pytest.raises(openai.APIStatusError) as refused:  # an unpublished checkpoint looks absent
        other.completions.create(model=checkpoint, prompt=[[1, 2]], max_tokens=2, echo=True, logprobs=1)
    assert refused.value.status_code in (403, 404)
    with pytest.raises(openai.NotFoundError, match="not a live session"):  # no file path is a model
        other.completions.create(model="/etc/passwd", prompt="a", max_tokens=2)


def test_bad_batched_and_streamed_inputs_are_400s_naming_them(served):
    _, tc, _, client = served
    bad = [
        (dict(prompt=[[1, 2], [3, 10**7]]), r"prompt\[1\]: token id 10000000 is outside the vocabulary"),
        (dict(prompt=["a", ""]), r"prompt\[1\]: an empty string"),
        (dict(prompt=["a", [1, 2], 3]), "prompt: expected a non-empty string"),
        (
            dict(prompt="a", extra_body={"stream_options": {"include_usage": True}}),
            "stream_options: applies only",
        ),
        (
            dict(prompt="a", stream=True, stream_options={"bogus": 1}),
            r"stream_options.bogus: not a stream option",
        ),
        (dict(prompt=[[1]] * 1025), "prompt: 1025 prompts is over the limit"),
    ]
    for kwargs, message in bad:
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=tc.name, max_tokens=2, **kwargs)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].name: not supported"):
        client.chat.completions.create(
            model=tc.name, messages=[{"role": "user", "content": "a", "name": "x"}]
        )


def test_a_client_gone_mid_stream_stops_its_sampling(served):
    svc, tc, _, client = served
    body = {"model": tc.name, "prompt": "a", "max_tokens": 2000, "temperature": 0.0}
    whole = client.completions.create(**body)
    assert whole.choices[0].finish_reason == "length"  # unstreamed, greedy samples all 2000
    before = svc.get_usage(tc.name).sampled_tokens
    started = time.monotonic()
    with httpx.stream(
        "POST",
        f"{client.base_url}completions",
        headers={"Authorization": f"Bearer {client.api_key}"},
        json={**body, "stream": True},
        timeout=60,
    ) as response:
        lines = response.iter_lines()
        firsts = [next(lines) for _ in range(6)]  # a few tokens' chunks, then the client goes
    assert all(line.startswith("data: {") or not line for line in firsts)
    while time.monotonic() - started < 300:  # the op ends at the batch's next step, and is billed
        sampled = svc.get_usage(tc.name).sampled_tokens - before
        if sampled:
            break
        time.sleep(0.2)
    assert 0 < sampled < 2000, sampled
