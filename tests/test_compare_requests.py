"""compare_requests (P4's per-request comparison, all of a step's requests at once): per request what compare_outputs
says of it alone, the same failures, notes and check count."""
import pytest
import torch

from harness.props.outputs import compare_outputs, compare_requests
from harness.props.tolerances import Tol
from harness.verdict import Verdict

TOL = Tol(1e-3, 1e-3, "test")
T, V, K = 2, 5, 2


def _request(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(1, V, generator=g), dim=-1)
    topk_p, topk_index = logprobs.exp().topk(K, dim=-1)
    return {"logits": torch.randn(T, V, generator=g), "hidden": torch.randn(T, 3, generator=g), "logprobs": logprobs,
            "topk_p": topk_p, "topk_index": topk_index}


def _requests() -> list[tuple[dict, dict]]:
    """Five requests: equal; a logit off by 1 (past the tolerance); other top-k ids of other probabilities (no tie); a
    swapped pair of ids whose probabilities are equal (a tie); a logit off by 1e-6 (within it)."""
    refs = [_request(i) for i in range(5)]
    tie = refs[3]
    tie["logprobs"] = torch.log(torch.tensor([[0.4, 0.4, 0.1, 0.05, 0.05]]))
    tie["topk_p"], tie["topk_index"] = torch.tensor([[0.4, 0.4]]), torch.tensor([[0, 1]])
    gots = [{k: t.clone() for k, t in ref.items()} for ref in refs]
    gots[1]["logits"][1, 3] += 1.0
    gots[2]["topk_index"] = refs[2]["topk_index"].flip(-1) + V  # an id past the vocabulary: not a tie
    gots[3]["topk_index"] = torch.tensor([[1, 0]])
    gots[4]["logits"][0, 0] += 1e-6
    return list(zip(refs, gots, strict=True))


def _one_by_one(items, tol) -> tuple[Verdict, list[bool]]:
    v = Verdict("PX")
    return v, [compare_outputs(v, "cmp", w, ref, got, tol, label) for w, ref, got, label in items]


def _items(pairs):
    return [({"request": i}, ref, got, lambda r, i=i: f"row {r} of request {i}") for i, (ref, got) in enumerate(pairs)]


@pytest.mark.parametrize("tol", [TOL, None], ids=["tol", "bitwise"])
def test_compare_requests_says_what_compare_outputs_says_of_each(tol):
    items = _items(_requests())
    v = Verdict("PX")
    same = compare_requests(v, "cmp", items, tol)
    ref_v, ref_same = _one_by_one(items, tol)
    assert same == ref_same
    assert [f.message() for f in v.failures] == [f.message() for f in ref_v.failures]
    assert v.notes == ref_v.notes and v.checked == ref_v.checked == 5 * len(items)


def test_compare_requests_worked_example():
    v = Verdict("PX")
    same = compare_requests(v, "cmp", _items(_requests()), TOL)
    assert same == [True, True, False, False, True]  # a float difference keeps the path; other top-k ids end it
    assert [(f.field, f.where["request"]) for f in v.failures] == [("logits", 1), ("topk_index", 2)]
    assert "row 1 of request 1" in v.failures[0].detail and "outside the vocabulary" in v.failures[1].detail
    assert len(v.notes) == 1 and "tie" in v.notes[0] and "request': 3" in v.notes[0]


def test_compare_requests_of_other_shapes_compares_each_alone():
    pairs = _requests()
    pairs[0][1]["hidden"] = pairs[0][1]["hidden"][:1]  # a request's rows cut short: shape differs
    pairs[4] = tuple({**d, "logits": d["logits"][:1]} for d in pairs[4])  # another request of fewer rows on both sides
    items = _items(pairs)
    v = Verdict("PX")
    same = compare_requests(v, "cmp", items, TOL)
    ref_v, ref_same = _one_by_one(items, TOL)
    assert same == ref_same == [True, True, False, False, True]
    assert [f.message() for f in v.failures] == [f.message() for f in ref_v.failures]
    assert v.failures[0].field == "hidden" and v.failures[0].detail == "shape"
    assert compare_requests(Verdict("PX"), "cmp", [], TOL) == []
