"""Zero-copy GPU experts (`--gpu-experts arena`): the fused Triton kernels read leased arena
slots in place. Under the Triton interpreter (CI, no GPU) the arena mapping is a CPU tensor; on a
GPU it is the CUDA-registered mapping. Either way streamed == resident raw slots bit for bit,
whatever the arena's size, the read mode (O_DIRECT places each expert's parts differently) or a
prompt's split into tokens."""

from __future__ import annotations

import pytest
import torch

from moestream.common.layout import ModelLayout
from moestream.decoder.experts.bank import ExpertBank
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import forward_step
from moestream.decoder.experts.gpu.zero_copy import open_arena_gpu
from moestream.decoder.kernels.gpu.experts import available
from moestream.decoder.models import load_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPT = [5, 17, 99, 3, 250, 41, 7]
pytestmark = pytest.mark.skipif(not available(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")


def logits(model, backend, one_sequence: bool) -> torch.Tensor:
    """Logits [T, V] of PROMPT, as one forward pass (prefill path) or token by token (decode path)."""
    model, cache = model.with_bank(ExpertBank(backend)), model.new_cache(1, len(PROMPT))
    if one_sequence:
        return forward_step(model, torch.tensor([PROMPT], device=model.device), cache)[0].float().cpu()
    return torch.cat([forward_step(model, torch.tensor([[t]], device=model.device), cache)[0]
                      for t in PROMPT]).float().cpu()


@torch.inference_mode()
@pytest.mark.parametrize("quant, slots, direct", [("Q8_0", 10, False), ("Q4_K", 16, True)])
def test_arena_in_place_equals_resident_raw_slots(make_tiny_model, start_daemon, quant, slots, direct):
    path = make_tiny_model(arch="qwen3moe", quant=quant)
    layout = ModelLayout(path)
    model = load_model(layout, DEVICE, torch.float32)
    resident = ResidentExperts(layout, DEVICE, torch.float32, "raw", kernels=True)
    daemon = start_daemon(path, arena_slots=slots, extra_args=["--direct" if direct else "--no-direct"])
    with open_arena_gpu(layout, daemon.endpoint, DEVICE, keep=8) as src:  # a layer's 8 experts, of 16
        for one_sequence in (False, True):
            assert torch.equal(logits(model, src, one_sequence), logits(model, resident, one_sequence))
        st = src.stats()
    assert st.held <= 8 and st.released > 0 and st.held_hits > 0  # leases kept across tokens, bounded
    assert st.demand > 0


@torch.inference_mode()
def test_a_layer_wider_than_the_leases_kept_is_a_clear_error(make_tiny_model, start_daemon):
    from moestream.common.client import IodUnavailable

    path = make_tiny_model(arch="qwen3moe", quant="Q8_0")
    layout = ModelLayout(path)
    model = load_model(layout, DEVICE, torch.float32)
    daemon = start_daemon(path, arena_slots=8)
    with open_arena_gpu(layout, daemon.endpoint, DEVICE, keep=3) as src:
        with pytest.raises(IodUnavailable, match="routes to .* experts, more than the 3 leases"):
            logits(model, src, one_sequence=True)


def test_gpu_experts_arena_is_checked(tiny_model):
    from moestream.decoder.config import ConfigError, DecoderConfig

    with pytest.raises(ConfigError, match="on a CPU the arena is always read in place"):
        DecoderConfig(model=str(tiny_model), iod="ipc:///x", prompts=["a"], device="cpu", gpu_experts="arena")
    with pytest.raises(ConfigError, match="gpu_experts must be one of slots, arena"):
        DecoderConfig(model=str(tiny_model), iod="ipc:///x", prompts=["a"], gpu_experts="device")
