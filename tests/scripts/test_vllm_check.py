from _scripts import load_script


def _script():
    return load_script("vllm_check")


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
    res = {"command": "python scripts/vllm_check.py", "date": "d", "machine": {"platform": "p", "cpu_count": 2},
           "vllm_version": "0.32.0", "k": 3, "prompts": ["a"], "max_tokens": 8, "plain_outputs_equal_across_engines": "1/1",
           "formats": {"vllm-eagle3": _row(2.0, 1.9)}}
    row = next(line for line in mod.markdown(res).splitlines() if line.startswith("| vllm-eagle3"))
    assert row.startswith("| vllm-eagle3 | draftheads/data/heads/smollm2-135m-eagle3 | 2.000 | 1.900 | -5.0 % |")
