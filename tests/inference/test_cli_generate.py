import json
import subprocess
import sys

import pytest
import torch

from draftheads.cli import main
from draftheads.heads import save_head
from draftheads.testing import random_heads


@pytest.fixture(scope="module")
def eagle3_dir(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "eagle3"
    save_head(random_heads(tiny_target.model)["eagle3"], out)
    return out


def test_generate_with_head_reports_metrics_and_identity(tiny_llama_dir, eagle3_dir, capsys):
    rc = main(["generate", "--target", str(tiny_llama_dir), "--prompt", "What is 12 plus 30?", "--head", str(eagle3_dir),
               "--max-new-tokens", "12", "--tree", "small", "--compare-plain"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("[eagle3, small]") and "tau=" in last and "speedup" in last
    assert "identical to plain" in last


def test_generate_ngram_and_plain(tiny_llama_dir, capsys):
    assert main(["generate", "--target", str(tiny_llama_dir), "--prompt", "hi", "--proposer", "ngram",
                 "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("[ngram, auto]")
    assert main(["generate", "--target", str(tiny_llama_dir), "--prompt", "hi", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("[plain]")


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature -1.0 must be >= 0"),
    (["--top-p", "1.5"], "top_p 1.5 must be in (0, 1]"),
    (["--proposer", "ngram", "--tree", "nonsense.json"], "neither a named tree"),
    (["--proposer", "ngram", "--tree", "small"], "drafts chains"),
    (["--proposer", "ngram", "--tree", "chain100000"], "more than the 128"),
    (["--proposer", "ngram", "--tree", "chain4"], None),
    (["--head", "/nonexistent"], "lacks config.json"),
])
def test_bad_generate_input_is_one_line(tiny_llama_dir, args, message):
    r = subprocess.run([sys.executable, "-m", "draftheads.cli", "generate", "--target", str(tiny_llama_dir),
                        "--prompt", "hi", "--max-new-tokens", "4", *args], capture_output=True, text=True)
    if message is None:
        assert r.returncode == 0
        return
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and message in r.stderr


def test_head_for_another_target_is_rejected(tmp_path, eagle3_dir):
    from draftheads.testing import save_tiny_llama

    other = save_tiny_llama(tmp_path / "wide", hidden_size=96, intermediate_size=128)
    r = subprocess.run([sys.executable, "-m", "draftheads.cli", "generate", "--target", str(other), "--prompt", "hi",
                        "--head", str(eagle3_dir)], capture_output=True, text=True)
    assert r.returncode == 2 and "use a head trained for this target" in r.stderr


def test_malformed_tree_file_for_medusa(tiny_target, tiny_llama_dir, tmp_path):
    med = tmp_path / "medusa"
    save_head(random_heads(tiny_target.model)["medusa"], med)
    bad = tmp_path / "tree.json"
    bad.write_text(json.dumps([[0], "x"]))
    r = subprocess.run([sys.executable, "-m", "draftheads.cli", "generate", "--target", str(tiny_llama_dir), "--prompt",
                        "hi", "--head", str(med), "--tree", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "malformed" in r.stderr


def test_profile_curve_is_kept_per_dtype(tiny_llama_dir, capsys):
    """A bfloat16 curve does not overwrite the float32 one, and each engine is seeded with its own dtype's."""
    from draftheads.inference.build import make_engine
    from draftheads.inference.profile import load_profile
    from draftheads.inference.proposers.ngram import NGramProposer
    from draftheads.targets import load_target

    for dtype in ("float32", "bfloat16"):
        assert main(["profile", "--target", str(tiny_llama_dir), "--dtype", dtype, "--ks", "1,4", "--prefix", "16",
                     "--repeats", "2"]) == 0
        out = capsys.readouterr().out
        assert "| 1 |" in out and "| 4 |" in out and f"-{dtype}.json" in out
    curves = {}
    for dtype in (torch.float32, torch.bfloat16):
        target = load_target(str(tiny_llama_dir), dtype=dtype)
        curves[dtype] = load_profile(target.info.name, target.model)
        assert sorted(curves[dtype]) == [1, 4]
        engine = make_engine(target, NGramProposer(), tree="auto")
        assert engine.policy.curve.points == {k: [ms / 1000, 20.0] for k, ms in curves[dtype].items()}
    assert curves[torch.float32] != curves[torch.bfloat16]
