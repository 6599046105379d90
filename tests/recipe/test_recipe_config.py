import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftheads.errors import DraftheadsError
from draftheads.recipe import scaling
from draftheads.recipe.config import load_recipe
from draftheads.recipe.run import run_recipe
from draftheads.recipe.stages import Plan, run_epochs

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
EAGLE3 = str(ROOT / "configs/smollm2-eagle3-reference.yaml")


def _write(tmp_path, **fields) -> Path:
    body = {"name": "t", "run_dir": str(tmp_path / "run"), "heads": [{"family": "eagle3", "config": EAGLE3}]} | fields
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_lists_its_stages_without_a_model(path, capsys, monkeypatch):
    import draftheads.targets

    monkeypatch.setattr(draftheads.targets, "load_target", lambda *a, **k: pytest.fail("a dry run loaded a model"))
    assert run_recipe(str(path), ["run_dir=" + str(Path("/nonexistent") / path.stem)], dry_run=True, cwd=ROOT) == 0
    out = capsys.readouterr().out
    recipe = load_recipe(path)
    assert f"recipe {recipe.name}: target {recipe.target}" in out and "error:" not in out
    for stage in ("distill", "train", "export", "eval") + (("features",) if recipe.data.features == "cache" else ()):
        assert f". {stage} [" in out
    assert f"train-head fit --config /nonexistent/{path.stem}/main/train.yaml" in out
    assert f"draftheads eval --target {recipe.target} --head /nonexistent/{path.stem}/" in out


def test_a_gpu_recipe_generates_with_vllm_and_trains_online(capsys):
    assert run_recipe(str(ROOT / "recipes/llama31-8b-eagle3.yaml"), ["run_dir=/nonexistent/l"], dry_run=True, cwd=ROOT) == 0
    out = capsys.readouterr().out
    assert ". features [" not in out  # online: the target runs inside training
    assert "--engine vllm --tensor-parallel-size 1 --data-parallel-size 8" in out
    assert "--dtype bfloat16" in out and "eval --target meta-llama/Llama-3.1-8B-Instruct" in out
    assert out.count("--device cuda") == 6  # synthesize, distill, export, eval, bench, serve-check
    plan = Plan(load_recipe(ROOT / "recipes/llama31-8b-eagle3.yaml", ["run_dir=/tmp/x"]), ROOT, "c")
    train = next(s for s in plan.stages() if s.name == "train")
    assert train.needs == ("distill",)


def test_the_reference_recipe_lists_every_stage_and_command(capsys):
    assert run_recipe(str(ROOT / "recipes/smollm2-135m.yaml"), ["run_dir=/nonexistent/ref"], dry_run=True, cwd=ROOT) == 0
    out = capsys.readouterr().out
    names = [line.split(". ", 1)[1].split(" [")[0] for line in out.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    assert names == ["synthesize", "distill", "features", "train", "extend", "export", "eval", "package", "bench",
                     "compare", "scaling", "serve"]
    assert "synthesize --target smollm2-135m --num-prompts 8600" in out
    assert "--layers eagle3+dflash+dspark" in out  # the features every head reads
    # the block drafters' eval and bench modes: their served chain of 7 and the small tree beside chain 3
    assert "--head /nonexistent/ref/dflash/head --prompts bundled:eval --limit-per-domain 12 --max-new-tokens 128 " \
           "--tree chain3,chain7,small" in out
    assert "--tree auto,chain7,small --only proposers,batch" in out


def test_a_wrong_field_is_one_line_naming_it(tmp_path):
    cases = [({"dataa": {}}, "recipe field dataa: unknown field; did you mean data?"),
             ({"data": {"synthesise": 10}}, "recipe field data.synthesise: unknown field; did you mean synthesize?"),
             ({"data": {"batch_size": "many"}}, "recipe field data.batch_size: expected int, got 'many'"),
             ({"data": {"engine": "sglang"}}, "recipe field data.engine: 'sglang': use one of draftheads, vllm"),
             ({"heads": [{"family": "eagle4", "config": EAGLE3}]}, "recipe field heads.0.family: 'eagle4'"),
             ({"heads": [{"family": "eagle3"}]}, "recipe field heads.0.config: is required"),
             ({"heads": []}, "recipe field heads: is empty"),
             ({"heads": [{"family": "eagle3", "config": EAGLE3, "rounds": [2, 0]}]}, "heads.0.rounds: [2, 0]"),
             ({"eval": {"modes": ["chain3", "chain3"]}}, "recipe field eval.modes 'chain3,chain3': give one or more"),
             ({"package": {"dir": "x", "mode": "medium"}}, "recipe field package.mode: 'medium' is not among eval.modes")]
    for fields, message in cases:
        with pytest.raises(DraftheadsError) as e:
            load_recipe(_write(tmp_path, **fields))
        assert message in str(e.value) and "\n" not in str(e.value), (fields, str(e.value))


def test_set_overrides_fields_and_refuses_a_path_that_is_not_there(tmp_path):
    path = _write(tmp_path)
    r = load_recipe(path, ["data.synthesize=12", "heads.0.rounds=[1, 2]", "eval.modes=[chain3]"])
    assert r.data.synthesize == 12 and r.heads[0].rounds == [1, 2] and r.eval.modes == ["chain3"]
    with pytest.raises(DraftheadsError, match="--set heads.3.epochs: heads.3 is not in the recipe"):
        load_recipe(path, ["heads.3.epochs=1"])
    with pytest.raises(DraftheadsError, match="use field.path=value"):
        load_recipe(path, ["data.synthesize"])
    with pytest.raises(DraftheadsError, match="recipe field data.synthesise: unknown field"):
        load_recipe(path, ["data.synthesise=3"])


def test_the_command_line_prints_one_error_line_for_a_bad_recipe(tmp_path):
    path = _write(tmp_path, data={"max_new_tokens": 0})
    proc = subprocess.run([sys.executable, "-m", "draftheads.cli", "recipe", "run", str(path), "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: recipe field data.max_new_tokens: 0 must be >= 1"


def test_a_warm_restart_takes_restart_lr_and_the_model_overrides(tmp_path):
    head = {"family": "eagle3", "config": EAGLE3, "init_head": "reference", "restart_lr": 3e-4,
            "model": {"intermediate_size": 3072}, "epochs": 1, "precision": "32"}
    plan = Plan(load_recipe(_write(tmp_path, heads=[head])), tmp_path, "cmd")
    plan.write_config(tmp_path / "main", plan.recipe.head, None, tmp_path / "shipped", 1.0, None)
    cfg = yaml.safe_load((tmp_path / "main/train.yaml").read_text())
    init = cfg["model"]["init_args"]
    assert (init["intermediate_size"], init["init_head"], init["lr"]) == (3072, str(tmp_path / "shipped"), 3e-4)
    assert init["target"] == "smollm2-135m" and init["head_dir"] == str(tmp_path / "main/head")
    assert cfg["trainer"]["max_epochs"] == 1 and cfg["trainer"]["precision"] == "32"
    base = yaml.safe_load(Path(EAGLE3).read_text())["model"]["init_args"]["lr"]
    plan.write_config(tmp_path / "new", plan.recipe.head, None, None, 1.0, None)
    init = yaml.safe_load((tmp_path / "new/train.yaml").read_text())["model"]["init_args"]
    assert init["lr"] == base and "init_head" not in init


def test_the_other_heads_train_their_own_epochs_and_share_the_compare_modes(tmp_path):
    heads = [{"family": "eagle3", "config": EAGLE3, "epochs": 1, "rounds": [3]},
             {"family": "dflash", "config": str(ROOT / "configs/smollm2-dflash-reference.yaml"), "epochs": 4,
              "modes": ["chain3", "chain7", "small"]}]
    plan = Plan(load_recipe(_write(tmp_path, heads=heads, bench={})), tmp_path, "cmd")
    assert run_epochs(plan.recipe.head) == 4
    stage = next(s for s in plan.stages() if s.name == "compare")
    labels = [s.label for s in stage.steps]
    assert labels == ["compare dflash", "compare eval eagle3", "compare eval dflash", "compare bench"]
    stage.steps[0].prepare()
    assert yaml.safe_load((tmp_path / "run/dflash/train.yaml").read_text())["trainer"]["max_epochs"] == 4
    tree = lambda argv: argv[argv.index("--tree") + 1]  # noqa: E731
    assert {tree(s.argv) for s in stage.steps[1:3]} == {"chain3,chain7,small"}
    assert tree(stage.steps[3].argv) == "auto,chain7,small"  # and chain3, which the bench always runs
    assert str(tmp_path / "run/extended/head") in stage.steps[3].argv


def test_a_scaling_point_trains_as_many_steps_as_the_full_set():
    for fraction, epochs, every in [(0.5, 4, 1), (0.25, 8, 2), (0.125, 16, 4)]:
        s = scaling.schedule(2, fraction)
        assert s["max_epochs"] * fraction == 2  # epochs x data = the full set's 2 epochs
        assert (s["max_epochs"], s["check_val_every_n_epoch"], s["val_check_interval"]) == (epochs, every, 1.0)
        assert s["max_epochs"] // s["check_val_every_n_epoch"] == 4  # validated 4 times, as the full set


def test_scaling_table_shows_first_tokens_accuracy_where_a_head_has_it():
    def point(tokens, acc, window=None, epochs=2):
        p = {"answer_tokens": tokens, "epochs": epochs, "val_acc": acc, "val_sim_tau": 1.5, "tau_chain3": 1.4,
             "speedup_chain3": 0.9}
        return p | ({"val_window": 128, "val_window_acc": window, "val_window_sim_tau": 1.3} if window else {})

    table = scaling.table([point(1000, [0.5, 0.4], [0.42, 0.3], epochs=16), point(8000, [0.6, 0.5])], 3, 128)
    lines = table.splitlines()
    assert "first 128" in lines[0] and "val acc@1 (first 128)" in lines[2]
    assert len({len(line.split("|")) for line in lines[2:]}) == 1  # header, rule and rows line up
    assert "| 1,000 | 16 | 0.500 | 0.400 | 1.50 | 0.420 | 1.30 | 1.40 | 0.90x |" in table
    assert "| 8,000 | 2 | 0.600 | 0.500 | 1.50 | – | – | 1.40 | 0.90x |" in table
    assert "first" not in scaling.table([point(8000, [0.6, 0.5])], 3, 128)


def test_from_answer_caches_features_for_the_answers_from_that_one_on(tmp_path):
    plan = Plan(load_recipe(_write(tmp_path, data={"from_answer": 3, "store": str(tmp_path / "store")})), tmp_path, "c")
    plan.answers.parent.mkdir(parents=True)
    plan.answers.write_text("".join(json.dumps({"id": f"p{i}"}) + "\n" for i in range(5)))
    assert plan.features_from() == 0 and not plan.same_pass()
    plan._slice()
    assert [json.loads(x)["id"] for x in plan.answers_from().read_text().splitlines()] == ["p3", "p4"]
    assert plan.features_from() == 3  # a rerun with another from_answer makes the features again
    plan.recipe.data.from_answer = 5
    with pytest.raises(DraftheadsError, match="holds 5 answers"):
        plan._slice()


def test_only_refuses_a_stage_whose_input_is_unfinished(tmp_path):
    path = _write(tmp_path, scaling={})
    with pytest.raises(SystemExit, match="--only scaling reads what features makes, and it is not finished"):
        run_recipe(str(path), only="scaling", cwd=tmp_path)
    assert not (tmp_path / "run/scaling").exists()
    with pytest.raises(DraftheadsError, match="--only nope: no such stage"):
        run_recipe(str(path), only="scaling,nope", cwd=tmp_path)


def test_only_refuses_a_redo_of_its_input_before_removing_anything(tmp_path):
    path = _write(tmp_path, scaling={})
    (tmp_path / "run/features").mkdir(parents=True)
    (tmp_path / "run/features/index.json").write_text("{}")
    (tmp_path / "run/recipe.json").write_text(json.dumps({"recipe": "t", "target": "smollm2-135m"}))
    with pytest.raises(SystemExit, match="--only scaling reads what features makes, and --redo makes features again"):
        run_recipe(str(path), redo="distill", only="scaling", cwd=tmp_path)
    assert (tmp_path / "run/features/index.json").is_file()  # a redo of distill would have removed the features


def test_a_redone_stage_leaves_none_of_its_old_tables(tmp_path):
    path = _write(tmp_path, bench={})
    run = tmp_path / "run"
    for f in ("eval/results.json", "eval/results.md", "eval/tau_by_domain.png", "bench/results.md", "recipe.json"):
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_text(json.dumps({"recipe": "t", "target": "smollm2-135m"}))
    with pytest.raises(SystemExit, match="--only eval reads what train makes"):  # no head: nothing to evaluate
        run_recipe(str(path), redo="eval", only="eval", cwd=tmp_path)
    assert not (run / "eval").exists() and not (run / "bench").exists()  # a redo redoes what follows


def test_a_run_directory_of_another_recipe_is_refused_before_anything_runs(tmp_path):
    path = _write(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run/recipe.json").write_text(json.dumps({"recipe": "other", "target": "smollm2-135m"}))
    with pytest.raises(DraftheadsError, match="made by recipe 'other'"):
        run_recipe(str(path), cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["recipe.json"]


def test_fits_writes_the_configs_of_the_unfinished_fits_in_order(tmp_path):
    from draftheads.recipe.run import write_fits

    path = _write(tmp_path, heads=[{"family": "eagle3", "config": EAGLE3, "rounds": [1, 2]}])
    run = tmp_path / "run"
    assert write_fits(str(path), cwd=tmp_path) == [run / "main/train.yaml", run / "extended/train.yaml",
                                                   run / "extended2/train.yaml"]
    second = yaml.safe_load((run / "extended2/train.yaml").read_text())
    assert second["model"]["init_args"]["init_head"] == str(run / "extended/head")
    assert second["trainer"]["max_epochs"] == 2
    (run / "main/head").mkdir()
    assert write_fits(str(path), cwd=tmp_path, only="extend")[0] == run / "extended/train.yaml"
    assert write_fits(str(path), cwd=tmp_path, only="train") == []


def test_a_head_naming_layers_the_target_lacks_is_one_line(tmp_path):
    from draftheads.testing import save_tiny_llama

    tiny = save_tiny_llama(tmp_path / "tiny")  # 4 layers
    head = {"family": "eagle3", "config": EAGLE3, "model": {"aux_layer_ids": [1, 2, 6]}}
    path = _write(tmp_path, target=str(tiny), heads=[head])
    with pytest.raises(DraftheadsError) as e:
        run_recipe(str(path), dry_run=True, cwd=tmp_path)
    assert str(e.value).startswith("recipe field heads.0.model.aux_layer_ids: [1, 2, 6]: target ")
    assert "has 4 layers" in str(e.value) and "\n" not in str(e.value)
    head["model"]["aux_layer_ids"] = [1, 2, 3]
    assert run_recipe(str(_write(tmp_path, target=str(tiny), heads=[head])), dry_run=True, cwd=tmp_path) == 0


def test_each_ablation_arm_is_a_stage_of_equal_steps_with_its_overrides_then_walked(tmp_path):
    arms = [{"name": "base"}, {"name": "ttt3", "model": {"ttt_steps": 3}},
            {"name": "crop", "model": {"train_answer_window": 128}, "trainer": {"gradient_clip_val": 1.0}}]
    heads = [{"family": "eagle3", "config": EAGLE3, "rounds": [2], "model": {"lr": 5e-4}}]
    plan = Plan(load_recipe(_write(tmp_path, heads=heads, ablation={"arms": arms, "steps": 40, "val_every": 20})),
                tmp_path, "cmd")
    stages = [s for s in plan.stages() if s.name.startswith("ablation")]
    assert [s.name for s in stages] == ["ablation-base", "ablation-ttt3", "ablation-crop"]
    configs = {}
    for s in stages:
        fit, walk = s.steps
        assert s.needs == ("features",) and walk.argv[1] == "walk"
        assert walk.argv[walk.argv.index("--tree") + 1] == "chain3,small"
        fit.prepare()
        configs[s.name] = yaml.safe_load((tmp_path / "run/ablation" / s.name[9:] / "train.yaml").read_text())
    for cfg in configs.values():  # the same steps, validations and start for every arm; no warm restarts
        tr = cfg["trainer"]
        assert (tr["max_steps"], tr["max_epochs"], tr["val_check_interval"], tr["check_val_every_n_epoch"]) == \
            (40, -1, 20, None)
        assert cfg["model"]["init_args"]["lr"] == 5e-4 and "init_head" not in cfg["model"]["init_args"]
        assert cfg["seed_everything"] == configs["ablation-base"]["seed_everything"]
    assert configs["ablation-ttt3"]["model"]["init_args"]["ttt_steps"] == 3
    assert configs["ablation-base"]["model"]["init_args"]["ttt_steps"] == 5
    assert configs["ablation-crop"]["model"]["init_args"]["train_answer_window"] == 128
    assert configs["ablation-crop"]["trainer"]["gradient_clip_val"] == 1.0
    for bad, where in (({"arms": []}, "ablation.arms"), ({"arms": [{"name": "a"}, {"name": "a"}]}, "ablation.arms.1.name"),
                       ({"arms": [{"name": "a"}], "modes": ["auto"]}, "ablation.modes")):
        with pytest.raises(DraftheadsError, match=f"recipe field {where}"):
            load_recipe(_write(tmp_path, ablation=bad))


def test_an_ablation_arm_on_features_of_another_dtype_reads_a_second_cache_made_once(tmp_path):
    arms = [{"name": "base"}, {"name": "fp32", "features_dtype": "float32"},
            {"name": "fp32-ttt3", "features_dtype": "float32", "model": {"ttt_steps": 3}},
            {"name": "same", "features_dtype": "bfloat16"}]
    plan = Plan(load_recipe(_write(tmp_path, data={"dtype": "bfloat16"}, ablation={"arms": arms})), tmp_path, "cmd")
    stages = {s.name: s for s in plan.stages()}
    names = list(stages)
    assert [n for n in names if n.startswith("features")] == ["features", "features-float32"]
    assert names.index("features-float32") < names.index("ablation-base")
    (step,) = stages["features-float32"].steps
    argv = [str(a) for a in step.argv]
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--out") + 1] == str(tmp_path / "run/features-float32")
    assert argv[argv.index("--data") + 1] == [str(a) for a in stages["features"].steps[0].argv][argv.index("--data") + 1]
    for name, needs, features in (("base", ("features",), "run/features"), ("same", ("features",), "run/features"),
                                  ("fp32", ("features", "features-float32"), "run/features-float32"),
                                  ("fp32-ttt3", ("features", "features-float32"), "run/features-float32")):
        s = stages[f"ablation-{name}"]
        assert s.needs == needs
        s.steps[0].prepare()
        cfg = yaml.safe_load((tmp_path / "run/ablation" / name / "train.yaml").read_text())
        assert cfg["data"]["feature_dir"] == str(tmp_path / features)
    with pytest.raises(DraftheadsError, match="recipe field ablation.arms.0.features_dtype"):
        load_recipe(_write(tmp_path, ablation={"arms": [{"name": "a", "features_dtype": "fp8"}]}))


def test_the_ablation_table_reads_each_arm_against_the_first():
    from draftheads.recipe import ablation

    def arm(name, tau, acc, **over):
        return {"name": name, "overrides": {"model": over} if over else {}, "command": f"train-head fit {name}",
                "walk_command": f"draftheads walk {name}", "walked_tau": {"chain3": tau, "small": tau + 0.5},
                "val_acc": acc, "val_window": 128, "val_window_acc": [a - 0.1 for a in acc], "tok_s": 900.4}

    res = {"recipe": "r", "head_config": "c.yaml", "steps": 400, "modes": ["chain3", "small"], "prompts": "bundled:eval",
           "limit_per_domain": 12, "max_new_tokens": 128, "date": "d",
           "arms": [arm("base", 2.0, [0.7, 0.6]), arm("ttt3", 2.1, [0.72, 0.61], ttt_steps=3)]}
    lines = ablation.markdown(res).splitlines()
    assert lines[2].startswith("| arm | overrides | walked τ chain3 | walked τ small | val top-1 per step (first 128")
    assert lines[4] == "| base | (the config as it is) | 2.000 | 2.500 | 0.600 / 0.500 | 0.700 / 0.600 | 900 |"
    assert lines[5].startswith("| ttt3 | ttt_steps: 3 | 2.100 (+5.0 %) | 2.600 (+4.0 %) |")
    assert "- ttt3: `train-head fit ttt3`; `draftheads walk ttt3`" in lines


def _finished_arm(done: Path, tau: float = 2.0) -> None:
    """An arm's directory as its stage leaves it: the head's config, the walk and the training log."""
    (done / "head").mkdir(parents=True)
    (done / "head/config.json").write_text(json.dumps({"val_accuracies": [0.7, 0.6], "val_answer_window": 128,
                                                        "val_window_accuracies": [0.6, 0.5]}))
    (done / "walk").mkdir()
    (done / "walk/results.json").write_text(json.dumps({"command": f"draftheads walk --head {done}/head", "modes": {
        m: {"overall": {"tau": t, "alpha": [0.5]}} for m, t in (("chain3", tau), ("small", tau + 0.4))}}))
    (done / "train/csv/version_0").mkdir(parents=True)
    (done / "train/csv/version_0/metrics.csv").write_text("step,train/tok_s,val/loss\n1,800.0,\n2,,3.1\n3,850.5,\n")


def test_the_ablation_table_is_rendered_again_from_the_arms_finished_so_far(tmp_path):
    from draftheads.bench.report import render_results

    arms = [{"name": "base"}, {"name": "norm", "model": {"norm_init": "target"}}]
    plan = Plan(load_recipe(_write(tmp_path, ablation={"arms": arms})), tmp_path, "cmd")
    _finished_arm(tmp_path / "run/ablation/base")
    stage = next(s for s in plan.stages() if s.name == "ablation-base")
    stage.after({"machines": {"ablation-base": [18.5]}}, lambda m: None)
    res = json.loads((tmp_path / "run/ablation/results.json").read_text())
    assert [a["name"] for a in res["arms"]] == ["base"] and res["arms"][0]["tok_s"] == 850.5
    assert res["arms"][0]["walked_tau"] == {"chain3": 2.0, "small": 2.4}
    assert res["arms"][0]["plain_tok_s"] == [18.5]  # the yardstick of the machine it trained on
    # the commands name the run's paths from the checkout the recipe ran in
    assert res["arms"][0]["command"] == "train-head fit --config run/ablation/base/train.yaml"
    assert res["arms"][0]["walk_command"] == "draftheads walk --head run/ablation/base/head"
    assert render_results(res) == (tmp_path / "run/ablation/results.md").read_text()
    assert "| 850 (18.5) |" in render_results(res)


def test_an_ablation_keeps_the_arms_of_an_earlier_table_it_has_not_trained_again(tmp_path):
    arms = [{"name": "base"}, {"name": "norm", "model": {"norm_init": "target"}}, {"name": "ttt3"}]
    first = Plan(load_recipe(_write(tmp_path, run_dir=str(tmp_path / "one"), ablation={"arms": arms})), tmp_path, "c")
    _finished_arm(tmp_path / "one/ablation/base", 2.0)
    _finished_arm(tmp_path / "one/ablation/norm", 2.2)
    next(s for s in first.stages() if s.name == "ablation-norm").after({}, lambda m: None)
    (tmp_path / "kept.json").write_text((tmp_path / "one/ablation/results.json").read_text())
    # another machine, a new run directory: it trains base again and ttt3, and keeps norm from the earlier table
    said = []
    later = Plan(load_recipe(_write(tmp_path, ablation={"arms": arms, "earlier": "kept.json"})), tmp_path, "c")
    _finished_arm(tmp_path / "run/ablation/base", 2.1)
    _finished_arm(tmp_path / "run/ablation/ttt3", 1.9)
    next(s for s in later.stages() if s.name == "ablation-ttt3").after({}, said.append)
    res = json.loads((tmp_path / "run/ablation/results.json").read_text())
    assert [(a["name"], a["walked_tau"]["chain3"]) for a in res["arms"]] == [("base", 2.1), ("norm", 2.2), ("ttt3", 1.9)]
    assert res["arms"][1]["walk_command"] == "draftheads walk --head one/ablation/norm/head"
    assert said == ["ablation: 3 of 3 arms in run/ablation/results.md, 1 of them kept from kept.json"]
    # a table of other settings does not compare
    wrong = json.loads((tmp_path / "kept.json").read_text()) | {"steps": 99}
    (tmp_path / "kept.json").write_text(json.dumps(wrong))
    with pytest.raises(DraftheadsError, match=r"ablation.earlier: .* other steps \(99 here 400\)"):
        next(s for s in later.stages() if s.name == "ablation-ttt3").after({}, said.append)


