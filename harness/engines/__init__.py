"""engine-check: our invariants on an engine's own graph runners (docs/engine-check.md).

install.py installs releases side by side; sglang/ and vllm/ are the adapters (engine-specific
stubs and stand-ins, producing our records); check.py and record_checks.py run the invariants
on those records. Engine-neutral: options.py (the device paths and runners a run selects),
drive.py (load, pre-flight, report, exit status), guard.py / interpreter.py / isolate.py (an
engine bug is a finding, never the end of the run), baseline.py (known findings), report.py;
command.py is the `harness engine-check` subcommand.
"""
