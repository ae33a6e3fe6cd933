"""The official OpenAI and Anthropic Python SDKs, unchanged, against kvroute.

Used by: tests/sdk.rs (kvroute in front of a `kvbench sim` server), docs/dev/testing.md.
Usage: sdk_conformance.py BASE_URL MODEL   (BASE_URL without /v1, e.g. http://127.0.0.1:8080)
Runs the Responses API (`client.responses.create`, streamed and not, a `previous_response_id`
chain) and the Messages API (`messages.create`, `messages.stream`, `messages.count_tokens`),
asserting event order, text, usage and the id round trip; prints one line per check and exits
non-zero on the first failure. The SDKs' own retries are off, so a failure is kvroute's answer.
"""

import sys

import anthropic
import openai


def check(name, cond, detail=""):
    if not cond:
        print(f"FAIL {name}: {detail}", flush=True)
        sys.exit(1)
    print(f"ok   {name}", flush=True)


def responses(base, model):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    prompt = "Explain how a prefix cache makes a second turn fast. " * 8
    first = client.responses.create(
        model=model, input=prompt, max_output_tokens=8, store=True
    )
    check("responses.create", first.status == "completed" and first.output_text, first)
    check("responses usage", first.usage.input_tokens > 0 and first.usage.output_tokens > 0)

    # Streamed: the SDK parses every event; the order is the API's.
    events = list(
        client.responses.create(
            model=model, input=prompt + " Again.", max_output_tokens=8, stream=True
        )
    )
    kinds = [e.type for e in events]
    check("stream opens", kinds[:2] == ["response.created", "response.in_progress"], kinds)
    check("stream closes", kinds[-1] == "response.completed", kinds)
    seqs = [e.sequence_number for e in events]
    check("sequence numbers", seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    check("streamed text", text and text == done.output_text, (text, done.output_text))
    check("streamed usage", done.usage.input_tokens > 0, done.usage)

    # A stored chain: the id kvroute returned names the conversation for the next turn.
    second = client.responses.create(
        model=model,
        input="And a third?",
        previous_response_id=first.id,
        max_output_tokens=8,
    )
    check("previous_response_id", second.status == "completed", second)
    check(
        "chain carries the history",
        second.usage.input_tokens > first.usage.input_tokens,
        (first.usage, second.usage),
    )
    cached = second.usage.input_tokens_details.cached_tokens
    check("chain hits the cache", cached > 0, second.usage)

    # The id round trip: the calls on a stored response reach it.
    got = client.responses.retrieve(second.id)
    check("responses.retrieve", got.id == second.id and got.output_text == second.output_text, got)
    items = client.responses.input_items.list(second.id)
    check("input_items.list", len(items.data) >= 1, items)
    client.responses.delete(second.id)
    try:
        client.responses.retrieve(second.id)
        check("deleted", False, "still retrievable")
    except openai.NotFoundError:
        check("deleted", True)

    try:
        client.responses.create(model="no-such-model", input="x", max_output_tokens=4)
        check("unknown model", False, "no error")
    except openai.NotFoundError as e:
        check("unknown model is 404", e.status_code == 404, e)


def messages(base, model):
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    system = "You are a terse assistant. " * 20
    history = [{"role": "user", "content": "What does a router do with a session key?"}]
    m = client.messages.create(model=model, max_tokens=8, system=system, messages=history)
    check("messages.create", m.type == "message" and m.content[0].text, m)
    check("messages usage", m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0)

    history += [
        {"role": "assistant", "content": m.content[0].text},
        {"role": "user", "content": "And then?"},
    ]
    with client.messages.stream(
        model=model, max_tokens=8, system=system, messages=history
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    check("stream opens", kinds[0] == "message_start", kinds)
    check("stream closes", kinds[-1] == "message_stop", kinds)
    check(
        "block events",
        kinds.index("content_block_start") < kinds.index("content_block_delta")
        < kinds.index("content_block_stop") < kinds.index("message_delta"),
        kinds,
    )
    check("streamed text", final.content[0].text, final)
    check("follow-up hits the cache", (final.usage.cache_read_input_tokens or 0) > 0, final.usage)

    n = client.messages.count_tokens(model=model, system=system, messages=history)
    check("count_tokens", n.input_tokens > 0, n)

    try:
        client.messages.create(model="no-such-model", max_tokens=4, messages=history)
        check("unknown model", False, "no error")
    except anthropic.NotFoundError as e:
        check("unknown model is not_found_error", e.body["error"]["type"] == "not_found_error", e.body)


if __name__ == "__main__":
    base, model = sys.argv[1], sys.argv[2]
    responses(base, model)
    messages(base, model)
    print("all checks passed")
