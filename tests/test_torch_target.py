"""The `torch` target (model.pt2) and backend: greedy tokens equal the `ort` target's (contiguous and paged caches,
single prompts and a batch; SmolLM2 in a slow test), the archive holds ATen ops only and loads without the
compiler, the KV cache stays on the backend's device between steps, and bad input is one line."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import fxllm
from fxllm.errors import ArtifactError, FxllmError
from fxllm.runtime.contract import CONTRACT_METADATA_KEY, LOGITS, parse_cache_name
from fxllm.runtime.manifest import load_manifest
from tests.conftest import PROMPTS

NEW_TOKENS = 12


@pytest.fixture(autouse=True)
def torch_threads():
    """The tiny models run on one thread (torch's backend sets the process-wide count; restored after each test):
    on a shared 2-core machine two spinning threads made a 2-layer model's step 30x slower."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def greedy(engine, prompts: list[str], batched: bool) -> list[list[int]]:
    if batched:
        return [r.token_ids for r in engine.generate(prompts, max_new_tokens=NEW_TOKENS)]
    return [engine.generate(p, max_new_tokens=NEW_TOKENS).token_ids for p in prompts]


@pytest.fixture(scope="module")
def ort_tokens(make_tiny_artifact) -> list[list[int]]:
    return greedy(fxllm.load(make_tiny_artifact("llama")), PROMPTS, batched=False)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_torch_target_greedy_tokens_equal_ort_target(make_torch_artifact, ort_tokens, paged):
    engine = fxllm.load(make_torch_artifact("llama", paged=paged), backend="torch", device="cpu", threads=1)
    assert engine.backend.providers == ["torch:cpu"]
    assert greedy(engine, PROMPTS, batched=False) == ort_tokens
    assert greedy(engine, PROMPTS, batched=True) == ort_tokens
    assert all(len(tokens) == NEW_TOKENS for tokens in ort_tokens)


def test_pt2_holds_aten_ops_only_and_the_contract_digest(make_torch_artifact):
    artifact = make_torch_artifact("llama", paged=True)
    manifest = load_manifest(artifact)
    assert manifest.target == "torch" and manifest.model_file.name == "model.pt2"
    extra = {CONTRACT_METADATA_KEY: ""}
    program = torch.export.load(str(manifest.model_file), extra_files=extra)
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    namespaces = {t.namespace for t in targets if isinstance(t, torch._ops.OpOverload)}
    assert namespaces == {"aten"}
    sdpa = [n for n in program.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == manifest.spec.num_layers
    assert all(n.kwargs.get("enable_gqa") for n in sdpa)  # K/V at the KV heads, grouped by SDPA itself
    assert len(extra[CONTRACT_METADATA_KEY]) == 64


def test_kv_cache_stays_on_the_device_between_steps(make_torch_artifact):
    """Every cache input after the first step is the very tensor a previous step returned (contiguous) or the
    pool itself (paged): nothing goes through numpy."""
    for paged in (False, True):
        engine = fxllm.load(make_torch_artifact("llama", paged=paged), backend="torch", threads=1)
        run, seen = engine.backend.run, []
        produced: set[int] = set()

        def spy(feeds):
            caches = {k: v for k, v in feeds.items() if parse_cache_name(k)}
            seen.append(all(isinstance(v, torch.Tensor) for v in caches.values())
                        and (not produced or paged or all(id(v) in produced for v in caches.values())))
            outputs = run(feeds)
            assert isinstance(outputs[LOGITS], np.ndarray)
            kv = [v for k, v in outputs.items() if parse_cache_name(k)]
            assert kv and all(isinstance(v, torch.Tensor) for v in kv)
            produced.update(id(v) for v in kv)
            return outputs

        engine.backend.run = spy
        engine.generate(PROMPTS[:2], max_new_tokens=4)
        assert len(seen) >= 4 and all(seen), (paged, seen)
        if paged:
            pools = engine.runner.pool.feeds().values()
            assert all(isinstance(p, torch.Tensor) and p.device.type == "cpu" for p in pools)


def test_the_program_moves_to_another_device(make_torch_artifact):
    """Lowering runs on CPU and torch.export burns that device into the graph (the masks' arange); the backend's
    move must leave nothing on CPU. The meta device stands in for CUDA: a naive `.to()` of the module fails on it."""
    from fxllm.compiler.interface import make_input, sample_dims
    from fxllm.runtime.backend_torch import program_on_device

    manifest = load_manifest(make_torch_artifact("llama", paged=True))  # both mask ops build positions with arange
    inputs = [make_input(sig, sample_dims()).to("meta") for sig in manifest.io.inputs]
    with pytest.raises(RuntimeError, match="device"):
        torch.export.load(str(manifest.model_file)).module().to("meta")(*inputs)
    outputs = program_on_device(torch, torch.export.load(str(manifest.model_file)), "meta")(*inputs)
    assert all(value.device.type == "meta" for value in outputs)


def test_the_runtime_runs_a_torch_artifact_without_the_compiler(make_torch_artifact, tmp_path):
    from tests.test_thin_runtime import Blocked

    artifact = make_torch_artifact("llama")
    expected = fxllm.load(artifact, backend="torch", threads=1).generate(PROMPTS[0], max_new_tokens=6).token_ids
    blocked = Blocked(tmp_path / "no-compiler", ("fxllm.compiler", "fxllm.passes", "transformers", "onnxscript"))
    proc = blocked.python(f"import fxllm; print(fxllm.load({str(artifact)!r}, backend='torch', threads=1)"
                          f".generate({PROMPTS[0]!r}, max_new_tokens=6).token_ids)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(expected)
    assert blocked.attempts_by_fxllm() == []


def test_bad_input_is_one_line(make_torch_artifact, make_tiny_artifact, make_tiny_model, tmp_path):
    torch_artifact, ort_artifact = make_torch_artifact("llama"), make_tiny_artifact("llama")
    cases = [
        (lambda: fxllm.load(ort_artifact, backend="torch"), "compiled for target 'ort'"),
        (lambda: fxllm.load(torch_artifact, backend="onnxruntime"), "backend='torch'"),
        (lambda: fxllm.load(torch_artifact, backend="torch", device="tpu"), "unknown device 'tpu'"),
        (lambda: fxllm.compile(make_tiny_model("llama"), tmp_path / "x", dtype="float16"),
         "target 'ort' does not run float16"),
    ]
    if not torch.cuda.is_available():
        cases.append((lambda: fxllm.load(torch_artifact, backend="torch", device="cuda"), "needs a CUDA GPU"))
    for call, words in cases:
        with pytest.raises(FxllmError) as info:
            call()
        assert words in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ArtifactError):
        fxllm.load(ort_artifact, backend="torch")


def test_missing_torch_is_one_line(make_torch_artifact, tmp_path):
    from tests.test_thin_runtime import Blocked

    blocked = Blocked(tmp_path / "no-torch", ("torch",))
    proc = blocked.cli("generate", str(make_torch_artifact("llama")), "--backend", "torch", "--prompt", "Hi")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "fxllm[compile]" in proc.stderr


@pytest.mark.slow
def test_smollm2_torch_target_matches_ort_target(smollm2_artifact, tmp_path_factory):
    output = tmp_path_factory.mktemp("smollm2-torch") / "artifact"
    fxllm.compile("smollm2-135m", output, target="torch", requantize=True)
    expected = greedy(fxllm.load(smollm2_artifact), PROMPTS, batched=True)
    engine = fxllm.load(output, backend="torch", threads=1)
    assert greedy(engine, PROMPTS, batched=False) == expected
    assert greedy(engine, PROMPTS, batched=True) == expected


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="torch.compile's CPU backend needs a C++ compiler")
def test_torch_compile_gives_the_same_tokens(make_torch_artifact, ort_tokens):
    engine = fxllm.load(make_torch_artifact("llama"), backend="torch", torch_compile=True, threads=1)
    assert greedy(engine, PROMPTS[:2], batched=False) == ort_tokens[:2]


class RunsCode:
    """Unpickling this writes a file: the proof that an archive's pickle ran."""

    def __init__(self, proof):
        self.proof = str(proof)

    def __reduce__(self):
        return (eval, (f"__import__('pathlib').Path({self.proof!r}).write_text('ran') and __import__('torch').zeros(8)",))


def rewritten_archive(source, target, rewrite) -> None:
    """A copy of the zip archive `source` at `target`, each entry's bytes passed through rewrite(name, data)."""
    import zipfile

    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            new.writestr(info, rewrite(info.filename, old.read(info.filename)))


@pytest.mark.parametrize("where", ["weight", "sample_inputs"])
def test_an_archive_holding_a_pickle_is_refused_before_it_runs(make_torch_artifact, tmp_path, where):
    """A tampered model.pt2 (its checksums rewritten too, as anyone handing over an artifact can: here verify=False)
    whose weight is marked `use_pickle`, or whose sample inputs are a pickle weights_only refuses (torch would retry
    without it): refused with one line, and the pickle never runs."""
    import io
    import json
    import shutil

    artifact = tmp_path / "artifact"
    shutil.copytree(make_torch_artifact("llama"), artifact)
    proof = tmp_path / "proof"
    payload = io.BytesIO()
    torch.save(RunsCode(proof), payload)
    pt2 = artifact / "model.pt2"
    original = tmp_path / "original.pt2"
    pt2.rename(original)
    poisoned = {}

    def rewrite(name: str, data: bytes) -> bytes:
        if where == "weight" and name.endswith("_weights_config.json"):
            config = json.loads(data)
            fqn = next(iter(config["config"]))
            config["config"][fqn]["use_pickle"] = True
            poisoned["name"] = config["config"][fqn]["path_name"]
            return json.dumps(config).encode()
        if where == "weight" and name.endswith(f"/{poisoned.get('name')}"):
            return payload.getvalue()
        if where == "sample_inputs" and "/sample_inputs/" in name:
            return payload.getvalue()
        return data

    rewritten_archive(original, tmp_path / "first.pt2", rewrite)  # learns the poisoned weight's file name
    rewritten_archive(original, pt2, rewrite)
    with pytest.raises(ArtifactError, match="could run arbitrary code") as refused:
        fxllm.load(artifact, backend="torch", verify=False)
    assert "\n" not in str(refused.value) and not proof.exists()
