"""The OpenAI Python SDK's Responses API and the OpenAI Agents SDK (its default, Responses
model), unchanged, against stable-harness: text, streaming, retrieval, chains, server tools run
inside, and client tools returned to the client and continued."""

import asyncio
import json

import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from conftest import ADMIN_KEY, CLIENT_KEY, admin, calls_reply, stored_input, text_reply

set_tracing_disabled(True)

PATCH_TOOL = {
    "type": "function",
    "name": "apply_patch",
    "description": "Apply a patch to the client's files",
    "parameters": {"type": "object", "properties": {"patch": {"type": "string"}}, "required": ["patch"]},
    "strict": False,
}


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=CLIENT_KEY, max_retries=0)


def test_create_and_retrieve(client, upstream):
    upstream.push(text_reply("Hello from the harness"))
    response = client.responses.create(model="coder", input="hi", instructions="Be brief")
    assert response.status == "completed"
    assert response.output_text == "Hello from the harness"
    assert response.usage.total_tokens == 18
    again = client.responses.retrieve(response.id)
    assert again.output_text == "Hello from the harness"
    assert again.instructions == "Be brief"


def test_stream_accumulates_the_final_text(client, upstream):
    upstream.push(text_reply("one two three four"))
    deltas = []
    with client.responses.stream(model="coder", input="count") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == "one two three four"
    assert final.output_text == "one two three four"
    assert final.status == "completed"


def test_previous_response_id_across_a_client_tool_round_trip(client, upstream):
    upstream.push(calls_reply(("apply_patch", '{"patch": "fix typo"}')), text_reply("Patched it."))
    first = client.responses.create(model="coder", input="fix the typo", tools=[PATCH_TOOL])
    calls = [item for item in first.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["apply_patch"]
    assert json.loads(calls[0].arguments) == {"patch": "fix typo"}
    second = client.responses.create(
        model="coder",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "applied cleanly"}],
        tools=[PATCH_TOOL],
    )
    assert second.output_text == "Patched it."
    sent = upstream.requests[-1]["messages"]
    assert sent[-1] == {"role": "tool", "tool_call_id": calls[0].call_id, "content": "applied cleanly"}
    assert any(m.get("content") == "fix the typo" for m in sent)


def test_unknown_previous_response_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="coder", input="x", previous_response_id="resp_unknown")


def agent_client(base_url):
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=CLIENT_KEY, max_retries=0)


def test_agents_sdk_with_a_server_tool(base_url, upstream):
    upstream.push(calls_reply(("weather_lookup", '{"city": "Oslo"}')), text_reply("It is 21 degrees in Oslo."))
    before = len(upstream.tool_calls)
    agent = Agent(name="helper", instructions="Answer.", model=OpenAIResponsesModel("coder", agent_client(base_url)))
    result = asyncio.run(Runner.run(agent, "Weather in Oslo?"))
    assert result.final_output == "It is 21 degrees in Oslo."
    # The server ran its own tool; the SDK never saw the call.
    assert upstream.tool_calls[before:] == [{"city": "Oslo"}]


def test_agents_sdk_with_a_client_function_tool(base_url, upstream):
    ran = []

    @function_tool
    def local_clock(zone: str) -> str:
        """The time in a zone, from the client's machine."""
        ran.append(zone)
        return f"12:00 in {zone}"

    upstream.push(calls_reply(("local_clock", '{"zone": "UTC"}')), text_reply("It is noon."))
    agent = Agent(
        name="helper", instructions="Answer.", tools=[local_clock],
        model=OpenAIResponsesModel("coder", agent_client(base_url)),
    )
    result = asyncio.run(Runner.run(agent, "What time is it?"))
    assert ran == ["UTC"]
    assert result.final_output == "It is noon."
    assert upstream.requests[-1]["messages"][-1]["content"] == "12:00 in UTC"


def test_agents_sdk_loop_is_stored_as_what_each_call_adds(base_url, upstream):
    """The Agents SDK's loop sends its instructions and its whole input to every model
    call, with no `previous_response_id`: once the transcript is 4 KiB long, the second
    call names the first (which holds the transcript and the instructions whole) and stores
    only what the loop added."""
    ran = []

    @function_tool
    def read_file(path: str) -> str:
        """A file from the client's machine."""
        ran.append(path)
        return "line\n" * 200

    upstream.push(calls_reply(("read_file", '{"path": "main.rs"}')), text_reply("It prints lines."))
    agent = Agent(
        name="helper", instructions="Answer.", tools=[read_file],
        model=OpenAIResponsesModel("coder", agent_client(base_url)),
    )
    question = "What does this do? " + "context " * 600

    def listed():
        return [request["requestId"] for request in admin(base_url, "GET", "/admin/requests?limit=100")["data"]]

    before = set(listed())
    result = asyncio.run(Runner.run(agent, question))
    assert ran == ["main.rs"]
    assert result.final_output == "It prints lines."
    # The listing is newest first.
    second, first = [request for request in listed() if request not in before]
    held, naming = stored_input(first), stored_input(second)
    assert "prefixOf" not in held and len(held["inputDigest"]) == 64
    assert naming["prefixOf"] == first
    assert naming["prefixLen"] == len(held["messages"])
    # The instructions, sent with each call, held by the first and named by the second.
    assert held["leading"] == [{"role": "system", "content": "Answer."}]
    assert naming["leadingOf"] == first and "leading" not in naming
    assert naming["leadingDigest"] == held["leadingDigest"]
    # The model heard the instructions and the whole transcript on the second call, the
    # file's text last.
    assert {"role": "system", "content": "Answer."} in upstream.requests[-1]["messages"]
    assert upstream.requests[-1]["messages"][-1]["content"] == "line\n" * 200
    assert question in json.dumps(upstream.requests[-1]["messages"])


def refusals_counted(base_url):
    """How many requests the `greeter-pace` limit refused, from the server's metrics."""
    import urllib.request

    request = urllib.request.Request(f"{base_url}/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith('stable_harness_rate_limited_total{limit="greeter-pace"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_rate_limit_answers_429_and_the_sdk_retry_succeeds(base_url):
    """`greeter` takes 60 requests a minute (a bucket of 60, refilled one a second): past it the
    answer is 429 `rate_limited` with `retry-after`, and the SDK's own retry then succeeds."""
    strict = openai.OpenAI(base_url=f"{base_url}/v1", api_key=CLIENT_KEY, max_retries=0)
    refused = None
    for _ in range(200):
        try:
            strict.chat.completions.create(model="greeter", messages=[{"role": "user", "content": "you"}])
        except openai.RateLimitError as error:
            refused = error
            break
    assert refused is not None, "the bucket never ran dry"
    assert refused.status_code == 429
    assert refused.body["code"] == "rate_limited"
    assert refused.body["param"] == "greeter-pace"
    assert 1 <= int(refused.response.headers["retry-after"]) <= 2

    # Empty the bucket again, then let the SDK wait out `retry-after` and try again.
    while True:
        try:
            strict.chat.completions.create(model="greeter", messages=[{"role": "user", "content": "you"}])
        except openai.RateLimitError:
            break
    before = refusals_counted(base_url)
    patient = openai.OpenAI(base_url=f"{base_url}/v1", api_key=CLIENT_KEY, max_retries=3)
    completion = patient.chat.completions.create(model="greeter", messages=[{"role": "user", "content": "you"}])
    assert completion.choices[0].message.content == "Hello you"
    assert refusals_counted(base_url) >= before + 1, "the SDK's first try was refused, its retry served"
