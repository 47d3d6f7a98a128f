"""Prefix-aware routing on Ray Serve's request router API (`ray.serve.request_router.RequestRouter`, alpha in
Ray 2.60): a request whose prompt starts like earlier ones goes to the replica those went to — its engine has
the prompt's KV blocks in its prefix cache — unless that replica is busier than the least loaded by more than
`imbalance` requests (then, or when it is full, the others in order of load); a prompt with no such replica (or a
short match) goes to the less loaded of two random replicas (what Serve's default router does).

What the router sees: Serve gives `choose_replicas` the pending call's arguments, here the ingress's
`respond(route, request)` call with the parsed request (which is why the app has an ingress deployment: a request
that the HTTP proxy routes itself carries only its headers until the replica reads the body). A prompt is cut into
blocks (`block_chars` characters of a text prompt or of a conversation's roles and contents; `block_tokens` ids of a
token prompt), each block's key hashing it with all blocks before it, as the engine's prefix cache keys its KV
blocks. The router remembers the keys it sent to each replica (a bounded LRU per replica: `max_keys`), so the
longest run of a prompt's leading keys that a replica has seen is its match. The memory is this router's own: with
several ingress replicas each learns from the requests it routes (no shared state on the routing path).
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import LocalityMixin, PendingRequest, ReplicaID, RequestRouter

from fxllm.serving.protocol import ChatCompletionRequest, CompletionRequest


class PrefixAwareRouter(LocalityMixin, RequestRouter):
    def initialize_state(self, block_chars: int = 64, block_tokens: int = 16, min_match_blocks: int = 1,
                         min_match_ratio: float = 0.1, imbalance: int = 8, max_keys: int = 100_000):
        """Serve calls this with RequestRouterConfig.request_router_kwargs."""
        self.block_chars, self.block_tokens = block_chars, block_tokens
        self.min_match_blocks, self.min_match_ratio = min_match_blocks, min_match_ratio
        self.imbalance, self.max_keys = imbalance, max_keys
        self.seen: dict[ReplicaID, OrderedDict[int, None]] = {}  # replica → prefix keys sent to it (LRU)
        self.routed = {"affinity": 0, "balanced": 0}

    async def choose_replicas(self, candidate_replicas, pending_request: PendingRequest | None = None):
        keys = prefix_keys(_request_of(pending_request), self.block_chars, self.block_tokens)
        if keys:
            best, matched = None, 0
            for replica in candidate_replicas:
                count = self._matched(replica.replica_id, keys)
                if count > matched:
                    best, matched = replica, count
            if (best is not None and matched >= self.min_match_blocks and matched / len(keys) >= self.min_match_ratio
                    and self._load(best) - min(self._load(r) for r in candidate_replicas) <= self.imbalance):
                self.routed["affinity"] += 1
                if pending_request is not None:  # every replica is offered: if none takes it, back off
                    pending_request.routing_context.should_backoff = True
                others = sorted((r for r in candidate_replicas if r is not best), key=self._load)
                return [[best], others]
        self.routed["balanced"] += 1
        return [self._two_random(candidate_replicas, pending_request)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys = prefix_keys(_request_of(pending_request), self.block_chars, self.block_tokens)
        seen = self.seen.setdefault(replica_id, OrderedDict())
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.max_keys:
            seen.popitem(last=False)

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        for gone in [r for r in self.seen if r not in self._replica_id_set]:
            del self.seen[gone]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.seen.pop(replica_id, None)

    def _two_random(self, candidate_replicas, pending_request: PendingRequest | None) -> list:
        """Serve's default choice: two random replicas (same node first, when Serve prefers that); the less loaded
        of them takes the request."""
        local = self.apply_locality_routing(pending_request)
        pool = [r for r in candidate_replicas if r.replica_id in local] or list(candidate_replicas)
        return random.sample(pool, min(2, len(pool)))

    def _matched(self, replica_id: ReplicaID, keys: list[int]) -> int:
        seen = self.seen.get(replica_id)
        if not seen:
            return 0
        count = 0
        for key in keys:
            if key not in seen:
                break
            count += 1
        return count

    def _load(self, replica) -> int:
        """Requests the replica is running, as Serve last learned it (0 when unknown)."""
        queue_len = self._replica_queue_len_cache.get(replica.replica_id)
        return 0 if queue_len is None else queue_len


def _request_of(pending_request: PendingRequest | None):
    if pending_request is None:
        return None
    return next((a for a in pending_request.args if isinstance(a, (CompletionRequest, ChatCompletionRequest))), None)


def prefix_keys(request, block_chars: int, block_tokens: int) -> list[int]:
    """The keys of the request's prompt's full blocks (empty for a prompt shorter than one block, or no request)."""
    if isinstance(request, ChatCompletionRequest):
        units, size = conversation_text(request), block_chars
    elif isinstance(request, CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: route by the first
        units, size = (prompt, block_chars) if isinstance(prompt, str) else (tuple(prompt), block_tokens)
    else:
        return []
    keys, key = [], 0
    for start in range(0, len(units) - size + 1, size):
        key = hash((key, units[start:start + size]))
        keys.append(key)
    return keys


def conversation_text(request: ChatCompletionRequest) -> str:
    """The messages' roles and contents in order (the part of the rendered prompt that differs between requests)."""
    parts = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        parts.append(f"\x1e{message.role}\x1f{content or ''}")
    return "".join(parts)
