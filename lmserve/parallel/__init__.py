"""Tensor parallelism over torch.distributed (Megatron-style; gloo on CPUs, NCCL on GPUs).

    group.py   TPGroup: this rank's place, the collectives (one all-reduce after attention and one
               after the MLP, the vocab gather), the rendezvous (env:// as torchrun sets it)
    shard.py   how a loaded model is cut: heads and MLP channels by rank, vocab-parallel embedding
               and LM head, quantized linears with their scales and groups
    step.py    the step as it travels from rank 0 to the others: int64 / float tensors, never pickle
    driver.py  rank 0: the model proxy the engine's runner calls, the worker processes it starts
    worker.py  ranks 1..N-1: receive a step, run their shard, join the collectives
"""
