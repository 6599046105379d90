from draftheads.export import serve_check


def _script():
    return serve_check


def _row(vllm_tau, our_tau, identical=True):
    return {"head": "draftheads/data/heads/smollm2-135m-eagle3", "vllm_tau": vllm_tau, "our_tau": our_tau,
            "identical_output": identical, "vllm_per_position": [0.5, 0.26, 0.16], "our_per_position": [0.5, 0.26, 0.16],
            "vllm_tok_s_plain": 18.9, "vllm_tok_s_spec": 28.1, "our_tok_s_plain": 28.5, "our_tok_s_spec": 31.7,
            "our_best_tree": "chain3"}


def test_the_check_fails_on_a_tau_gap_beyond_the_tolerance_or_different_text():
    mod = _script()
    res = {"formats": {"same": _row(1.915, 1.915), "close": _row(2.0, 2.09), "far": _row(2.0, 2.11),
                       "text": _row(1.5, 1.5, identical=False), "crashed": {"head": "h", "error": "boom"}}}
    assert mod.failures(res) == ["far", "text", "crashed"]


def test_the_table_names_the_head_each_format_was_checked_with():
    mod = _script()
    res = {"command": "draftheads serve-check", "date": "d", "machine": {"platform": "p", "cpu_count": 2},
           "vllm_version": "0.32.0", "k": 3, "prompts": ["a"], "max_tokens": 8, "plain_outputs_equal_across_engines": "1/1",
           "formats": {"vllm-eagle3": _row(2.0, 1.9)}}
    row = next(line for line in mod.markdown(res).splitlines() if line.startswith("| vllm-eagle3"))
    assert row.startswith("| vllm-eagle3 | draftheads/data/heads/smollm2-135m-eagle3 | 2.000 | 1.900 | -5.0 % |")


def _vllm_env(mod, monkeypatch, tmp_path, fmt):
    """The environment ``run_vllm`` starts vLLM with for ``fmt`` (subprocess replaced)."""
    import json
    import subprocess

    seen = {}

    def fake_run(cmd, env, **kw):
        seen.update(env)
        (tmp_path / "out.json").write_text(json.dumps({"rows": []}))
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    for k in mod.V2_ON_CPU_ENV:  # the suite runs with TRITON_INTERPRET=1
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: False)
    draft = tmp_path / "draft"
    draft.mkdir(exist_ok=True)
    (draft / "config.json").write_text("{}")
    mod.run_vllm("python", tmp_path, tmp_path / "p.json", 8, tmp_path / "out.json", fmt, draft if fmt else None)
    return seen


def test_dspark_runs_on_vllms_v2_runner_with_triton_interpreted_on_cpu(monkeypatch, tmp_path):
    import os
    import subprocess
    import sys

    mod = _script()
    dspark = _vllm_env(mod, monkeypatch, tmp_path, "vllm-dspark")
    assert {k: dspark[k] for k in mod.V2_ON_CPU_ENV} == mod.V2_ON_CPU_ENV
    assert dspark["PYTHONPATH"].split(os.pathsep)[0] == str(mod.V2_ON_CPU_PATH)
    for fmt in ("vllm-dflash", None):  # the V1 runner, as vLLM chooses
        assert not set(mod.V2_ON_CPU_ENV) & set(_vllm_env(mod, monkeypatch, tmp_path, fmt))
    monkeypatch.undo()  # subprocess.run again
    # the shim names the interpreter as Triton's CPU backend, only when both variables are set
    probe = "from triton.backends import backends; print('cpu' in backends)"
    for extra, want in ((mod.V2_ON_CPU_ENV, "True"), ({"TRITON_INTERPRET": "1"}, "False")):
        env = {k: v for k, v in os.environ.items() if k not in mod.V2_ON_CPU_ENV}
        env.update(extra, PYTHONPATH=str(mod.V2_ON_CPU_PATH))
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


FAKE_VLLM = '''
__version__ = "fake"


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.max_tokens = max_tokens


class _Out:
    def __init__(self, ids):
        self.outputs = [type("Completion", (), {"token_ids": ids, "text": " ".join(map(str, ids))})()]


class LLM:
    def __init__(self, **kwargs):
        self.spec = kwargs.get("speculative_config")

    def generate(self, prompts, params, use_tqdm=False):
        return [_Out([p["prompt_token_ids"][-1] + i for i in range(params.max_tokens)]) for p in prompts]

    def get_metrics(self):
        return []
'''


def test_the_vllm_side_imports_vllm_not_the_export_module_beside_it(tmp_path):
    """vllm_run.py runs as a script from draftheads/export/, next to draftheads/export/vllm.py: it must still
    import the vLLM of its environment (here a stand-in), and write the rows it generated."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm/__init__.py").write_text(FAKE_VLLM)
    (tmp_path / "vllm/inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                             "    return {'prompt_token_ids': prompt_token_ids}\n")
    (tmp_path / "prompts.json").write_text(json.dumps([[1, 2, 3], [7]]))
    script = Path(serve_check.__file__).with_name("vllm_run.py")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    subprocess.run([sys.executable, str(script), "--target", "t", "--prompts", str(tmp_path / "prompts.json"),
                    "--max-tokens", "3", "--out", str(tmp_path / "out.json")], env=env, check=True, cwd=tmp_path)
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["vllm_version"] == "fake" and res["spec"] is None
    assert [r["token_ids"] for r in res["rows"]] == [[3, 4, 5], [7, 8, 9]]
