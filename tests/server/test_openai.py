"""The official ``openai`` client against the engine's /v1 routes: live sessions and checkpoints."""

from __future__ import annotations

import openai
import pytest

from sess.engine import ServiceClient

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
