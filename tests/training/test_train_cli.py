import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftheads.testing import save_tiny_llama
from draftheads.training.cli import main
from draftheads.training.datamodule import ChatDataModule

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    save_tiny_llama(d / "tiny")
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} plus {i + 1}?"},
                      {"role": "assistant", "content": f"The answer is {2 * i + 1}. The quick brown fox."}]}
        for i in range(24)
    ]
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _config(workdir, run: str, model: str, epochs: int, extra_model=None, **trainer):
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_epochs": epochs, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False,
            "default_root_dir": str(workdir / run),
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(workdir / run / "ckpt"), "save_last": True,
                                         "every_n_epochs": 1, "save_top_k": -1}},
                          {"class_path": "draftheads.walked.WalkedTau", "init_args": {"modes": ["chain3"]}}],
            **trainer,
        },
        "model": {"class_path": f"draftheads.training.{model}",
                  "init_args": {"target": str(workdir / "tiny"), "lr": 3e-3, "head_dir": str(workdir / run / "head"),
                                **(extra_model or {})}},
        "data": {"train_files": [str(workdir / "data.jsonl")], "max_length": 96, "batch_size": 4,
                 "val_fraction": 0.2},
    }
    path = workdir / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _weights(workdir, run):
    return load_file(str(workdir / run / "head" / "model.safetensors"))


@pytest.mark.parametrize("model,extra", [
    ("EagleModule", {"feature_noise": 0.2}),
    ("Eagle3Module", {"ttt_steps": 2, "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 384, "loss_impl": "compiled"}),
    ("MedusaModule", {"num_heads": 2, "draft_vocab_size": 40}),
    ("DFlashModule", {"block_size": 4, "anchors_per_row": 6, "num_layers": 2, "target_layer_ids": [1, 3]}),
    ("DSparkModule", {"block_size": 4, "anchors_per_row": 6, "target_layer_ids": [1, 3], "markov_rank": 8,
                      "loss_impl": "compiled"}),
])
def test_interrupted_and_resumed_equals_uninterrupted(workdir, model, extra):
    full = _config(workdir, f"full-{model}", model, 2, extra)
    assert main(["fit", "--config", str(full)]) == 0
    part = _config(workdir, f"part-{model}", model, 2, extra)
    stop = '{"class_path": "_interrupt.StopAfterEpoch", "init_args": {"epoch": 0}}'
    assert main(["fit", "--config", str(part), "--trainer.callbacks+=" + stop]) == 0
    ckpt = torch.load(workdir / f"part-{model}" / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["epoch"] == 0  # interrupted after the first of two epochs
    assert main(["fit", "--config", str(part), "--ckpt_path", "last"]) == 0
    a, b = _weights(workdir, f"full-{model}"), _weights(workdir, f"part-{model}")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    # checkpoints hold only the head and the optimizer, not the target
    ckpt = torch.load(workdir / f"part-{model}" / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["state_dict"] and all(k.startswith("head.") for k in ckpt["state_dict"])
    assert ckpt["optimizer_states"]
    meta = json.loads((workdir / f"part-{model}" / "head" / "config.json").read_text())
    assert len(meta["val_accuracies"]) >= 1
    assert meta["val_answer_window"] == 128  # the default: accuracies over each answer's first 128 tokens too
    assert len(meta["val_window_accuracies"]) == len(meta["val_accuracies"])
    # the default walked mode, chain3: the engine's drafting replayed along validation answers
    assert set(meta["val_walk_tau"]) == {"chain3"} and 1.0 <= meta["val_walk_tau"]["chain3"] <= 4.0


def test_resumed_mid_epoch_goes_on_with_the_rows_it_had_not_reached(workdir):
    extra = {"ttt_steps": 2, "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 384}
    data = {"packed": False, "batch_size": 1}  # one conversation per step: many steps per epoch
    every = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"save_last": True, "every_n_train_steps": 5}}

    def config(run):
        path = _config(workdir, run, "Eagle3Module", 2, extra)
        cfg = yaml.safe_load(path.read_text())
        cfg["data"].update(data)
        every["init_args"]["dirpath"] = str(workdir / run / "ckpt")
        cfg["trainer"]["callbacks"] = [every]
        path.write_text(yaml.safe_dump(cfg))
        return path

    assert main(["fit", "--config", str(config("mid-full"))]) == 0
    part = config("mid-part")
    stop = '{"class_path": "_interrupt.StopAfterStep", "init_args": {"step": 5}}'
    assert main(["fit", "--config", str(part), "--trainer.callbacks+=" + stop]) == 0
    ckpt = torch.load(workdir / "mid-part" / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 5 and ckpt["epoch"] == 0
    assert ckpt["ChatDataModule"] == {"epoch": 0, "batches": 5}
    dm = ChatDataModule(train_files=[str(workdir / "data.jsonl")], target=str(workdir / "tiny"), max_length=96,
                        val_fraction=0.2, **data)
    dm.setup()
    assert len(dm.train_set) > 5  # so the stop fell inside the first epoch
    assert main(["fit", "--config", str(part), "--ckpt_path", "last"]) == 0
    a, b = _weights(workdir, "mid-full"), _weights(workdir, "mid-part")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_init_head_goes_on_from_a_trained_head(workdir):
    from draftheads.errors import DraftheadsError
    from draftheads.training import Eagle3Module, MedusaModule

    # the whole vocabulary: the random target's argmax tokens are mostly outside one built from the data
    extra = {"ttt_steps": 2, "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 384}
    assert main(["fit", "--config", str(_config(workdir, "init-src", "Eagle3Module", 1, extra))]) == 0
    src = workdir / "init-src" / "head"
    trained = load_file(str(src / "model.safetensors"))
    module = Eagle3Module(target=str(workdir / "tiny"), init_head=str(src), freeze_lm_head=True, **extra)
    module.configure_model()
    state = module.head.state_dict()
    assert state.keys() == trained.keys()
    for k, v in trained.items():
        assert torch.equal(state[k], v.float()), k
    assert not module.head.lm_head.weight.requires_grad
    with pytest.raises(DraftheadsError, match="model.init_head .* is a eagle3 head but this module trains medusa"):
        MedusaModule(target=str(workdir / "tiny"), init_head=str(src)).configure_model()
    # a fit from it trains on and writes a head of the same shape and vocabulary
    cfg = _config(workdir, "init-more", "Eagle3Module", 1, {**extra, "init_head": str(src)})
    assert main(["fit", "--config", str(cfg)]) == 0
    more = _weights(workdir, "init-more")
    assert more.keys() == trained.keys() and torch.equal(more["d2t"], trained["d2t"])
    # the vocabulary's coverage, measured when the first head built it, is carried over with it
    src_meta = json.loads((src / "config.json").read_text())
    more_meta = json.loads((workdir / "init-more" / "head" / "config.json").read_text())
    assert src_meta["draft_vocab_coverage"] and more_meta["draft_vocab_coverage"] == src_meta["draft_vocab_coverage"]
    assert not torch.equal(more["fc.weight"], trained["fc.weight"])


def _trained_eagle3(workdir):
    """(the model options, the head) of a small EAGLE-3 head trained one epoch, to start other fits from."""
    extra = {"ttt_steps": 2, "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 384}
    src = workdir / "wide-src" / "head"
    if not src.exists():
        assert main(["fit", "--config", str(_config(workdir, "wide-src", "Eagle3Module", 1, extra))]) == 0
    return extra, src


def _assert_same_function(head, start):
    """``head`` drafts what ``start`` (the head it grew from) drafts, on random inputs."""
    h = start.config.hidden_size
    aux, emb = torch.randn(1, 5, 3 * h), torch.randn(1, 5, h)
    pos = torch.arange(5)[None]
    start = start.float()
    torch.testing.assert_close(head.normed(head(emb, head.fuse(aux), pos)[0]),
                               start.normed(start(emb, start.fuse(aux), pos)[0]))


def test_init_head_widened_starts_as_that_head_and_saves_its_width(workdir):
    from draftheads.errors import DraftheadsError
    from draftheads.heads import load_head
    from draftheads.training import Eagle3Module

    extra, src = _trained_eagle3(workdir)
    narrow, _ = load_head(src)
    width = narrow.config.layer.intermediate_size
    module = Eagle3Module(target=str(workdir / "tiny"), init_head=str(src), intermediate_size=2 * width, **extra)
    module.configure_model()
    wide = module.head
    assert wide.config.layer.intermediate_size == 2 * width
    assert wide.layers[0].mlp.down_proj.weight.shape[1] == 2 * width
    _assert_same_function(wide, narrow)
    with pytest.raises(DraftheadsError, match="model.intermediate_size=.* is below the init_head's"):
        Eagle3Module(target=str(workdir / "tiny"), init_head=str(src), intermediate_size=width // 2,
                     **extra).configure_model()
    # a fit from it writes the wider head, which loads with its own width
    cfg = _config(workdir, "wide-more", "Eagle3Module", 1, {**extra, "init_head": str(src),
                                                            "intermediate_size": 2 * width})
    assert main(["fit", "--config", str(cfg)]) == 0
    more, _ = load_head(workdir / "wide-more" / "head")
    assert more.config.layer.intermediate_size == 2 * width
    assert more.layers[0].mlp.gate_proj.weight.shape == (2 * width, narrow.config.hidden_size)


def test_two_process_ddp_ends_with_equal_weights(workdir):
    extra = {"ttt_steps": 2, "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 384}  # the whole vocabulary
    cfg = _config(workdir, "ddp", "Eagle3Module", 1, extra)
    data = yaml.safe_load(cfg.read_text())
    data["trainer"]["callbacks"][0]["init_args"].update({"save_last": False, "save_top_k": 1})
    data["trainer"]["callbacks"].append({"class_path": "draftheads.training.callbacks.WeightDigest",
                                         "init_args": {"out_dir": str(workdir / "ddp" / "digests")}})
    cfg.write_text(yaml.safe_dump(data))
    r = subprocess.run(
        [sys.executable, "-m", "draftheads.training.cli", "fit", "--config", str(cfg),
         "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"],
        capture_output=True, text=True, cwd=workdir, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    digests = [(workdir / "ddp" / "digests" / f"digest-rank{i}.txt").read_text() for i in (0, 1)]
    assert digests[0] == digests[1]
    assert len(list((workdir / "ddp" / "ckpt").glob("*.ckpt"))) == 1
    assert (workdir / "ddp" / "head" / "model.safetensors").is_file()


def test_unknown_config_key_names_the_key(workdir, capsys):
    cfg = _config(workdir, "bad", "Eagle3Module", 1, {"not_a_knob": 3})
    assert main(["fit", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not_a_knob" in err[0], err


def test_unknown_loss_impl_names_the_choices(workdir, capsys):
    cfg = _config(workdir, "bad-impl", "Eagle3Module", 1, {"loss_impl": "fast"})
    assert main(["fit", "--config", str(cfg)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.loss_impl='fast'") and "compiled" in err[0], err


def test_compiled_loss_without_a_compiler_says_so(workdir, capsys, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    cfg = _config(workdir, "no-cxx", "Eagle3Module", 1, {"loss_impl": "compiled"})
    assert main(["fit", "--config", str(cfg)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.loss_impl=compiled needs a C++ compiler"), err


def test_nan_loss_stops_with_step_and_checkpoint(workdir, tmp_path, capsys):
    bad = save_tiny_llama(tmp_path / "nan-target")
    w = load_file(str(bad / "model.safetensors"))
    w["model.norm.weight"][:] = float("nan")
    from safetensors.torch import save_file

    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    cfg = _config(workdir, "nan", "EagleModule", 1)
    data = yaml.safe_load(cfg.read_text())
    data["model"]["init_args"]["target"] = str(bad)
    cfg.write_text(yaml.safe_dump(data))
    assert main(["fit", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: training loss is nan at step 0") and "last good checkpoint" in err


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_parses_and_names_its_command(path, capsys, monkeypatch):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# train-head fit --config configs/" + path.name), first
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(path.relative_to(ROOT)), "--print_config"])
    assert e.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"].startswith("draftheads.training.")
    assert printed["model"]["init_args"]["head_dir"].startswith("runs/")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_config_under_moves_every_output_path(path, tmp_path):
    """What the scripts train writes (trainer root, loggers, checkpoints, head) lands under the run
    directory given, and the features are read from the one given: no output path of the shipped config
    is left."""
    from draftheads.training.cli import config_under

    cfg = config_under(path, tmp_path / "run", tmp_path / "features", trainer={"max_epochs": 1})
    assert "runs/" not in yaml.safe_dump({k: cfg[k] for k in ("trainer", "model")})
    assert cfg["model"]["init_args"]["head_dir"] == str(tmp_path / "run/head")
    assert cfg["data"]["feature_dir"] == str(tmp_path / "features") and cfg["trainer"]["max_epochs"] == 1


def test_the_head_norm_starts_at_ones_or_at_the_targets_final_norm(workdir):
    from draftheads.errors import DraftheadsError
    from draftheads.targets import decoder_parts, freeze, load_target
    from draftheads.training import Eagle3Module

    dm = ChatDataModule(train_files=[str(workdir / "data.jsonl")], target=str(workdir / "tiny"), max_length=96,
                        val_fraction=0.2, batch_size=4)
    loaded = load_target(str(workdir / "tiny"))
    norm = decoder_parts(loaded.model)[2].weight
    with torch.no_grad():
        norm.copy_(torch.linspace(0.5, 1.5, norm.numel()))  # a trained target's norm is not all ones
    for how, want in (("ones", torch.ones_like(norm)), ("target", norm)):
        module = Eagle3Module(target=str(workdir / "tiny"), ttt_steps=2, aux_layer_ids=[1, 2, 3],
                              draft_vocab_size=384, norm_init=how)
        module.target, module.info = freeze(loaded.model), loaded.info
        head = module.build_head(loaded.info, dm)
        torch.testing.assert_close(head.norm.weight.detach(), want.detach())
    with pytest.raises(DraftheadsError, match="model.norm_init='zeros': use one of ones, target"):
        Eagle3Module(target=str(workdir / "tiny"), norm_init="zeros")


def test_training_scores_only_the_answer_window_it_is_given(workdir, monkeypatch):
    from draftheads.training import Eagle3Module
    from draftheads.training.data import answer_window

    seen = []

    def loss(self, batch):
        seen.append(batch["loss_mask"].clone())
        return torch.zeros((), requires_grad=True), {}, []

    monkeypatch.setattr(Eagle3Module, "compute_loss", loss)
    monkeypatch.setattr(Eagle3Module, "log", lambda *a, **k: None)
    monkeypatch.setattr(Eagle3Module, "lr_schedulers", lambda self: None)
    dm = ChatDataModule(train_files=[str(workdir / "data.jsonl")], target=str(workdir / "tiny"), max_length=96,
                        val_fraction=0.2, batch_size=4)
    dm.setup()
    batch = dm._collate([dm.train_set[i] for i in range(4)])
    for n in (0, 3):
        Eagle3Module(target=str(workdir / "tiny"), train_answer_window=n).training_step(batch, 0)
    full, window = seen
    assert torch.equal(full, batch["loss_mask"])
    assert torch.equal(window, answer_window(batch["loss_mask"], batch["doc_ids"], 3))
    assert 0 < window.sum() < full.sum()


def test_init_head_deepened_starts_as_that_head_and_trains_every_layer(workdir):
    from draftheads.errors import DraftheadsError
    from draftheads.export.vllm import export_head
    from draftheads.heads import load_head, save_head
    from draftheads.training import Eagle3Module

    extra, src = _trained_eagle3(workdir)
    shallow, _ = load_head(src)
    module = Eagle3Module(target=str(workdir / "tiny"), init_head=str(src), num_layers=2, **extra)
    module.configure_model()
    deep = module.head
    assert len(deep.layers) == 2 and deep.config.num_layers == 2
    _assert_same_function(deep, shallow)
    save_head(deep, workdir / "deep-saved")
    with pytest.raises(DraftheadsError, match="model.num_layers=1 is below the init_head's 2"):
        Eagle3Module(target=str(workdir / "tiny"), init_head=str(workdir / "deep-saved"), num_layers=1,
                     **extra).configure_model()
    cfg = _config(workdir, "deep-more", "Eagle3Module", 1, {**extra, "init_head": str(src), "num_layers": 2})
    assert main(["fit", "--config", str(cfg)]) == 0
    more, _ = load_head(workdir / "deep-more" / "head")
    assert more.config.num_layers == 2 and more.layers[1].self_attn.o_proj.weight.abs().sum() > 0  # it trained
    out, _ = export_head(more, "vllm-eagle3", workdir / "deep-export", verifier="t")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2

