"""House rule: runners/ carries no harness instrumentation; P1's records are taken from outside (harness.run.observe).

Every identifier of runners/ (classes, functions, parameters, attributes, names, keywords) is
checked for a record hook: a class named *Record, or a name with a `record` / `records` word
(`_record`, `capture_records`, `last_decode_records`, `record=`). runners/graph/record.py is
exempt: its recorder is the CPU graph itself (it records the ops a CUDA graph would), part of
the system under test, not a window for the harness. A CUDA event's own `record()` (torch.cuda.Event,
called on a name ending in `event`) is the device API, not a hook.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_GRAPH = Path("runners/graph/record.py")
CPU_GRAPH_MODULE = "graph_record"  # the name other runners import it under (`from runners.graph import record as graph_record`)
HOOK = re.compile(r"(Record$|(^|_)records?($|_))")


def _event_record(node: ast.Attribute) -> bool:
    receiver = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
    return node.attr == "record" and receiver.endswith("event")


def _identifiers(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.Attribute):
            if not _event_record(node):
                yield node.lineno, node.attr
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg
        elif isinstance(node, ast.alias):
            yield getattr(node, "lineno", 0), node.asname or node.name.rsplit(".", 1)[-1]


def record_hooks(root: Path) -> list[str]:
    """file:line name, for every record-hook identifier under root/runners."""
    out = []
    for path in sorted((root / "runners").rglob("*.py")):
        rel = path.relative_to(root)
        if rel == CPU_GRAPH:
            continue
        for line, name in _identifiers(ast.parse(path.read_text(), str(path))):
            if name != CPU_GRAPH_MODULE and HOOK.search(name):
                out.append(f"{rel}:{line} {name}")
    return sorted(set(out))


def test_runners_carry_no_record_hooks():
    hooks = record_hooks(ROOT)
    assert not hooks, "runners/ holds harness instrumentation; observe the runner from harness.run.observe instead:\n" + "\n".join(hooks)


def test_the_rule_sees_a_hook(tmp_path):
    """The rule is not blind: each kind of hook it must refuse, planted in a runner module, is found."""
    (tmp_path / "runners").mkdir()
    (tmp_path / "runners" / "r.py").write_text(
        "class CaptureRecord:\n    pass\n"
        "class R:\n"
        "    def _record(self, inp):\n        self.capture_records = {}\n"
        "    def replay(self, inp, record=True):\n        return self.last_decode_records\n"
        "def f(r):\n    return r.replay(1, record=False)\n"
    )
    (tmp_path / "runners" / "graph").mkdir()
    (tmp_path / "runners" / "graph" / "record.py").write_text("def _record(op):\n    return op\n")
    (tmp_path / "runners" / "backend.py").write_text("from runners.graph import record as graph_record\nok = graph_record.recording\n")
    found = {h.split(" ")[1] for h in record_hooks(tmp_path)}
    assert found == {"CaptureRecord", "_record", "capture_records", "record", "last_decode_records"}
