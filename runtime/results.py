"""GenerationResult: what Engine.generate returns for one prompt, assembled from the request's RequestOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fxllm.errors import GenerationError
from fxllm.runtime.metrics import RequestMetrics
from fxllm.runtime.request import RequestOutput


@dataclass
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "eos" | "stop" | "length" | "context"
    timings: dict[str, float] = field(default_factory=dict)  # this request's: prefill_ms, decode_ms_per_token, inter_token_ms...
    metrics: RequestMetrics | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "timings": self.timings,
        }



def collector(result: GenerationResult, max_new_tokens: int, max_context: int, done: list):
    """A sink that builds a GenerationResult from a request's outputs; the final output goes to `done`."""

    def sink(output: RequestOutput) -> None:
        result.token_ids += output.new_token_ids
        result.text += output.text_delta
        if not output.finished:
            return
        # "context" only where the context cut the request short: max_new_tokens that end exactly at it are "length"
        result.finish_reason = _finish_reason(output, len(result.prompt_token_ids) + max_new_tokens > max_context)
        result.metrics = output.metrics
        m = output.metrics
        result.timings = {"prefill_ms": round(m.prefill_ms, 3), "decode_ms_per_token": round(m.decode_ms_per_token, 3),
                          "inter_token_ms": round(m.inter_token_ms, 3),
                          "decode_steps": m.decode_steps, "ttft_ms": round(m.time_to_first_token_ms or 0.0, 3),
                          "total_ms": round(m.e2e_ms or 0.0, 3)}
        done.append(output)

    return sink


def _finish_reason(output: RequestOutput, reaches_context: bool) -> str:
    """GenerationResult's vocabulary: "eos" (an EOS id), "stop" (a stop string), "context" (the model's context ended
    the output before max_new_tokens), "length"."""
    if output.finish_reason == "stop":
        return "eos" if isinstance(output.stop_reason, int) else "stop"
    if output.finish_reason == "length" and reaches_context:
        return "context"
    return output.finish_reason


def raise_failure(outputs: list[RequestOutput]) -> None:
    failed = next((out for out in outputs if out.finish_reason == "error"), None)
    if failed is not None:
        raise GenerationError(f"generation failed: {failed.error}")

