"""Cases: what a case file holds (case: `Case`, `load_case`, the shipped cases), its requests (requests), the resource
budget it must fit (budget), the schema the docs and `harness new-case` read (schema), the writer of a case file
(template), and where the shipped cases and their goldens are (data).

This package's own __init__ imports nothing: the pytest plugin's options read harness.cases.data without torch.
"""
