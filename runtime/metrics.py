"""Typed metrics: per request (returned with every RequestOutput and GenerationResult) and per engine core
(`EngineCore.stats()`, counters since the core started). Times are `time.monotonic()` seconds; durations are the
wall time of the model calls a request took part in (a decode call is shared by its whole batch)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass
class RequestMetrics:
    arrival_time: float  # when add_request accepted it (time.monotonic())
    first_scheduled_time: float | None = None  # its first model call started
    first_token_time: float | None = None  # its first output token was sampled
    last_token_time: float | None = None  # its latest output tokens were appended
    finished_time: float | None = None
    prefill_ms: float = 0.0  # model calls that computed its prompt (again after a preemption)
    decode_ms: float = 0.0  # decode calls it took part in
    decode_steps: int = 0  # decode calls it took part in
    decode_tokens: int = 0  # tokens those calls gave it (more than one per call when decoding speculatively)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    preemptions: int = 0

    def snapshot(self) -> RequestMetrics:
        """A copy that later steps do not change (what an output carries)."""
        copy = object.__new__(RequestMetrics)
        copy.__dict__.update(self.__dict__)
        return copy

    @property
    def time_to_first_token_ms(self) -> float | None:
        return None if self.first_token_time is None else (self.first_token_time - self.arrival_time) * 1e3

    @property
    def decode_ms_per_token(self) -> float:
        """Model-call time per decoded token: the decode calls it took part in (their sampling included), per token
        they gave it. What the model costs; the latency it saw is `inter_token_ms`."""
        return self.decode_ms / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def inter_token_ms(self) -> float:
        """Wall time per token after its first (first token to latest, per decoded token): the inter-token latency
        this request saw, with everything between its model calls (scheduling, detokenizing, handing outputs over,
        other requests' calls). What a baseline that times its own generation loop measures."""
        if not self.decode_tokens or self.first_token_time is None or self.last_token_time is None:
            return 0.0
        return (self.last_token_time - self.first_token_time) * 1e3 / self.decode_tokens

    @property
    def e2e_ms(self) -> float | None:
        return None if self.finished_time is None else (self.finished_time - self.arrival_time) * 1e3


@dataclass
class SpeculativeStats:
    """Counters over a generation: draft tokens proposed and accepted, target (verification) calls, and time spent."""

    proposed: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def record(self, proposed: int, accepted: int) -> None:
        """Count one verification call that checked `proposed` draft tokens and accepted `accepted` of them."""
        self.proposed += proposed
        self.accepted += accepted
        self.target_calls += 1

    @property
    def acceptance_rate(self) -> float:
        """Fraction of proposed draft tokens accepted (0 when none were proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Tokens emitted per target call: each call emits its accepted drafts plus one target token."""
        return (self.accepted + self.target_calls) / self.target_calls if self.target_calls else 0.0


@dataclass
class SpeculativeMetrics(SpeculativeStats):
    """Speculative decoding counters (artifacts compiled with a draft), with the draft mode and k."""

    mode: str = ""
    k: int = 0

    def since(self, earlier: SpeculativeMetrics) -> SpeculativeMetrics:
        return replace(self, **{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                                for f in fields(SpeculativeStats)})


@dataclass
class EngineCounters:
    """The engine core's running totals (stats() reports them with the scheduler's)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_batch_total: int = 0
    max_decode_batch: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine core. Gauges (running, waiting, KV blocks) are current; counters run since the core
    started; peaks run since the core started or the last `reset_peak_stats()`. KV fields are None on contiguous
    artifacts (no block pool)."""

    running: int
    waiting: int
    kv_blocks_used: int | None
    kv_blocks_total: int | None
    prefix_cache_hits: int  # full prompt blocks found in the prefix cache
    prefix_cache_queries: int  # full prompt blocks looked up
    preemptions: int
    prompt_tokens: int  # of the requests accepted
    generation_tokens: int  # tokens sampled and delivered
    requests_finished: int
    steps: int  # model calls
    prefill_steps: int
    decode_steps: int
    prefill_tokens: int  # computed in prefill (prefix-cache hits excluded, recomputation after preemption included)
    prefill_cached_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_batch_total: int  # sum of decode batch sizes
    max_decode_batch: int  # peak
    peak_kv_blocks_used: int | None  # peak
    kv_waste_at_peak: float | None  # unfilled / allocated slots when the most blocks were in use
    speculative: SpeculativeMetrics | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_batch_total / self.decode_steps if self.decode_steps else 0.0

    def since(self, earlier: EngineStats) -> EngineStats:
        """The counters' growth since `earlier` (a snapshot of the same core); gauges and peaks as they are now."""
        speculative = self.speculative
        if speculative is not None and earlier.speculative is not None:
            speculative = speculative.since(earlier.speculative)
        return replace(self, speculative=speculative,
                       **{name: getattr(self, name) - getattr(earlier, name) for name in _COUNTERS})


_GAUGES_AND_PEAKS = {"running", "waiting", "kv_blocks_used", "kv_blocks_total", "max_decode_batch",
                     "peak_kv_blocks_used", "kv_waste_at_peak", "speculative"}
_COUNTERS = [f.name for f in fields(EngineStats) if f.name not in _GAUGES_AND_PEAKS]
