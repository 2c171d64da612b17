"""SPMD launch of a layout's ranks: simulated (threads in one process) and real (torch.distributed),
spawned by the harness or started by torchrun / srun."""
