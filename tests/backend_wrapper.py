"""A test double's base: wraps a real backend and passes every Backend protocol member through to it; subclasses
override `run` to inject failures or record calls."""

from __future__ import annotations

from fxllm.runtime.backend import Backend


class WrappedBackend:
    def __init__(self, inner: Backend):
        self.inner, self.name = inner, inner.name
        self.allows_empty_selection = inner.allows_empty_selection

    @property
    def providers(self) -> list[str]:
        return self.inner.providers

    def run(self, feeds):
        return self.inner.run(feeds)

    def input_signature(self):
        return self.inner.input_signature()

    def output_signature(self):
        return self.inner.output_signature()

    def metadata(self):
        return self.inner.metadata()
