"""A vLLM page layout names its namespace: pages of another layout are never another's
(gateway/vllm_connector/page_layout.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gateway.core.fingerprint import Scope
from gateway.vllm_connector.page_layout import VllmPageLayout

LAYOUT = VllmPageLayout(vllm_version="0.32.0", backend="CPU_ATTN", isa="vec",
                        dtype=torch.float32, block_size=64, num_layers=30, kv_heads=3,
                        head_size=64)
SECRET = b"s" * 32
TENANT_A = Scope.of_tenant("a")


def namespace(layout: VllmPageLayout, scope: Scope = TENANT_A) -> bytes:
    return layout.namespace(deployment_secret=SECRET, model_fingerprint="m",
                            scope=scope).digest


@pytest.mark.parametrize("changed", [
    dataclasses.replace(LAYOUT, vllm_version="0.33.0"),
    dataclasses.replace(LAYOUT, backend="OTHER"), dataclasses.replace(LAYOUT, isa="amx"),
    dataclasses.replace(LAYOUT, dtype=torch.bfloat16),
    dataclasses.replace(LAYOUT, block_size=128)], ids=["version", "backend", "isa", "dtype",
                                                       "block size"])
def test_a_change_of_what_a_pages_bytes_mean_changes_the_namespace(
        changed: VllmPageLayout) -> None:
    assert namespace(changed) != namespace(LAYOUT)


def test_tenants_have_namespaces_of_their_own() -> None:
    assert namespace(LAYOUT, Scope.of_tenant("b")) != namespace(LAYOUT)
    assert namespace(LAYOUT, Scope.shared()) != namespace(LAYOUT)


def test_a_block_holds_one_page_of_every_layer() -> None:
    layout = LAYOUT.kv_layout
    assert (layout.num_layers, layout.kv_heads, layout.head_dim, layout.dtype) == (
        30, 3, 64, torch.float32)


def test_kvgates_block_is_vllms_page() -> None:
    assert LAYOUT.problems(64) == []
    (problem,) = LAYOUT.problems(32)
    assert "block_tokens is 32" in problem and "--block-size" in problem


def test_a_block_size_the_cpu_backend_refuses_is_named() -> None:
    odd = dataclasses.replace(LAYOUT, block_size=48)
    assert any("multiple of 32" in problem for problem in odd.problems(48))
