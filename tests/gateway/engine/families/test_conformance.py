"""The conformance suite every registered model family runs (issue 43).

For each family in ``gateway.engine.models.families.FAMILIES``, a tiny random checkpoint of it
(``checkpoints.BUILDERS``) is loaded as ``kvgate serve`` loads one, and:

- its family describes it and the start-up probe chooses the batched route (asserted);
- its logits at every position of a prompt agree with transformers' own model on the same
  checkpoint within ``LOGIT_TOLERANCE``;
- its greedy tokens equal transformers' ``generate`` up to the first near-tie of the top two
  logits;
- a warm answer equals the cold one bit for bit, tokens and K/V, from the device tier and from
  the host tier, alone and beside other requests in odd step sizes.

Each checkpoint runs on the CPU in float32 and, marked ``gpu``, on CUDA in bfloat16 (the dtype
``kvgate serve`` computes in there): the Triton kernel, its windows and scales, the experts'
products on the GPU. Agreement with transformers is checked on the CPU only -- in bfloat16 two
correct kernels differ by more than any useful tolerance -- and exactness on both.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
import torch

from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams, TokenDelta
from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.engine import Engine
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.families import FAMILIES
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.families.checkpoints import BUILDERS, VARIANTS
from tests.gateway.engine.kernels import ROWWISE
from tests.gateway.engine.parity import (
    ALICE,
    BLOCK,
    SECRET,
    assert_served_equals_cold,
    cache_config,
    engine_forward,
    evict_once_released,
    load_tiny_as_served,
    make_engine,
    model_device,
    run,
)

FAMILY_NAMES = [family.name for family in FAMILIES]
CHECKPOINTS = {**BUILDERS, **VARIANTS}
LOGIT_TOLERANCE = 1e-4
"""float32, 3 layers: how far our walk's logits may be from transformers' (other kernels, the
same arithmetic). Greedy tokens are compared only where the top two are further apart."""
BFLOAT16_TOLERANCE = 0.1
"""bfloat16, 3 layers: how far our last logits may be from transformers' in bfloat16, as a share
of their largest (2026-11-28, every checkpoint here: 0.7-4.5%)."""
GREEDY_TOKENS = 24
SYSTEM = [(5 * i + 3) % 400 for i in range(70)]


def test_every_registered_family_has_a_tiny_checkpoint() -> None:
    assert set(BUILDERS) == set(FAMILY_NAMES)


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(scope="module", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def loaded(request: pytest.FixtureRequest, device: str,
           tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    name = request.param
    return load_tiny_as_served(str(CHECKPOINTS[name](tmp_path_factory.mktemp(name) / "model")),
                               device)


def _on_the_cpu_only(loaded: LoadedModel) -> None:
    if model_device(loaded).type != "cpu":
        pytest.skip("agreement with transformers is checked in float32 on the CPU")


@pytest.fixture(scope="module")
def served(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Engine, OpenedCache]]:
    """An engine with the machine's own search over device and host tiers, odd step sizes."""
    root = tmp_path_factory.mktemp("tiers")
    opened = open_cache(cache_config(root, disk_bytes=0, disk_path=None), layout=loaded.layout,
                        deployment_secret=SECRET, device=model_device(loaded))
    engine = make_engine(loaded, opened, step_tokens=37, prefill_step_tokens=37)
    yield engine, opened
    engine.stop(grace_s=5)
    opened.close()


def _prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return SYSTEM + [rng.randrange(400) for _ in range(num_tokens)]


def test_the_family_describes_it_and_the_probe_chooses_the_batched_route(
        loaded: LoadedModel, served: tuple[Engine, OpenedCache]) -> None:
    assert loaded.features is not None and loaded.batched_problem is None
    assert loaded.features.family in FAMILY_NAMES
    engine, _ = served
    assert engine.route.name == "batched", engine.route.reason


def test_logits_agree_with_transformers_at_every_position(loaded: LoadedModel) -> None:
    _on_the_cpu_only(loaded)
    tokens = torch.tensor(_prompt(1, 90))
    forward = engine_forward(loaded, torch.device("cpu"))
    sequence = KVSequence.alone(loaded.layout, len(tokens))
    ours = []
    for position in range(len(tokens)):  # each position's logits, one token a step
        logits = forward.forward([SequenceRows(sequence=sequence,
                                               tokens=tokens[position:position + 1],
                                               wants_logits=True)])[0]
        assert logits is not None
        ours.append(logits)
    with torch.inference_mode():
        theirs = loaded.transformers_model()(tokens.reshape(1, -1)).logits[0].float()
    difference = (torch.stack(ours) - theirs).abs().max().item()
    assert difference <= LOGIT_TOLERANCE


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_forward_computes_in_bfloat16_as_on_cuda(
        name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every part of the layer returns the dtype it was given (OLMo 2's rotary tables are
    float32 and once turned its bfloat16 heads into float32 ones), so K/V are stored in
    bfloat16 and the logits are transformers' own, here on the CPU as on CUDA."""
    path = CHECKPOINTS[name](tmp_path_factory.mktemp(name) / "model")
    loaded = load_model(str(path), dtype=torch.bfloat16)
    forward = BatchedForward(loaded.model, TiledAttention(), ROWWISE, loaded.features)
    tokens = torch.tensor(_prompt(5, 20))
    sequence = KVSequence.alone(loaded.layout, len(tokens))
    ours = forward.forward([SequenceRows(sequence=sequence, tokens=tokens, wants_logits=True)])[0]
    assert ours is not None
    assert sequence.block(0, BLOCK).keys[0].dtype == torch.bfloat16
    with torch.inference_mode():
        theirs = loaded.transformers_model()(tokens.reshape(1, -1)).logits[0, -1].float()
    difference = (ours.float() - theirs).abs().max().item()
    assert difference <= BFLOAT16_TOLERANCE * theirs.abs().max().item()


def test_a_sequence_alone_has_the_bits_it_has_beside_eight_others(loaded: LoadedModel) -> None:
    """Prefill and a decode step, alone and in one step with eight other sequences (every
    row-wise part of the layer, experts' routing and products included, keeps a row's bits)."""
    forward = engine_forward(loaded, model_device(loaded))
    mine = torch.tensor(_prompt(7, 30))

    def run_steps(others: int) -> list[torch.Tensor]:
        rng = random.Random(others)
        sequences = [KVSequence.alone(loaded.layout, 256, device=model_device(loaded))
                     for _ in range(others + 1)]
        prompts = [mine] + [torch.tensor(_prompt(100 + i, rng.randrange(3, 90)))
                            for i in range(others)]
        first = forward.forward([SequenceRows(sequence=s, tokens=p, wants_logits=True)
                                 for s, p in zip(sequences, prompts, strict=True)])
        assert first[0] is not None
        token = first[0].argmax().reshape(1)
        second = forward.forward([SequenceRows(sequence=sequences[0], tokens=token,
                                               wants_logits=True, is_decode=True)]
                                 + [SequenceRows(sequence=s, tokens=p[-1:], wants_logits=True,
                                                 is_decode=True)
                                    for s, p in zip(sequences[1:], prompts[1:], strict=True)])
        assert second[0] is not None
        return [first[0], second[0]]

    alone, beside = run_steps(0), run_steps(8)
    assert all(torch.equal(a, b) for a, b in zip(alone, beside, strict=True))


def test_greedy_tokens_equal_transformers_generate_until_a_near_tie(
        loaded: LoadedModel, served: tuple[Engine, OpenedCache]) -> None:
    _on_the_cpu_only(loaded)
    engine, _ = served
    prompt = _prompt(2, 20)
    ours, _, _ = run(engine, PromptInput(token_ids=prompt), no_cache=True,
                     max_tokens=GREEDY_TOKENS)
    model = loaded.transformers_model()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=list(loaded.eos_token_ids), pad_token_id=0)
    theirs = out.sequences[0, len(prompt):].tolist()
    compared = 0
    for step, (mine, their) in enumerate(zip(ours, theirs, strict=False)):
        top2 = out.scores[step][0].float().topk(2).values
        if (top2[0] - top2[1]).item() < LOGIT_TOLERANCE:
            break  # a near-tie: either token is the model's answer
        assert mine == their, f"token {step}: {mine} != {their}"
        compared += 1
    else:
        assert len(ours) == len(theirs)
    assert compared >= 1


def test_a_warm_answer_from_the_device_tier_equals_the_cold_one(
        loaded: LoadedModel, served: tuple[Engine, OpenedCache],
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine, opened = served
    prompt = PromptInput(token_ids=_prompt(3, 41))
    cold = run(engine, prompt, no_cache=True)[:2]
    assert run(engine, prompt)[:2] == cold
    assert_served_equals_cold(loaded, engine, opened, monkeypatch, prompt, cold, "device")


def test_a_warm_answer_from_the_host_tier_equals_the_cold_one(
        loaded: LoadedModel, served: tuple[Engine, OpenedCache],
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine, opened = served
    prompt = PromptInput(token_ids=_prompt(4, 29))
    cold = run(engine, prompt, no_cache=True)[:2]
    assert run(engine, prompt)[:2] == cold
    evict_once_released(opened, "device")
    assert_served_equals_cold(loaded, engine, opened, monkeypatch, prompt, cold, "host")


def test_warm_answers_beside_other_requests_equal_their_cold_ones(
        served: tuple[Engine, OpenedCache]) -> None:
    engine, _ = served
    prompts = [_prompt(10 + i, 5 + 13 * i) for i in range(5)]
    cold = _concurrently(engine, prompts, no_cache=True)
    first = _concurrently(engine, prompts)
    warm = _concurrently(engine, prompts)
    assert first == cold and warm == cold


def _concurrently(engine: Engine, prompts: list[list[int]], *,
                  no_cache: bool = False) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        try:
            barrier.wait()
            handle = engine.generate(GenerateRequest(
                prompt=PromptInput(token_ids=prompts[i]), scope=ALICE,
                sampling=SamplingParams(max_tokens=9), cache=CacheOptions(no_cache=no_cache)))
            for event in handle:
                if isinstance(event, TokenDelta):
                    results[i].extend(event.token_ids)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return results
