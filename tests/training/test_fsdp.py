"""FSDP pieces of draft-head training, on CPU: float32 buffers under mixed precision, norm clipping and
the gathered head through torch FSDP itself (two gloo processes), and the module's wiring of both."""

import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from draftheads.training import fsdp
from draftheads.training.fsdp import DecoderLayerFSDP

HERE = Path(__file__).parent


def test_mixed_precision_keeps_buffers_float32():
    plain = FSDPStrategy(precision_plugin=FSDPPrecision("bf16-mixed"))
    assert plain.mixed_precision_config.buffer_dtype == torch.bfloat16  # Lightning's: RoPE tables in bf16
    ours = DecoderLayerFSDP(precision_plugin=FSDPPrecision("bf16-mixed")).mixed_precision_config
    assert ours.param_dtype == torch.bfloat16 and ours.reduce_dtype == torch.bfloat16
    assert ours.buffer_dtype == torch.float32


def test_two_processes_gather_the_full_weights_and_clip_by_the_global_norm(tmp_path):
    sys.path.insert(0, str(HERE))
    from _fsdp_worker import model

    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "_fsdp_worker.py"), str(r), "2", port, str(tmp_path)])
             for r in range(2)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    want = model().state_dict()
    got = ranks[0]["state"]
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(torch.tensor(got[k]), v)  # full, unsharded tensors on rank 0
    assert ranks[1]["state"] == {}  # rank 0 only: the other ranks hold nothing
    full = sum(torch.tensor(s).numel() for s in want.values())
    local = sum(torch.tensor(s).prod().item() for s in ranks[0]["local_shapes"].values() if s)
    assert local < full  # the parameters really were sharded
    # both ranks clip by the norm of the whole averaged gradient, as one process would see it
    ref = model()
    losses = [ref(torch.randn(4, 6, generator=torch.Generator().manual_seed(r))).square().sum() for r in range(2)]
    (sum(losses) / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01).item()
    assert ranks[0]["norm"] == pytest.approx(norm, rel=1e-5) and ranks[1]["norm"] == pytest.approx(norm, rel=1e-5)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_a_bf16_target_and_a_float32_head_are_wrapped_apart(tmp_path):
    """What the layers leave over (embeddings, lm_head, fc) of a bf16 target and a float32 head: in one
    flat parameter FSDP refuses them; the draft-head policy puts them in the target's and the head's units.
    The full state dict then gathers the head's unit alone: the target's never unshards."""
    proc = subprocess.run([sys.executable, str(HERE / "_fsdp_worker.py"), "mixed", _free_port(), str(tmp_path)],
                          timeout=300)
    assert proc.returncode == 0
    seen = json.loads((tmp_path / "mixed.json").read_text())
    assert "uniform dtype" in seen["layers"]["error"]
    assert seen["draft_head"]["grads"] == 4  # the head's two weights and two biases; the target is frozen
    assert seen["draft_head"]["state"] == {"head.0.weight": [5, 6], "head.0.bias": [5], "head.1.weight": [3, 5],
                                           "head.1.bias": [3]}
    assert seen["draft_head"]["target_visits"] == 0


def test_the_strategy_wraps_the_modules_target_and_head(monkeypatch):
    from types import SimpleNamespace as NS

    strategy = DecoderLayerFSDP()
    got = {}
    monkeypatch.setattr(FSDPStrategy, "_setup_model", lambda self, model: got.update(self.kwargs) or model)
    model = NS(target=torch.nn.Linear(2, 2), head=torch.nn.Linear(2, 2))
    strategy._setup_model(model)
    policy = got["auto_wrap_policy"]
    assert policy(model.target, False, 0) and policy(model.head, False, 0)
    assert not policy(torch.nn.Linear(2, 2), False, 0)


class _Recorder:
    def __init__(self):
        self.calls = []

    def clip_grad_norm_(self, max_norm):
        self.calls.append(max_norm)


def _module_with(strategy, is_global_zero=True):
    from draftheads.training.module import DraftHeadModule

    m = DraftHeadModule()
    m._trainer = SimpleNamespace(strategy=strategy, is_global_zero=is_global_zero)
    return m


def test_module_clips_through_the_root_fsdp_module():
    with pytest.raises(MisconfigurationException, match="not supported"):  # what gradient_clip_val hit
        FSDPPrecision("bf16-mixed").clip_grad_by_norm(None, 0.5)
    strategy = DecoderLayerFSDP(precision_plugin=FSDPPrecision("bf16-mixed"))
    strategy._model = _Recorder()
    _module_with(strategy).configure_gradient_clipping(None, 0.5, "norm")
    assert strategy._model.calls == [0.5]


def test_head_is_written_from_the_gathered_state_by_rank_zero_only(tmp_path, monkeypatch, tiny_llama_dir):
    from draftheads.heads import load_head
    from draftheads.training.dflash import DFlashModule

    calls = []
    for rank in (1, 0):
        m = DFlashModule(target=str(tiny_llama_dir), head_dir=str(tmp_path / "head"), target_layer_ids=[1, 3],
                         block_size=4, mask_token_id=0)
        m.configure_model()
        gathered = {f"head.{k}": v + 1.0 if v.is_floating_point() else v for k, v in m.head.state_dict().items()}
        monkeypatch.setattr(fsdp, "full_state_dict", lambda s, g=gathered, r=rank: calls.append(r) or g)
        m._trainer = SimpleNamespace(strategy=DecoderLayerFSDP(), is_global_zero=rank == 0)
        m.on_fit_end()
        assert (tmp_path / "head").exists() == (rank == 0)  # rank 1 gathered but wrote nothing
    assert calls == [1, 0]  # every rank takes part in the gather
    back, _ = load_head(tmp_path / "head")
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, gathered[f"head.{k}"])  # the gathered tensors, not the local ones


def test_target_loads_on_the_rank_device(monkeypatch, tiny_llama_dir):
    """Each rank builds the frozen target on its own device (not the host), so the statistics a head takes
    at build time (EAGLE-3's aux scale) run there too."""
    from draftheads.training import module as module_mod
    from draftheads.training.dflash import DFlashModule

    seen = []
    real = module_mod.load_target
    monkeypatch.setattr(module_mod, "load_target", lambda *a, **k: seen.append(k.get("device")) or real(*a, **k))
    m = DFlashModule(target=str(tiny_llama_dir), target_layer_ids=[1, 3], block_size=4, mask_token_id=0)
    m._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu", 0)), datamodule=None)
    m.configure_model()
    assert seen == [torch.device("cpu", 0)]
