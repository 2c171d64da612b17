"""benchmarks/host_ops.py: the host ops a graphed iteration launches outside its graphs, counted on CPU."""
from __future__ import annotations

import re

from benchmarks import host_ops


def test_the_graphed_iteration_launches_no_copy_of_its_outputs(capsys):
    """The runners hand back views of their graph outputs (runners.outputs): the host launches the replay fills and
    copy-ins, and nothing per output; the iteration's count is its three runners' counts."""
    assert host_ops.main(["--backends", "torch", "--bs", "2", "--model", "default"]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    cells = [tuple(map(int, c)) for c in re.findall(r"(\d+) / (\d+)", row)]
    assert len(cells) == 4, row
    (ext, _), (dec, _), (ver, _), (it, _) = cells
    assert it == ext + dec + ver > 0, row
    assert "clone" not in row, row
