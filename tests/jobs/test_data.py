"""The evaluation sets shipped inside the package."""

import gzip
import hashlib
from pathlib import Path

import pytest

from tierspec.data import DATASETS, PACKAGED_DATA, DataError, default_data_dir, load_prompts, read_jsonl

COUNTS = {"spec_bench": 480, "gsm8k": 1000, "humaneval": 164, "mt_bench": 80, "cnn_dailymail": 200, "xsum": 240,
          "wmt14": 2500, "json_extract": 52}
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def test_packaged_data_is_the_default_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TIERSPEC_DATA", raising=False)
    assert default_data_dir() == PACKAGED_DATA
    for dataset in DATASETS:
        assert len(load_prompts(dataset)) == COUNTS[dataset], dataset
    assert len(load_prompts("gsm8k", split="train")) == 7473
    assert (PACKAGED_DATA / "SOURCES.md").read_text().count("licence") >= 1


@pytest.mark.skipif(not SHARED.is_dir(), reason="the upstream copy is only in the development checkout")
def test_packaged_files_hold_the_same_bytes_as_the_sources():
    for source in sorted(SHARED.rglob("*.jsonl")):
        packed = PACKAGED_DATA / source.relative_to(SHARED).with_name(source.name + ".gz")
        with gzip.open(packed, "rb") as handle:
            assert hashlib.sha256(handle.read()).hexdigest() == hashlib.sha256(source.read_bytes()).hexdigest(), source


def test_data_dir_override_and_damaged_files(tmp_path, monkeypatch):
    folder = tmp_path / "data" / "mt_bench"
    folder.mkdir(parents=True)
    (folder / "question.jsonl").write_text('{"question_id": 1, "category": "writing", "turns": ["Hi"]}\n')
    assert [p.text for p in load_prompts("mt_bench", tmp_path / "data")] == ["Hi"]
    monkeypatch.setenv("TIERSPEC_DATA", str(tmp_path / "data"))
    assert default_data_dir() == tmp_path / "data"
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"a": 1}\n')[:-12])
    with pytest.raises(DataError, match="damaged"):
        read_jsonl(broken)
    monkeypatch.setenv("TIERSPEC_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="not a folder"):
        default_data_dir()
