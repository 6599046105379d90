"""The training-step benchmark (``scripts/bench_train_step.py``) at a small size: the training-time test
at the scored positions gives the loss and gradients of the test run everywhere, and its JSON renders."""

from draftheads.bench.train_step import markdown, run


def test_the_scored_step_has_the_same_loss_and_its_json_renders():
    res = run(dtype="float32", rows=2, tokens=256, repeats=1, ttt_steps=3, parts="scored")
    a = res["scored"]
    assert a["loss"]["abs_diff"] < 1e-5 and a["max_rel_grad_diff"] < 1e-4
    assert 0.5 < a["answer_share"] < 0.9 and a["kept_width_share"] < 1.0  # prompts left out
    res["command"] = "python scripts/bench_train_step.py --parts scored"
    table = markdown(res)
    assert "the training-time test at every position → where the loss scores" in table
    assert f"{a['speedup']:.2f}x" in table
