"""SmolLM2 over HTTP: greedy completions and chat through `fxllm serve` equal the in-process engine's."""

from __future__ import annotations

import openai
import pytest

import fxllm
from tests.conftest import PROMPTS
from tests.serving.conftest import ServerProcess


@pytest.mark.slow
def test_smollm2_over_http_equals_the_engine(smollm2_artifact, tmp_path):
    engine = fxllm.load(smollm2_artifact)
    process = ServerProcess(smollm2_artifact, "--served-model-name", "smollm2", log=tmp_path / "stderr.log")
    try:
        client = openai.OpenAI(base_url=process.url, api_key="unused", max_retries=0, timeout=300)
        completions = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=24, temperature=0)
        chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPTS[3]}],
                                              max_tokens=24, temperature=0)
    finally:
        assert process.terminate() == 0
    assert [c.text for c in completions.choices] == [r.text for r in engine.generate(PROMPTS, max_new_tokens=24)]
    assert chat.choices[0].message.content == engine.generate(PROMPTS[3], max_new_tokens=24, chat=True).text
