"""Speculative decoding on the paged cache, batched: 16 concurrent requests give plain paged decoding's greedy tokens
with an ngram and a self-int4 draft, sharing prefix-cached blocks and under a KV budget that forces preemption;
sampling through the batched path keeps the target's exact distribution (the chi-square test of
test_speculative_sampling.py, run through a real paged artifact with a model draft); failures fail only their
requests and free their blocks. A model draft's unrolled graph (its k proposals in one call) gives what its k
one-step calls give, and the same guarantees through the engine."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import fxllm
from fxllm.errors import ArtifactError, InvalidArgumentError
from fxllm.runtime.request import SamplingParams
from fxllm.runtime.sampler import probabilities
from fxllm.runtime.speculative import BIASED_RULE, EXACT_RULE, processed_probs
from tests.conftest import PROMPTS, TINY_PAGED_PASSES
from tests.test_logits_adjustment import reference_adjust
from tests.test_engine_core import FailingBackend, assert_pool_whole
from tests.test_speculative_sampling import PROMPT, VOCAB, _chi_square_p, _tiny_llama

MIXED = [(prompt + " ") * (1 + i % 3) + str(i) for i, prompt in enumerate(PROMPTS * 4)]  # 16 prompts, shared starts
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def self_int4_artifact(make_tiny_model, tmp_path_factory):
    """The tiny llama compiled paged (blocks of 4 tokens) with a self-int4 draft, k=4."""
    output = tmp_path_factory.mktemp("paged-self-int4") / "artifact"
    fxllm.compile(make_tiny_model("llama"), output, passes=TINY_PAGED_PASSES, draft="self-int4", spec_k=4)
    return output


@pytest.fixture(scope="module")
def speculative_engine(tiny_paged_artifact, self_int4_artifact):
    """draft → a loader of its speculative engine (prompt lookup needs no compiled draft) with .artifact of each."""
    artifacts = {"ngram": (tiny_paged_artifact, "ngram"), "self-int4": (self_int4_artifact, True),
                 "self-int4-unrolled": (self_int4_artifact, True)}  # its k proposals in one call of the draft

    def load(draft: str, **options):
        artifact, speculative = artifacts[draft]
        if draft.endswith("-unrolled"):
            options["unrolled_draft"] = True
        return fxllm.load(artifact, speculative=speculative, **options)

    load.artifact = {draft: artifact for draft, (artifact, _) in artifacts.items()}
    return load


@pytest.fixture(scope="module")
def echo_prompts(tiny_paged_artifact):
    """Each prompt, the model's own greedy continuation of it, the prompt again: the continuation partly repeats
    what came before, so prompt lookup finds matches the target accepts (random weights rarely repeat otherwise)."""
    engine = fxllm.load(tiny_paged_artifact)
    ids = [engine.encode(prompt) for prompt in MIXED]
    return [p + r.token_ids + p for p, r in zip(ids, engine.generate_ids(ids, max_new_tokens=NEW_TOKENS))]


@pytest.mark.parametrize("draft", ["ngram", "self-int4", "self-int4-unrolled"])
def test_sixteen_requests_give_plain_paged_greedy_tokens(draft, speculative_engine, echo_prompts):
    plain = fxllm.load(speculative_engine.artifact[draft], speculative=False)
    assert plain.speculator is None
    expected = [r.token_ids for r in plain.generate_ids(echo_prompts, max_new_tokens=NEW_TOKENS)]
    for kv_blocks in (None, 96):  # 96 blocks of 4 tokens hold two or three of the 16 requests at a time
        engine = speculative_engine(draft, kv_blocks=kv_blocks)
        results = engine.generate_ids(echo_prompts, max_new_tokens=NEW_TOKENS)
        assert [r.token_ids for r in results] == expected, (draft, kv_blocks)
        stats, spec = engine.stats(), engine.stats().speculative
        assert spec.mode == draft.removesuffix("-unrolled") and spec.proposed > 0 and spec.accepted > 0  # both verdicts
        assert spec.accepted < spec.proposed
        assert stats.prefix_cache_hits > 0  # the prompts share prefixes and repeat themselves
        if kv_blocks is None:
            assert stats.preemptions == 0 and stats.max_decode_batch == 16  # all verified in one call
            assert stats.decode_steps < 16 * NEW_TOKENS / 2
        else:
            assert stats.preemptions > 0
        assert_pool_whole(engine)


def test_sampled_requests_are_seeded_and_alone_equal_batched(speculative_engine, echo_prompts):
    """A sampled request's tokens depend on its seed, not on the batch it is verified in."""
    engine = speculative_engine("self-int4")
    params = dict(max_new_tokens=16, temperature=0.8, top_k=40, top_p=0.95, seed=11)
    alone = [engine.generate_ids([ids], **params)[0].token_ids for ids in echo_prompts[:4]]
    together = [r.token_ids for r in engine.generate_ids(echo_prompts[:4], **params)]
    assert together == alone and all(len(t) == 16 for t in alone)
    assert engine.stats().speculative.accepted > 0
    assert_pool_whole(engine)


def test_logprobs_and_stop_strings_through_the_batched_path(speculative_engine, echo_prompts, tiny_paged_artifact):
    plain, engine = fxllm.load(tiny_paged_artifact), speculative_engine("self-int4")
    params = SamplingParams(max_tokens=12, logprobs=2, prompt_logprobs=1)
    outputs = [list(e.stream_outputs(echo_prompts[1], params)) for e in (plain, engine)]
    (expected, got) = ([t for out in outs for t in out.logprobs] for outs in outputs)
    assert [t.token_id for t in got] == [t.token_id for t in expected]
    assert np.allclose([t.logprob for t in got], [t.logprob for t in expected], atol=1e-4)
    assert len(outputs[1][0].prompt_logprobs) == len(echo_prompts[1])
    text = plain.generate_ids([echo_prompts[2]], max_new_tokens=12)[0].text
    stop = text[len(text) // 2:][:3]
    assert stop.strip()
    cut = [e.generate_ids([echo_prompts[2]], max_new_tokens=12, stop=stop)[0] for e in (plain, engine)]
    assert cut[0].finish_reason == "stop" and len(cut[0].text) < len(text)
    assert cut[1].text == cut[0].text and cut[1].token_ids == cut[0].token_ids
    assert_pool_whole(engine)


def test_a_failing_verify_or_draft_fails_only_its_requests(speculative_engine, echo_prompts):
    engine = speculative_engine("self-int4")
    target = engine.runner.backend = FailingBackend(engine.runner.backend)
    draft = engine.speculator.drafter.runner.backend = FailingBackend(engine.speculator.drafter.runner.backend)
    target.arm(rows=3)  # the first verify of three or more rows
    failed = [out for out in _finished(engine.core, "r", echo_prompts[:4]) if out.finish_reason == "error"]
    assert len(failed) >= 3 and all("injected backend failure" in out.error for out in failed)
    assert_pool_whole(engine)
    draft.arm(rows=1)  # the draft fails for the first request it proposes for; the other one runs to the end
    outcome = [out.finish_reason for out in _finished(engine.core, "d", echo_prompts[:2])]
    assert sorted(outcome) == ["error", "length"]
    assert_pool_whole(engine)


def _finished(core, prefix: str, prompts: list[list[int]]) -> list:
    """Run the prompts (8 greedy tokens each) through the core to the end: their final outputs."""
    for i, ids in enumerate(prompts):
        core.add_request(f"{prefix}{i}", ids, SamplingParams(max_tokens=8))
    finished = []
    while core.has_unfinished():
        finished += [out for out in core.step() if out.finished]
    return finished


def test_prompt_lookup_at_load_time_and_bad_values(tiny_paged_artifact, self_int4_artifact):
    assert fxllm.load(tiny_paged_artifact).speculator is None  # compiled without a draft: plain unless asked
    engine = fxllm.load(tiny_paged_artifact, speculative="ngram", spec_k=3)
    assert (engine.speculator.mode, engine.speculator.k) == ("ngram", 3)
    assert fxllm.load(self_int4_artifact, speculative="ngram").speculator.k == 4  # the artifact's k
    for bad in ("eagle", 1, None):
        with pytest.raises(InvalidArgumentError, match="speculative must be True"):
            fxllm.load(tiny_paged_artifact, speculative=bad)


# --- the sampling distribution through the batched path --------------------------------------------------------

SAMPLES = 2000  # through the engine; the biased rule's p-value is ~1e-30 at this size, the exact rule's uniform


@pytest.fixture(scope="module")
def vocab12_artifact(tmp_path_factory):
    """test_speculative_sampling.py's tiny Llamas (vocabulary 12; seed 0 the target, seed 1 a clearly different
    draft) as a paged artifact with a model draft, k=2, and a word-level tokenizer of the 12 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    sources = []
    for seed in (0, 1):
        directory = tmp_path_factory.mktemp(f"vocab12-seed{seed}")
        _tiny_llama(seed).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        sources.append(directory)
    output = tmp_path_factory.mktemp("vocab12-paged") / "artifact"
    fxllm.compile(sources[0], output, passes=TINY_PAGED_PASSES, draft=str(sources[1]), spec_k=2)
    return output


# logit_bias, penalties and min-p: each drafted position's distribution then depends on the drafts before it
ADJUSTED = dict(logit_bias={5: 1.5, 8: -2.0}, repetition_penalty=1.8, frequency_penalty=0.9, presence_penalty=0.6,
                min_p=0.03)


def _exact_pair_distribution(adjusted: dict | None = None) -> np.ndarray:
    """P(t1, t2): the target's joint of the second and third generated tokens, the first summed out [V, V], each
    token's distribution from its logits adjusted by hand for the tokens before it (tests/test_logits_adjustment.py's
    reference_adjust), then tempered (1.0) and cut by min-p."""
    params = SamplingParams(temperature=1.0, **(adjusted or {}))
    target = _tiny_llama(0)
    with torch.no_grad():
        prefixes = torch.tensor([PROMPT + list(p) for p in itertools.product(range(VOCAB), repeat=2)])
        logits = target(prefixes).logits.double().numpy()  # row a·V + b: the prompt, then a, then b
    n = len(PROMPT)

    def distribution(row: np.ndarray, output: list[int]) -> np.ndarray:
        return probabilities(reference_adjust(row, params, PROMPT, output)[None], params)[0]

    p0 = distribution(logits[0, n - 1], [])  # [t0]
    p1 = np.stack([distribution(logits[a * VOCAB, n], [a]) for a in range(VOCAB)])  # [t0, t1]
    p2 = np.stack([distribution(logits[a * VOCAB + b, n + 1], [a, b])
                   for a, b in itertools.product(range(VOCAB), repeat=2)]).reshape(VOCAB, VOCAB, VOCAB)
    return np.einsum("a,ab,abc->bc", p0, p1, p2)


def _sampled_pairs(engine, rule: str, adjusted: dict | None = None) -> tuple[np.ndarray, object]:
    """SAMPLES requests with their own seeds, all in the core at once: (t1, t2) counts and the run's counters."""
    engine.speculator.rule = rule
    core, before = engine.core, engine.stats()
    for i in range(SAMPLES):
        core.add_request(f"{rule}-{i}", PROMPT, SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True,
                                                               **(adjusted or {})))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for ids in tokens.values():
        counts[ids[1], ids[2]] += 1
    return counts, engine.stats().since(before)


@pytest.mark.parametrize("unrolled", [False, True])
def test_sampling_through_the_batched_path_keeps_the_target_distribution(vocab12_artifact, unrolled):
    """unrolled: the draft samples both proposals in one call of its unrolled graph (Gumbel noise from each
    request's stream), its q the tempered softmax of the logits that call returns."""
    exact = _exact_pair_distribution()
    engine = fxllm.load(vocab12_artifact, max_batch=256, unrolled_draft=unrolled)
    assert (engine.speculator.drafter.unrolled is not None) == unrolled
    counts, stats = _sampled_pairs(engine, EXACT_RULE)
    p_value, spec = _chi_square_p(counts, exact), stats.speculative
    print(f"\nexact rule through the engine{' (unrolled draft)' * unrolled}: {SAMPLES} requests, chi-square p = "
          f"{p_value:.4g}, acceptance {spec.acceptance_rate:.3f}, largest verify batch {stats.max_decode_batch}")
    assert counts.sum() == SAMPLES and stats.max_decode_batch >= 64  # verified many rows per call
    assert 0.1 < spec.acceptance_rate < 0.9  # both the accept and the residual-resample paths, many times
    assert p_value > 1e-3
    if unrolled:
        assert_pool_whole(engine)
        return
    counts, _ = _sampled_pairs(engine, BIASED_RULE)  # the same test catches the common bug through this path
    p_biased = _chi_square_p(counts, exact)
    print(f"biased rule through the engine: chi-square p = {p_biased:.4g}")
    assert p_biased < 1e-6
    assert_pool_whole(engine)


def test_penalties_bias_and_min_p_keep_the_adjusted_target_distribution(vocab12_artifact):
    """The target's logits at a drafted position are adjusted for the output so far plus the drafts before it (a
    verification that counted only the output would give the second token's penalties no first token)."""
    exact, plain = _exact_pair_distribution(ADJUSTED), _exact_pair_distribution()
    assert 0.5 * np.abs(exact - plain).sum() > 0.2  # the settings move the distribution a long way
    engine = fxllm.load(vocab12_artifact, max_batch=256)
    counts, stats = _sampled_pairs(engine, EXACT_RULE, ADJUSTED)
    p_value, spec = _chi_square_p(counts, exact), stats.speculative
    print(f"\nexact rule with penalties, bias and min-p: chi-square p = {p_value:.4g}, acceptance "
          f"{spec.acceptance_rate:.3f}")
    assert counts.sum() == SAMPLES and 0.1 < spec.acceptance_rate < 0.9
    assert p_value > 1e-3
    assert_pool_whole(engine)


# --- the draft's unrolled graph ----------------------------------------------------------------------------------


def test_unrolled_graph_equals_k_one_step_calls(self_int4_artifact):
    """Greedy: the same k tokens, the same logits and the same cache as k calls of the one-step graph, from an
    empty cache (a whole prompt fed) and from a cached prefix (one token fed)."""
    from fxllm.runtime.manifest import load_manifest
    from fxllm.runtime.unrolled_draft import UnrolledDraft

    manifest = load_manifest(self_int4_artifact / "draft")
    assert manifest.unrolled_draft.k == 4 and manifest.unrolled_draft.model_file.is_file()
    step = fxllm.load(manifest.directory).runner
    unrolled = UnrolledDraft.load(manifest, threads=2)
    prompt = step.pad_token_id, *range(100, 130)
    greedy = SamplingParams(temperature=0.0)
    step_cache, unrolled_cache, first_logits = step.new_cache(), unrolled.new_cache(), None
    for feed in (list(prompt), [7]):
        expected_tokens, expected_logits = [], []
        token_feed = feed
        for _ in range(4):
            logits = step.step_one(step_cache, token_feed, step_cache.length, all_logits=False)[-1]
            expected_tokens.append(int(logits.argmax()))
            expected_logits.append(logits)
            token_feed = [expected_tokens[-1]]
        tokens, probs = unrolled.propose(unrolled_cache, feed, greedy, np.random.default_rng(0))
        assert tokens == expected_tokens and probs is None
        assert unrolled_cache.length == step_cache.length  # the feed and the first k-1 drafts
        length = step_cache.length
        for mine, theirs in zip(unrolled_cache.keys + unrolled_cache.values, step_cache.keys + step_cache.values):
            np.testing.assert_allclose(mine[:, :, :length], theirs[:, :, :length], atol=1e-5)
        first_logits = expected_logits[0] if first_logits is None else first_logits  # of the whole prompt
    sampled, distributions = unrolled.propose(unrolled.new_cache(), list(prompt), SamplingParams(temperature=0.7),
                                              np.random.default_rng(1))
    assert len(sampled) == 4 and distributions.shape == (4, manifest.spec.vocab_size)
    np.testing.assert_allclose(distributions[0], processed_probs(first_logits, 0.7), rtol=1e-4)


def test_unrolled_draft_choice_and_bad_values(self_int4_artifact, tiny_paged_artifact):
    assert fxllm.load(self_int4_artifact).speculator.drafter.unrolled is None  # CPU default: one call per token
    for bad, match in ((1, "unrolled_draft must be True or False"),
                       ("yes", "unrolled_draft must be True or False")):
        with pytest.raises(InvalidArgumentError, match=match):
            fxllm.load(self_int4_artifact, unrolled_draft=bad)
    with pytest.raises(InvalidArgumentError, match=r"no unrolled graph for k=3 \(it has 4"):
        fxllm.load(self_int4_artifact, unrolled_draft=True, spec_k=3)
    with pytest.raises(InvalidArgumentError, match="int8 activations"):
        fxllm.load(self_int4_artifact, unrolled_draft=True, int8_activations=True)
    drafter = fxllm.load(self_int4_artifact).speculator.drafter  # a quantized draft: int8 activations, its fastest
    assert drafter.runner.backend.session.get_session_options().get_session_config_entry(
        "session.qdq_matmulnbits_accuracy_level") == "4"
    assert fxllm.load(self_int4_artifact, spec_k=3).speculator.k == 3  # another k: the one-step calls


def test_a_wrong_unrolled_graph_is_refused_at_load(self_int4_artifact, tmp_path):
    import shutil

    from fxllm.runtime.artifact import write_manifest
    from fxllm.runtime.manifest import load_manifest

    copy = tmp_path / "artifact"
    shutil.copytree(self_int4_artifact, copy)
    draft = load_manifest(copy / "draft")
    shutil.copy(draft.model_file, draft.unrolled_draft.model_file)  # the one-step graph where the unrolled belongs
    data = {key: value for key, value in draft.data.items() if key not in ("kind", "format_version", "files")}
    write_manifest(draft.directory, data)
    write_manifest(copy, {key: value for key, value in load_manifest(copy, verify=False).data.items()
                          if key not in ("kind", "format_version", "files")})
    with pytest.raises(ArtifactError, match="'model.unrolled.onnx' does not match the draft's manifest"):
        fxllm.load(copy, unrolled_draft=True)


def test_every_row_decodes_plainly_before_anyone_is_preempted(tiny_paged_artifact, monkeypatch):
    """Drafts are optional: with one block free, where the first row's drafts would take it and the second row needs
    it for its one token, the first row drops its drafts and nobody is preempted (the first row kept them and the
    second was preempted: a full recompute). Every row proposes 4 drafts here; the greedy tokens stay plain
    decoding's through the preemptions the small pool needs later."""
    from fxllm.runtime.speculative import NgramProposer

    monkeypatch.setattr(NgramProposer, "propose", lambda self, tokens: [int(tokens[-1])] * self.k)
    prompts = {"A": list(range(100, 107)), "B": list(range(200, 208))}  # 2 blocks of 4 each, A's with a slot free
    engine = fxllm.load(tiny_paged_artifact, kv_blocks=5, speculative="ngram", spec_k=4)
    scheduler = engine.core.scheduler
    decode, batches = scheduler._decode, []
    monkeypatch.setattr(scheduler, "_decode", lambda: batches.append(decode()) or batches[-1])
    for request_id, ids in prompts.items():
        engine.core.add_request(request_id, ids, SamplingParams(max_tokens=10))
    tokens = {request_id: [] for request_id in prompts}
    while engine.core.has_unfinished():
        for output in engine.core.step():
            tokens[output.request_id] += output.new_token_ids
    first = batches[0]
    assert [(r.request_id, len(d)) for r, d in zip(first.requests, first.drafts)] == [("A", 0), ("B", 0)]
    assert first.preempted == []
    plain = fxllm.load(tiny_paged_artifact)
    assert [tokens[i] for i in prompts] == [r.token_ids for r in plain.generate_ids(list(prompts.values()), 10)]
    assert_pool_whole(engine)
