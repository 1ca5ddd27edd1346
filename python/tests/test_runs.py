"""regatta.train.run and regatta.score.run: real runs (libtorch ranks and scorer actors) on
the driver's local cluster."""

import json
import os

import pytest

import regatta
import regatta.score
import regatta.train

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "data", "corpus.txt")


def test_a_training_then_a_scoring_run_from_python(tmp_path, capsys):
    checkpoints = tmp_path / "ckpt"
    summary = regatta.train.run({
        "world_size": 1,
        "steps": 4,
        "micro_batch_size": 2,
        "checkpoint": {"dir": str(checkpoints), "interval": 4},
        "resources": {"CPU": 1},
        "data": {"path": os.path.abspath(CORPUS)},
    })
    assert summary["steps"] == 4 and len(summary["losses"]) == 4, summary
    assert all(loss > 0 for loss in summary["losses"])
    assert "trained 4 steps" in capsys.readouterr().out, "progress lines reach the driver"

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "text": f"row number {i} of the test"}) + "\n" for i in range(6)))
    scored = regatta.score.run({
        "input": str(rows),
        "model": str(checkpoints),
        "output": str(tmp_path / "scores"),
        "actors": 1,
        "resources": {"CPU": 1},
    })
    assert scored["rows"] == 6 and scored["errors"] == 0, scored


def test_bad_run_configurations_are_refused_clearly(tmp_path):
    with pytest.raises(regatta.RegattaError, match="zero_stage"):
        regatta.train.run({"zero_stage": 7, "steps": 1})
    with pytest.raises(FileNotFoundError):
        regatta.score.run(str(tmp_path / "missing.toml"))
    with pytest.raises(TypeError):
        regatta.train.run(42)
