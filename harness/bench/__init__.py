"""`harness bench`: the command and its draft-extend table (command), every runner's rig and table (runners), how a
repetition is timed (timer). `python -m harness.bench ARGS` is `harness bench ARGS`."""
