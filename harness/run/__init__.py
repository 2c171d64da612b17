"""How a case runs: its scenario, the rig that builds our runners for it, the speculative decoding loop, the records
observed from outside the runners, and `CaseRun`, the runs of one case built once and shared by every property.

Nothing here judges: the properties (harness.props) read what these modules produce. The arrow is one way:
harness.props imports harness.run, never the reverse.
"""
