"""``bench --remote --plot PATH`` draws the rows' samples/s, the server's ceiling as a line."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from benchmarks import remote  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_chart_is_a_png_of_every_row_with_a_loader_missing(tmp_path):
    runs = {(row.key, loader): [{"samples_per_s": 100.0 + k}]
            for row in remote.ROWS for k, loader in enumerate(remote.LOADERS)
            if loader != remote.DALI}  # a loader that did not run is drawn as such
    path = tmp_path / "remote.png"
    remote.chart(str(path), runs, 1.0, 2.0)
    assert path.read_bytes()[:8] == PNG


def test_plot_without_matplotlib_is_refused_before_any_cell(monkeypatch, capsys):
    monkeypatch.setattr(remote, "installed", lambda name: name != "matplotlib")

    class Args:
        plot = "remote.png"

    assert remote.run(Args(), 1.0, 0.0, 1) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
