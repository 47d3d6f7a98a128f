"""Talk to `fxllm serve` with the official `openai` package (pip install openai).

    fxllm compile smollm2-135m -o artifacts/smollm2-paged \\
        --passes cleanup,gqa,fuse-projections,select-logits,kv-cache,paged
    fxllm serve artifacts/smollm2-paged --api-key sk-local &      # prints the URL when ready
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --api-key sk-local

The same works against `fxllm serve artifacts/smollm2-paged --ray --replicas 2 --api-key sk-local` (Ray Serve
replicas behind one endpoint, docs/ray.md): the API is the same app's.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if it was started with one")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id  # the served model name (default: the artifact directory's name)

    # A completion (greedy: the same text as `fxllm generate`), with usage numbers.
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16,
                                           temperature=0)
    print(repr(completion.choices[0].text), completion.choices[0].finish_reason, completion.usage)

    # A chat through the artifact's chat template, streamed token by token.
    stream = client.chat.completions.create(model=model, max_tokens=48, temperature=0, stream=True,
                                            messages=[{"role": "system", "content": "You are a concise assistant."},
                                                      {"role": "user", "content": "What is a KV cache?"}])
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()

    # Three samples at once; choice i samples with seed + i, so the same request gives the same three again.
    samples = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0.8,
                                        n=3, seed=1, stop=["\n"])
    for choice in samples.choices:
        print(choice.index, repr(choice.text))

    # Logprobs of each generated token and its 3 most likely alternatives (top_k is an fxllm/vLLM extension).
    scored = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3,
                                       extra_body={"top_k": 40})
    logprobs = scored.choices[0].logprobs
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        print(f"{token!r:>8} {logprob:7.3f}  {top}")

    # Structured output: the reply follows a JSON schema (OpenAI's response_format; vLLM's guided_json,
    # guided_regex and guided_choice work too, as extra_body fields).
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                             "country": {"type": "string", "maxLength": 40}},
            "required": ["city", "country"], "additionalProperties": False}
    structured = client.chat.completions.create(
        model=model, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": city}})
    print(json.loads(structured.choices[0].message.content))
    choice = client.completions.create(model=model, prompt="Is Paris in France? Answer:", max_tokens=4,
                                       temperature=0, extra_body={"guided_choice": [" yes", " no"]})
    print(repr(choice.choices[0].text))

    # Many requests at once from asyncio: the server batches them continuously.
    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key) as aclient:
            answers = await asyncio.gather(*[
                aclient.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                                messages=[{"role": "user", "content": f"Name a {thing}."}])
                for thing in ("colour", "river", "planet", "composer")])
            return [answer.choices[0].message.content for answer in answers]

    for answer in asyncio.run(together()):
        print(repr(answer))

    try:
        client.completions.create(model=model, prompt="x", temperature=-1)
    except openai.BadRequestError as error:  # every error is the OpenAI error body, one line
        print("400:", error.body["message"])


if __name__ == "__main__":
    main()
