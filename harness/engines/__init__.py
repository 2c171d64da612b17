"""engine-check: our invariants on an engine's own graph runners (docs/engine-check.md).

install.py installs releases side by side; sglang/ is the SGLang adapter (engine-specific
stubs and stand-ins, producing our records); check.py runs the invariants on those records;
report.py formats the result; command.py is the `harness engine-check` subcommand.
"""
