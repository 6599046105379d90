"""A new head family is one record plus its own files: registered from outside the package, a toy family
trains with train-head, drafts in the engine (greedy text unchanged), exports and imports, with no edit
elsewhere."""

import json

import pytest
import torch
import yaml
from _toy_family import register_toy_family

from draftheads.export import vllm
from draftheads.export.contract import TargetShape, check_contract
from draftheads.export.vllm import export_head
from draftheads.heads import load_head
from draftheads.inference.build import make_engine, make_proposer
from draftheads.inference.sampling import SamplingParams
from draftheads.targets import load_target
from draftheads.testing import save_tiny_llama
from draftheads.training.cli import main


@pytest.fixture
def toy_family(monkeypatch):
    """The toy family registered for one test, the registries as they were afterwards."""
    from draftheads import heads
    from draftheads.export import vllm
    from draftheads.inference import proposers
    from draftheads.inference.proposers import registry

    proposers.proposer_for("medusa")  # the built-in ones registered first, so that the copy holds them
    from draftheads.export import imports

    for module, name in ((heads, "FAMILIES"), (vllm, "EXPORTS"), (registry, "PROPOSERS"), (imports, "SOURCES")):
        monkeypatch.setattr(module, name, dict(getattr(module, name)))
    monkeypatch.setattr(vllm, "FORMATS", vllm.EXPORTS)
    register_toy_family()


def test_a_family_registered_from_outside_trains_drafts_and_exports(tmp_path, toy_family):
    tiny = save_tiny_llama(tmp_path / "tiny")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i + 1}?"},
                          {"role": "assistant", "content": f"The answer is {2 * i + 1}. The quick brown fox."}]}
            for i in range(16)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 1, "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "default_root_dir": str(tmp_path / "run"), "callbacks": []},
        "model": {"class_path": "_toy_family.ToyModule",
                  "init_args": {"target": str(tiny), "num_heads": 2, "lr": 3e-3, "head_dir": str(tmp_path / "head")}},
        "data": {"train_files": [str(tmp_path / "data.jsonl")], "max_length": 64, "batch_size": 4, "val_fraction": 0.25},
    }))
    assert main(["fit", "--config", str(config)]) == 0
    head, meta = load_head(tmp_path / "head")
    assert meta["head_type"] == "toy" and type(head).__name__ == "ToyHeads"

    target = load_target(str(tiny))
    proposer = make_proposer(target, str(tmp_path / "head"))
    assert type(proposer).__name__ == "ToyProposer"
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    params = SamplingParams(max_new_tokens=16, stop_at_eos=False)
    want = target.model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    out = make_engine(target, proposer, "chain2").generate([prompt], params)[0]
    assert out.token_ids == want and out.metrics.drafts > 0

    path, _ = export_head(head, "toy-medusa", tmp_path / "export", k=2, target=target)
    check_contract(path, vllm.EXPORTS["toy-medusa"], TargetShape.of(target.model), k=2, head_config=head.config)
    assert json.loads((path / "config.json").read_text())["num_heads"] == 2
    # and its public checkpoints import (here: the export just written, read back)
    from draftheads.export.imports import import_checkpoint

    back = import_checkpoint("toy", path, tmp_path / "imported")
    assert type(back).__name__ == "ToyHeads" and load_head(tmp_path / "imported")[1]["head_type"] == "toy"
