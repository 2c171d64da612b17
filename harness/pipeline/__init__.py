"""The case pipeline: a case's runs (harness.run.case_run.CaseRun) judged by every selected property of the registry
(check), the same judgement shown step by step (replay) with every rank's buffers at a step (dump), and the mutant
runner that plants each catalog mutant and runs the probes it names (mutants).

The arrow is one way: this package reads harness.props and harness.run; neither imports it.
"""
