"""The server driven by the official `openai` Python client: chat and completions, whole and
streamed, greedy results equal to transformers', 32 concurrent streams each equal to its lone
result, and the errors the client raises for bad requests, with the server serving throughout."""

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from conftest import API_KEY, MODEL


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def case(reference, kind):
    return next(c for c in reference if c["kind"] == kind)


def test_completion_matches_transformers_greedy(client, reference):
    c = case(reference, "text")
    r = client.completions.create(model=MODEL, prompt=c["prompt"])
    assert r.choices[0].text == c["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(c["prompt_ids"])
    assert r.usage.completion_tokens == len(c["greedy_ids"])


def test_chat_matches_transformers_greedy(client, reference):
    c = case(reference, "chat")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": c["prompt"]}])
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == c["text"]
    assert r.usage.prompt_tokens == len(c["prompt_ids"])
    assert r.usage.completion_tokens == len(c["greedy_ids"])


def test_streamed_chat_and_completion_add_up_to_the_reference(client, reference):
    c = case(reference, "chat")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": c["prompt"]}], stream=True,
        stream_options={"include_usage": True})
    text, reasons, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert text == c["text"]
    assert reasons == ["length"]
    assert usage.completion_tokens == len(c["greedy_ids"])

    c = case(reference, "text")
    stream = client.completions.create(model=MODEL, prompt=c["prompt"], stream=True)
    pieces = [ch.choices[0].text for ch in stream if ch.choices]
    assert "".join(pieces) == c["text"]


def lone(client, i, kind):
    prompt = f"Story {i}: the fox and the owl " * (1 + i % 4)
    if kind == "chat":
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": prompt}],
            max_tokens=32, temperature=0)
        return r.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    return r.choices[0].text


def streamed(client, i, kind):
    prompt = f"Story {i}: the fox and the owl " * (1 + i % 4)
    if kind == "chat":
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": prompt}],
            max_tokens=32, temperature=0, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True)
    return "".join(ch.choices[0].text for ch in stream if ch.choices)


def test_thirty_two_concurrent_streams_each_equal_the_lone_result(client, server):
    jobs = [(i, "chat" if i % 2 else "completion") for i in range(32)]
    alone = {job: lone(client, *job) for job in jobs}
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        together = dict(zip(jobs, pool.map(lambda job: streamed(client, *job), jobs)))
    for job in jobs:
        assert together[job] == alone[job], f"request {job} differs when batched"
    # The shared system prompt's blocks were reused across requests.
    assert server.metric("moerun_prefix_cache_hits_total") > 0


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_logprobs_through_the_client(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob
               for t in content)


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"temperature": "hot"}, "temperature"),
    ({"prompt": list(range(100)) * 50}, "prompt"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
])
def test_bad_completion_requests_raise_bad_request_naming_the_parameter(client, kwargs, param):
    args = {"model": MODEL, "prompt": "hello", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param


def test_missing_messages_unknown_model_and_wrong_key(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model",
                                       messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "model"
    other = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        other.completions.create(model=MODEL, prompt="x")
    assert e.value.status_code == 401
    # No key at all (the client refuses to send none, so by hand).
    status, body = raw_post(server, json.dumps({"model": MODEL, "prompt": "x"}).encode(),
                            headers={"Authorization": ""})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def raw_post(server, body, headers=None):
    request = urllib.request.Request(
        server.url + "/v1/completions", data=body, method="POST",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json",
                 **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_and_oversized_bodies(server):
    status, body = raw_post(server, b'{"model": "fixture", "prompt": ')
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = raw_post(server, json.dumps({"model": MODEL, "prompt": "x" * (9 << 20)}).encode())
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_a_client_leaving_mid_stream_is_aborted_and_the_server_keeps_serving(client, server):
    before = server.metric('moerun_requests_finished_total{finish_reason="abort"}')
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4000, stream=True,
        extra_body={"ignore_eos": True, "stream_options": {"continuous_usage_stats": True}})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.time() + 10
    while server.metric('moerun_requests_finished_total{finish_reason="abort"}') == before:
        assert time.time() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    assert server.metric("moerun_kv_cache_blocks_used") == 0
    r = client.completions.create(model=MODEL, prompt="still there?", max_tokens=2)
    assert r.usage.completion_tokens == 2
