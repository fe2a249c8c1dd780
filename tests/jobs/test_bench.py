"""Benchmark harness: metric functions on hand-made cases, the runner end to end on a tiny model."""

import json
from dataclasses import replace

import pytest
import torch
from conftest import char_tokenizer, tiny_llama, write_spec_bench

from tierspec.bench import metrics
from tierspec.bench.runner import BenchConfig, BenchError, parse_spec, read_records, run_bench
from tierspec.models import wrap_model


class TestMetrics:
    @pytest.mark.parametrize(
        "text, expected",
        [("so she pays 18 dollars.", "18"), ("#### 1,234", "1234"), ("It is 3.50 then 7.0", "7"), ("no digits", None),
         ("-5 degrees", "-5")],
    )
    def test_final_number(self, text, expected):
        assert metrics.final_number(text) == expected

    def test_gsm8k_exact_match(self):
        reference = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18"
        assert metrics.gsm8k_exact_match("She makes 9 * 2 = 18 dollars.\nThe answer is 18.", reference) == 1.0
        assert metrics.gsm8k_exact_match("She makes 20 dollars.", reference) == 0.0

    def test_rouge_l(self):
        assert metrics.rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
        # LCS "the cat sat" (3 of 3 predicted, 3 of 6 reference): F1 = 2·1·0.5/1.5
        assert metrics.rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
        assert metrics.rouge_l("dogs bark", "the cat sat") == 0.0

    def test_bleu(self):
        assert metrics.corpus_bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(100.0)
        assert metrics.corpus_bleu(["a b c d"], ["the cat sat on the mat"]) == pytest.approx(0.0)

    TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    PROMPT = "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n"

    def test_pass_at_1_correct_wrong_and_infinite_loop(self):
        correct = "```python\ndef add(a, b):\n    return a + b\n```"
        wrong = "```python\ndef add(a, b):\n    return a - b\n```"
        looping = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
        run = lambda reply, timeout=10: metrics.humaneval_pass(metrics.extract_code(reply, self.PROMPT, "add"), self.TEST, "add", timeout)
        assert run(correct) is True
        assert run(wrong) is False
        assert run(looping, timeout=2) is False

    def test_completion_without_definition_is_appended_to_the_prompt(self):
        program = metrics.extract_code("    return a + b\n", self.PROMPT, "add")
        assert metrics.humaneval_pass(program, self.TEST, "add")

    def test_target_nll_matches_a_manual_computation(self, tiny_target):
        prompt, generated = torch.tensor([1, 2, 3]), [4, 5]
        with torch.inference_mode():
            logprobs = tiny_target.model(torch.tensor([[1, 2, 3, 4, 5]])).logits[0].log_softmax(-1)
        manual = -(logprobs[2, 4] + logprobs[3, 5]) / 2
        assert metrics.target_nll(tiny_target.model, prompt, generated) == pytest.approx(float(manual), rel=1e-6)  # float32 log-softmax


def test_a_method_in_another_dtype_runs_on_that_dtypes_model(tmp_path, data_dir):
    """``ar:dtype=bfloat16`` in a float32 run generates what a bfloat16 run's ``ar`` does (its
    own model, loaded once), and a bad dtype is refused before anything runs."""
    tiny_llama(3, vocab_size=56).model.save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    config = BenchConfig(target=str(tmp_path / "m"), methods=("ar", "ar:dtype=bfloat16", "pld:dtype=bfloat16"),
                         dataset="spec_bench", per_category=1, max_new_tokens=8, data_dir=str(data_dir),
                         compute_nll=False, dtype="float32")
    run_bench(config, tmp_path / "mixed", progress=False)
    only = replace(config, dtype="bfloat16", methods=("ar",))
    run_bench(only, tmp_path / "bf16", progress=False)
    mixed = {(r["method"], r["prompt_id"]): r["token_ids"] for r in read_records(tmp_path / "mixed" / "records.jsonl")}
    alone = {r["prompt_id"]: r["token_ids"] for r in read_records(tmp_path / "bf16" / "records.jsonl")}
    assert alone and all(mixed["ar:dtype=bfloat16", p] == mixed["pld:dtype=bfloat16", p] == ids for p, ids in alone.items())
    with pytest.raises(BenchError, match="unsupported dtype"):
        parse_spec("ar:dtype=float8")


def test_method_specs():
    assert parse_spec("via:alpha2=0.5:mask=m.json") == ("via", {"alpha2": "0.5", "mask": "m.json"})
    assert parse_spec("lossy:draft_with=ngram") == ("lossy", {"drafter_kind": "ngram"})  # the CLI flag name works too
    with pytest.raises(BenchError, match="unknown method 'warp'"):
        parse_spec("warp")
    with pytest.raises(BenchError, match="not key=value"):
        parse_spec("pld:3")


@pytest.fixture
def tiny_text_model():
    tokenizer = char_tokenizer()
    model = tiny_llama(seed=4, vocab_size=56, layers=3, sharpness=20.0).model
    model.generation_config.eos_token_id = None
    return wrap_model(model, tokenizer, name="tiny-char")


@pytest.fixture
def data_dir(tmp_path):
    return write_spec_bench(tmp_path / "data", {"qa": ["what is the capital of france?"],
                                                "translation": ["translate: der hund ist gross."]})


def test_runner_end_to_end_and_resume(tmp_path, tiny_text_model, data_dir):
    config = BenchConfig(target="tiny", methods=("ar", "pld", "sd", "lossy:alpha=0.3", "hf-greedy", "hf-greedy-stock"),
                         dataset="spec_bench",
                         per_category=1, max_new_tokens=12, data_dir=str(data_dir))
    out = tmp_path / "out"
    summary = run_bench(config, out, progress=False, target=tiny_text_model)
    for name in ("records.jsonl", "summary.json", "summary.md", "speedup_by_category.png", "quality_vs_speedup.png", "tier_fractions.png"):
        assert (out / name).exists(), name
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 6
    assert summary["methods"]["ar"]["overall"]["speedup"] == pytest.approx(1.0)
    assert summary["methods"]["ar"]["categories"]["qa"]["speedup"] == pytest.approx(1.0)
    for lossless in ("pld", "sd", "hf-greedy", "hf-greedy-stock"):  # greedy lossless methods reproduce ar exactly
        assert summary["methods"][lossless]["overall"]["fidelity_exact_match"] == 1.0
    inner = summary["methods"]["pld"]["overall"]
    for key in ("speedup", "tokens_per_s", "mean_accepted_tokens", "rejection_rate", "n_prompts", "target_nll", "peak_rss_mb"):
        assert key in inner
    assert inner["n_prompts"] == 2 and "baseline_check" in summary
    from tierspec.bench.runner import stock_copy
    from tierspec.kernels import FewRowLinear, PackedLinear

    stock = stock_copy(tiny_text_model.model)  # the stock peer ran on plain nn.Linear, the target kept its kernels
    assert not any(isinstance(m, (FewRowLinear, PackedLinear)) for m in stock.modules())
    assert {type(m) for m in stock.modules()} >= {torch.nn.Linear}
    assert any(isinstance(m, (FewRowLinear, PackedLinear)) for m in tiny_text_model.model.modules())
    assert "hf-*-stock" in (out / "summary.md").read_text()

    # Resume: nothing left to do, so no generation runs and no record is added.
    before = (out / "records.jsonl").read_text()
    import tierspec.bench.runner as runner_module

    calls = []
    original = runner_module.MethodRunner.run
    runner_module.MethodRunner.run = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    try:
        run_bench(config, out, progress=False, target=tiny_text_model)
    finally:
        runner_module.MethodRunner.run = original
    assert calls == [] and (out / "records.jsonl").read_text() == before

    # A run killed mid-write: the last two records are missing, one of them half written (no
    # newline). The rerun cuts the half line off and redoes exactly those two; every line parses.
    lines = before.splitlines()
    (out / "records.jsonl").write_text("\n".join(lines[:-2]) + "\n" + lines[-2][:30])
    run_bench(config, out, progress=False, target=tiny_text_model)
    after = (out / "records.jsonl").read_text().splitlines()
    assert len(after) == len(lines) and all(json.loads(line) for line in after)
    assert {(json.loads(l)["method"], json.loads(l)["prompt_id"]) for l in after} == {
        (json.loads(l)["method"], json.loads(l)["prompt_id"]) for l in lines}


@pytest.mark.parametrize("changes, methods, message", [
    ({"mask": "m.json"}, ("ar", "pld"), "--mask"),
    ({"mask": "m.json"}, ("ar", "via:mask=own.json"), "--mask"),  # the only masked spec names its own
    ({"drafter": "d"}, ("ar", "pld", "lossy:draft_with=ngram"), "--drafter"),
    ({"hf_pld_tokens": 3}, ("ar", "pld"), "--hf-pld-tokens"),
    ({"hf_pld_tokens": 3}, ("ar", "hf-pld:tokens=4"), "--hf-pld-tokens"),
    ({"hf_early_exit_layer": 5}, ("ar", "hf-greedy"), "--hf-early-exit-layer"),
])
def test_a_run_wide_setting_no_method_reads_is_refused(changes, methods, message):
    """Each would change nothing and exit 0 (the same refusal as an unused method option)."""
    from tierspec.bench.runner import check_run_flags, parse_spec

    config = BenchConfig(target="tiny", methods=methods, **changes)
    with pytest.raises(BenchError, match=f"no method of this run uses {message}"):
        check_run_flags(config, [parse_spec(spec) for spec in methods])


@pytest.mark.parametrize("changes, methods", [
    ({"mask": "m.json"}, ("ar", "via-judge")), ({"mask": "m.json"}, ("self", "via:mask=own.json")),
    ({"drafter": "d"}, ("ar", "sd")), ({"drafter": "d"}, ("lossy",)), ({"drafter": "d"}, ("hf-assisted-stock",)),
    ({"hf_pld_tokens": 3}, ("hf-pld-stock",)), ({"hf_early_exit_layer": 5}, ("hf-early-exit",)),
])
def test_a_run_wide_setting_a_method_reads_is_taken(changes, methods):
    from tierspec.bench.runner import check_run_flags, parse_spec

    check_run_flags(BenchConfig(target="tiny", methods=methods, **changes), [parse_spec(spec) for spec in methods])


def test_code_execution_flags_outside_humaneval_are_refused(tmp_path, tiny_text_model, data_dir):
    from dataclasses import replace

    config = BenchConfig(target="tiny", methods=("ar",), dataset="spec_bench", per_category=1, max_new_tokens=4,
                         data_dir=str(data_dir))
    for changed, allow in ((config, True), (replace(config, code_sandbox=False), False)):
        with pytest.raises(BenchError, match="concern humaneval's code runs"):
            run_bench(changed, tmp_path / "out", progress=False, target=tiny_text_model, allow_code_execution=allow)
    assert not (tmp_path / "out").exists()
    run_bench(config, tmp_path / "out", progress=False, target=tiny_text_model)  # a summary runs no code: the
    run_bench(config, tmp_path / "out", progress=False, target=tiny_text_model, generate=False,  # flags of the run
              allow_code_execution=True)  # that made the folder may come with it


def test_a_resumed_runs_bar_counts_the_whole_run(tmp_path, tiny_text_model, data_dir, capsys):
    """It counted only what was left (0/13 where 5 of 18 were done)."""
    from dataclasses import replace

    config = BenchConfig(target="tiny", methods=("ar", "pld"), dataset="spec_bench", per_category=1, max_new_tokens=4,
                         data_dir=str(data_dir))
    out = tmp_path / "out"
    run_bench(replace(config, methods=("ar",)), out, progress=False, target=tiny_text_model)
    done = len(read_records(out / "records.jsonl"))
    capsys.readouterr()
    run_bench(config, out, progress=True, target=tiny_text_model)
    bar = capsys.readouterr().err
    assert f"{done}/{2 * done}" in bar and f"{2 * done}/{2 * done}" in bar


def test_missing_data_dir_is_a_clear_error(tmp_path, tiny_text_model):
    config = BenchConfig(target="tiny", methods=("ar",), data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="data file .* is missing"):
        run_bench(config, tmp_path / "out", progress=False, target=tiny_text_model)


def test_resume_with_other_settings_is_refused_and_changes_nothing(tmp_path, tiny_text_model, data_dir):
    config = BenchConfig(target="tiny", methods=("ar",), dataset="spec_bench", per_category=1, max_new_tokens=6,
                         data_dir=str(data_dir))
    out = tmp_path / "out"
    run_bench(config, out, progress=False, target=tiny_text_model)
    before = {name: (out / name).read_bytes() for name in ("records.jsonl", "config.json")}
    from dataclasses import replace

    with pytest.raises(BenchError, match="temperature: 0.0 → 1.0"):
        run_bench(replace(config, temperature=1.0), out, progress=False, target=tiny_text_model)
    assert {name: (out / name).read_bytes() for name in before} == before
    # More methods and prompts may join a run: they do not change what a record measures.
    run_bench(replace(config, methods=("ar", "pld")), out, progress=False, target=tiny_text_model)
    # The records name the code that computed them; a run on other code is not resumed into them.
    assert json.loads((out / "config.json").read_text())["implementation"] == "transformers"


def test_a_run_made_by_other_tierspec_code_is_not_resumed(tmp_path, tiny_text_model, data_dir):
    """The records named the method and implementation, not the code: a folder resumed after an upgrade
    mixed records of two versions of a method under one name."""
    config = BenchConfig(target="tiny", methods=("ar",), dataset="spec_bench", per_category=1, max_new_tokens=6,
                         data_dir=str(data_dir))
    out = tmp_path / "out"
    run_bench(config, out, progress=False, target=tiny_text_model)
    saved = json.loads((out / "config.json").read_text())
    assert saved["code"] == config.code and len(config.code) == 16
    (out / "config.json").write_text(json.dumps({**saved, "code": "0123456789abcdef"}))
    before = (out / "records.jsonl").read_bytes()
    from dataclasses import replace

    with pytest.raises(BenchError, match=f"made by other tierspec code \\(source 0123456789abcdef, this is {config.code}"):
        run_bench(replace(config, methods=("ar", "pld")), out, progress=False, target=tiny_text_model)
    assert (out / "records.jsonl").read_bytes() == before
    # a summary reports the code its records came from; a folder from before the key is not refused
    assert run_bench(config, out, progress=False, generate=False, target=tiny_text_model)["config"]["code"] == \
        "0123456789abcdef"
    del saved["code"]
    (out / "config.json").write_text(json.dumps(saved))
    run_bench(replace(config, methods=("ar", "pld")), out, progress=False, target=tiny_text_model)


def test_a_run_made_on_transformers_modules_is_not_resumed_on_tierspec_code(tmp_path, data_dir):
    from dataclasses import replace

    from tierspec.llama import LlamaLM
    from tierspec.models import load_model

    tiny_llama(3, vocab_size=56).model.save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    config = BenchConfig(target=str(tmp_path / "m"), methods=("ar",), dataset="spec_bench", per_category=1,
                         max_new_tokens=4, data_dir=str(data_dir), compute_nll=False)
    out = tmp_path / "out"
    run_bench(replace(config, implementation="transformers"), out, progress=False)
    with pytest.raises(BenchError, match="implementation: 'transformers' → 'tierspec'"):
        run_bench(config, out, progress=False)  # auto: tierspec's code for this model
    assert isinstance(load_model(tmp_path / "m").model, LlamaLM)
    # A folder written before the setting existed ran on transformers' modules: refused alike, and a
    # summary of it reports the code its records came from.
    saved = json.loads((out / "config.json").read_text())
    del saved["implementation"]
    (out / "config.json").write_text(json.dumps(saved))
    with pytest.raises(BenchError, match="implementation: 'transformers' → 'tierspec'"):
        run_bench(config, out, progress=False)
    summary = run_bench(config, out, progress=False, generate=False)
    assert summary["config"]["implementation"] == "transformers"


def test_a_summary_reports_the_folders_run_not_the_commands_flags(tmp_path, tiny_text_model, data_dir):
    """--summarize-only took its own --methods (the default when left out): the report was rewritten
    without the other methods' results, with exit 0."""
    from dataclasses import replace

    run = BenchConfig(target="tiny", methods=("ar", "pld", "adaptive-pld"), dataset="spec_bench", per_category=1,
                      max_new_tokens=6, data_dir=str(data_dir))
    out = tmp_path / "out"
    made = run_bench(run, out, progress=False, target=tiny_text_model)
    summary = run_bench(replace(run, methods=("ar",), per_category=None, limit=1), out, progress=False,
                        target=tiny_text_model, generate=False)
    assert list(summary["methods"]) == list(made["methods"]) == ["ar", "pld", "adaptive-pld"]
    assert summary["methods"] == made["methods"]


def test_fidelity_against_a_reference_run(tmp_path, tiny_text_model, data_dir):
    greedy = BenchConfig(target="tiny", methods=("ar", "pld"), dataset="spec_bench", per_category=1, max_new_tokens=10,
                         data_dir=str(data_dir))
    run_bench(greedy, tmp_path / "greedy", progress=False, target=tiny_text_model)
    from dataclasses import replace

    # Same greedy settings, the first run as reference: ar reproduces its reference exactly.
    same = run_bench(replace(greedy, fidelity_reference=str(tmp_path / "greedy")), tmp_path / "again", progress=False,
                     target=tiny_text_model)
    assert same["methods"]["ar"]["overall"]["fidelity_exact_match"] == 1.0
    # A planted reference whose ar outputs differ on one of the two prompts: exact match 0.5.
    lines = [json.loads(line) for line in (tmp_path / "greedy" / "records.jsonl").read_text().splitlines()]
    planted = [r for r in lines if r["method"] == "ar"]
    planted[0]["token_ids"] = planted[0]["token_ids"][:-1] + [(planted[0]["token_ids"][-1] + 1) % 56]
    (tmp_path / "planted.jsonl").write_text("\n".join(json.dumps(r) for r in planted) + "\n")
    other = run_bench(replace(greedy, fidelity_reference=str(tmp_path / "planted.jsonl")), tmp_path / "again",
                      progress=False, target=tiny_text_model, generate=False)
    assert other["methods"]["ar"]["overall"]["fidelity_exact_match"] == 0.5
    assert other["methods"]["pld"]["overall"]["fidelity_exact_match"] == 0.5
    assert "reference run" in (tmp_path / "again" / "summary.md").read_text()
    (tmp_path / "empty.jsonl").write_text(json.dumps({"method": "pld", "prompt_id": "x", "repeat": 0}) + "\n")
    with pytest.raises(BenchError, match="no `ar` records"):
        run_bench(replace(greedy, fidelity_reference=str(tmp_path / "empty.jsonl")), tmp_path / "third",
                  progress=False, target=tiny_text_model)


def test_frontier_question_on_planted_points():
    from tierspec.bench.report import faster_than_every_as_faithful

    pld = {"speedup": 1.3, "em": 1.0, "nll": 0.55}
    lossy = {"speedup": 1.4, "em": 0.4, "nll": 0.50}
    slow_via = {"speedup": 0.8, "em": 0.4, "nll": 0.60}
    fast_via = {"speedup": 1.5, "em": 0.4, "nll": 0.60}
    assert faster_than_every_as_faithful(slow_via, [pld, lossy], "em", higher_is_better=True) is False
    assert faster_than_every_as_faithful(fast_via, [pld, lossy], "em", higher_is_better=True) is True
    # Less faithful two-tier points do not count: only pld is as faithful by EM as a 0.9-EM point.
    assert faster_than_every_as_faithful({"speedup": 1.35, "em": 0.9}, [pld, lossy], "em", higher_is_better=True) is True
    # By NLL lower is better: every two-tier point has NLL ≤ 0.60, so fast_via must beat both.
    assert faster_than_every_as_faithful({"speedup": 1.35, "nll": 0.60}, [pld, lossy], "nll", higher_is_better=False) is False
    assert faster_than_every_as_faithful({"speedup": 1.0}, [pld], "nll", higher_is_better=False) is None


def test_repeats_report_their_spread_and_acceptance_by_position(tmp_path, tiny_text_model, data_dir):
    config = BenchConfig(target="tiny", methods=("ar", "pld"), dataset="spec_bench", per_category=1, max_new_tokens=10,
                         data_dir=str(data_dir), repeats=2, compute_nll=False)
    summary = run_bench(config, tmp_path / "out", progress=False, target=tiny_text_model)
    pld = summary["methods"]["pld"]["overall"]
    assert len(pld["speedup_by_repeat"]) == 2 and pld["speedup_std"] is not None
    assert pld["acceptance_by_position"] is not None and all(0 <= a <= 1 for a in pld["acceptance_by_position"] if a is not None)
    assert " ± " in (tmp_path / "out" / "summary.md").read_text()
    record = json.loads((tmp_path / "out" / "records.jsonl").read_text().splitlines()[0])
    assert record["peak_rss_mb"] > 0


# ---- one run per folder (issue 23, finding 2) -----------------------------------------------------

_HOLDER = """
import sys
sys.path.insert(0, {tests!r})
import conftest
from tierspec.bench import runner
from tierspec.bench.runner import BenchConfig, run_bench
from tierspec.models import wrap_model

model = conftest.tiny_llama(seed=4, vocab_size=56, layers=3, sharpness=20.0).model
model.generation_config.eos_token_id = None
target = wrap_model(model, conftest.char_tokenizer(), name="tiny-char")

def blocked(self, *args, **kwargs):
    print("running", flush=True)
    sys.stdin.readline()  # held here until the test kills this process

runner.MethodRunner.run = blocked
run_bench(BenchConfig(target="tiny", methods=("ar", "pld"), per_category=1, max_new_tokens=6, data_dir={data!r},
                      compute_nll=False), __import__("pathlib").Path({out!r}), progress=False, target=target)
"""


def test_a_second_run_into_a_busy_folder_is_refused_and_a_killed_runs_lock_is_not(tmp_path, tiny_text_model, data_dir):
    """Two runs into one --out both appended (12 records for 6 pairs). The second is refused,
    naming the folder and the first run's pid; once that run is killed (kill -9: no cleanup),
    its lock is gone and a rerun completes the folder with one record per pair."""
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out"
    config = BenchConfig(target="tiny", methods=("ar", "pld"), per_category=1, max_new_tokens=6, data_dir=str(data_dir),
                         compute_nll=False)
    script = _HOLDER.format(tests=str(Path(__file__).parents[1]), data=str(data_dir), out=str(out))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert holder.stdout.readline().strip() == "running"
        with pytest.raises(BenchError, match=f"{re.escape(str(out))}.*in use by another tierspec bench run \\(pid {holder.pid}\\)"):
            run_bench(config, out, progress=False, target=tiny_text_model)
        with pytest.raises(BenchError, match=f"pid {holder.pid}"):  # a summary of a folder being written waits too
            run_bench(config, out, progress=False, target=tiny_text_model, generate=False)
        assert not (out / "records.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    run_bench(config, out, progress=False, target=tiny_text_model)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["prompt_id"]) for r in records) == sorted(
        (m, p) for m in ("ar", "pld") for p in {r["prompt_id"] for r in records})
    assert len(records) == 4


def test_duplicate_records_are_counted_once_with_a_warning(tmp_path, tiny_text_model, data_dir, capsys):
    """A folder written by two runs at once (before the lock) holds every record twice; its
    summary counts each (method, prompt, repeat) once and says so."""
    config = BenchConfig(target="tiny", methods=("ar", "pld"), per_category=1, max_new_tokens=6, data_dir=str(data_dir),
                         compute_nll=False)
    out = tmp_path / "out"
    once = run_bench(config, out, progress=False, target=tiny_text_model)
    lines = (out / "records.jsonl").read_text()
    (out / "records.jsonl").write_text(lines + lines)
    capsys.readouterr()
    twice = run_bench(config, out, progress=False, target=tiny_text_model, generate=False)
    assert twice["methods"]["pld"]["overall"]["n_prompts"] == once["methods"]["pld"]["overall"]["n_prompts"] == 2
    assert twice["methods"] == once["methods"]
    assert "4 duplicate records" in capsys.readouterr().err


# ---- bad flags: one line, exit 2, nothing written (issue 23, findings 9 and 11) -------------------

@pytest.mark.parametrize("flags, message", [
    (["--methods", ""], "methods is empty: name at least one method (e.g. --methods ar,pld)"),
    (["--methods", " , "], "methods is empty: name at least one method (e.g. --methods ar,pld)"),
    (["--methods", "pld:num_draft=abc"], "method spec 'pld:num_draft=abc': num_draft must be an integer, got 'abc'"),
    (["--methods", "lossy:alpha=much"], "method spec 'lossy:alpha=much': alpha must be a number, got 'much'"),
    (["--methods", "hf-pld:tokens=x"], "method spec 'hf-pld:tokens=x': tokens must be an integer, got 'x'"),
    (["--methods", "pld:gamma=3"], "method spec 'pld:gamma=3': unknown parameter(s) ['gamma']"),
    (["--limit", "-1"], "limit must be an integer >= 1, got -1"),
    (["--limit", "0"], "limit must be an integer >= 1, got 0"),
    (["--per-category", "0"], "per_category must be an integer >= 1, got 0"),
    (["--repeats", "0"], "repeats must be an integer >= 1, got 0"),
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1, got 0"),
    (["--num-draft", "-1"], "--num-draft must be an integer from 0 to 64 (tokens drafted per cycle), got -1"),
    (["--num-draft", "1000000"], "--num-draft must be an integer from 0 to 64 (tokens drafted per cycle), got 1000000"),
])
def test_bad_bench_flags_are_one_line_errors(flags, message, tmp_path, tiny_text_model, data_dir, monkeypatch, capsys):
    from tierspec import cli

    monkeypatch.setattr("tierspec.bench.runner.load_model", lambda *a, **k: tiny_text_model)
    out = tmp_path / "out"
    code = cli.main(["bench", "--out", str(out), "--data-dir", str(data_dir), "--max-new-tokens", "4", "--no-progress",
                     "--no-nll", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"tierspec: error: {message}") and err.count("\n") == 1
    assert not out.exists()


def test_bench_out_that_is_a_file_is_a_one_line_error(tmp_path, tiny_text_model, data_dir, monkeypatch, capsys):
    from tierspec import cli

    monkeypatch.setattr("tierspec.bench.runner.load_model", lambda *a, **k: tiny_text_model)
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    for extra in ([], ["--summarize-only"]):
        assert cli.main(["bench", "--out", str(out), "--data-dir", str(data_dir), "--methods", "ar", *extra]) == 2
        assert capsys.readouterr().err == f"tierspec: error: --out {out} is a file; give a folder (a new one, or one a bench run made)\n"
    assert out.read_text() == "mine"


def test_summarizing_a_folder_without_records_is_a_one_line_error(tmp_path, tiny_text_model, data_dir, monkeypatch, capsys):
    from tierspec import cli

    monkeypatch.setattr("tierspec.bench.runner.load_model", lambda *a, **k: tiny_text_model)
    missing = tmp_path / "typo"
    assert cli.main(["bench", "--summarize-only", "--out", str(missing), "--data-dir", str(data_dir)]) == 2
    assert capsys.readouterr().err == f"tierspec: error: {missing} does not exist: nothing to summarize\n"
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["bench", "--summarize-only", "--out", str(empty), "--data-dir", str(data_dir)]) == 2
    assert capsys.readouterr().err == f"tierspec: error: {empty} holds no records.jsonl of a bench run: nothing to summarize\n"
    assert list(empty.iterdir()) == []


def test_the_largest_seed_runs(tmp_path, tiny_text_model, data_dir):
    """Per-prompt generators are seeded from the run's seed, the repeat and the prompt: for seeds
    near 2**63 that sum overflowed torch's 64-bit seed (a traceback)."""
    config = BenchConfig(target="tiny", methods=("ar",), per_category=1, max_new_tokens=4, data_dir=str(data_dir),
                         compute_nll=False, temperature=1.0, seed=2**63 - 1)
    summary = run_bench(config, tmp_path / "out", progress=False, target=tiny_text_model)
    assert summary["methods"]["ar"]["overall"]["n_prompts"] == 2


def test_plot_labels_are_whole_and_distinct():
    """Plots name every method in full (a legend, row labels): nothing is cut, and two specs that
    shorten to the same label (two heads both called head.safetensors) are shown as written."""
    from tierspec.bench.report import method_labels

    long = "via:mask=masks/smollm2-135m-sublayer-c0.3.json:alpha2=0.1:draft_with=eagle:slim_vocabulary=draft-head"
    first, second = "judge:judge_head=results/a/head.safetensors", "judge:judge_head=results/b/head.safetensors"
    labels = method_labels(["ar", long, first, second])
    assert labels == {"ar": "ar", long: "via(mask=c0.3,alpha2=0.1,draft_with=eagle,slim_vocabulary=draft-head)",
                      first: first, second: second}
