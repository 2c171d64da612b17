"""The graph mechanism the runners capture and replay with: torch.cuda.CUDAGraph on a GPU, a recording graph that
behaves like one on CPU (record), the memory pool the graphs of one backend share (pool), and eager-or-graph (mode)."""
