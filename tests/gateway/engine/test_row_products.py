"""The forward's row products: oneDNN with every row of a step in one product (decode rows too),
BLAS with decode rows alone, and the choice between them.

The oneDNN tests run the real kernel on this CPU; where this torch has none they skip (the
engine then takes BLAS, which the rest of the suite also covers with ``linear_kernel="blas"``).
"""

from __future__ import annotations

import pytest
import torch

from gateway.engine.attention_choice import attention_for
from gateway.engine.engine import EngineConfig
from gateway.engine.forward import BatchedForward, SequenceRows, projection_weights
from gateway.engine.kv_sequence import KVSequence
from gateway.engine.model import LoadedModel, load_model
from gateway.engine.row_padding import sampled_counts
from gateway.engine.row_products import (
    BLAS_CPU_PRODUCTS,
    ONEDNN_ROW_PADDING,
    RowProducts,
    candidate_row_products,
    onednn_problem,
)
from tests.tiny_llama import VOCAB, save_tiny_llama

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(onednn_problem(CPU) is not None,
                                  reason=f"no oneDNN here: {onednn_problem(CPU)}")
ONEDNN = RowProducts(kernel="onednn", padding=ONEDNN_ROW_PADDING, shares_decode_rows=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def _candidates(tiny: LoadedModel, kernel: str = "auto") -> list[RowProducts]:
    return candidate_row_products(CPU, projection_weights(tiny.model),
                                  tiny.model.lm_head.weight, max_rows=1024, max_logit_rows=16,
                                  kernel=kernel)  # type: ignore[arg-type]


def test_onednn_pads_one_or_two_rows_to_two_and_more_to_a_multiple_of_eight() -> None:
    assert [ONEDNN_ROW_PADDING.rows_for(n) for n in (0, 1, 2, 3, 8, 9, 1000)] == \
        [0, 2, 2, 8, 8, 16, 1000]
    assert ONEDNN.label == "dnnl-r2x8"
    assert BLAS_CPU_PRODUCTS.label == ""  # the CPU namespaces made before oneDNN


@needs_onednn
@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536)])
def test_a_onednn_row_keeps_its_bits_for_every_row_count_from_two(shape) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(*shape, generator=generator)
    rows = torch.randn(200, shape[1], generator=generator)
    every = ONEDNN.product(rows, weight, None)
    for count in range(2, 200):
        assert torch.equal(ONEDNN.product(rows[:count], weight, None), every[:count]), count


def test_sampled_counts_keep_the_small_ones_and_the_largest() -> None:
    counts = sampled_counts(2, 1024, 8)
    assert counts[:3] == [2, 8, 16] and counts[-1] == 1024
    assert all(c % 8 == 0 for c in counts[1:]) and counts == sorted(set(counts))
    assert len(counts) < 40  # not all 129


@needs_onednn
def test_on_a_cpu_onednn_comes_first_and_blas_after(tiny: LoadedModel) -> None:
    assert _candidates(tiny) == [ONEDNN, BLAS_CPU_PRODUCTS]
    assert _candidates(tiny, "blas") == [BLAS_CPU_PRODUCTS]


def test_an_unknown_linear_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="linear_kernel"):
        EngineConfig(linear_kernel="mkl")  # type: ignore[arg-type]


@needs_onednn
def test_with_onednn_a_decoded_token_writes_the_k_v_a_prefill_writes(tiny: LoadedModel) -> None:
    forward = BatchedForward(tiny.model, attention_for(CPU, decode_as_prefill=True), ONEDNN)
    tokens = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(5))
    prefilled = KVSequence(tiny.layout, 80)
    forward.forward([SequenceRows(sequence=prefilled, tokens=tokens, wants_logits=False)])
    decoded = KVSequence(tiny.layout, 80)
    forward.forward([SequenceRows(sequence=decoded, tokens=tokens[:66], wants_logits=False)])
    other = KVSequence(tiny.layout, 80)
    for at in range(66, 70):  # each decode row beside another sequence's prefill chunk
        forward.forward([
            SequenceRows(sequence=other, tokens=tokens[at - 66:at - 63], wants_logits=True),
            SequenceRows(sequence=decoded, tokens=tokens[at:at + 1], wants_logits=True,
                         is_decode=True)])
    for layer in range(tiny.layout.num_layers):
        assert torch.equal(decoded.keys(layer), prefilled.keys(layer))
        assert torch.equal(decoded.values(layer), prefilled.values(layer))

