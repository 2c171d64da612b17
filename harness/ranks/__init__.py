"""SPMD launch of a layout's ranks: simulated (threads in one process) and real (torch.distributed)."""
