"""The JSON ending shared by benchmark commands: brief on stdout, whole in ``--out``."""

import json

from json_out import emit_result


def test_prints_brief_and_writes_whole(tmp_path, capsys):
    res = {"model": "m", "steps": [1, 2, 3], "max_gap_s": 0.5}
    out = tmp_path / "r.json"
    emit_result(res, str(out), brief=("steps",))
    assert json.loads(capsys.readouterr().out) == {"model": "m", "max_gap_s": 0.5}
    assert json.loads(out.read_text()) == res


def test_without_out_only_prints(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    emit_result({"a": 1}, None)
    assert json.loads(capsys.readouterr().out) == {"a": 1}
    assert list(tmp_path.iterdir()) == []
